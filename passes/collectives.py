"""Helpers shared by the expansion passes: insert functional collectives with complete meta."""

from __future__ import annotations

import torch
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
