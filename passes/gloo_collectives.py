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

The program holds no rank: which rows are this rank's is read from the process group at each
call (``group_rank``), so the program is the same on every rank of the group and one rank may
build it for all of them (spmd_compiler/build/shared_compile.py).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
import torch.fx as fx

from spmd_compiler.torch_internals import _resolve_process_group

from . import meta
from .collectives import aten, c10d, joined
from .subgraph import insert_traced


def _group_size(name) -> int | None:
    """The size of the process group called ``name``, or None outside a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        group = _resolve_process_group(name)
    except (KeyError, RuntimeError, ValueError):
        return None
    return group.size()


def _cpu_static(val) -> bool:
    return (isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.is_contiguous()
            and all(isinstance(s, int) for s in val.shape))


def group_rank(name: str) -> int:
    """Graph node: this process's rank in the process group called ``name``, read per call."""
    return _resolve_process_group(name).rank()


def _own_rows(graph: fx.Graph, tensor: fx.Node, rows: int, name: str, region) -> fx.Node:
    """Before the graph's insertion point: ``tensor``'s rows ``[rank * rows, (rank + 1) * rows)``
    (a view, ``narrow``), the rank read from group ``name`` when the program runs."""
    rank = graph.call_function(group_rank, (name,))
    start = graph.call_function(operator.mul, (rank, rows))
    own = graph.call_function(aten.narrow.default, (tensor, 0, start, rows))
    own.meta["val"] = tensor.meta["val"].narrow(0, 0, rows)  # the same shape on every rank
    for n in (rank, start, own):
        n.meta[meta.REGION] = region
    return own


def _broadcast_every_rows(buf, world: int, rows: int, name: str) -> list:
    """Broadcast each rank's rows of ``buf`` from that rank, in place."""
    return [c10d.broadcast_.default(aten.slice.Tensor(buf, 0, r * rows, (r + 1) * rows), r, name)
            for r in range(world)]


def _waits(*issued) -> list:
    return [c10d.wait_tensor.default(x) for x in issued]


def _filled(graph: fx.Graph, shard: fx.Node, buf: fx.Node, rows: int, name: str, region, *,
            before: fx.Node) -> fx.Node:
    """``buf`` once ``shard`` is copied into this rank's rows of it (``joined``: what reads it
    runs after the copy)."""
    with graph.inserting_before(before):
        own = _own_rows(graph, buf, rows, name, region)
        copied = graph.call_function(aten.copy_.default, (own, shard))
        filled = graph.call_function(joined, (buf, copied))
    copied.meta.update(val=own.meta["val"], **{meta.REGION: region})
    filled.meta.update(val=buf.meta["val"], **{meta.REGION: region})
    return filled


def _fresh_copy(rows):
    """A new tensor (``empty``: the memory plan may place it) holding ``rows``."""
    empty = aten.empty.memory_format(list(rows.shape), dtype=rows.dtype, device=rows.device)
    return aten.copy_.default(empty, rows)


def broadcast_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn each ``all_gather_into_tensor_out(shard, world, group, out=buf)`` of CPU tensors
    into a copy of the shard into this rank's rows of ``buf`` (the rank read per call) and one
    in-place ``broadcast_`` of every rank's rows from that rank, all after the copy; its
    ``wait_tensor`` into a wait per broadcast.

    Reads: all_gather_into_tensor_out nodes and their waits. Writes: those nodes; recompiles.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not c10d.all_gather_into_tensor_out.default:
            continue
        shard, world, name = node.args
        buf = node.kwargs["out"]
        waits = list(node.users)
        if (_group_size(name) != world or not _cpu_static(buf.meta.get("val"))
                or any(w.target is not c10d.wait_tensor.default for w in waits)):
            continue
        rows = buf.meta["val"].shape[0] // world
        info = dict(node.meta.get(meta.COLLECTIVE) or {}, kind="broadcast")
        region = node.meta.get(meta.REGION)
        filled = _filled(graph, shard, buf, rows, name, region, before=node)
        issued = insert_traced(graph, _broadcast_every_rows, (filled, world, rows, name),
                               before=node, region=region, collective=info)
        for wait in waits:
            done = insert_traced(graph, _waits, tuple(issued), before=wait, region=region)
            with graph.inserting_before(wait):
                whole = graph.call_function(joined, (buf, *done))  # a Python call: not traced
            whole.meta.update(val=wait.meta["val"], **{meta.REGION: wait.meta.get(meta.REGION)})
            wait.replace_all_uses_with(whole)
            graph.erase_node(wait)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def all_reduce_scatters(gm: fx.GraphModule, owned) -> fx.GraphModule:
    """Turn each ``reduce_scatter_tensor(x, op, world, group)`` of a CPU tensor ``x`` that
    nothing else reads (``owned(x, node)``) into an in-place ``all_reduce_`` of ``x`` and, at
    its wait, a copy of this rank's rows of it (the rank read per call) into a new (``empty``)
    tensor.

    Reads: reduce_scatter_tensor nodes and their waits. Writes: those nodes; recompiles.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not c10d.reduce_scatter_tensor.default:
            continue
        x, op, world, name = node.args
        waits = list(node.users)
        if (_group_size(name) != world or not _cpu_static(x.meta.get("val"))
                or not owned(x, node) or any(w.target is not c10d.wait_tensor.default for w in waits)):
            continue
        rows = x.meta["val"].shape[0] // world
        region = x.meta.get(meta.REGION)
        reduced = insert_traced(graph, c10d.all_reduce_.default, (x, op, name), before=node,
                                region=region, collective=node.meta.get(meta.COLLECTIVE))
        for wait in waits:
            done = insert_traced(graph, c10d.wait_tensor.default, (reduced,), before=wait,
                                 region=region)
            with graph.inserting_before(wait):
                mine = _own_rows(graph, done, rows, name, wait.meta.get(meta.REGION))
            shard = insert_traced(graph, _fresh_copy, (mine,), before=wait,
                                  region=wait.meta.get(meta.REGION))
            wait.replace_all_uses_with(shard)
            graph.erase_node(wait)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
