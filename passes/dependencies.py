"""What each node reads and writes, and the order that follows from it.

A graph of the whole step mutates state in place (the optimizer updates parameter shards, a
gradient is clipped in place), so data edges alone do not say which orders are valid: a write
must stay after every earlier read and write of the same storage, and a read after the write
before it. A functional collective keeps reading its input until its ``wait_tensor``.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from .collectives import c10d


def storage_base(value: fx.Node) -> fx.Node:
    """The node that owns ``value``'s storage (following views, in-place ops and getitem)."""
    while value.op == "call_function":
        if value.target is operator.getitem and isinstance(value.args[0], fx.Node):
            value = value.args[0]  # an element of a multi-output op: its storage is the op's
            continue
        schema = getattr(value.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        value = value.args[0]
    return value


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s result is a view of its input (its schema's single return aliases an
    argument without writing it)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def views_of(node: fx.Node) -> list[fx.Node]:
    """The nodes that only view ``node``'s result, transitively, in order of discovery."""
    out, todo, seen = [], [node], {node}
    while todo:
        for user in todo.pop(0).users:
            if user not in seen and is_view(user) and all(a in seen for a in user.all_input_nodes):
                seen.add(user)
                out.append(user)
                todo.append(user)
    return out


def accesses(node: fx.Node, j: int | None = None, length: int = 0):
    """(input nodes, storages read, storages written in place) of ``node``, or of element ``j``
    of a list op whose index-aligned lists have ``length`` elements."""
    if node.op != "call_function":
        return list(node.all_input_nodes), set(), set()
    schema = getattr(node.target, "_schema", None)
    positional = list(schema.arguments) if schema is not None else []
    named = {a.name: a for a in positional}
    values = [(v, positional[i] if i < len(positional) else None) for i, v in enumerate(node.args)]
    values += [(v, named.get(k)) for k, v in node.kwargs.items()]
    inputs, reads, writes = [], set(), set()
    for value, arg in values:
        if isinstance(value, (list, tuple)):
            items = [value[j]] if j is not None and len(value) == length else list(value)
        else:
            items = [value]
        items = [v for v in items if isinstance(v, fx.Node)]
        inputs += items
        bases = {storage_base(v) for v in items}
        reads |= bases
        if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
            writes |= bases
    return inputs, reads, writes


def step_dependencies(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """For every node, the nodes that must run before it: its inputs; the last writer of each
    storage it reads or writes; every reader of a storage it writes since that storage's last
    write. A ``wait_tensor`` counts as reading what its collective read (the collective may
    read its input until it is waited on). The graph's order satisfies every constraint."""
    deps: dict[fx.Node, set[fx.Node]] = {}
    last_write: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        inputs, reads, writes = accesses(node)
        if node.target is c10d.wait_tensor.default and isinstance(node.args[0], fx.Node):
            reads = reads | accesses(node.args[0])[1]
        before = set(inputs)
        for s in reads | writes:
            if s in last_write:
                before.add(last_write[s])
        for s in writes:
            before.update(readers.pop(s, ()))
            last_write[s] = node
        for s in reads - writes:
            readers.setdefault(s, []).append(node)
        before.discard(node)
        deps[node] = before
    return deps
