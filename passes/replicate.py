"""Replicate (DDP-like) expansion: average every parameter gradient over the ranks."""

from __future__ import annotations

import torch
import torch.fx as fx

from . import meta
from .collectives import aten, c10d, finish_reduction, insert_call, insert_cast, insert_collective


def expand_replicate(
    gm: fx.GraphModule, *, group_name: str, world_size: int, broadcast_buffers: bool = True,
    reduce_dtype: torch.dtype | None = None, divide_after_sum: bool = False,
    sync_grads: bool = True,
) -> fx.GraphModule:
    """Insert the collectives that make a traced step DDP's data-parallel step.

    Reads: ROLE (GRAD nodes, BUFFER placeholders), PARAM_FQN, REGION, node.meta["val"].
    Writes: after each gradient node, ``div(world_size)`` + ``all_reduce(sum)`` + ``wait_tensor``
    (DDP divides before it sums); every later use of the gradient reads the averaged value
    (the wait node, marked SYNCED_GRAD). With ``reduce_dtype`` (mixed precision) a gradient of
    another dtype is cast to it before the division and back after the wait (the cast back is
    then the SYNCED_GRAD node). With ``divide_after_sum`` the sum is divided instead (FSDP2's
    order: ``ReduceOp.AVG``). ``sync_grads=False`` (a step that only accumulates gradients)
    inserts no gradient collective.
    With ``broadcast_buffers``, rank 0's buffers are copied into every rank's buffers at the start
    of the step (DDP's default). Collective nodes get ROLE=COLLECTIVE and COLLECTIVE meta.
    """
    graph = gm.graph
    if broadcast_buffers:
        broadcast_buffers_from_rank0(graph, group_name, world_size)
    grads = [n for n in graph.nodes if n.meta.get(meta.ROLE) == meta.Role.GRAD]
    for grad in grads if sync_grads else []:
        users = list(grad.users)
        val = grad.meta["val"]
        cast = reduce_dtype is not None and reduce_dtype != val.dtype
        with graph.inserting_before(grad.next):  # inserting_before keeps insertion order
            x = insert_cast(graph, grad, reduce_dtype) if cast else grad
            scaled = x if divide_after_sum else insert_call(
                graph, aten.div.Tensor, (x, world_size), like=x)
            averaged = insert_collective(
                graph, c10d.all_reduce.default, (scaled, "sum", group_name),
                val=x.meta["val"], region=grad.meta.get(meta.REGION), kind="all_reduce",
                params=[grad.meta[meta.PARAM_FQN]],
            )
        averaged = finish_reduction(graph, averaged, users,
                                    divide_by=world_size if divide_after_sum else None,
                                    dtype=val.dtype if cast else None)
        averaged.meta[meta.SYNCED_GRAD] = grad.meta[meta.PARAM_FQN]
        for user in users:
            user.replace_input_with(grad, averaged)
    gm.recompile()
    return gm


def broadcast_buffers_from_rank0(graph: fx.Graph, group_name: str, world_size: int) -> None:
    """At the start of the step, copy rank 0's value into every BUFFER placeholder (DDP's
    ``broadcast_buffers``): ``broadcast`` + ``wait_tensor`` + ``copy_`` per buffer."""
    buffers = [n for n in graph.nodes if n.meta.get(meta.ROLE) == meta.Role.BUFFER]
    if not buffers or world_size == 1:
        return
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op):
        for buf in buffers:
            synced = insert_collective(
                graph, c10d.broadcast.default, (buf, 0, group_name),
                val=buf.meta["val"], region=meta.Region.FORWARD, kind="broadcast",
                params=[buf.meta[meta.PARAM_FQN]],
            )
            insert_call(graph, aten.copy_.default, (buf, synced), like=buf,
                        region=meta.Region.FORWARD)
