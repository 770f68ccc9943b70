"""Read, at trace time, the values of tensors that depend only on shapes and constants.

A step may read a tensor's value in Python while it is recorded: ``nn.Transformer`` and
``nn.TransformerEncoder`` compare the attention mask with a causal one
(``bool((mask == causal).all())``) to pick a kernel, models test ``mask.any()`` or call
``torch.equal``. When that tensor is computed only from sizes, Python constants, tensor constants
and deterministic factory ops (``full``, ``arange``, ``triu``, ...), and not from a parameter,
buffer, optimizer state or the batch, its value is the same on every call the graph serves: it is a
function of the sizes. :class:`ReadConstantValues` answers such reads by replaying the recorded
ops that produced the tensor on real tensors, and specializes every symbolic size the replay reads
(``int(size)``: a ShapeEnv guard, so a call with another size recompiles). A step input that is
not batched (``input_batch_dim=None``, e.g. a mask built outside the step and passed in) may take
part too: its value at trace time is used, and the graph is then valid only for inputs equal to
it (a value guard the runtime checks on every call). Any other read — of a parameter, buffer,
optimizer state or batch data — is left to the tracer, which raises its data-dependent error (a
``TraceError`` naming the user's line).

torch's own machinery does not cover this: FakeTensor constant propagation only tracks tensors made
from Python scalars (at most one element), and ``propagate_real_tensors`` would read the values of
this particular batch and these parameters, which the next call does not share.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
)
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..torch_internals import FakeTensor, TorchDispatchMode, pytree, unset_fake_temporarily

from .side_effects import value_read_line

aten = torch.ops.aten

# The ops through which Python reads a tensor's value: bool(t), t.item(), int(t), float(t),
# t.tolist() go through _local_scalar_dense; torch.equal returns a bool.
_READS = {aten._local_scalar_dense.default, aten.equal.default}


class _Unknown(Exception):
    """The value depends on something that is not a constant."""


class ReadConstantValues(TorchDispatchMode):
    """Inside ``make_fx``: answer value reads of shape-only tensors (see the module docstring).

    ``inputs`` maps a placeholder's position to the real value of an unbatched step input that
    reads may use; ``used`` collects the positions whose values were read."""

    def __init__(self, inputs: dict[int, torch.Tensor] | None = None):
        super().__init__()
        self.inputs = inputs or {}
        self.used: set[int] = set()
        self.user_reads: list[str] = []  # user lines reading a value that is not a constant

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            mode = get_proxy_mode()
            try:
                with disable_proxy_modes_tracing(), unset_fake_temporarily():
                    return func(*[self._real_value(a, mode) for a in args], **kwargs)
            except Exception:  # noqa: BLE001 - not a constant, or not replayable here:
                # the tracer's own handling (its data-dependent error) applies
                line = value_read_line()  # a print or log of it: warned (side_effects.py)
                if line is not None:
                    self.user_reads.append(line)
        return func(*args, **kwargs)

    def _real_value(self, t, mode):
        """The real value of ``t`` (a tensor being traced by the proxy ``mode``, or a real
        constant), replayed from the graph recorded so far; raises ``_Unknown`` when it depends
        on more than sizes, constants and unbatched inputs. Runs with the fake and proxy modes
        off."""
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, FakeTensor):
            return t.clone()  # a real constant
        if mode is None:
            raise _Unknown
        slot = get_proxy_slot(t, mode.tracer, None)
        if slot is None:
            raise _Unknown
        node = slot.proxy.node
        placeholders = {n: i for i, n in enumerate(node.graph.find_nodes(op="placeholder"))}
        inputs = {n: self.inputs[i] for n, i in placeholders.items() if i in self.inputs}
        env = _replay(node.graph, node, mode.tracer.root, inputs)
        self.used |= {placeholders[n] for n in inputs if n in env}
        return env[node]


def _is_symbolic_value(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _writes(node: fx.Node) -> list[fx.Node]:
    """The arguments an in-place op writes."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info and arg.alias_info.is_write and value is not None:
            out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value])
                       if isinstance(v, fx.Node))
    return out


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info
                and not schema.returns[0].alias_info.is_write)


def _needed(graph: fx.Graph, target: fx.Node) -> set[fx.Node]:
    """The nodes whose replay gives ``target``'s value: its ancestors, the views taken of them
    and the in-place ops that wrote into those (a write through a view changes the base), up to a
    fixpoint. Symbolic sizes are leaves: their value is read from the ShapeEnv."""
    needed: set[fx.Node] = set()

    def add(node):
        todo = [node]
        while todo:
            n = todo.pop()
            if n in needed:
                continue
            needed.add(n)
            if not _is_symbolic_value(n):
                todo.extend(n.all_input_nodes)

    add(target)
    changed = True
    while changed:
        changed = False
        for n in graph.nodes:
            if n in needed or n.op != "call_function":
                continue
            if (_is_view(n) and n.args and n.args[0] in needed) or any(
                    w in needed for w in _writes(n)):
                add(n)
                changed = True
    return needed


def _replay(graph: fx.Graph, target: fx.Node, root: torch.nn.Module,
            inputs: dict[fx.Node, torch.Tensor]) -> dict[fx.Node, object]:
    needed = _needed(graph, target)
    env: dict[fx.Node, object] = {}
    for n in graph.nodes:
        if n not in needed:
            continue
        if _is_symbolic_value(n):
            env[n] = _specialize(n.meta["val"])
        elif n in inputs:
            env[n] = inputs[n].clone()
        elif n.op == "get_attr":
            env[n] = getattr(root, n.target).clone()  # replayed in-place ops must not touch it
        elif n.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(
                n.target, "tags", ()):
            raise _Unknown  # a parameter, buffer, state, batch input or a random op
        else:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*pytree.tree_map(_specialize, args), **pytree.tree_map(_specialize, kwargs))
    return env


def _specialize(x):
    """A symbolic size as a Python number, guarded: the graph is valid only for this value."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) and free_unbacked_symbols(x):
        raise _Unknown  # a size computed from tensor data
    if isinstance(x, torch.SymInt):
        return int(x)
    if isinstance(x, torch.SymFloat):
        return float(x)
    if isinstance(x, torch.SymBool):
        return bool(x)
    return x
