"""Overlap: let communication run while the graph keeps computing."""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from .collectives import c10d
from .dependencies import views_of


def sink_waits(gm: fx.GraphModule, only: Callable[[fx.Node], bool] | None = None) -> fx.GraphModule:
    """Move every ``wait_tensor``, with the views taken of its result (a bucket's per-parameter
    slices), down to just before the first node that computes with them.

    A functional collective is issued where its input is ready; its wait blocks until the
    transfer is done. Placed at the first real consumer instead of right after the issue, the
    wait lets the nodes in between (the rest of the backward, other buckets' optimizer updates)
    run while the transfer is in flight.

    ``only``: sink just the waits it accepts (after the memory-aware schedule, which orders the
    data-parallel ones itself, a tensor-parallel plan's: MODEL_PARALLEL).

    Reads: ``wait_tensor`` nodes, their users, op schemas. Writes: node order only.
    """
    graph = gm.graph
    for wait in [n for n in graph.nodes if n.target is c10d.wait_tensor.default
                 and (only is None or only(n))]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        group = {wait, *views_of(wait)}
        consumers = [u for n in group for u in n.users if u not in group]
        if not consumers:
            continue
        first = min(consumers, key=order.__getitem__)
        for node in sorted(group, key=order.__getitem__):
            if order[node] < order[first]:
                first.prepend(node)
    graph.lint()
    gm.recompile()
    return gm
