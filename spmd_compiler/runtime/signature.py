"""The compiled step's signature: what each input and output of its graph is, by name.

The tracer makes it (spmd_compiler/trace/record.py), the pipeline adds what later stages append
(kept gradients, sharded state), the runtime binds live state with it and reads the outputs
back with it, and the disk cache stores it. Nothing else counts the graph's placeholders or
outputs.

Inputs, in order::

    params | buffers | states | hparams | inputs | grads_in | workspaces | agreement

(``workspaces``: the eager lowering's planned workspaces, passes/memory_plan.py; ``agreement``:
the per-call agreement a graph that checks the ranks itself awaits, passes/rank_check.py.)

Outputs, in order::

    user outputs | new_states | grads_out | kept_grads
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..torch_internals import pytree


class StepOutputs(NamedTuple):
    """A run's flat outputs, split by the signature."""

    user: list[Any]  # the step's tensor return values (non-tensor ones are constants)
    new_states: list[Any]  # optimizer state the step created, one per ``new_states`` key
    grads_out: list[Any]  # this rank's accumulated gradients (no_sync calls)
    kept_grads: list[Any]  # averaged gradients kept in ``p.grad`` (``keep_grads``)


@dataclass(frozen=True)
class StepSignature:
    """Names of the compiled graph's inputs and outputs (see the module docstring)."""

    params: tuple[str, ...]  # unique parameters' qualified names (tied weights once)
    buffers: tuple[str, ...]  # unique buffers' qualified names
    states: tuple[tuple[str, str], ...]  # (parameter, state name) of optimizer state inputs
    # per lifted hyperparameter (the ``lr`` of each param group): bound as a float64 0-d tensor
    # (fused kernels) or a Python float
    hparams: tuple[bool, ...]
    inputs: tuple[int, ...]  # the step argument leaves (their positions) that are graph inputs
    grads_in: tuple[str, ...] = ()  # parameters whose accumulated gradient is an input
    user_outputs: int = 0  # the step's tensor return values
    new_states: tuple[tuple[str, str], ...] = ()  # optimizer state created by the step
    grads_out: tuple[str, ...] = ()  # parameters whose accumulated gradient is returned
    kept_grads: tuple[str, ...] = ()  # parameters whose averaged gradient is returned last
    # (device, bytes) of each workspace input of the lowered graph: a uint8 buffer at least
    # that long, owned by the runtime (runtime.program.Workspaces)
    workspaces: tuple[tuple[str, int], ...] = ()
    # optimizer state of the parameter's shape is bound as padded dim-0 shards (fully_shard)
    sharded_states: bool = False
    # tensor subclasses (spmd_compiler/features/subclass_params.py): per parameter, state, user output
    # and created state its Flat (one graph input or output per inner tensor), None when plain;
    # empty: all plain
    param_flats: tuple = ()
    state_flats: tuple = ()
    user_flats: tuple = ()
    new_state_flats: tuple = ()

    @property
    def input_groups(self) -> tuple[int, ...]:
        """How many placeholders each group has: params, buffers, states, hparams, then the
        rest (inputs and accumulated gradients)."""
        return (_width(self.param_flats, len(self.params)), len(self.buffers),
                _width(self.state_flats, len(self.states)), len(self.hparams))

    def split_outputs(self, outs) -> StepOutputs:
        """The run's flat outputs by kind (a subclass value rebuilt from its inner tensors)."""
        from ..features.subclass_params import unflatten_outputs

        a = _width(self.user_flats, self.user_outputs)
        b = a + _width(self.new_state_flats, len(self.new_states))
        c = b + len(self.grads_out)
        user, new_states = list(outs[:a]), list(outs[a:b])
        if self.user_flats:
            user = unflatten_outputs(user, self.user_flats)
        if self.new_state_flats:
            new_states = unflatten_outputs(new_states, self.new_state_flats)
        return StepOutputs(user, new_states, list(outs[b:c]),
                           list(outs[c:c + len(self.kept_grads)]))


def _width(flats: tuple, count: int) -> int:
    """Graph inputs or outputs of ``count`` values whose flattenings are ``flats``."""
    if not flats:
        return count
    return sum(len(f.names) if f is not None else 1 for f in flats)


def split_inputs(flat, counts) -> list[list[Any]]:
    """``flat`` cut into ``len(counts)`` groups of those sizes, then the rest."""
    out, start = [], 0
    for c in counts:
        out.append(list(flat[start:start + c]))
        start += c
    out.append(list(flat[start:]))
    return out


@dataclass
class TracedStep:
    """A traced step: its graph, its signature and the conditions under which it is valid."""

    gm: torch.fx.GraphModule
    shape_env: ShapeEnv
    signature: StepSignature  # what each graph input and output is
    fake_inputs: list[torch.Tensor]  # fake batch leaves, for guard expressions
    # (input position, dim, size) of batch dims the trace specialized to a constant (a batch of
    # one meeting a width-1 layer): the graph is valid only for that size.
    specialized: list[tuple[int, int, int]] = field(default_factory=list)
    # input leaf -> non-batch dims traced as symbolic sizes
    dynamic_dims: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # per input, (dim, size) of the dims the graph holds as constants (checked on every call)
    static_sizes: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    # (leaf, dim, size, user line) of dynamic dims the step specialized to a constant
    specialized_dims: list[tuple[int, int, int, str]] = field(default_factory=list)
    # (leaf, dim, user line) of dims that were dynamic until the step tied them to a batch size;
    # traced static
    entangled: list[tuple[int, int, str]] = field(default_factory=list)
    # Python files with code on the stack of any recorded node (what the recording depends on)
    source_files: list[str] = field(default_factory=list)
    # (index, value) of hyperparameters the graph holds as constants: a call with another value
    # needs another graph
    specialized_hparams: list[tuple[int, float]] = field(default_factory=list)
    # (input position, value) of unbatched inputs whose values the trace read (a mask passed in
    # and checked for causality): the graph is valid only for inputs equal to these
    specialized_inputs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # the Python values the step read (spmd_compiler/trace/guards.py): constants in the graph, guarded,
    # or lifted (trailing hyperparameters, in order)
    value_guards: list = field(default_factory=list)
    out_spec: pytree.TreeSpec = None
    out_constants: dict[int, Any] = field(default_factory=dict)  # non-tensor output leaves
    # statements of the step run again after every call (spmd_compiler/trace/replay.py)
    replay: tuple[str, ...] = ()
    # Python conditions on the optimizers' lifted numbers the recording branched on (SGD's
    # ``momentum != 0``), over ``h<index>``: the graph serves every value that satisfies them
    hparam_conditions: tuple[str, ...] = ()
    # (path, Python expression over h<index>) of lifted numbers assigned outside the step's own
    # lines (a forward's counter), set after every call (trace/replay.plan_with_assignments)
    assignments: tuple = ()
    # a SideEffectError this recording could not avoid, raised unless a recording with the
    # numbers the step writes lifted replaces it (trace/guards.record_lifting)
    deferred_error: Any = None

    # The signature's parts under their earlier names.
    param_fqns = property(lambda self: list(self.signature.params))
    buffer_fqns = property(lambda self: list(self.signature.buffers))
    state_keys = property(lambda self: list(self.signature.states))
    new_state_keys = property(lambda self: list(self.signature.new_states))
    num_hparams = property(lambda self: len(self.signature.hparams))
    hparam_tensors = property(lambda self: list(self.signature.hparams))
    num_tensor_outputs = property(lambda self: self.signature.user_outputs)
