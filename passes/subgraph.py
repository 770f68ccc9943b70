"""Replacement subgraphs traced, not hand-built: a pass writes what it inserts as a plain Python
function of tensors, and ``insert_traced`` records it on the argument nodes' fake values (in the
graph's own fake mode and ShapeEnv) and inlines the recorded ops before a node, as Inductor's
bucketing does (torch/_inductor/fx_passes/bucketing.py). A function that calls plain operators
only is recorded by a light TorchFunctionMode (the graph make_fx gives, at a fraction of its
time per op); anything else by ``make_fx``. The recording is
pre-dispatch: each op as the function calls it (a ``reshape`` is not decomposed into the view
or copy it does; the memory planner knows it as an alias of its input). Every inserted
node's ``val`` is what its op computed; the pass gives the meta only it knows (REGION, the
collectives' ROLE and COLLECTIVE, a bucket index).

Recordings are cached per fake mode, keyed by everything the recorded graph depends on: the
function's code with its closure's and defaults' values, the constants among the arguments and
each tensor argument's metadata (shape and stride with their symbolic expressions, dtype,
device, layout, ``requires_grad``) and the grad mode. The many gradients of one shape share one
recording: a hit copies the cached nodes and runs each op on the new arguments' values in the
fake mode, so every inserted node still holds its own value as its op computed it (a functional
collective's: a new tensor of its recorded metadata, which its meta function derives from the
arguments' metadata alone). A function
whose key cannot be formed from plain values (a closure holding a tensor or a node, ...) is
recorded every time.

The plain ops passes insert (reshapes, views, slices, ``cat``, division, padding and the
functional collectives) on statically shaped values get their values from the op's meta kernel,
as fake mode computes them, without fake mode's dispatch around it
(torch_internals.meta_kernel_value): a bucket's copies and pieces, a fake op per parameter, cost
a tenth of the fake call. Any other op, or a symbolic size, runs in fake mode.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from spmd_compiler.torch_internals import (
    FakeTensor, FakeTensorMode, OpOverload, meta_kernel_value, new_fake, pytree,
)

from . import meta

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def insert_traced(graph: fx.Graph, fn: Callable[..., Any], args: tuple, *, before: fx.Node,
                  region=None, collective: dict | Callable[[Any], dict] | None = None,
                  **extra) -> Any:
    """Record ``fn(*args)`` and insert its ops before ``before``; its result with each tensor
    replaced by the node computing it (an argument node when ``fn`` returns it unchanged).

    ``args`` may nest nodes (tensor-valued: their ``val`` is what ``fn`` sees) and constants in
    tuples, lists and dicts. Every inserted node gets ``REGION = region``; every functional
    collective and its ``wait_tensor`` ``ROLE = COLLECTIVE`` and the ``extra`` meta; every
    collective that issues communication also ``COLLECTIVE``: ``collective`` (or
    ``collective(op)``) with ``bytes``, the bytes of its result, after ``kind``.

    Reads: the argument nodes' ``val``. Writes: the inserted nodes.
    """
    nodes: list[fx.Node] = []
    fx.node.map_arg(args, nodes.append)
    nodes = list(dict.fromkeys(nodes))
    vals = [n.meta["val"] for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        raise TypeError(f"insert_traced: arguments {[n.name for n in nodes]} must be tensors")

    fake_mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if fake_mode is None:  # real values (a hand-written graph): traced on fake copies
        fake_mode = FakeTensorMode()
        vals = [fake_mode.from_tensor(v) for v in vals]
    sub, fresh = _recorded(fn, args, nodes, vals, fake_mode)
    env: dict[fx.Node, Any] = dict(zip(sub.find_nodes(op="placeholder"), nodes))
    values: dict[fx.Node, Any] = dict(zip(sub.find_nodes(op="placeholder"), vals))
    result = None
    with graph.inserting_before(before), fake_mode, torch.no_grad():  # (entered once: costly)
        for n in sub.nodes:
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
            elif n.op == "call_function" and n.target is torch.ops.aten.detach.default:
                env[n] = env[n.args[0]]
                values[n] = values[n.args[0]]
            elif n.op == "call_function":
                env[n] = new = graph.node_copy(n, env.__getitem__)
                values[n] = n.meta["val"] if fresh else _rerun(n, values)
                new.meta = {"val": values[n]}
                _tag(new, region, collective, extra)
    return result


class _Uncacheable(Exception):
    """A value a recording's cache key cannot be formed from."""


# fake mode -> cache key -> recorded graph (one ShapeEnv per fake mode: symbols never mix)
_RECORDINGS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _recorded(fn, args, nodes, vals, fake_mode) -> tuple[fx.Graph, bool]:
    """``fn``'s recording on ``vals`` and whether it was recorded just now (its nodes' values
    are then the values to insert), from the fake mode's cache when it holds one."""
    try:
        index = {n: _ArgRef(i) for i, n in enumerate(nodes)}
        key = (_canon(fn), _canon(fx.node.map_arg(args, index.__getitem__)),
               tuple(_tensor_key(v) for v in vals), torch.is_grad_enabled())
        cache = _RECORDINGS.setdefault(fake_mode, {})
        hit = cache.get(key)
    except (_Uncacheable, TypeError, ValueError):  # an unhashable value, an empty closure cell
        key = cache = hit = None
    if hit is not None:
        return hit, False

    def traced(*tensors):
        env = dict(zip(nodes, tensors))
        return fn(*fx.node.map_arg(args, env.__getitem__))

    sub = _record(traced, vals, fake_mode)
    for n in sub.nodes:
        if n.op not in ("placeholder", "call_function", "output"):
            raise TypeError(f"insert_traced: {fn} recorded a {n.op} node ({n.target})")
    if cache is not None and all(_replayable(n) for n in sub.nodes if n.op == "call_function"):
        cache[key] = sub
    return sub, True


def _record(fn: Callable, vals: list, fake_mode) -> fx.Graph:
    """``fn(*vals)`` recorded pre-dispatch (ops as called: ``reshape`` stays one node, as the
    graph's own do): by ``_OperatorRecorder`` when it calls operators only (a tenth of make_fx's
    time per op), else by make_fx."""
    sub = _recorded_by_ops(fn, vals, fake_mode)
    if sub is None:
        with fake_mode:
            sub = make_fx(fn, pre_dispatch=True)(*vals).graph
    return sub


class _Unrecordable(Exception):
    """A call the operator recorder does not record as make_fx would (make_fx records it)."""


# what a function may ask of a tensor besides operators: its metadata, never a tensor
_METADATA_QUERIES = {"__get__", "dim", "size", "stride", "numel", "element_size",
                     "storage_offset", "is_contiguous", "nelement", "ndimension"}


class _OperatorRecorder(TorchFunctionMode):
    """Records each operator a function calls on fake tensors as one node, with the arguments
    normalized as the dispatcher hands them to make_fx (defaults left out, keyword-only ones as
    keywords) and the op's result (detached) as its value: make_fx's pre-dispatch recording
    of a function of plain operators, without its proxies. Anything else (a Python-level torch
    function, an in-place or multi-output op, a symbolic size in an argument) raises
    ``_Unrecordable``."""

    def __init__(self, graph: fx.Graph, known: dict[int, tuple[torch.Tensor, fx.Node]], fake_mode):
        super().__init__()
        self.graph, self.known, self.fake_mode = graph, known, fake_mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, OpOverload):
            if getattr(func, "__name__", None) not in _METADATA_QUERIES:
                raise _Unrecordable(func)
            out = func(*args, **kwargs)
            if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(out)):
                raise _Unrecordable(func)
            return out
        if func._schema.is_mutable or not isinstance(
                out := _value(func, args, kwargs, self.fake_mode), torch.Tensor) or id(out) in self.known:
            raise _Unrecordable(func)
        node_args, node_kwargs = pytree.tree_map(self._arg, _as_dispatched(func, args, kwargs))
        node = self.graph.create_node("call_function", func, tuple(node_args), node_kwargs,
                                      name=func.overloadpacket.__name__)  # as make_fx names it
        node.meta["val"] = out.detach() if out.requires_grad else out  # make_fx's value
        self.known[id(out)] = (out, node)
        return out

    def _arg(self, value):
        if isinstance(value, torch.Tensor):
            if id(value) not in self.known:
                raise _Unrecordable("a tensor the function did not get or compute")
            return self.known[id(value)][1]
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Unrecordable("a symbolic size")
        return value


def _as_dispatched(op: OpOverload, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """``op``'s arguments as the dispatcher passes them to Python: positional up to the last
    one that differs from its default, keyword-only ones (not at their default) as keywords,
    lists as lists."""
    positional, keywords, last = [], {}, 0
    for i, arg in enumerate(op._schema.arguments):
        given = i < len(args) or arg.name in kwargs
        value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        if isinstance(value, tuple) and _is_list(arg.type):
            value = list(value)
        default = not given or (arg.has_default_value() and type(value) is type(
            arg.default_value) and value == arg.default_value)
        if arg.kwarg_only:
            if not default:
                keywords[arg.name] = value
        else:
            positional.append(value)
            last = last if default else len(positional)
    return positional[:last], keywords


def _is_list(kind) -> bool:
    """Is an argument of schema type ``kind`` a list (or an optional one)?"""
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.ListType)


def _recorded_by_ops(fn: Callable, vals: list, fake_mode) -> fx.Graph | None:
    """``fn(*vals)`` recorded by ``_OperatorRecorder`` in ``fake_mode``; None when it calls
    something only make_fx records."""
    graph = fx.Graph()
    known = {}
    for i, v in enumerate(vals):
        node = graph.placeholder(f"arg{i}")
        node.meta["val"] = v
        known[id(v)] = (v, node)
    try:
        with fake_mode, _OperatorRecorder(graph, known, fake_mode) as recorder:
            out = fn(*vals)
        graph.output(pytree.tree_map(recorder._arg, out))
    except _Unrecordable:
        return None
    return graph


@dataclasses.dataclass(frozen=True)
class _ArgRef:
    """The ``index``-th distinct argument node, in a cache key."""

    index: int


def _replayable(node: fx.Node) -> bool:
    """Whether running ``node``'s target again computes its value and nothing else: an operator
    or a function of ``operator`` (SymInt arithmetic), not a grad-mode switch."""
    return isinstance(node.target, OpOverload) or \
        getattr(node.target, "__module__", None) in ("_operator", "operator")


# functional collectives: each returns a new tensor whose metadata its meta function derives
# from its arguments' metadata alone (``new_empty`` / ``empty_like``)
_NEW_TENSOR_OPS = {getattr(torch.ops._c10d_functional, name).default for name in (
    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor", "broadcast")}


def _rerun(node: fx.Node, values: dict):
    """The value of a cached recording's ``node`` on the new arguments ``values`` (in the
    caller's fake mode): a functional collective's with static metadata is a new tensor like
    its recorded one (equal arguments' metadata: an equal result, at a fraction of the
    collective's fake dispatch), any other op's is what ``_run`` computes."""
    recorded = node.meta["val"]
    if node.target in _NEW_TENSOR_OPS and isinstance(recorded, torch.Tensor) and _static(recorded):
        new = new_fake(getattr(recorded, "fake_mode", None), recorded.shape, recorded.stride(), recorded.dtype,
                       recorded.device)
        return new if new is not None else torch.empty_strided(
            recorded.shape, recorded.stride(), dtype=recorded.dtype, device=recorded.device)
    return _run(node, values)


def _run(node: fx.Node, values: dict):
    """``node``'s op run on its arguments' values (in the caller's fake mode, without
    autograd): a new value of its own, as make_fx records it (no two nodes share one fake
    tensor; a result that is one of the arguments is detached)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
    given = {id(v) for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)}
    fake_mode = next((v.fake_mode for v in values.values() if isinstance(v, FakeTensor)), None)
    out = _value(node.target, args, kwargs, fake_mode)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach() if id(t) in given else t, out)


# ops whose fake value is their meta kernel's (no fake implementation of their own, no
# constant propagation on graph values, no data-dependent size)
_META_OPS = {torch.ops.aten.reshape.default, torch.ops.aten.view.default,
             torch.ops.aten.slice.Tensor, torch.ops.aten.cat.default, torch.ops.aten.div.Tensor,
             torch.ops.aten.constant_pad_nd.default} | _NEW_TENSOR_OPS


def _value(op, args: tuple, kwargs: dict, fake_mode):
    """``op(*args, **kwargs)`` in ``fake_mode`` (entered by the caller): through the op's meta
    kernel alone when it is one of ``_META_OPS`` on fake tensors of ``fake_mode`` with static
    sizes, strides and offsets (the value fake mode computes, at a tenth of its dispatch), else
    the op called as it is."""
    if op in _META_OPS and fake_mode is not None:
        tensors = [t for a in (*args, *kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)]
        if tensors and all(type(t) is FakeTensor and t.fake_mode is fake_mode and t.constant is None
                           and _static(t) for t in tensors):
            out = meta_kernel_value(fake_mode, op, args, kwargs, tensors[0].device)
            if out is not None:
                return out
    return op(*args, **kwargs)


def _static(t: torch.Tensor) -> bool:
    return all(type(d) is int for d in (*t.shape, *t.stride(), t.storage_offset()))


def _tensor_key(v: torch.Tensor) -> tuple:
    """What a recording depends on in a tensor argument: its metadata, symbolic sizes as their
    expressions (one ShapeEnv per fake mode, so equal expressions are equal sizes)."""
    return (type(v), v.dtype, v.device, v.layout, v.requires_grad, _canon(tuple(v.shape)),
            _canon(v.stride()), _canon(v.storage_offset()))


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, OpOverload,
          enum.Enum, Placement, _ArgRef, types.BuiltinFunctionType)


def _canon(x):
    """A hashable value equal for two values exactly when a recording cannot tell them apart;
    ``_Uncacheable`` for anything else (a tensor, a node, an arbitrary object)."""
    if isinstance(x, _PLAIN):
        return (type(x), x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(x), str(x.node.expr))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_canon(v) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((_canon(k), _canon(v)) for k, v in x.items()))
    if isinstance(x, types.FunctionType):
        cells = tuple(_canon(c.cell_contents) for c in x.__closure__ or ())
        return (x.__code__, cells, _canon(x.__defaults__), _canon(x.__kwdefaults__))
    if isinstance(x, functools.partial):
        return (functools.partial, _canon(x.func), _canon(x.args), _canon(x.keywords))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), tuple(_canon(getattr(x, f.name)) for f in dataclasses.fields(x)))
    raise _Uncacheable(type(x).__name__)


def _tag(node: fx.Node, region, collective: dict | None, extra: dict) -> None:
    if region is not None:
        node.meta[meta.REGION] = region
    if getattr(node.target, "namespace", None) != "_c10d_functional":
        return
    node.meta[meta.ROLE] = meta.Role.COLLECTIVE
    node.meta.update(extra)
    if collective is not None and node.target is not _WAIT:
        info = dict(collective(node.target) if callable(collective) else collective)
        node.meta[meta.COLLECTIVE] = {"kind": info.pop("kind", None),
                                      "bytes": tensor_bytes(node.meta["val"]), **info}


def tensor_bytes(val) -> int | None:
    """Bytes of a (fake) tensor, or None when its size is symbolic."""
    try:
        return int(val.numel()) * val.element_size()
    except (TypeError, ValueError, RuntimeError):
        return None
