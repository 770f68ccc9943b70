"""Split optimizer: update each gradient bucket's parameters as soon as that bucket arrives."""

from __future__ import annotations

import operator

import torch.fx as fx

from . import meta
from .collectives import c10d
from .dependencies import accesses

_GRADIENT_COLLECTIVES = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default)


def split_optimizer_by_bucket(gm: fx.GraphModule) -> fx.GraphModule:
    """Reorder the optimizer so the updates that read the first-issued gradient bucket come
    first, then those of the next bucket, and so on.

    The recorded optimizer visits parameters in model order, which is roughly the reverse of
    the order their gradient buckets are issued in, so its first update waits for the last
    bucket. Ordered by bucket, bucket k's updates run while bucket k+1 is still in flight (the
    overlap pass then moves each wait to its first reader).

    Every node from the first optimizer node on gets a rank: the latest gradient collective it
    depends on, through its inputs and through the storage it reads or writes in place (so no
    read moves across a write of the same tensor). A ``_foreach_*``/``_fused_*`` op over tensors
    of several ranks (a fused Adam over every parameter) is first split into one op per rank,
    each over its own parameters. A stable sort by rank then keeps every data and in-place
    dependency. Updates that need every bucket (a global grad norm) stay last.

    Reads: gradient all_reduce / reduce_scatter nodes, REGION, op schemas. Writes: node order;
    replaces split list ops (and remaps their ``getitem`` users).
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.meta.get(meta.REGION) == meta.Region.OPTIMIZER), None)
    if start is None:
        return gm
    first = nodes[start]
    arrival = {n: i + 1 for i, n in enumerate(n for n in nodes if n.target in _GRADIENT_COLLECTIVES)}
    ranks = _Ranks(arrival)
    for i, node in enumerate(nodes):
        length = _list_length(node) if i >= start else None
        if length:
            groups: dict[int, list[int]] = {}
            for j in range(length):
                groups.setdefault(ranks.of(*accesses(node, j, length)), []).append(j)
            if len(groups) > 1:
                parts = _split(graph, node, [groups[r] for r in sorted(groups)], length)
                first = parts[0] if node is first else first
                for part in parts:
                    ranks.visit(part)
                continue
        ranks.visit(node)
    nodes = list(graph.nodes)
    start = nodes.index(first)
    tail = [n for n in nodes[start:] if n.op != "output"]
    order = {n: i for i, n in enumerate(tail)}
    anchor = nodes[start].prev
    for node in sorted(tail, key=lambda n: (ranks.rank[n], order[n])):
        anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()
    return gm


class _Ranks:
    """Per node, the latest gradient collective it must follow (see split_optimizer_by_bucket)."""

    def __init__(self, arrival: dict[fx.Node, int]):
        self.arrival = arrival
        self.rank: dict[fx.Node, int] = {}
        self.read_rank: dict[fx.Node, int] = {}
        self.write_rank: dict[fx.Node, int] = {}

    def of(self, inputs, reads, writes) -> int:
        """The rank of an access: after its inputs and after every conflicting storage access."""
        return max([0] + [self.rank.get(a, 0) for a in inputs] + [self.write_rank.get(s, 0) for s in reads | writes]
                   + [self.read_rank.get(s, 0) for s in writes])

    def visit(self, node: fx.Node) -> None:
        inputs, reads, writes = accesses(node)
        r = max(self.of(inputs, reads, writes), self.arrival.get(node, 0))
        self.rank[node] = r
        for s in reads:
            self.read_rank[s] = max(self.read_rank.get(s, 0), r)
        for s in writes:
            self.write_rank[s] = r


def _list_length(node: fx.Node) -> int | None:
    """For a ``_foreach_*``/``_fused_*`` op whose index-aligned list arguments can be split,
    their common length; else None."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    name = schema.name.split("::")[-1]
    if not (name.startswith("_foreach_") or name.startswith("_fused_")):
        return None
    if len(schema.returns) > 1 or (schema.returns and str(schema.returns[0].type) != "List[Tensor]"):
        return None
    if schema.returns and not all(u.target is operator.getitem for u in node.users):
        return None
    lengths = {len(v) for v in (*node.args, *node.kwargs.values()) if isinstance(v, (list, tuple)) and v}
    if len(lengths) != 1:  # (an empty list is an optional argument left out, e.g. amsgrad's)
        return None
    length = lengths.pop()
    return length if length > 1 else None


def _split(graph: fx.Graph, node: fx.Node, groups: list[list[int]], length: int) -> list[fx.Node]:
    """Replace list op ``node`` by one op per group of element indices; return the new nodes."""

    def pick(value, indices):
        if isinstance(value, (list, tuple)) and len(value) == length:
            return type(value)(value[i] for i in indices)
        return value

    parts, where = [], {}
    with graph.inserting_before(node):
        for indices in groups:
            part = graph.call_function(node.target, tuple(pick(a, indices) for a in node.args),
                                       {k: pick(v, indices) for k, v in node.kwargs.items()})
            part.meta = dict(node.meta)
            for key in ("val", meta.PLACEMENT):  # per-element meta
                value = node.meta.get(key)
                if isinstance(value, (list, tuple)) and len(value) == length:
                    part.meta[key] = [value[i] for i in indices]
            for position, i in enumerate(indices):
                where[i] = (part, position)
            parts.append(part)
    for user in list(node.users):  # getitem(node, i) -> getitem(part, position)
        user.args = where[user.args[1]]
    graph.erase_node(node)
    return parts
