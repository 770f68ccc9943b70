"""Gloo without gloo's scratch copies: the eager lowering's collectives on CPU tensors.

Measured on torch 2.13's gloo backend (2 and 3 ranks on one host): ``all_gather_into_tensor``
gathers into a scratch buffer of the output's size and copies it out, and
``reduce_scatter_tensor`` copies its whole input into a scratch buffer that it holds until the
wait. Both allocate those buffers from the C library's heap inside every step, where their
wandering addresses keep touching new pages (the resident memory of a fully_shard step grew by
hundreds of MiB over its first steps), and both were slower than the collectives they could be
built from: ``world`` in-place broadcasts into the output's rows took 0.5-0.7x the all-gather's
time, and an in-place all-reduce 0.7-1.0x the reduce-scatter's. This pass builds them so,
in buffers the step owns (passes/memory_plan.py places those in its workspace).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from . import meta
from .collectives import aten, c10d, joined, rank_rows, source_rows


def _group(name):
    """(rank, size) in the process group called ``name``, or None outside a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        group = dist.distributed_c10d._resolve_process_group(name)
    except (KeyError, RuntimeError, ValueError):
        return None
    return group.rank(), group.size()


def _cpu_static(val) -> bool:
    return (isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.is_contiguous()
            and all(isinstance(s, int) for s in val.shape))


def _call(graph, target, args, like, val=None):
    node = graph.call_function(target, tuple(args))
    node.meta["val"] = like.meta.get("val") if val is None else val
    if meta.REGION in like.meta:
        node.meta[meta.REGION] = like.meta[meta.REGION]
    return node


def broadcast_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn each ``all_gather_into_tensor_out(shard, world, group, out=buf)`` of CPU tensors
    into a copy of the shard into this rank's rows of ``buf`` and one in-place ``broadcast_``
    of every rank's rows from that rank; its ``wait_tensor`` into a wait per broadcast.

    Reads: all_gather_into_tensor_out nodes and their waits. Writes: those nodes; recompiles.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not c10d.all_gather_into_tensor_out.default:
            continue
        shard, world, name = node.args
        buf = node.kwargs["out"]
        group = _group(name)
        waits = list(node.users)
        if (group is None or group[1] != world or not _cpu_static(buf.meta.get("val"))
                or any(w.target is not c10d.wait_tensor.default for w in waits)):
            continue
        rows = buf.meta["val"].shape[0] // world
        with graph.inserting_before(node):
            slices = [_call(graph, aten.slice.Tensor, (buf, 0, r * rows, (r + 1) * rows), node,
                            buf.meta["val"][r * rows:(r + 1) * rows]) for r in range(world)]
            mine = _call(graph, rank_rows, (buf, rows, name), slices[0])
            own = _call(graph, aten.copy_.default, (mine, shard), mine)
            sources = [_call(graph, source_rows, (own, s, r, name), s) for r, s in enumerate(slices)]
            issued = [_call(graph, c10d.broadcast_.default, (s, r, name), s)
                      for r, s in enumerate(sources)]
        for issue in issued:
            issue.meta[meta.ROLE] = meta.Role.COLLECTIVE
            issue.meta[meta.COLLECTIVE] = dict(node.meta.get(meta.COLLECTIVE) or {}, kind="broadcast")
        for wait in waits:
            with graph.inserting_before(wait):
                done = [_call(graph, c10d.wait_tensor.default, (i,), i) for i in issued]
                whole = _call(graph, joined, (buf, *done), wait)
            wait.replace_all_uses_with(whole)
            graph.erase_node(wait)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def all_reduce_scatters(gm: fx.GraphModule, owned) -> fx.GraphModule:
    """Turn each ``reduce_scatter_tensor(x, op, world, group)`` of a CPU tensor ``x`` that
    nothing else reads (``owned(x, node)``) into an in-place ``all_reduce_`` of ``x`` and, at
    its wait, a copy of this rank's rows of it into a new (``empty``) tensor.

    Reads: reduce_scatter_tensor nodes and their waits. Writes: those nodes; recompiles.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not c10d.reduce_scatter_tensor.default:
            continue
        x, op, world, name = node.args
        group = _group(name)
        waits = list(node.users)
        if (group is None or group[1] != world or not _cpu_static(x.meta.get("val"))
                or not owned(x, node) or any(w.target is not c10d.wait_tensor.default for w in waits)):
            continue
        rows = x.meta["val"].shape[0] // world
        with graph.inserting_before(node):
            reduced = _call(graph, c10d.all_reduce_.default, (x, op, name), x)
        reduced.meta.update({k: node.meta[k] for k in (meta.ROLE, meta.COLLECTIVE) if k in node.meta})
        for wait in waits:
            with graph.inserting_before(wait):
                done = _call(graph, c10d.wait_tensor.default, (reduced,), reduced)
                mine = _call(graph, rank_rows, (done, rows, name), wait)
                val = wait.meta["val"]
                empty = graph.call_function(aten.empty.memory_format, (list(val.shape),),
                                            {"dtype": val.dtype, "device": val.device})
                empty.meta.update(val=val, **{meta.REGION: wait.meta.get(meta.REGION)})
                shard = _call(graph, aten.copy_.default, (empty, mine), wait)
            wait.replace_all_uses_with(shard)
            graph.erase_node(wait)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
