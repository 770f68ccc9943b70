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

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Shard

from . import meta
from .collectives import aten, c10d, insert_call, insert_collective
from .fully_shard import (
    LOGICAL_SHAPE, ShardingError, padded_gradient, reduce_optimizer_partials, shard_parameters,
    shard_val,
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
                         broadcast_buffers: bool = True) -> fx.GraphModule:
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
    ``gm.meta[MESH_DIMS]``: the group names by mesh dim.
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
    _reduce_gradients(graph, layout, set(sharded))
    gm.recompile()
    if shard:
        reduce_optimizer_partials(gm, shard[0].group_name, shard[0].size)
    gm.meta[meta.MESH_DIMS] = [d.group_name for d in layout]
    return gm


def _reduce_gradients(graph: fx.Graph, layout: Sequence[MeshDim], sharded: set[str]) -> None:
    """Average every GRAD node over the mesh: divide by the number of ranks, then per mesh dim
    from the innermost, ``reduce_scatter`` (a parameter sharded on that dim: the padded
    gradient becomes this rank's shard) or ``all_reduce``."""
    ranks = math.prod(d.size for d in layout)
    for grad in [n for n in graph.nodes if n.meta.get(meta.ROLE) == meta.Role.GRAD]:
        fqn = grad.meta[meta.PARAM_FQN]
        users = list(grad.users)
        val = grad.meta["val"]
        region = grad.meta.get(meta.REGION)
        with graph.inserting_before(grad.next):
            x = grad
            if fqn in sharded:
                world = next(d.size for d in layout if d.placement.is_shard())
                x = padded_gradient(graph, grad, world)
            x = insert_call(graph, aten.div.Tensor, (x, ranks), like=x, region=region)
            for d in reversed(layout):
                if fqn in sharded and d.placement.is_shard():
                    x = insert_collective(
                        graph, c10d.reduce_scatter_tensor.default, (x, "sum", d.size, d.group_name),
                        val=shard_val(val, d.size), region=region, kind="reduce_scatter",
                        params=[fqn])
                    x.meta[meta.PLACEMENT] = Shard(0)
                    x.meta[LOGICAL_SHAPE] = tuple(val.shape)
                else:
                    summed = insert_collective(
                        graph, c10d.all_reduce.default, (x, "sum", d.group_name),
                        val=x.meta["val"], region=region, kind="all_reduce", params=[fqn])
                    for key in (meta.PLACEMENT, LOGICAL_SHAPE):  # a shard stays a shard
                        if key in x.meta:
                            summed.meta[key] = x.meta[key]
                    x = summed
        x.meta[meta.SYNCED_GRAD] = fqn
        for u in users:
            u.replace_input_with(grad, x)


def mesh_dim_of(gm: fx.GraphModule, collective: fx.Node) -> int | None:
    """The mesh dim a collective issue node runs on (None if unknown)."""
    names = gm.meta.get(meta.MESH_DIMS) or []
    group = collective.args[-1] if collective.args else None
    return names.index(group) if group in names else None
