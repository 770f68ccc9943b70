"""Split optimizer: update each gradient bucket's parameters as soon as that bucket arrives."""

from __future__ import annotations

import operator

import torch.fx as fx

from . import meta
from .collectives import c10d

_GRADIENT_COLLECTIVES = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default)


def split_optimizer_by_bucket(gm: fx.GraphModule) -> fx.GraphModule:
    """Reorder the optimizer so the updates that read the first-issued gradient bucket come
    first, then those of the next bucket, and so on.

    The recorded optimizer visits parameters in model order, which is roughly the reverse of
    the order their gradient buckets are issued in, so its first update waits for the last
    bucket. Ordered by bucket, bucket k's updates run while bucket k+1 is still in flight (the
    overlap pass then moves each wait to its first reader). Updates over all parameters at
    once (foreach/fused kernels, a global grad norm) read every bucket and stay last.

    Every node from the first optimizer node on gets a rank: the latest gradient collective it
    depends on, through its inputs and through the storage it reads or writes in place (so no
    read moves across a write of the same tensor). A stable sort by rank keeps every data and
    in-place dependency.

    Reads: gradient all_reduce / reduce_scatter nodes, REGION, op schemas. Writes: node order.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.meta.get(meta.REGION) == meta.Region.OPTIMIZER), None)
    if start is None:
        return gm
    arrival = {n: i + 1 for i, n in enumerate(n for n in nodes if n.target in _GRADIENT_COLLECTIVES)}
    rank: dict[fx.Node, int] = {}
    read_rank: dict[fx.Node, int] = {}
    write_rank: dict[fx.Node, int] = {}
    for node in nodes:
        r = max([rank.get(a, 0) for a in node.all_input_nodes] + [arrival.get(node, 0)])
        reads, writes = _storage_access(node)
        r = max([r] + [write_rank.get(s, 0) for s in reads | writes]
                + [read_rank.get(s, 0) for s in writes])
        rank[node] = r
        for s in reads:
            read_rank[s] = max(read_rank.get(s, 0), r)
        for s in writes:
            write_rank[s] = r
    tail = [n for n in nodes[start:] if n.op != "output"]
    order = {n: i for i, n in enumerate(tail)}
    anchor = nodes[start].prev
    for node in sorted(tail, key=lambda n: (rank[n], order[n])):
        anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()
    return gm


def _storage_access(node: fx.Node) -> tuple[set[fx.Node], set[fx.Node]]:
    """The storages (base nodes) ``node`` reads and the ones it writes in place."""
    reads, writes = set(), set()
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function":
        return reads, writes
    arguments = schema.arguments if schema is not None else []
    for i, value in enumerate(node.args):
        values = value if isinstance(value, (list, tuple)) else [value]
        bases = {_base(v) for v in values if isinstance(v, fx.Node)}
        reads |= bases
        info = arguments[i].alias_info if i < len(arguments) else None
        if info is not None and info.is_write:
            writes |= bases
    for value in node.kwargs.values():
        values = value if isinstance(value, (list, tuple)) else [value]
        reads |= {_base(v) for v in values if isinstance(v, fx.Node)}
    return reads, writes


def _base(value: fx.Node) -> fx.Node:
    """The node that owns ``value``'s storage (following view and in-place ops)."""
    while value.op == "call_function":
        if value.target is operator.getitem and isinstance(value.args[0], fx.Node):
            value = value.args[0]  # an element of a multi-output op: its storage is the op's
            continue
        schema = getattr(value.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        value = value.args[0]
    return value
