"""Helpers shared by the expansion passes: insert functional collectives with complete meta."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from . import meta

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.broadcast.default: "broadcast",
}


def tensor_bytes(val) -> int | None:
    """Bytes of a (fake) tensor, or None when its size is symbolic."""
    try:
        return int(val.numel()) * val.element_size()
    except (TypeError, ValueError, RuntimeError):
        return None


def insert_call(graph: fx.Graph, target, args, *, like=None, val=None, region=None, **extra_meta):
    """Insert ``target(*args)`` at the graph's current insert point with val/region meta."""
    node = graph.call_function(target, tuple(args))
    if val is None and like is not None:
        val = like.meta.get("val")
    if val is not None:
        node.meta["val"] = val
    if region is None and like is not None:
        region = like.meta.get(meta.REGION)
    if region is not None:
        node.meta[meta.REGION] = region
    node.meta.update(extra_meta)
    return node


def insert_cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, *, region=None) -> fx.Node:
    """Insert ``node.to(dtype)`` (``aten._to_copy``) at the graph's current insert point."""
    val = node.meta["val"]
    cast = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    cast.meta["val"] = val.new_empty(val.shape, dtype=dtype)
    region = node.meta.get(meta.REGION) if region is None else region
    if region is not None:
        cast.meta[meta.REGION] = region
    return cast


def finish_reduction(graph: fx.Graph, reduced: fx.Node, users: list[fx.Node], *,
                     divide_by: int | None = None, dtype: torch.dtype | None = None) -> fx.Node:
    """The ops that follow a gradient's collective (the division by the world size when it comes
    after the sum; the cast back from the reduce dtype), inserted just before the first of
    ``users`` in graph order: later passes may move ``reduced`` (bucketing replaces a
    collective's wait by a slice of the bucket's), never past its original users."""
    if not divide_by and dtype is None:
        return reduced
    pending = set(users)
    first = next((n for n in graph.nodes if n in pending), None)
    with graph.inserting_before(first if first is not None else reduced.next):
        if divide_by:
            reduced = insert_call(graph, aten.div.Tensor, (reduced, divide_by), like=reduced)
        if dtype is not None:
            reduced = insert_cast(graph, reduced, dtype)
    return reduced


def insert_collective(graph: fx.Graph, target, args, *, val, region, kind, params):
    """Insert a functional collective and its ``wait_tensor``; return the wait node."""
    issue = insert_call(
        graph, target, args, val=val, region=region,
        **{meta.ROLE: meta.Role.COLLECTIVE,
           meta.COLLECTIVE: dict(kind=kind, bytes=tensor_bytes(val), params=list(params))},
    )
    return insert_call(
        graph, c10d.wait_tensor.default, (issue,), val=val, region=region,
        **{meta.ROLE: meta.Role.COLLECTIVE},
    )


def joined(tensor: torch.Tensor, *waited: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself: a graph node that reads ``waited`` (the waits of collectives writing
    into ``tensor``) so that its users run after all of them."""
    return tensor


def _rank(name) -> int:
    return dist.distributed_c10d._resolve_process_group(name).rank()


def rank_rows(buf: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """This rank's ``rows`` rows of ``buf`` (a view), the rank in group ``name`` looked up when
    the step runs: the program holds no rank and serves every rank of the group."""
    return buf.narrow(0, _rank(name) * rows, rows)


def source_rows(own: torch.Tensor, rows: torch.Tensor, src: int, name: str) -> torch.Tensor:
    """What a broadcast from ``src`` sends or receives: ``own`` (the rows this rank just wrote)
    when this rank is ``src``, else ``rows`` (the same buffer)."""
    return own if _rank(name) == src else rows
