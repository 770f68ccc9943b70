"""The ``Shard(0)`` mesh dim of the expansion (passes/expand.py; fully_shard, ZeRO-3 / FSDP-like,
and the shard dim of hybrid_shard): parameters, gradients and optimizer state live as dim-0
shards; parameters are all-gathered just in time, gradients reduce-scattered (expand.py inserts
those), and the optimizer's reductions over shards are completed.

Layout: a parameter with ``n`` rows is padded to ``rows * world`` rows, ``rows = ceil(n / world)``;
rank r holds rows ``[r * rows, (r + 1) * rows)``, so every collective is even. Padding rows are
zero in parameters, gradients and optimizer state, so they never reach a result. 0-d parameters are
not sharded (their gradients are all-reduced as in replicate).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict, deque

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from spmd_compiler.torch_internals import new_fake

from . import meta
from .subgraph import insert_traced
from .collectives import aten, c10d, collective_meta, finish_reduction, mutates, to_dtype, waited
from .extension_gathers import keep_recorded_gathers

_VIEW_OR_CAST = {
    aten.t.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.transpose.int, aten.expand.default, aten.detach.default,
    aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.slice.Tensor, aten.select.int, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.split.Tensor, aten.chunk.default, aten.unbind.int,
}


class ShardingError(Exception):
    """The step does something to parameter / optimizer-state shards that sharding would change."""




def shard_rows(n: int, world: int) -> int:
    return -(-n // world)


def shard_val(val: torch.Tensor, world: int) -> torch.Tensor:
    """A fake tensor of the padded local shard's shape (what ``val.new_empty`` makes; of static
    sizes without fake mode's dispatch, whose cache misses on every new shape)."""
    shape = (shard_rows(val.shape[0], world),) + tuple(val.shape[1:])
    if all(type(d) is int for d in shape):
        new = new_fake(getattr(val, "fake_mode", None), shape, _contiguous_strides(shape),
                       val.dtype, val.device)
        if new is not None:
            return new
    return val.new_empty(shape)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, as ``empty`` gives them (a dim of size 0 counts as 1)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _first(nodes, order: dict, graph: fx.Graph):
    """The earliest of ``nodes`` by ``order`` (node -> position; renumbered from ``graph`` in
    place when a node is missing: one inserted since)."""
    nodes = list(nodes)
    if any(n not in order for n in nodes):
        order.clear()
        order.update((n, i) for i, n in enumerate(graph.nodes))
    return min(nodes, key=order.__getitem__)


def _gather(graph, shard, full_val, world, group_name, before, region, fqn):
    """all_gather + wait (+ narrow away the padding) before ``before``; return the full param.
    A ``full_val`` of another dtype than the shard's gathers the shard cast to it."""
    n, dtype = full_val.shape[0], full_val.dtype

    def gather(x):
        x = to_dtype(x, dtype) if x.dtype != dtype else x
        x = waited(c10d.all_gather_into_tensor.default, x, world, group_name)
        return aten.slice.Tensor(x, 0, 0, n) if shard_rows(n, world) * world != n else x

    gathered = insert_traced(graph, gather, (shard,), before=before, region=region,
                             collective=collective_meta([fqn]))
    gathered.meta[meta.PARAM_FQN] = fqn
    return gathered


def _sole_cast(users: list[fx.Node]) -> fx.Node | None:
    """One of ``users`` if every one is the same plain cast (``_to_copy(p, dtype=d)``, as mixed
    precision records), else None."""
    keys = {(u.target, len(u.args), tuple(sorted(u.kwargs.items()))) for u in users}
    if len(keys) != 1:
        return None
    target, nargs, kwargs = keys.pop()
    return users[0] if target is aten._to_copy.default and nargs == 1 and (
        [k for k, _ in kwargs] == ["dtype"]) else None


def _forward_chain(full: fx.Node) -> list[fx.Node]:
    """Forward nodes computed from the gathered parameter alone by views and casts."""
    chain, seen, todo = [], {full}, deque([full])
    while todo:
        node = todo.popleft()
        for user in node.users:
            if (user not in seen and user.op == "call_function" and user.target in _VIEW_OR_CAST
                    and user.meta.get(meta.REGION) == meta.Region.FORWARD
                    and all(a in seen for a in user.all_input_nodes)):
                seen.add(user)
                chain.append(user)
                todo.append(user)
    return chain


def shard_parameters(gm: fx.GraphModule, *, group_name: str, world_size: int,
                     reshard_after_forward: bool = True) -> dict[str, tuple[fx.Node, torch.Tensor]]:
    """Make the parameters dim-0 shards over ``group_name``; return the sharded ones
    {fqn: (placeholder, full val)}.

    Reads: ROLE (PARAM / OPT_STATE placeholders), PARAM_FQN, REGION, node.meta["val"]. Writes:
    PARAM (other than 0-d) and same-shaped OPT_STATE placeholders become padded dim-0 shards
    (meta val and PLACEMENT Shard(0)); ``all_gather`` + narrow before each parameter's first
    forward use, and with ``reshard_after_forward`` a second gather (and re-derived views) before
    its first backward use; a parameter updated in place between two forwards (an optimizer
    stepping between two backward calls) is gathered so again after each update. A parameter whose every use outside the optimizer is the same cast
    (mixed precision's ``param_dtype``) is gathered in the cast dtype: the shard is cast before
    each gather, as FSDP2 does, and the gathered tensor replaces the casts. GATHERED parameters
    (their unshard recorded by the tracer) are sharded too; their gathers are the recorded ones
    (passes/extension_gathers.py).
    """
    graph = gm.graph
    world = world_size
    params, gathered = _parameters(graph)
    param_shapes = {fqn: tuple(val.shape) for fqn, (_, val) in {**params, **gathered}.items()}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        role = node.meta.get(meta.ROLE)
        fqn = node.meta.get(meta.PARAM_FQN)
        val = node.meta.get("val")
        if fqn in param_shapes and role in (meta.Role.PARAM, meta.Role.OPT_STATE) and (
            tuple(val.shape) == param_shapes[fqn]
        ):
            node.meta[meta.LOGICAL_SHAPE] = tuple(val.shape)
            node.meta["val"] = shard_val(val, world)
            node.meta[meta.PLACEMENT] = Shard(0)
    keep_recorded_gathers(graph, reshard_after_forward)
    order = {n: i for i, n in enumerate(graph.nodes)}  # (the uses of ``params`` keep their place)
    for fqn, (param, full_val) in params.items():
        for compute in _uses_between_updates(param, order):
            _gather_uses(graph, param, full_val, compute, world, group_name, reshard_after_forward,
                         fqn, order)

    return {**params, **gathered}


def _uses_between_updates(param: fx.Node, order: dict) -> list[list[fx.Node]]:
    """The parameter's uses outside the optimizer, split by the in-place updates of it (an
    optimizer stepping between two forwards of a step with several backward calls): each part
    reads the value the last update left, and is gathered anew."""
    users = sorted(param.users, key=order.__getitem__)
    parts: list[list[fx.Node]] = [[]]
    for u in users:
        if u.meta.get(meta.REGION) != meta.Region.OPTIMIZER:
            parts[-1].append(u)
        elif mutates(u, param) and parts[-1]:
            parts.append([])
    return [p for p in parts if p]


def _gather_uses(graph: fx.Graph, param: fx.Node, full_val, compute: list[fx.Node], world: int,
                 group_name: str, reshard_after_forward: bool, fqn: str, order: dict) -> None:
    """Gather ``param`` for the uses ``compute`` (all reading one value of it): before the first
    forward use, and with ``reshard_after_forward`` again before the first backward use of what
    the forward derived from it by views and casts. ``order``: positions of the graph's nodes
    (nodes inserted since keep their relative order, so it stays valid for the nodes it has)."""
    forward = [u for u in compute if u.meta.get(meta.REGION) == meta.Region.FORWARD]
    first = _first(forward or compute, order, graph)
    cast = _sole_cast(compute)
    if cast is not None:
        full_val = cast.meta["val"]
    full = _gather(graph, param, full_val, world, group_name, first,
                   first.meta.get(meta.REGION), fqn)
    for u in compute:
        if cast is not None:
            u.replace_all_uses_with(full)
            graph.erase_node(u)
        else:
            u.replace_input_with(param, full)
    if cast is not None:
        forward = [u for u in full.users if u.meta.get(meta.REGION) == meta.Region.FORWARD]
    if not reshard_after_forward or not forward:
        return
    derived = [full] + _forward_chain(full)
    backward_users = {
        u for d in derived for u in d.users
        if u.meta.get(meta.REGION) == meta.Region.BACKWARD
    }
    if not backward_users:
        return
    first_bwd = _first(backward_users, order, graph)
    again = {full: _gather(graph, param, full_val, world, group_name, first_bwd,
                           meta.Region.BACKWARD, fqn)}
    with graph.inserting_before(first_bwd):
        for d in derived[1:]:
            copy = graph.node_copy(d, lambda a: again.get(a, a))
            copy.meta[meta.REGION] = meta.Region.BACKWARD
            again[d] = copy
    for u in backward_users:
        for d in derived:
            if d in u.all_input_nodes:
                u.replace_input_with(d, again[d])


def _parameters(graph: fx.Graph) -> tuple[dict, dict]:
    """{fqn: (placeholder, val)} of the parameters (not 0-d) to gather, and of the GATHERED ones
    (gathered by the step itself: all-gather extensions; one placeholder per inner tensor)."""
    params, gathered = {}, {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.meta.get(meta.ROLE) == meta.Role.PARAM and val.dim() > 0:
            target = gathered if node.meta.get(meta.GATHERED) else params
            target.setdefault(node.meta[meta.PARAM_FQN], (node, val))
    return params, gathered


def pad_rows(x, world: int):
    """``x`` padded with zero rows to a multiple of ``world`` rows (``x`` when it is one)."""
    pad = shard_rows(x.shape[0], world) * world - x.shape[0]
    return aten.constant_pad_nd.default(x, [0, 0] * (x.dim() - 1) + [0, pad]) if pad else x


def micro_batch_parts(grad: fx.Node) -> list[fx.Node] | None:
    """The per-micro-batch gradients autograd accumulated into ``grad`` (``add_(add_(detach(g1),
    g2), g3)``, each link used once), first to last; None if ``grad`` is not such a chain."""
    parts, node = [], grad
    while node.target in (aten.add_.Tensor, aten.add.Tensor) and len(node.args) == 2 and (
            not node.kwargs) and (node is grad or len(node.users) == 1):
        node, part = node.args
        parts.append(part)
    # the first backward's gradient, detached when autograd stored it in ``.grad`` (a sum of
    # two uses in one backward, a tied weight, has no detach: one micro-batch)
    if not parts or not isinstance(node, fx.Node) or node.target is not aten.detach.default or (
            len(node.users) != 1):
        return None
    return [node.args[0]] + parts[::-1]


def reduce_scatter_parts(graph, grad, parts, world, group_name, reduce_dtype, divide_after_sum,
                         divide_factor=None):
    """Reduce-scatter each micro-batch's gradient right after it is computed and sum the
    shards; the sum replaces ``grad`` (the unsharded ``add_`` chain is erased). Each is divided
    by ``divide_factor``, default ``world``."""
    divisor = divide_factor or world
    val = grad.meta["val"]
    fqn = grad.meta[meta.PARAM_FQN]
    region = grad.meta.get(meta.REGION)
    cast = reduce_dtype is not None and reduce_dtype != val.dtype
    users = list(grad.users)

    def part_reduce(x):
        x = to_dtype(x, reduce_dtype) if cast else x
        x = pad_rows(x, world)
        x = x if divide_after_sum else aten.div.Tensor(x, divisor)
        return waited(c10d.reduce_scatter_tensor.default, x, "sum", world, group_name)

    shards = []
    for index, part in enumerate(parts):
        shard = insert_traced(graph, part_reduce, (part,), before=part.next, region=region,
                              collective=collective_meta([fqn]))
        shard.args[0].meta[meta.MICRO_BATCH] = index
        shards.append(shard)
    chain = [grad]
    while chain[-1].target in (aten.add_.Tensor, aten.add.Tensor) and chain[-1].args[0] not in parts:
        chain.append(chain[-1].args[0])
    pending = set(users)  # the sum goes before the first use: bucketing may move the shards
    first_use = next((n for n in graph.nodes if n in pending), None)
    total = insert_traced(graph, lambda first, *rest: functools.reduce(aten.add.Tensor, rest, first),
                          tuple(shards), before=first_use if first_use is not None else grad.next,
                          region=region)
    total = finish_reduction(graph, total, users, divide_by=divisor if divide_after_sum else None,
                             dtype=val.dtype if cast else None)
    total.meta[meta.PLACEMENT] = Shard(0)
    total.meta[meta.LOGICAL_SHAPE] = tuple(val.shape)
    total.meta[meta.SYNCED_GRAD] = fqn
    for u in users:
        u.replace_input_with(grad, total)
    for node in chain:  # the unsharded accumulation, now unused
        if not node.users:
            graph.erase_node(node)
    first = parts[0]
    for node in list(graph.nodes):
        if node.target is aten.detach.default and node.args[0] is first and not node.users:
            graph.erase_node(node)


_NORMS = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar, aten.norm.Scalar,
          aten.norm.ScalarOpt_dim}
_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_MAXES = {aten.amax.default, aten.max.default}


def _values(val):
    return list(val) if isinstance(val, (list, tuple)) else [val]


def reduce_optimizer_partials(gm: fx.GraphModule, group_name: str, world: int) -> None:
    """All-reduce the optimizer region's reductions over shards (a gradient norm for clipping, a
    sum) right where they are computed, so everything after them sees whole values.

    A value is a shard when it comes from a sharded parameter / state / reduce-scattered gradient
    through ops that keep the shard's shape. A sharded input turning into an output of another
    shape is a reduction: norms, sums and maxima are completed with an all_reduce; anything else
    raises, since its result on shards would differ from the unsharded step.
    """
    graph = gm.graph
    # Shapes as the unsharded step sees them (node.meta["val"] of optimizer-region nodes still
    # holds those): a shard-derived value keeps its parameter's logical shape.
    sharded: dict[fx.Node, tuple] = {
        n: n.meta[meta.LOGICAL_SHAPE] for n in graph.nodes if meta.LOGICAL_SHAPE in n.meta
    }
    pending: list[tuple[fx.Node, fx.Node]] = []  # (value, reduction) made whole after the walk
    for node in list(graph.nodes):
        if node.meta.get(meta.REGION) != meta.Region.OPTIMIZER or node in sharded:
            continue
        if node.op != "call_function" or (node.meta.get(meta.ROLE) == meta.Role.COLLECTIVE
                                          and node.target not in _ELEMENTWISE_COLLECTIVES):
            continue
        shard_inputs = [a for a in _flat_inputs(node) if a in sharded]
        if not shard_inputs:
            continue
        if node.target is operator.getitem:
            source, index = node.args
            if source in sharded:
                sharded[node] = tuple(node.meta["val"].shape)
                _to_shard_vals(node, {sharded[node]}, world)
            continue
        logical = {sharded[a] for a in shard_inputs}
        outs = _values(node.meta.get("val"))
        if node.target in _NORMS or node.target in _SUMS or node.target in _MAXES:
            pending.extend(_reductions(node))
            continue
        if _is_inplace_on(node, sharded) or all(
            getattr(o, "shape", None) is None or tuple(o.shape) in logical for o in outs
        ):
            first = outs[0] if outs and getattr(outs[0], "shape", None) is not None else None
            sharded[node] = tuple(first.shape) if first is not None else next(iter(logical))
            _to_shard_vals(node, logical, world)
            continue
        raise ShardingError(
            f"fully_shard: {node.target} in the optimizer region turns a parameter/optimizer-state "
            f"shard into a value of another shape ({node.format_node()}); only elementwise "
            f"updates and norm / sum / max reductions can run on shards. "
            f"User code: {node.meta.get('stack_trace', '<unknown>')}"
        )
    if pending:
        _complete_reductions(graph, pending, group_name)
    gm.recompile()


# a plan's all_reduce of a gradient the optimizer reads (DTensor's, over a tensor- or
# context-parallel dim) keeps the shape of what it reduces: on a shard, a shard
_ELEMENTWISE_COLLECTIVES = (torch.ops._c10d_functional.all_reduce.default,
                            torch.ops._c10d_functional.wait_tensor.default)


def _to_shard_vals(node: fx.Node, logical: set[tuple], world: int) -> None:
    """Give a value computed on shards its local (padded shard) shape in node.meta["val"], so
    sizes read off the graph (the memory estimate) are the local ones."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and tuple(val.shape) in logical and val.dim() > 0:
        node.meta["val"] = shard_val(val, world)
    elif isinstance(val, (list, tuple)):
        node.meta["val"] = type(val)(
            shard_val(v, world) if isinstance(v, torch.Tensor) and tuple(v.shape) in logical
            and v.dim() > 0 else v for v in val)


def _flat_inputs(node: fx.Node) -> list[fx.Node]:
    return node.all_input_nodes


def _is_inplace_on(node: fx.Node, sharded: set[fx.Node]) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.is_mutable and node.args and (
        node.args[0] in sharded or (isinstance(node.args[0], (list, tuple))
                                    and any(a in sharded for a in node.args[0]))))


def _reductions(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(value, reduction) of each value a reduction over shards yields: the node itself, or
    each element (getitem) of a list-valued one (``_foreach_norm``)."""
    if isinstance(node.meta.get("val"), (list, tuple)):
        return [(u, node) for u in node.users if u.target is operator.getitem]
    return [(node, node)]


def _how(reduction: fx.Node) -> tuple[str, float | None]:
    """How values of ``reduction`` over shards are made whole: ("pow", p) for a p-norm (the
    sum of p-th powers), ("sum", None) or ("max", None) (a sum, a maximum, an inf-norm)."""
    if reduction.target in _NORMS:
        p = reduction.args[1] if len(reduction.args) > 1 else reduction.kwargs.get("ord", 2)
        p = 2.0 if p is None else float(p)
        if p != float("inf"):
            return "pow", p
    return ("sum" if reduction.target in _SUMS else "max"), None


def _complete_reductions(graph: fx.Graph, pending: list[tuple[fx.Node, fx.Node]],
                         group_name: str) -> None:
    """Make the values of reductions over shards whole, in as few all_reduces as can be: values
    completed alike (same kind, dtype and shape) share one all_reduce of them stacked when
    every one of them is computed before any of them is read (clipping's per-parameter norms:
    one all_reduce, not one per parameter)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for value, reduction in pending:
        val = value.meta["val"]
        groups[(_how(reduction), val.dtype, tuple(val.shape))].append(value)
    for (how, _, _), values in groups.items():
        values.sort(key=position.__getitem__)
        batch: list[fx.Node] = []
        first_read = len(position)
        for value in values:
            if batch and position[value] >= first_read:
                _complete_stacked(graph, batch, how, group_name)
                batch, first_read = [], len(position)
            batch.append(value)
            first_read = min([first_read] + [position[u] for u in value.users])
        _complete_stacked(graph, batch, how, group_name)


def _complete_stacked(graph: fx.Graph, values: list[fx.Node], how: tuple[str, float | None],
                      group_name: str) -> None:
    """One all_reduce for ``values`` (in graph order, all computed before any is read), right
    after the last of them; their readers then read the whole values."""
    kind, p = how
    users = {v: list(v.users) for v in values}

    def complete(*xs):  # a p-norm: (the sum over shards of norm ** p) ** (1 / p)
        stacked = aten.stack.default([aten.pow.Tensor_Scalar(x, p) for x in xs] if p else list(xs))
        whole = waited(c10d.all_reduce.default, stacked, "sum" if p else kind, group_name)
        return aten.unbind.int(aten.pow.Tensor_Scalar(whole, 1.0 / p) if p else whole)

    wholes = insert_traced(graph, complete, tuple(values), before=values[-1].next,
                           region=values[0].meta.get(meta.REGION), collective=collective_meta([]))
    for value, whole in zip(values, wholes):
        whole.meta[meta.PLACEMENT] = Replicate()
        for u in users[value]:
            u.replace_input_with(value, whole)
