"""Batch-dim analysis: placement propagation on symbolic shapes.

``annotate_placements(gm)`` labels every tensor in a traced training step with how it is laid out
across data-parallel ranks, as a DTensor placement. The analysis **describes**; it never refuses a
program that DDP runs: under DDP every rank runs the same local program on its own batch and only
gradients and buffers cross ranks, so no placement inside the step can make the program wrong.

- ``Shard(d)``: batch-sharded along dim d: the ranks' tensors concatenated along d make the tensor
  of the whole (global) batch. Dim d is batch-sharded iff its size expression (after the ShapeEnv's
  replacements) contains a batch symbol: the symbol of an input's batch dim, or an unbacked size
  (``nonzero``, boolean masks) that an op computed from batch-sharded data.
- ``_StridedShard(d, split_factor=k)``: an interleaved batch shard, as DTensor names it: dim d is
  ``k`` chunks, each sharded over the ranks. A reshape that puts the batch inside a dim
  (``(T, B, E) -> (T*B, E)`` in ``nn.MultiheadAttention`` and ``nn.LSTM``) gives ``k = T``; the
  factor is followed through reshapes from the input shapes, so it stays exact when T is symbolic.
  A reshape whose rows mix two samples (``(T, B, 4) -> (T*B*4/3, 3)``) proves only the ranks'
  concatenation: ``Shard`` on its batch dim.
- ``Replicate()``: the same on every rank (parameters, buffers, optimizer state, constants, values
  computed only from those).
- ``Partial("avg")``: a rank-local value without a batch dim computed from the local batch (a loss,
  a sum or statistic over the batch, a weight gradient, a sample picked from the batch); the
  data-parallel step means its average over the ranks. Every value computed from a
  ``Partial("avg")`` stays ``Partial("avg")`` until an ``all_reduce`` makes it ``Replicate()``.

Local positions are what DDP computes: ``arange(b)``, ``logits[arange(b), labels]``, gathers,
scatters and sorts along the batch number each rank's own samples; their results are described like
any other batch-shaped value.

On a fully_shard-expanded graph a placeholder that already carries ``Shard(k)`` on a static dim is a
stored parameter/state shard; elementwise optimizer math keeps it, and a reduction over it is a
``Partial`` with DTensor's reduce op (``sum``, ``max``, ``min``, or DTensor's ``_NormPartial``),
which the expansion must all-reduce before anything else reads it.

``PlacementError`` is raised only where the expanded program would be wrong or the graph cannot be
read: a parameter-shard reduction used before its all_reduce, parameter shards mixed with batch
data or used by an op that sharding changes, a collective over batch data, a non-aten node, an
input batch dim that is out of range or static. docs/batch_dim.md lists the rules.
"""

from __future__ import annotations

import operator
from math import prod
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
)
from torch.fx.operator_schemas import normalize_function

from spmd_compiler.torch_internals import OpOverload, _NormPartial, _StridedShard, detect_fake_mode

from .meta import (
    INPUT_BATCH_DIM, LOCAL_SHARD, MODEL_PARALLEL, PLACEMENT, PLACEMENT_INPUTS, ROLE, Role,
)

__all__ = ["PlacementError", "annotate_placements"]

AVG = Partial("avg")

# Ops whose output values do not depend on their tensor inputs' values (only on shapes/options).
_FACTORIES = frozenset({
    "arange", "ones", "zeros", "full", "empty", "empty_strided", "scalar_tensor", "rand", "randn",
    "randint", "randperm", "linspace", "logspace", "eye", "ones_like", "zeros_like", "full_like",
    "empty_like", "rand_like", "randn_like", "randint_like", "new_ones", "new_zeros", "new_full",
    "new_empty", "new_empty_strided", "zero_", "fill_", "uniform_", "normal_", "bernoulli_",
    "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
})

# Reshapes: the row-major order of the elements is unchanged, so the batch factor keeps its
# position in the flattened index (see _Analysis.reshaped).
_RESHAPES = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "flatten", "unflatten", "squeeze",
    "squeeze_", "unsqueeze", "unsqueeze_", "view_copy", "_reshape_copy",
})
# Ops that copy their (first) input elementwise without being tagged pointwise.
_IDENTITIES = frozenset({
    "detach", "alias", "_to_copy", "copy_", "lift_fresh_copy", "contiguous", "clone",
    "native_dropout", "native_dropout_backward", "_foreach_copy_",
})

_COLLECTIVE_NS = "_c10d_functional"

_BatchShard = (Shard, _StridedShard)


class PlacementError(Exception):
    """A node whose placement makes the expanded program wrong, or that cannot be analyzed.

    Attributes: ``node`` (the node's name), ``op`` (its target as a string), ``stack_trace`` (the
    user's source lines recorded by the tracer, or None) and ``reason``.
    """

    def __init__(self, node: fx.Node, reason: str):
        self.node = node.name
        self.op = str(node.target)
        self.stack_trace = node.meta.get("stack_trace")
        self.reason = reason
        where = self.stack_trace.strip() if self.stack_trace else "(no source line recorded)"
        super().__init__(f"batch-dim analysis: node {self.node} ({self.op}): {reason}\n{where}")


_STACKING = frozenset({"stack", "unbind", "select"})  # keep each element's reduction as it is


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _op_name(target) -> str:
    if isinstance(target, OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _fail(node: fx.Node, reason: str):
    raise PlacementError(node, reason)


def _arguments(node: fx.Node) -> dict[str, Any] | None:
    """The node's arguments by schema name (``self`` is called ``input``), defaults filled in;
    None when they do not match the schema."""
    normalized = normalize_function(node.target, node.args, node.kwargs,
                                    normalize_to_only_use_kwargs=True)
    return None if normalized is None else normalized.kwargs


def _split_factor(p: Placement):
    return p.split_factor if isinstance(p, _StridedShard) else 1


def _same(a, b) -> bool:
    """Are two reuse keys' parts equal? Placements and plain values by value, containers item
    by item, anything else (a node, a tensor, an argument tuple) by identity: no comparison
    that could add a guard on a symbolic size."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, (Placement, bool, int, float, str)):
        return a == b
    return False


class _Analysis:
    """Symbol bookkeeping and the per-node rules; one instance per ``annotate_placements`` call."""

    def __init__(self, gm: fx.GraphModule):
        self.batch_syms: set[sympy.Symbol] = set()
        # unbacked sizes read from rank-local values (``loss.item()``): sizes that differ per rank
        self.local_syms: set[sympy.Symbol] = set()
        self.shape_env = None
        self.env: dict[fx.Node, Any] = {}  # node -> placement of the value it defines
        self.current: dict[fx.Node, Placement] = {}  # mutated node -> placement after mutation
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.meta.get(ROLE) == Role.INPUT and node.meta.get(INPUT_BATCH_DIM) is not None:
                self._add_batch_symbol(node)

    # -- shapes ----------------------------------------------------------------------------

    def _add_batch_symbol(self, node: fx.Node) -> None:
        d = node.meta[INPUT_BATCH_DIM]
        val = node.meta["val"]
        if not -val.dim() <= d < val.dim():
            _fail(node, f"input batch dim {d} out of range for shape {tuple(val.shape)}")
        size = val.shape[d]
        if not isinstance(size, torch.SymInt):
            _fail(node, f"the input's batch dim {d} has static size {size}; it must be traced as a "
                        "dynamic size (a batch of size 0 or 1 is specialized by the tracer)")
        self.shape_env = size.node.shape_env
        syms = self._expr(size).free_symbols
        if not syms:
            _fail(node, f"the input's batch size was specialized to {self._expr(size)}")
        self.batch_syms |= syms

    @staticmethod
    def _expr(size) -> sympy.Expr:
        """The size as a sympy expression in canonical symbols (ShapeEnv replacements applied)."""
        if isinstance(size, torch.SymInt):
            return size.node.shape_env.simplify(size.node.expr)
        return sympy.Integer(size)

    def _canonical(self, expr: sympy.Expr) -> sympy.Expr:
        return self.shape_env.simplify(expr) if self.shape_env is not None else expr

    def _syms(self, size) -> set:
        return self._expr(size).free_symbols if isinstance(size, torch.SymInt) else set()

    def batch_dims(self, val: torch.Tensor) -> list[int]:
        return [i for i, s in enumerate(val.shape) if self._syms(s) & self.batch_syms]

    def _is_local_shape(self, val: torch.Tensor) -> bool:
        return any(self._syms(s) & self.local_syms for s in val.shape)

    def is_batch_shard(self, val, p) -> bool:
        return isinstance(p, _BatchShard) and bool(self._syms(val.shape[p.dim]) & self.batch_syms)

    def _bind_unbacked(self, node: fx.Node, ins) -> None:
        """Unbacked sizes the node computes (``nonzero``, a boolean mask, ``item``) from batch data
        are batch sizes: the selected samples or tokens are each rank's own. From other rank-local
        values they are rank-local sizes; from replicated values, ordinary sizes."""
        bound = node.meta.get("unbacked_bindings") or {}
        if not bound:
            return
        if self.shape_env is None:
            mode = detect_fake_mode(node.meta.get("val"))
            self.shape_env = getattr(mode, "shape_env", None)
        syms = set().union(*(self._canonical(s).free_symbols for s in bound))
        if any(self.is_batch_shard(v, p) for v, p in ins):
            self.batch_syms |= syms
        elif any(not isinstance(p, Replicate) for _, p in ins):
            self.local_syms |= syms

    def strided(self, dim: int, factor: sympy.Expr) -> Placement:
        """``Shard(dim)`` for a factor of 1, else ``_StridedShard(dim, split_factor=factor)``; a
        symbolic factor stays a SymInt (DTensor's constructor would pin it to its current value
        with a runtime assert in the ShapeEnv)."""
        factor = sympy.expand(factor)
        if factor == 1:
            return Shard(dim)
        if factor.is_Integer:
            return _StridedShard(dim, split_factor=int(factor))
        hint = int(self.shape_env.optimization_hint(factor, fallback=1))  # adds no guard
        p = _StridedShard(dim, split_factor=hint)
        p._symbolic_split_factor = self.shape_env.create_symintnode(factor, hint=hint)
        return p

    # -- inputs ----------------------------------------------------------------------------

    def inputs(self, node: fx.Node, args) -> list[tuple[torch.Tensor, Placement]]:
        """(val, placement) of every tensor-valued node in ``args`` (lists included)."""
        flat: list[fx.Node] = []
        fx.node.map_arg(args, flat.append)
        out = []
        for n in flat:
            p = self.current.get(n, self.env.get(n))
            if _is_tensor(n.meta.get("val")) and isinstance(p, Placement):
                out.append((n.meta["val"], p))
        return out

    # -- reuse -----------------------------------------------------------------------------

    def rebind_unbacked(self, node: fx.Node) -> None:
        """What ``node_placement`` records besides the placement (unbacked symbols' kinds), for
        a node whose placement is reused."""
        if node.op == "call_function" and node.meta.get("unbacked_bindings"):
            self._bind_unbacked(node, self.inputs(node, (node.args, node.kwargs)))

    # -- rules -----------------------------------------------------------------------------

    def node_placement(self, node: fx.Node):
        if node.op == "placeholder":
            return self.placeholder(node)
        if node.op == "get_attr":
            return Replicate() if _is_tensor(node.meta.get("val")) else None
        if node.op == "output":
            return None
        if node.op != "call_function":
            _fail(node, f"a {node.op} node: only aten-level graphs (call_function) are analyzed")
        if node.target is operator.getitem:
            parent = self.env.get(node.args[0])
            return parent[node.args[1]] if isinstance(parent, list) else None
        name = _op_name(node.target)
        val = node.meta.get("val")
        if node.meta.get(MODEL_PARALLEL) is not None:
            return self.model_parallel(node, name, val)
        if getattr(node.target, "namespace", None) == _COLLECTIVE_NS:
            return self.collective(node, name, val)
        if name.startswith(("_foreach_", "_fused_")):
            return self.per_index(node, name, val)
        if name.endswith("_like") and name in _FACTORIES and _is_tensor(val):
            src = self.inputs(node, node.args[:1])[0]
            if isinstance(src[1], Shard) and not self.is_batch_shard(*src):
                return src[1]  # a fresh tensor like a parameter shard is a shard of that tensor
        ins = self.inputs(node, (node.args, node.kwargs))
        self._bind_unbacked(node, ins)
        if _is_tensor(val):
            return self.output(node, name, val, ins)
        if isinstance(val, (list, tuple)) and any(_is_tensor(v) for v in val):
            return [self.output(node, name, v, ins) if _is_tensor(v) else None for v in val]
        return None  # a Python number (sym_size, item) or nothing

    def record_mutations(self, node: fx.Node) -> dict[fx.Node, Any]:
        """An in-place op gives the tensors it writes a new placement for their later readers;
        returns those (written node -> placement)."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            return {}
        name = _op_name(node.target)
        if getattr(node.target, "namespace", None) == _COLLECTIVE_NS:
            wrote = {node.args[0]: self.env[node]}  # an in-place collective (all_reduce_)
            self.current.update(wrote)
            return wrote
        per_index = self.env[node] if name.startswith(("_foreach_", "_fused_")) else None
        ins = None
        wrote = {}
        for arg, value in zip(schema.arguments, node.args):
            if not (arg.alias_info and arg.alias_info.is_write) or value is None:
                continue
            if per_index is not None:
                wrote.update(zip(value, per_index))
                self.current.update(zip(value, per_index))
                continue
            if ins is None:
                ins = self.inputs(node, (node.args, node.kwargs))
            for written in value if isinstance(value, (list, tuple)) else [value]:
                wrote[written] = self.current[written] = self.output(node, name, written.meta["val"], ins)
        return wrote

    def placeholder(self, node: fx.Node):
        val = node.meta.get("val")
        if not _is_tensor(val):
            return None
        if node.meta.get(ROLE) == Role.INPUT and node.meta.get(INPUT_BATCH_DIM) is not None:
            return Shard(node.meta[INPUT_BATCH_DIM] % val.dim())
        stored = node.meta.get(PLACEMENT)
        stateful = node.meta.get(ROLE) in (Role.PARAM, Role.BUFFER, Role.OPT_STATE)
        if isinstance(stored, Shard) and stateful:
            return stored  # a stored parameter/state shard (fully_shard expansion)
        return Replicate()

    def output(self, node, name, out, ins):
        """The placement of one tensor result ``out`` of ``node`` from its inputs' placements."""
        if name == "pow" and len(ins) == 1 and isinstance(ins[0][1], _NormPartial):
            args = _arguments(node)
            if args is not None and args["exponent"] == ins[0][1].norm_type:
                return Partial("sum")  # |shard|_p ** p: a sum over the shards
        if name in _STACKING and ins and all(isinstance(p, Partial) and p == ins[0][1] for _, p in ins):
            return ins[0][1]  # partial values side by side (reductions stacked for one all_reduce)
        for _, p in ins:
            if isinstance(p, Partial) and p != AVG:
                _fail(node, f"an input is {p} over parameter shards; it needs its all_reduce "
                            f"before {name}")
        batch_ins = [(v, p) for v, p in ins if self.is_batch_shard(v, p)]
        param_shards = [(v, p) for v, p in ins if isinstance(p, Shard) and not self.is_batch_shard(v, p)]
        dims = self.batch_dims(out)
        if dims:
            if param_shards:
                _fail(node, "mixes batch-sharded data with parameter shards: a parameter must "
                            "be all-gathered before it meets the batch")
            return self.batch_placement(node, name, out, dims, batch_ins)
        if param_shards:
            if any(isinstance(p, Partial) for _, p in ins):
                _fail(node, "mixes parameter shards with Partial values")
            return self.param_shard(node, name, out, ins)
        if name in _FACTORIES:  # values independent of the inputs
            return AVG if self._is_local_shape(out) else Replicate()
        if batch_ins or self._is_local_shape(out) or any(isinstance(p, Partial) for _, p in ins):
            return AVG  # rank-local
        return Replicate()

    def batch_placement(self, node, name, out, dims, batch_ins) -> Placement:
        """The batch shard of ``out``: where its batch dim came from and how it is laid out."""
        if name in _RESHAPES and len(batch_ins) == 1:
            # a reshape that cuts the batch factor's rows apart proves only the concatenation
            return self.reshaped(out, dims, *batch_ins[0]) or Shard(dims[0])
        args = _arguments(node) if name in ("repeat", "cat") else None
        if name == "repeat" and args is not None and len(batch_ins) == 1:
            (v, p), reps = batch_ins[0], args["repeats"]
            d = p.dim + len(reps) - v.dim()
            copies = reps[d].meta["val"] if isinstance(reps[d], fx.Node) else reps[d]
            return self.strided(d, self._expr(copies) * self._expr(_split_factor(p)))
        if name == "cat" and args is not None and batch_ins:
            d = args["dim"] % out.dim()
            parts = self.inputs(node, args["tensors"])
            along = [(v, p) for v, p in parts if self.is_batch_shard(v, p) and p.dim == d]
            if along:
                sizes = {self._expr(v.shape[d]) for v, _ in parts}
                factors = {self._expr(_split_factor(p)) for _, p in along}
                if len(along) == len(parts) and len(sizes) == 1 and len(factors) == 1:
                    return self.strided(d, len(parts) * factors.pop())  # k chunks, each sharded
                return Shard(d)  # the batch next to other rows: only the concatenation is known
        # The batch dim of an input: an output dim of the very same size is that dim.
        for v, p in batch_ins:
            size = self._expr(v.shape[p.dim])
            for d in dims:
                if self._expr(out.shape[d]) == size:
                    return self.strided(d, self._expr(_split_factor(p)))
        return Shard(dims[0])  # e.g. a factory of batch size: ones(b, 8), arange(b)

    def reshaped(self, out, dims, v, p) -> Placement | None:
        """Follow the batch factor of ``v`` (placement ``p``) through a row-major reshape.

        In the flattened index the elements are ``outer x batch x inner``: the batch factor comes
        after ``outer = prod(v.shape[:k]) * sf`` chunks (``k = p.dim``), and each sample holds
        ``inner`` consecutive elements (the rest of dim ``k``'s chunk, then ``v.shape[k+1:]``). An
        output dim ``d`` holding the batch symbol keeps it exactly when the dims before it split
        ``outer`` (``outer / prod(out.shape[:d])`` chunks: the output's split factor, 1 for a
        plain ``Shard(d)``) and the dims after it split ``inner`` (no row of ``d`` holds
        elements of two samples). None otherwise: the reshape cuts the batch factor apart.
        """
        k, sf = p.dim, self._expr(_split_factor(p))
        outer = prod(self._expr(s) for s in v.shape[:k]) * sf
        size = sympy.factor_terms(self._expr(v.shape[k]))  # 4*s0 + 4 -> 4*(s0 + 1)
        batch = size.as_independent(*self.batch_syms, as_Add=False)[1]
        inner = size / (sf * batch) * prod(self._expr(s) for s in v.shape[k + 1:])
        for d in dims:
            chunks = outer / prod(self._expr(s) for s in out.shape[:d])
            rows = inner / prod(self._expr(s) for s in out.shape[d + 1:])
            if self._whole(chunks) and self._whole(rows):
                return self.strided(d, sympy.cancel(chunks))
        return None

    def _whole(self, ratio: sympy.Expr) -> bool:
        """Whether ``ratio`` of two sizes is a whole number (a polynomial) free of the batch."""
        ratio = sympy.cancel(ratio)
        return sympy.fraction(ratio)[1] == 1 and not (ratio.free_symbols & self.batch_syms)

    @staticmethod
    def _elementwise(node, name) -> bool:
        if name in _IDENTITIES:
            return True
        if name.startswith(("_foreach_", "_fused_")):
            return name != "_foreach_norm"
        return torch.Tag.pointwise in getattr(node.target, "tags", ())

    def _masked_write(self, node, name, shards) -> bool:
        """``t[mask] = scalar`` (``index_put`` with one boolean mask of ``t``'s shape, as Rprop
        writes its update): elementwise, so a shard computes its part of the whole."""
        if name not in ("index_put", "index_put_"):
            return False
        args = _arguments(node)
        indices = args and args["indices"]
        if not (indices and len(indices) == 1 and isinstance(indices[0], fx.Node)):
            return False
        target, mask = args["input"].meta["val"], indices[0].meta["val"]
        values = args["values"].meta.get("val") if isinstance(args["values"], fx.Node) else None
        return (mask.dtype == torch.bool and mask.dim() == target.dim()
                and self.env.get(indices[0]) == self.current.get(args["input"],
                                                                 self.env.get(args["input"]))
                and (values is None or values.numel() == 1) and len({p for _, p in shards}) == 1)

    def param_shard(self, node, name, out, ins):
        """Results of ops on stored parameter/state shards (non-batch ``Shard``, static sizes).

        These placements are what fully_shard's expansion must honour: an elementwise update keeps
        the shard; a full sum / max / min / norm over a shard is a ``Partial`` that needs its
        all_reduce; anything else would compute something different on a shard than on the whole
        parameter."""
        shards = [(v, p) for v, p in ins if isinstance(p, Shard)]
        if self._masked_write(node, name, shards):
            return shards[0][1]
        if self._elementwise(node, name) and len({p.dim for _, p in shards}) == 1:
            # ranks only: a shard's meta may hold its local or its logical (unsharded) shape
            same = all(v.dim() == out.dim() for v, _ in shards)
            scalars = all(v.numel() == 1 for v, p in ins if isinstance(p, Replicate))
            if same and scalars:
                return shards[0][1]
        if out.numel() == 1 and all(v.dim() == out.dim() or out.dim() == 0 for v, _ in shards):
            if name == "sum":
                return Partial("sum")
            if name in ("amax", "max", "amin", "min"):
                return Partial("max" if "max" in name else "min")
            if name in ("linalg_vector_norm", "norm", "_foreach_norm"):
                args = _arguments(node) or {}
                order = args.get("ord", args.get("p"))
                return _NormPartial(2 if order is None else order)
        if LOCAL_SHARD in node.meta:  # an all-gather hook's op on this rank's shard, as FSDP2
            return shards[0][1]  # runs it (reductions above are completed by the hook's own)
        _fail(node, f"{name} on parameter shards is not covered: on a shard it would compute "
                    "something else than on the whole parameter")

    def per_index(self, node, name, val):
        """Foreach / fused optimizer ops: one placement per list index (what the op writes or
        returns at that index)."""
        lists = [a for a in (*node.args, *node.kwargs.values())
                 if isinstance(a, (list, tuple)) and a
                 and all(isinstance(x, fx.Node) and _is_tensor(x.meta.get("val")) for x in a)]
        others = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        if name == "_foreach_copy_":
            lists = lists[1:]
        if isinstance(val, (list, tuple)) and val:
            outs = val
        else:  # a void in-place op: what it writes into its first list
            outs = [x.meta["val"] for x in node.args[0]]
        return [self.output(node, name, out, self.inputs(node, ([lst[i] for lst in lists], others)))
                for i, out in enumerate(outs)]

    def model_parallel(self, node, name, val):
        """A collective the step itself issues (DTensor's, over a tensor-parallel group): over
        the data-parallel dims every rank runs it on its own data, as a local op. A result with
        a batch dim is batch-sharded there; anything else keeps its input's placement."""
        if name == "wait_tensor":
            return self.env[node.args[0]]

        def one(v, p):
            dims = self.batch_dims(v)
            return Shard(dims[0]) if dims else p

        ins = self.inputs(node, node.args)
        if isinstance(val, (list, tuple)):
            return [one(v, p) for v, (_, p) in zip(val, ins)]
        return one(val, ins[0][1])

    def collective(self, node, name, val):
        """Functional collectives: all_reduce makes Partial data Replicate (and keeps a parameter
        shard a shard: hybrid sharding sums shards over the replicate dim), all_gather gathers
        shards into Replicate, reduce_scatter scatters Partial data into Shard(0) parameter shards;
        wait_tensor passes its input through."""
        if name == "wait_tensor":
            return self.env[node.args[0]]

        def one(v, p):
            if self.batch_dims(v):
                _fail(node, f"{name} of batch-sharded data: the expansion only communicates "
                            "gradients, parameters and buffers")
            if name.startswith("all_reduce"):
                # a parameter shard summed over another mesh dim's replicas (hybrid sharding)
                # stays a shard; anything else becomes whole
                return p if isinstance(p, Shard) else Replicate()
            if name.startswith("all_gather") and not isinstance(p, Partial):
                return Replicate()
            if name.startswith("reduce_scatter") and not isinstance(p, Shard):
                return Shard(0)
            if name.startswith("broadcast"):
                return Replicate()
            _fail(node, f"{name} of a {p} tensor is not covered")

        ins = self.inputs(node, node.args)
        if isinstance(val, (list, tuple)):
            return [one(v, p) for v, p in ins]
        return one(*ins[0])


def annotate_placements(gm: fx.GraphModule) -> fx.GraphModule:
    """Write ``node.meta[PLACEMENT]`` for every node of a traced (or expanded) training step.

    Reads: ``node.meta["val"]`` (FakeTensors with symbolic batch sizes), ``unbacked_bindings``,
    ROLE and INPUT_BATCH_DIM of placeholders, and a ``Shard`` PLACEMENT already on a PARAM /
    BUFFER / OPT_STATE placeholder (a stored shard after fully_shard expansion).
    Writes: PLACEMENT on every node: a Placement for a tensor value; a list (one entry per element,
    None for non-tensors) for a list/tuple of tensors, and for a foreach/fused in-place op the
    placement of what it writes at each list index; None for non-tensor nodes.
    ``gm.meta[PLACEMENT_INPUTS]``: per node, what its placement was derived from and the
    placement. A later run on the same graph (after the expansion) reuses the placement of every
    node whose argument tuples and value are the same objects (a pass that changes them makes
    new ones) and none of whose inputs changed (a new node, a new value, another placement, or
    another placement written by an in-place op); it derives only the others: the nodes the
    expansion inserted and those downstream of a change.
    Raises: ``PlacementError`` only for what the expansion would get wrong (see the module
    docstring); then no node is annotated.
    """
    analysis = _Analysis(gm)
    before = gm.meta.get(PLACEMENT_INPUTS) or {}
    record: dict[fx.Node, tuple] = {}
    changed: set[fx.Node] = set()
    env = analysis.env
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        syms = (len(analysis.batch_syms), len(analysis.local_syms))
        old = before.get(node)
        if (old is not None and node.op != "placeholder" and old[0] is node.args
                and old[1] is node.kwargs and old[2] is val and old[4] == syms
                and not any(n in changed for n in node.all_input_nodes)):
            env[node] = old[3]
            analysis.rebind_unbacked(node)
        else:
            env[node] = analysis.node_placement(node)
            if old is None or old[2] is not val or not _same(old[3], env[node]):
                changed.add(node)
        writes = analysis.record_mutations(node)
        if writes and (old is None or not _same(list(writes.items()), list(old[5].items()))):
            changed.update(writes)
        record[node] = (node.args, node.kwargs, val, env[node], syms, writes)
    for node, p in env.items():
        node.meta[PLACEMENT] = p
    gm.meta[PLACEMENT_INPUTS] = record
    return gm
