"""Prefetch: issue fully_shard's parameter all-gathers ahead of their use, under a memory cap."""

from __future__ import annotations

import torch.fx as fx

from . import meta
from .collectives import c10d, tensor_bytes

MB = 2**20


def prefetch_all_gathers(gm: fx.GraphModule, *, prefetch_cap_mb: float = 64.0) -> fx.GraphModule:
    """Issue each all_gather earlier, so its transfer runs while earlier parameters compute.

    Gathers are taken in graph order (forward, then the backward's re-gathers). Gather k's issue
    (with the nodes that build its input, e.g. a bucket's ``cat``) moves to just after the wait
    of gather j < k, the earliest j for which the gathers j+1..k, fetched ahead of their use,
    hold at most ``prefetch_cap_mb`` MiB; j is in k's region, so the backward's re-gathers are
    not pulled into the forward (where they would keep the parameters that
    ``reshard_after_forward`` frees). A gather larger than the cap stays where it is. Waits
    stay in place (just before the first use), so the result is only read once it is needed.
    Gathers in the optimizer region (none today) are left alone: it updates the shards.

    Reads: all_gather_into_tensor issue/wait nodes, node.meta["val"], REGION. Writes: node
    order only.
    """
    cap = int(prefetch_cap_mb * MB)
    graph = gm.graph
    gathers = [
        (n, next(iter(n.users))) for n in graph.nodes
        if n.target is c10d.all_gather_into_tensor.default and len(n.users) == 1
        and n.meta.get(meta.REGION) != meta.Region.OPTIMIZER
    ]
    sizes = [tensor_bytes(issue.meta.get("val")) for issue, _ in gathers]
    regions = [issue.meta.get(meta.REGION) for issue, _ in gathers]
    last_moved = {}  # gather j -> the last node moved to follow its wait
    for k in range(1, len(gathers)):
        ahead, j = 0, k
        while (j > 0 and regions[j - 1] == regions[k] and sizes[j] is not None
               and ahead + sizes[j] <= cap):
            ahead += sizes[j]
            j -= 1
        if j < k:  # issue gather k right after gather j's wait (and earlier prefetches there)
            last_moved[j] = _move_after(graph, gathers[k][0], last_moved.get(j, gathers[j][1]))
    graph.lint()
    gm.recompile()
    return gm


def _move_after(graph: fx.Graph, node: fx.Node, anchor: fx.Node) -> fx.Node:
    """Move ``node``, with the inputs it needs that are computed after ``anchor``, to just after
    ``anchor`` in their relative order; return the last node moved (or ``anchor``)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    if order[node] <= order[anchor]:
        return anchor
    needed, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in needed or order[n] <= order[anchor]:
            continue
        needed.add(n)
        todo.extend(n.all_input_nodes)
    for n in sorted(needed, key=order.__getitem__):
        anchor.append(n)
        anchor = n
    return anchor
