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

from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement, Shard

from . import meta
from .fully_shard import ShardingError, expand_fully_shard
from .replicate import expand_replicate


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
    """Insert the collectives of the parameter layout ``layout`` (one MeshDim per mesh dim).

    Reads what replicate.py / fully_shard.py read. Writes their collectives, each on the group
    of the mesh dim whose placement asks for it, and ``gm.meta[MESH_DIMS]`` (the group names by
    mesh dim, so later readers can say which dim a collective runs on).
    """
    sharded = [d for d in layout if d.placement != Shard(0) and d.placement.is_shard()]
    if sharded:
        raise ShardingError(f"data parallelism shards parameters on dim 0 only, got {sharded[0].placement}")
    shard = [d for d in layout if d.placement.is_shard()]
    replicate = [(d.group_name, d.size) for d in layout if not d.placement.is_shard()]
    if len(shard) > 1:
        raise ShardingError("parameters can be sharded over one mesh dim only")
    if shard:
        gm = expand_fully_shard(
            gm, group_name=shard[0].group_name, world_size=shard[0].size,
            reshard_after_forward=reshard_after_forward, broadcast_buffers=broadcast_buffers,
            replicate_over=replicate)
    else:
        (group_name, size), *others = replicate
        if others:
            raise ShardingError("replicate takes a 1-D mesh")
        gm = expand_replicate(gm, group_name=group_name, world_size=size,
                              broadcast_buffers=broadcast_buffers)
    gm.meta[meta.MESH_DIMS] = [d.group_name for d in layout]
    return gm


def mesh_dim_of(gm: fx.GraphModule, collective: fx.Node) -> int | None:
    """The mesh dim a collective issue node runs on (None if unknown)."""
    names = gm.meta.get(meta.MESH_DIMS) or []
    group = collective.args[-1] if collective.args else None
    return names.index(group) if group in names else None
