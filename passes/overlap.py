"""Overlap: let communication run while the graph keeps computing."""

from __future__ import annotations

import torch.fx as fx

from .collectives import c10d


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every ``wait_tensor``, with the views taken of its result (a bucket's per-parameter
    slices), down to just before the first node that computes with them.

    A functional collective is issued where its input is ready; its wait blocks until the
    transfer is done. Placed at the first real consumer instead of right after the issue, the
    wait lets the nodes in between (the rest of the backward, other buckets' optimizer updates)
    run while the transfer is in flight.

    Reads: ``wait_tensor`` nodes, their users, op schemas. Writes: node order only.
    """
    graph = gm.graph
    for wait in [n for n in graph.nodes if n.target is c10d.wait_tensor.default]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        group = _with_views(wait)
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


def _with_views(wait: fx.Node) -> set[fx.Node]:
    """``wait`` and the nodes that only view its result (transitively)."""
    group, todo = {wait}, [wait]
    while todo:
        for user in todo.pop().users:
            if user not in group and _is_view(user) and all(
                a in group for a in user.all_input_nodes
            ):
                group.add(user)
                todo.append(user)
    return group


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write
