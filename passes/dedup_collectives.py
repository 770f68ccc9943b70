"""One collective per value: a value reduced twice on the same group is reduced once.

Eager DTensor reduces a ``Partial`` tensor each time an op needs it whole: a gradient left
``Partial`` by sequence parallelism and read by three ops of the optimizer is all-reduced three
times, and a whole-step recording keeps all three. This pass keeps the first of the
``all_reduce``s that take the same input with the same reduction and group and makes the later
ones' readers read its result (the ancestor ``_spmd`` deduplicated them too).

Reads: the graph's ``all_reduce`` issue nodes and their ``wait_tensor`` nodes, the
schemas of the ops between two equal collectives (which arguments they write), and
``node.meta["val"]`` (to see which tensors share storage).

Writes: the later of two equal collectives and its wait are removed; their readers read the
first one's wait, moved before the first of them if it came later. Nothing is merged when the
input (or a tensor sharing its storage) is written between the two, or when a reader writes
either result in place (two readers would then share one buffer). ``gm.meta[NOTES]`` says how
many collectives went.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from . import meta

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


def deduplicate_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove all_reduces that repeat an earlier one on the same value (module docstring)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first: dict[tuple, fx.Node] = {}
    removed = 0
    for node in list(gm.graph.nodes):
        key = _key(node)
        if key is None:
            continue
        earlier = first.get(key)
        if earlier is None or not _can_share(earlier, node, order):
            first[key] = node
            continue
        kept, dropped = _wait_of(earlier), _wait_of(node)
        if order[kept] > order[dropped]:
            dropped.prepend(kept)
        dropped.replace_all_uses_with(kept)
        gm.graph.erase_node(dropped)
        gm.graph.erase_node(node)
        removed += 1
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if removed:
        gm.graph.lint()
        gm.recompile()
        gm.meta.setdefault(meta.NOTES, {})["dedup"] = (
            f"{removed} collective(s) repeating an earlier one on the same value removed")
    return gm


def _key(node: fx.Node) -> tuple | None:
    """What makes two all_reduces equal: their arguments (the input node itself, reduction,
    group). Only reductions: a gather repeated on purpose (a parameter gathered again for the
    backward so that its full copy is not kept from the forward) stays."""
    if node.target is not _ALL_REDUCE or node.kwargs or _wait_of(node) is None:
        return None
    return tuple(node.args)


def _wait_of(node: fx.Node) -> fx.Node | None:
    """The only reader of an issue node, its wait (None if it has other readers)."""
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is _WAIT else None


def _can_share(earlier: fx.Node, later: fx.Node, order: dict) -> bool:
    """May ``later``'s readers read ``earlier``'s result? Its input is not written between the
    two, and no reader of either result writes it."""
    inputs = [a for a in earlier.args if isinstance(a, fx.Node)]
    storages = {s for a in inputs for s in _storages(a)}
    for n in list(earlier.graph.nodes)[order[earlier] + 1: order[later]]:
        if storages & {s for a in _written(n) for s in _storages(a)}:
            return False
    results = {_wait_of(earlier), _wait_of(later)}
    return not any(r in _written(u) for r in results for u in r.users)


def _written(node: fx.Node) -> list[fx.Node]:
    """The node arguments ``node`` writes in place (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        written += [v for v in (value if isinstance(value, (list, tuple)) else [value])
                    if isinstance(v, fx.Node)]
    return written


def _storages(node: fx.Node) -> set:
    """The storages of ``node``'s value (a view shares its base's); the node itself when its
    value has no storage to compare (so only the same node matches)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    out = set()
    for v in vals:
        if isinstance(v, torch.Tensor):
            try:
                out.add(StorageWeakRef(v.untyped_storage()))
                continue
            except (NotImplementedError, RuntimeError):
                pass
        out.add(node)
    return out
