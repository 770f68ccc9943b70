"""Expansion driven by the parameters' placements on the mesh: each mesh dim's placement picks
the collectives that run on that dim's process group.

A data-parallel layout gives every parameter one placement per mesh dim, outermost first:

- ``[Replicate()]`` (replicate, DDP): gradients ``all_reduce`` on the dim.
- ``[Shard(0)]`` (fully_shard, FSDP/ZeRO-3): parameters and optimizer state are dim-0 shards over
  the dim; ``all_gather`` before use, gradients ``reduce_scatter`` over it.
- ``[Replicate(), Shard(0)]`` (hybrid_shard, HSDP): the shard dim does what fully_shard does;
  the replicate dim then ``all_reduce``-s each gradient shard, and broadcasts buffers.

Every rank's gradient is divided by the number of ranks of the whole mesh before the first
reduction, so the reductions together average it over every rank (DDP's semantics). Reductions
the optimizer makes over shards (a global gradient norm) are completed over the shard dim only:
the replicate dims hold equal values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from . import meta
from .subgraph import insert_traced
from .collectives import (
    aten, c10d, carries_gradient_on, collective_meta, finish_reduction, mutates, replace_inputs,
    to_dtype, waited,
)
from .fully_shard import (
    ShardingError,
    micro_batch_parts,
    pad_rows,
    reduce_optimizer_partials,
    reduce_scatter_parts,
    shard_parameters,
)
from .replicate import broadcast_buffers_from_rank0


@dataclass(frozen=True)
class MeshDim:
    """One mesh dim as the expansion sees it: its process group, its size, and how parameters
    lie along it."""

    group_name: str
    size: int
    placement: Placement


def expand_data_parallel(gm: fx.GraphModule, layout: Sequence[MeshDim], *,
                         reshard_after_forward: bool = True,
                         broadcast_buffers: bool = True, reduce_dtype: torch.dtype | None = None,
                         divide_after_sum: bool = False, sync_grads: bool = True,
                         accumulate_cap_bytes: int | None = None,
                         divide_factor: float | None = None,
                         reduce_unread: bool = True) -> fx.GraphModule:
    """Insert the collectives of the parameter layout ``layout`` (one MeshDim per mesh dim,
    outermost first).

    Reads: ROLE (PARAM / OPT_STATE / BUFFER placeholders, GRAD nodes), PARAM_FQN, REGION,
    node.meta["val"]. Writes, each collective on the group of the mesh dim that asks for it:
    buffers broadcast from the first rank over every dim (``broadcast_buffers``); on a
    ``Shard(0)`` dim the parameters and their states become shards gathered before use
    (fully_shard.shard_parameters); each gradient divided by the mesh's rank count, then
    reduced dim by dim from the innermost: ``reduce_scatter`` on the shard dim for a sharded
    parameter, ``all_reduce`` on every other dim (the last wait marked SYNCED_GRAD, read by
    every later use); the optimizer's reductions over shards completed on the shard dim;
    ``gm.meta[MESH_DIMS]``: the group names by mesh dim. LOGICAL_SHAPE is used meanwhile and
    removed.

    With ``reduce_dtype`` (mixed precision) a gradient of another dtype is cast to it before the
    division and back after the last reduction. With ``divide_after_sum`` the reduced sum is
    divided instead of each rank's gradient (FSDP2's ``ReduceOp.AVG`` order). ``divide_factor``
    replaces the mesh's rank count as the divisor (FSDP2's ``set_gradient_divide_factor``).
    ``sync_grads=False`` (a step that only accumulates gradients) inserts no gradient
    collective; ``reduce_unread=False`` (no gradient is kept after the step) none for a final
    gradient nothing in the step reads (a discriminator's gradients from the generator's
    backward). Under a 1-D shard layout, gradients accumulated over micro-batches in the step
    (an ``add_`` chain per parameter) are summed unsharded and reduce-scattered once while their
    full-size bytes stay within ``accumulate_cap_bytes`` (None: no limit); beyond it each
    micro-batch's gradient is reduce-scattered and the shards are summed (FSDP2's default). The
    choice is noted in ``gm.meta[NOTES]``.
    """
    wrong = [d.placement for d in layout if d.placement.is_shard() and d.placement != Shard(0)]
    if wrong:
        raise ShardingError(f"data parallelism shards parameters on dim 0 only, got {wrong[0]}")
    shard = [d for d in layout if d.placement.is_shard()]
    if len(shard) > 1:
        raise ShardingError("parameters can be sharded over one mesh dim only")
    graph = gm.graph
    if broadcast_buffers:
        for d in reversed(layout):  # each insertion goes first: the outermost dim runs first
            broadcast_buffers_from_rank0(graph, d.group_name, d.size)
    sharded = {}
    if shard:
        sharded = shard_parameters(gm, group_name=shard[0].group_name, world_size=shard[0].size,
                                   reshard_after_forward=reshard_after_forward)
    if sync_grads and layout:  # no data-parallel dim (tensor parallelism alone): nothing to average
        per_micro_batch = _accumulation_choice(gm, layout, sharded, accumulate_cap_bytes)
        for grad, parts in per_micro_batch.items():
            reduce_scatter_parts(graph, grad, parts, shard[0].size, shard[0].group_name,
                                 reduce_dtype, divide_after_sum, divide_factor)
        _reduce_gradients(graph, layout, set(sharded), reduce_dtype, divide_after_sum,
                          divide_factor, reduce_unread)
    gm.recompile()
    if shard:
        reduce_optimizer_partials(gm, shard[0].group_name, shard[0].size)
    for node in graph.nodes:  # the expansion's own bookkeeping
        node.meta.pop(meta.LOGICAL_SHAPE, None)
    gm.meta[meta.MESH_DIMS] = [d.group_name for d in layout]
    gm.meta[meta.MESH_SIZES] = [d.size for d in layout]
    return gm


def _accumulation_choice(gm: fx.GraphModule, layout: Sequence[MeshDim], sharded: dict,
                         cap_bytes: int | None) -> dict[fx.Node, list[fx.Node]]:
    """The GRAD nodes whose micro-batch gradients are reduce-scattered one by one ({grad:
    parts}); empty when they are summed unsharded first. Notes the choice in gm.meta[NOTES]."""
    grads = [n for n in gm.graph.nodes if n.meta.get(meta.ROLE) == meta.Role.GRAD
             and n.meta[meta.PARAM_FQN] in sharded]
    accumulated = {g: p for g in grads if (p := micro_batch_parts(g))}
    if not accumulated:
        return {}
    full_bytes = sum(g.meta["val"].numel() * g.meta["val"].element_size() for g in accumulated)
    # each micro-batch on its own only on a 1-D shard layout (a hybrid layout would also need
    # the replicate dims' reduction of every micro-batch's shard)
    split = len(layout) == 1 and cap_bytes is not None and full_bytes > cap_bytes
    gm.meta.setdefault(meta.NOTES, {})["fully_shard"] = (
        f"{max(map(len, accumulated.values()))} micro-batches: "
        + (f"each micro-batch's gradients reduce-scattered ({full_bytes} B of full-size "
           f"gradients exceed the {cap_bytes} B cap)" if split else
           f"gradients accumulated unsharded ({full_bytes} B), reduce-scattered once"))
    return accumulated if split else {}


def _reduce_gradients(graph: fx.Graph, layout: Sequence[MeshDim], sharded: set[str],
                      reduce_dtype: torch.dtype | None, divide_after_sum: bool,
                      divide_factor: float | None = None, reduce_unread: bool = True) -> None:
    """Average every GRAD node over the mesh: divide by the number of ranks (or, with
    ``divide_after_sum``, the sum), then per mesh dim from the innermost, ``reduce_scatter``
    (a parameter sharded on that dim: the padded gradient becomes this rank's shard) or
    ``all_reduce``; in ``reduce_dtype`` when given (cast back to the gradient's dtype after).
    ``divide_factor`` (when given) is the divisor instead of the number of ranks; without
    ``reduce_unread`` a gradient nothing reads is left alone."""
    ranks = divide_factor or math.prod(d.size for d in layout)
    grads = [n for n in graph.nodes if n.meta.get(meta.ROLE) == meta.Role.GRAD]
    last = {g.meta[meta.PARAM_FQN]: g for g in grads}  # several backward calls: the final one
    reduced = [g for g in grads if reduce_unread or g.users]
    if not reduce_unread:
        _drop_unread_accumulations([last[f] for f in last if last[f] not in reduced])
    swaps: dict[fx.Node, dict[fx.Node, fx.Node]] = {}
    for grad in reduced:
        fqn = grad.meta[meta.PARAM_FQN]
        users = list(grad.users) if last[fqn] is grad else _readers(
            grad, fqn in sharded, read_later=any(g is last[fqn] for g in reduced))
        val = grad.meta["val"]
        cast = reduce_dtype is not None and reduce_dtype != val.dtype
        world = next(d.size for d in layout if d.placement.is_shard()) if fqn in sharded else None
        scatter = [fqn in sharded and d.placement.is_shard() for d in reversed(layout)]

        def reduce(x):
            x = to_dtype(x, reduce_dtype) if cast else x
            x = pad_rows(x, world) if world else x
            x = x if divide_after_sum else aten.div.Tensor(x, ranks)
            waits = []
            for d, rs in zip(reversed(layout), scatter):
                x = (waited(c10d.reduce_scatter_tensor.default, x, "sum", d.size, d.group_name) if rs
                     else waited(c10d.all_reduce.default, x, "sum", d.group_name))
                waits.append(x)
            return waits

        waits = insert_traced(graph, reduce, (grad,), before=grad.next,
                              region=grad.meta.get(meta.REGION), collective=collective_meta([fqn]))
        # an all-reduced shard stays a shard; a gradient reduced as it is keeps its placement
        untouched = not cast and divide_after_sum and not (world and val.shape[0] % world)
        placed = {k: grad.meta[k] for k in (meta.PLACEMENT, meta.LOGICAL_SHAPE)
                  if k in grad.meta and untouched}
        for wait, rs in zip(waits, scatter):
            if rs:
                placed = {meta.PLACEMENT: Shard(0), meta.LOGICAL_SHAPE: tuple(val.shape)}
            wait.meta.update(placed)
        x = waits[-1]
        x = finish_reduction(graph, x, users, divide_by=ranks if divide_after_sum else None,
                             dtype=val.dtype if cast else None)
        x.meta.update(placed)
        if last[fqn] is grad:
            x.meta[meta.SYNCED_GRAD] = fqn
        for u in users:
            swaps.setdefault(u, {})[grad] = x
    replace_inputs(swaps)


def _drop_unread_accumulations(grads: list[fx.Node]) -> None:
    """Erase the final accumulations nothing reads (a discriminator's gradients from the
    generator's backward added to its own): their inputs become dead code."""
    for grad in grads:
        if grad.target in (aten.add_.Tensor, aten.add.Tensor) and not grad.users and (
                grad.meta.get(meta.REGION) == meta.Region.BACKWARD):
            grad.graph.erase_node(grad)


def _readers(grad: fx.Node, sharded: bool, read_later: bool) -> list[fx.Node]:
    """The uses of an earlier backward's gradient that read its average (an optimizer stepping
    between two backward calls). Autograd's accumulation of the next backward's gradient goes
    on in the local gradient, reduced once with the final one (the average of a sum is the sum
    of the averages), unless a reader changes the gradient in place (clipping it): replicated,
    the accumulation then adds to the changed average (which the next reduction leaves as it
    is); sharded that cannot be, and is refused if the final gradient is ``read_later``."""
    readers = [u for u in grad.users if not carries_gradient_on(u, grad)]
    changed = [u for u in readers if mutates(u, grad)]
    if changed and not sharded:
        return list(grad.users)
    if changed and read_later:
        raise ShardingError(
            f"{changed[0].target} changes a gradient in place ({grad.meta[meta.PARAM_FQN]}) that "
            f"a later backward() adds to: sharded, the later gradient would not see the change. "
            f"Call zero_grad() before that backward, or use replicate. User code: "
            f"{changed[0].meta.get('stack_trace', '<unknown>')}")
    return readers


def mesh_dim_of(gm: fx.GraphModule, collective: fx.Node) -> int | None:
    """The mesh dim a collective issue node runs on (None if unknown)."""
    names = gm.meta.get(meta.MESH_DIMS) or []
    group = collective.args[-1] if collective.args else None
    return names.index(group) if group in names else None


def collective_dim(gm: fx.GraphModule, collective: fx.Node) -> str | None:
    """The mesh dim a collective issue node runs on, named alike on every rank (its group is
    not): ``mesh dim <d>`` for the data-parallel dim ``d``, ``plan dim <name>`` for a
    tensor-parallel plan's (MODEL_PARALLEL, ``gm.meta[PLAN_DIMS]``); None if unknown."""
    group = collective.meta.get(meta.MODEL_PARALLEL)
    if group is not None:
        return f"plan dim {(gm.meta.get(meta.PLAN_DIMS) or {}).get(group, '?')}"
    d = mesh_dim_of(gm, collective)
    return None if d is None else f"mesh dim {d}"


def expand_replicate(
    gm: fx.GraphModule, *, group_name: str, world_size: int, broadcast_buffers: bool = True,
    reduce_dtype: torch.dtype | None = None, divide_after_sum: bool = False,
    sync_grads: bool = True,
) -> fx.GraphModule:
    """The replicate layout (``Replicate()`` on a 1-D mesh) of passes/expand.py's expansion.

    Writes: after each gradient node, ``div(world_size)`` + ``all_reduce(sum)`` + ``wait_tensor``
    (DDP divides before it sums); every later use of the gradient reads the averaged value
    (the wait node, marked SYNCED_GRAD). With ``reduce_dtype`` (mixed precision) a gradient of
    another dtype is cast to it before the division and back after the wait (the cast back is
    then the SYNCED_GRAD node). With ``divide_after_sum`` the sum is divided instead (FSDP2's
    order: ``ReduceOp.AVG``). ``sync_grads=False`` (a step that only accumulates gradients)
    inserts no gradient collective.
    With ``broadcast_buffers``, rank 0's buffers are copied into every rank's buffers at the start
    of the step (DDP's default), in one collective. Collective nodes get ROLE=COLLECTIVE and
    COLLECTIVE meta.
    """
    return expand_data_parallel(gm, [MeshDim(group_name, world_size, Replicate())],
                                broadcast_buffers=broadcast_buffers, reduce_dtype=reduce_dtype,
                                divide_after_sum=divide_after_sum, sync_grads=sync_grads)


def expand_fully_shard(
    gm: fx.GraphModule, *, group_name: str, world_size: int, reshard_after_forward: bool = True,
    broadcast_buffers: bool = True, reduce_dtype: torch.dtype | None = None,
    divide_after_sum: bool = False, sync_grads: bool = True,
    accumulate_cap_bytes: int | None = None,
) -> fx.GraphModule:
    """The fully_shard layout (``Shard(0)`` on a 1-D mesh) of passes/expand.py's expansion.

    PARAM and same-shaped OPT_STATE placeholders become padded dim-0 shards (``shard_parameters``);
    each gradient is padded, divided by the world size and ``reduce_scatter``-ed, its optimizer
    uses reading the shard (the wait, marked SYNCED_GRAD); reductions over shards inside the
    optimizer region (e.g. a global grad norm) get the all_reduce that makes them whole
    (``reduce_optimizer_partials``). Buffers are broadcast from rank 0 as in replicate.
    Mixed precision, the division's order, accumulation: see ``expand_data_parallel``.
    """
    return expand_data_parallel(gm, [MeshDim(group_name, world_size, Shard(0))],
                                reshard_after_forward=reshard_after_forward,
                                broadcast_buffers=broadcast_buffers, reduce_dtype=reduce_dtype,
                                divide_after_sum=divide_after_sum, sync_grads=sync_grads,
                                accumulate_cap_bytes=accumulate_cap_bytes)
