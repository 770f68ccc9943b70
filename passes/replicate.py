"""Replicate (DDP-like) layout pieces of the expansion (passes/expand.py): buffers
broadcast from rank 0."""

from __future__ import annotations

import torch
import torch.fx as fx

from . import meta
from .collectives import aten, c10d, waited
from .subgraph import insert_traced


def broadcast_buffers_from_rank0(graph: fx.Graph, group_name: str, world_size: int) -> None:
    """At the start of the step, copy rank 0's value into every BUFFER placeholder (DDP's
    ``broadcast_buffers``), all of them in one collective.

    Every buffer, also one the step only reads: a forward outside the step (``model(x)`` in
    train mode) changes BatchNorm's running stats on each rank alone, and DDP's next forward
    broadcasts them whatever it then does with them. Their bytes (any dtypes) are packed into
    one flat uint8 tensor, broadcast once from rank 0 and unpacked into the buffers: ``cat`` of
    byte views + ``broadcast`` + ``wait_tensor`` + one ``copy_`` per buffer.
    """
    buffers = [n for n in graph.nodes if n.meta.get(meta.ROLE) == meta.Role.BUFFER
               and n.meta["val"].numel()]
    if not buffers or world_size == 1:
        return
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    insert_traced(graph, _broadcast, (buffers, group_name), before=first_op,
                  region=meta.Region.FORWARD,
                  collective=dict(kind="broadcast", params=[b.meta[meta.PARAM_FQN] for b in buffers]))


def _broadcast(buffers: list, group_name: str) -> None:
    """Rank 0's bytes of ``buffers`` copied into every rank's, in one flat broadcast."""
    views = [aten.view.dtype(aten.reshape.default(b, [-1]), torch.uint8) for b in buffers]
    synced = waited(c10d.broadcast.default, aten.cat.default(views), 0, group_name)
    offset = 0
    for b, view in zip(buffers, views):
        size = view.numel()
        part = aten.view.dtype(aten.slice.Tensor(synced, 0, offset, offset + size), b.dtype)
        aten.copy_.default(b, aten.view.default(part, list(b.shape)))
        offset += size
