"""Overlap: let communication run while the graph keeps computing."""

from __future__ import annotations

import torch.fx as fx

from .collectives import c10d


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every ``wait_tensor`` down to just before the first node that uses its result.

    A functional collective is issued where its input is ready; its wait blocks until the
    transfer is done. Placed at the first consumer instead of right after the issue, the wait
    lets the nodes in between (the rest of the backward, other buckets' optimizer updates) run
    while the transfer is in flight.

    Reads: ``wait_tensor`` nodes and their users. Writes: node order only.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in [n for n in graph.nodes if n.target is c10d.wait_tensor.default]:
        if not wait.users:
            continue
        first = min(wait.users, key=order.__getitem__)
        if first is not wait.next:
            first.prepend(wait)
    graph.lint()
    gm.recompile()
    return gm
