"""Replicate (DDP-like) layout pieces of the expansion (passes/expand.py): buffers
broadcast from rank 0."""

from __future__ import annotations

import torch
import torch.fx as fx

from . import meta
from .collectives import aten, c10d, insert_call, insert_collective


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
    region = meta.Region.FORWARD
    with graph.inserting_before(first_op):
        views = []
        for buf in buffers:
            flat = insert_call(graph, aten.reshape.default, (buf, [-1]),
                               val=buf.meta["val"].reshape(-1), region=region)
            views.append(insert_call(graph, aten.view.dtype, (flat, torch.uint8),
                                     val=flat.meta["val"].view(torch.uint8), region=region))
        packed = insert_call(graph, aten.cat.default, (views,),
                             val=torch.cat([v.meta["val"] for v in views]), region=region)
        synced = insert_collective(
            graph, c10d.broadcast.default, (packed, 0, group_name),
            val=packed.meta["val"], region=region, kind="broadcast",
            params=[buf.meta[meta.PARAM_FQN] for buf in buffers],
        )
        offset = 0
        for buf, view in zip(buffers, views):
            val = buf.meta["val"]
            size = view.meta["val"].numel()
            part = insert_call(graph, aten.slice.Tensor, (synced, 0, offset, offset + size),
                               val=synced.meta["val"][offset:offset + size], region=region)
            typed = insert_call(graph, aten.view.dtype, (part, val.dtype),
                                val=part.meta["val"].view(val.dtype), region=region)
            shaped = insert_call(graph, aten.view.default, (typed, list(val.shape)),
                                 val=typed.meta["val"].view(val.shape), region=region)
            insert_call(graph, aten.copy_.default, (buf, shaped), like=buf, region=region)
            offset += size
