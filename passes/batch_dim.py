"""Batch-dim analysis: placement propagation on symbolic shapes.

``annotate_placements(gm)`` labels every tensor in a traced training step with how it is laid out
across data-parallel ranks, as a DTensor placement:

- ``Shard(d)``: batch-sharded along dim d. Exact on symbolic shapes: dim d is sharded iff its size
  expression (after the ShapeEnv's replacements) contains a batch symbol, i.e. the symbol of an
  input's batch dim. A tensor may hold the symbol in one dim only, and only as the outermost factor
  of that dim.
- ``Replicate()``: the same on every rank (parameters, buffers, optimizer state, constants, values
  computed only from those).
- ``Partial("avg")``: a rank-local value computed from the local batch by an op that treats the
  batch samples symmetrically (sum, mean, contractions, losses, norms, batch-norm statistics, weight
  gradients); the data-parallel step means its average over the ranks. Every value computed from a
  ``Partial("avg")`` stays ``Partial("avg")`` until an ``all_reduce`` makes it ``Replicate()``.

On a fully_shard-expanded graph a placeholder that already carries ``Shard(k)`` on a static dim is a
stored parameter/state shard; elementwise optimizer math keeps it, and a reduction over it is a
``Partial`` with DTensor's reduce op (``sum``, ``max``, ``min``, or DTensor's ``_NormPartial``).

Anything no rule explains raises ``BatchDimError`` naming the node, the op and the user's source
line. docs/batch_dim.md lists the rules and the ops.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from math import prod
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.fx.operator_schemas import normalize_function

from .meta import INPUT_BATCH_DIM, PLACEMENT, ROLE, Role

__all__ = ["BatchDimError", "annotate_placements"]

AVG = Partial("avg")

# Ops whose output values do not depend on their tensor inputs' values (only on shapes/options).
_FACTORIES = frozenset({
    "arange", "ones", "zeros", "full", "empty", "empty_strided", "scalar_tensor", "rand", "randn",
    "randint", "randperm", "linspace", "logspace", "eye", "ones_like", "zeros_like", "full_like",
    "empty_like", "rand_like", "randn_like", "randint_like", "new_ones", "new_zeros", "new_full",
    "new_empty", "new_empty_strided", "zero_", "fill_", "uniform_", "normal_", "bernoulli_",
    "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
})
# Factories whose values depend on the position along a dim: along the batch they would number
# the local samples, not the global ones.
_POSITIONAL_FACTORIES = frozenset({"arange", "randperm", "linspace", "logspace", "eye"})

# Ops that, given batch-sharded inputs, may produce a tensor without the batch dim: they treat the
# batch samples symmetrically (sums, contractions, statistics, losses, scatter-adds), so the result
# is rank-local and means its average over the ranks: Partial("avg").
_BATCH_REDUCTIONS = frozenset({
    # reductions
    "sum", "nansum", "mean", "nanmean", "amax", "amin", "max", "min", "aminmax", "norm",
    "linalg_vector_norm", "var", "std", "var_mean", "std_mean", "prod", "logsumexp",
    "count_nonzero",
    # contractions
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv", "addr",
    "tensordot", "convolution_backward", "_convolution_double_backward",
    # normalization statistics and their parameter gradients
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
    "_batch_norm_with_update_functional", "native_batch_norm_backward", "batch_norm_backward",
    "native_layer_norm_backward", "native_group_norm_backward", "batch_norm_stats",
    # embedding and scatter-add gradients
    "embedding_dense_backward", "embedding_backward", "_embedding_bag_backward",
    "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward",
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put",
    # losses
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss_forward",
    "nll_loss2d_forward", "nll_loss", "nll_loss_nd", "cross_entropy_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss_forward", "margin_ranking_loss", "hinge_embedding_loss",
    "cosine_embedding_loss", "poisson_nll_loss", "triplet_margin_loss", "_ctc_loss",
})
# Reductions whose integer outputs are positions along the reduced dim (not symmetric).
_INDEX_RETURNING = frozenset({
    "max", "min", "median", "nanmedian", "mode", "kthvalue", "sort", "topk", "cummax", "cummin",
})
# Scatter-style reductions given as index_put(..., accumulate): only accumulate=True is a sum.
_ACCUMULATE = frozenset({"index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"})
# Advanced indexing (reads and writes) with a list of index tensors, one per indexed dim.
_INDEXING = _ACCUMULATE | {"index", "_unsafe_index"}

# Reshapes: the batch dim may be merged/split only with dims inside it (outer prefix unchanged).
_RESHAPES = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "flatten", "unflatten", "squeeze",
    "squeeze_", "unsqueeze", "unsqueeze_", "view_copy", "_reshape_copy",
})
# Ops that copy their (first) input elementwise without being tagged pointwise.
_IDENTITIES = frozenset({
    "detach", "alias", "_to_copy", "copy_", "lift_fresh_copy", "contiguous", "clone",
    "native_dropout", "native_dropout_backward", "_foreach_copy_",
})


# Ops that mix values along a dim argument; along the batch dim they would depend on where each
# sample sits in its rank's local batch (a softmax over the batch, a flip, a gather): op name ->
# (tensor argument, dim argument), as named by torch.fx.operator_schemas.normalize_function.
_MIXES_ALONG = {
    **dict.fromkeys(
        ["_softmax", "_log_softmax", "cumsum", "cumsum_", "cumprod", "logcumsumexp", "cummax",
         "cummin", "sort", "topk", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
         "scatter_reduce", "scatter_reduce_", "index_select", "index_fill", "index_copy",
         "index_add", "index_add_", "diff"], ("input", "dim")),
    "_softmax_backward_data": ("grad_output", "dim"),
    "_log_softmax_backward_data": ("grad_output", "dim"),
    "flip": ("input", "dims"),
    "roll": ("input", "dims"),  # no dims: rolls the flattened tensor
}

_COLLECTIVE_NS = "_c10d_functional"


class BatchDimError(Exception):
    """A node whose placement no batch-dim rule explains.

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


@dataclass(frozen=True)
class _Unusable:
    """An output of a multi-output op that has no placement; using it raises ``reason``."""

    reason: str


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _fail(node: fx.Node, reason: str):
    raise BatchDimError(node, reason)


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (``self`` is called ``input``), defaults filled in."""
    normalized = normalize_function(node.target, node.args, node.kwargs,
                                    normalize_to_only_use_kwargs=True)
    if normalized is None:
        _fail(node, "cannot match the node's arguments to its schema")
    return normalized.kwargs


class _Analysis:
    """Symbol bookkeeping and the per-node rules; one instance per ``annotate_placements`` call."""

    def __init__(self, gm: fx.GraphModule):
        self.batch_syms: set[sympy.Symbol] = set()
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

    def _has_batch(self, size) -> bool:
        if not isinstance(size, torch.SymInt):
            return False
        return bool(self._expr(size).free_symbols & self.batch_syms)

    def batch_dims(self, val: torch.Tensor) -> list[int]:
        return [i for i, s in enumerate(val.shape) if self._has_batch(s)]

    def is_batch_shard(self, val, p) -> bool:
        return isinstance(p, Shard) and self._has_batch(val.shape[p.dim])

    def _outermost_ok(self, size) -> bool:
        """Whether a batch dim's size is (batch symbol) x (batch-free factor)."""
        expr = self._expr(size)
        return any(
            not (sympy.expand(expr / s).free_symbols & self.batch_syms)
            for s in expr.free_symbols & self.batch_syms
        )

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
            p = parent[node.args[1]] if isinstance(parent, list) else None
            if isinstance(p, _Unusable):
                _fail(node.args[0], p.reason)  # the op that produced the unusable output
            return p
        name = _op_name(node.target)
        val = node.meta.get("val")
        if getattr(node.target, "namespace", None) == _COLLECTIVE_NS:
            return self.collective(node, name, val)
        if name.startswith(("_foreach_", "_fused_")):
            return self.per_index(node, name, val)
        if name in ("_local_scalar_dense", "item"):
            for v, p in self.inputs(node, node.args):
                if not isinstance(p, Replicate):
                    _fail(node, f"reads a {p} tensor into a Python number: the value differs "
                                "across ranks and would steer the step differently on each")
            return None
        if name.endswith("_like") and name in _FACTORIES and _is_tensor(val):
            src = self.inputs(node, node.args[:1])[0]
            if isinstance(src[1], Shard) and not self.is_batch_shard(*src):
                return src[1]  # a fresh tensor like a parameter shard is a shard of that tensor
        ins = self.inputs(node, self._value_args(node, name))
        if _is_tensor(val):
            p = self.output(node, name, val, ins, None)
            if isinstance(p, _Unusable):
                _fail(node, p.reason)
            return p
        if isinstance(val, (list, tuple)) and any(_is_tensor(v) for v in val):
            return [self.output(node, name, v, ins, i) if _is_tensor(v) else None
                    for i, v in enumerate(val)]
        return None

    def record_mutations(self, node: fx.Node) -> None:
        """An in-place op gives the tensors it writes a new placement for their later readers."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        name = _op_name(node.target)
        if getattr(node.target, "namespace", None) == _COLLECTIVE_NS:
            self.current[node.args[0]] = self.env[node]  # an in-place collective (all_reduce_)
            return
        per_index = self.env[node] if name.startswith(("_foreach_", "_fused_")) else None
        ins = None
        for arg, value in zip(schema.arguments, node.args):
            if not (arg.alias_info and arg.alias_info.is_write) or value is None:
                continue
            if per_index is not None:
                self.current.update(zip(value, per_index))
                continue
            if ins is None:
                ins = self.inputs(node, self._value_args(node, name))
            for written in value if isinstance(value, (list, tuple)) else [value]:
                p = self.output(node, name, written.meta["val"], ins, None)
                if isinstance(p, _Unusable):
                    _fail(node, p.reason)
                self.current[written] = p

    def _value_args(self, node: fx.Node, name: str):
        """The arguments whose values the result depends on."""
        if name in _FACTORIES:
            return ()
        if name == "copy_":  # the destination is overwritten
            return (node.args[1:], node.kwargs)
        return (node.args, node.kwargs)

    def placeholder(self, node: fx.Node):
        val = node.meta.get("val")
        if not _is_tensor(val):
            return None
        dims = self.batch_dims(val)
        if node.meta.get(ROLE) == Role.INPUT and node.meta.get(INPUT_BATCH_DIM) is not None:
            d = node.meta[INPUT_BATCH_DIM] % val.dim()
            if dims != [d]:
                _fail(node, f"input of shape {tuple(val.shape)} has the batch size in dims {dims}; "
                            f"expected it in its batch dim {d} only")
            return Shard(d)
        if dims:
            _fail(node, f"{node.meta.get(ROLE)} placeholder of shape {tuple(val.shape)} has a "
                        "batch-sized dim but is not a batched input")
        stored = node.meta.get(PLACEMENT)
        stateful = node.meta.get(ROLE) in (Role.PARAM, Role.BUFFER, Role.OPT_STATE)
        if isinstance(stored, Shard) and stateful:
            return stored  # a stored parameter/state shard (fully_shard expansion)
        return Replicate()

    def output(self, node, name, out, ins, position):
        """The placement of one tensor result ``out`` of ``node`` from its inputs' placements."""
        if name == "pow" and len(ins) == 1 and isinstance(ins[0][1], _NormPartial):
            if _arguments(node)["exponent"] == ins[0][1].norm_type:  # |shard|_p ** p: a sum
                return Partial("sum")
        for _, p in ins:
            if isinstance(p, Partial) and p != AVG:
                _fail(node, f"an input is {p} over parameter shards; it needs its all_reduce "
                            f"before {name}")
        dims = self.batch_dims(out)
        batch_ins = [(v, p) for v, p in ins if self.is_batch_shard(v, p)]
        if len(dims) > 1:
            _fail(node, f"result of shape {tuple(out.shape)} has the batch size in dims {dims}; "
                        "a tensor can be sharded along one batch dim only (e.g. an outer product "
                        "of the batch with itself)")
        if dims:
            d = dims[0]
            if not self._outermost_ok(out.shape[d]):
                _fail(node, f"dim {d} of the result {tuple(out.shape)} has size "
                            f"{self._expr(out.shape[d])}: not (batch size) x (a batch-free "
                            "factor); slicing, padding or concatenating along the batch dim is "
                            "not covered")
            if any(isinstance(p, Shard) and not self.is_batch_shard(v, p) for v, p in ins):
                _fail(node, "mixes batch-sharded data with parameter shards")
            self.check_shard(node, name, out, d, batch_ins)
            return Shard(d)
        if batch_ins:
            return self.reduction_over_batch(node, name, out, batch_ins, position)
        shards = [(v, p) for v, p in ins if isinstance(p, Shard)]
        if shards:
            if any(isinstance(p, Partial) for _, p in ins):
                _fail(node, "mixes parameter shards with Partial values")
            return self.param_shard(node, name, out, ins)
        if any(isinstance(p, Partial) for _, p in ins):
            return AVG
        return Replicate()

    def check_shard(self, node, name, out, d, batch_ins):
        """Op-specific conditions for a batch-sharded result ``out`` (sharded along ``d``)."""
        if name in _POSITIONAL_FACTORIES:
            _fail(node, f"{name} along the batch dim numbers each rank's local samples, not the "
                        "global ones")
        if name in _RESHAPES:
            for v, p in batch_ins:
                before = prod(self._expr(s) for s in v.shape[: p.dim])
                after = prod(self._expr(s) for s in out.shape[:d])
                if sympy.expand(before - after) != 0:
                    _fail(node, f"reshaping {tuple(v.shape)} (batch dim {p.dim}) to "
                                f"{tuple(out.shape)} puts the batch inside dim {d}, not outermost: "
                                "the ranks' shards would interleave")
        if name == "cat" and batch_ins and _arguments(node)["dim"] % out.dim() == d:
            _fail(node, "concatenating along the batch dim interleaves the ranks' samples")
        if name == "repeat":
            reps = _arguments(node)["repeats"]
            for v, p in batch_ins:
                if reps[p.dim + len(reps) - v.dim()] != 1:
                    _fail(node, "repeating along the batch dim interleaves the ranks' samples")
        if name in _MIXES_ALONG:
            src_name, dim_name = _MIXES_ALONG[name]
            args = _arguments(node)
            src, mixed = args[src_name], args[dim_name]
            v, p = src.meta["val"], self.env[src]
            mixed = list(range(v.dim())) if mixed in ([], None) else (
                [mixed] if isinstance(mixed, int) else mixed)
            if self.is_batch_shard(v, p) and p.dim in [m % v.dim() for m in mixed]:
                _fail(node, f"{name} along the batch dim depends on the positions of the samples "
                            "within one rank's batch")
        if name in _INDEXING:
            args = _arguments(node)
            v, p = args["input"].meta["val"], self.env[args["input"]]
            indices = args["indices"]
            if self.is_batch_shard(v, p) and p.dim < len(indices) and indices[p.dim] is not None:
                _fail(node, "indexing into the batch dim with an index tensor")
        if self._elementwise(node, name):
            for v, p in batch_ins:
                if p.dim + out.dim() - v.dim() != d:
                    _fail(node, f"elementwise op moves the batch dim from {p.dim} to {d}")

    @staticmethod
    def _elementwise(node, name) -> bool:
        if name in _IDENTITIES:
            return True
        if name.startswith(("_foreach_", "_fused_")):
            return name != "_foreach_norm"
            return True
        return torch.Tag.pointwise in getattr(node.target, "tags", ())

    def reduction_over_batch(self, node, name, out, batch_ins, position):
        v, p = batch_ins[0]
        if name not in _BATCH_REDUCTIONS:
            _fail(node, f"the result {tuple(out.shape)} has no batch dim but its input "
                        f"{tuple(v.shape)} is sharded along dim {p.dim}, and {name} is not a "
                        "symmetric reduction over the batch (it selects, slices or indexes into "
                        "it)")
        if name in _ACCUMULATE and not _arguments(node)["accumulate"]:
            _fail(node, f"{name} without accumulate writes batch samples by position")
        if name in _INDEX_RETURNING and position == 1:
            return _Unusable(f"{name} returns positions along the batch dim (indices of local "
                             "samples); only its values output is supported")
        return AVG

    def param_shard(self, node, name, out, ins):
        """Results of ops on stored parameter/state shards (non-batch ``Shard``, static sizes)."""
        shards = [(v, p) for v, p in ins if isinstance(p, Shard)]
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
                args = _arguments(node)
                order = args.get("ord", args.get("p"))
                return _NormPartial(2 if order is None else order)
        _fail(node, f"{name} on parameter shards is not covered")

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
        result = []
        for i, out in enumerate(outs):
            ins = self.inputs(node, ([lst[i] for lst in lists], others))
            p = self.output(node, name, out, ins, None)
            result.append(p)
        return result

    def collective(self, node, name, val):
        """Functional collectives: all_reduce makes Partial data Replicate, all_gather gathers
        shards into Replicate, reduce_scatter scatters Partial data into Shard(0) parameter shards;
        wait_tensor passes its input through."""
        if name == "wait_tensor":
            return self.env[node.args[0]]

        def one(v, p):
            if self.batch_dims(v):
                _fail(node, f"{name} of batch-sharded data is not covered")
            if name.startswith("all_reduce") and not isinstance(p, Shard):
                return Replicate()
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

    Reads: ``node.meta["val"]`` (FakeTensors with symbolic batch sizes), ROLE and
    INPUT_BATCH_DIM of placeholders, and a ``Shard`` PLACEMENT already on a PARAM / BUFFER /
    OPT_STATE placeholder (a stored shard after fully_shard expansion).
    Writes: PLACEMENT on every node: a Placement for a tensor value; a list (one entry per element,
    None for non-tensors) for a list/tuple of tensors, and for a foreach/fused in-place op the
    placement of what it writes at each list index; None for non-tensor nodes.
    Raises: ``BatchDimError`` for a node no rule explains; then no node is annotated.
    """
    analysis = _Analysis(gm)
    for node in gm.graph.nodes:
        analysis.env[node] = analysis.node_placement(node)
        analysis.record_mutations(node)
    for node, p in analysis.env.items():
        if isinstance(p, list):
            p = [None if isinstance(q, _Unusable) else q for q in p]
        node.meta[PLACEMENT] = p
    return gm
