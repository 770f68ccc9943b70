"""The parameters whose unshard the tracer recorded (FSDP2's all-gather extensions, GATHERED
placeholders; spmd_compiler/features/subclass_params.py) once the fully_shard expansion makes them shards.

The recording took this rank's rows of each at its global shape and ran the pre hook, the gather
and the post hook on them; the expansion keeps those nodes. Two things change:

- ``take_local_rows``: the slice of this rank's rows now reads the padded shard (rows ``[0, n)``).
- ``regather_for_backward`` (``reshard_after_forward``): as FSDP2 unshards again before the
  backward, every forward node computed from the parameter alone that the backward reads (the
  whole unshard: slices, hook ops, the gathers, the weight built from them, views of it) is
  computed again before its first backward use, so the forward's copy dies after the forward.
"""

from __future__ import annotations

import torch.fx as fx

from . import meta
from .collectives import aten


def take_local_rows(graph: fx.Graph) -> None:
    """The slices that took this rank's rows of a GATHERED parameter at its global shape take
    the first rows of its (padded) shard instead. Reads LOCAL_SHARD, GATHERED; writes their args."""
    for node in graph.nodes:
        if meta.LOCAL_SHARD in node.meta and node.target is aten.slice.Tensor and (
                node.args[0].meta.get(meta.GATHERED)):
            node.args = (node.args[0], 0, 0, node.meta[meta.LOCAL_SHARD])


def _from_parameter(graph: fx.Graph, roots: set[fx.Node]) -> list[fx.Node]:
    """Forward nodes computed from ``roots`` alone, in graph order."""
    derived: set[fx.Node] = set()
    for node in graph.nodes:
        ins = node.all_input_nodes
        if node.op == "call_function" and node.meta.get(meta.REGION) == meta.Region.FORWARD and (
                ins and all(a in derived or a in roots for a in ins)):
            derived.add(node)
    return [n for n in graph.nodes if n in derived]


def regather_for_backward(graph: fx.Graph) -> None:
    """Recompute, before its first backward use, each GATHERED parameter's unshard that the
    backward reads. Reads GATHERED, REGION; writes the copies (REGION backward; a copied
    collective keeps its COLLECTIVE meta) and points the backward's uses at them."""
    by_fqn: dict[str, set[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "placeholder" and node.meta.get(meta.GATHERED):
            by_fqn.setdefault(node.meta[meta.GATHERED], set()).add(node)
    for roots in by_fqn.values():
        derived = _from_parameter(graph, roots)
        inside = set(derived)
        readers = [u for d in derived for u in d.users
                   if u.meta.get(meta.REGION) == meta.Region.BACKWARD and u not in inside]
        if not readers:
            continue
        needed, todo = set(), [a for u in readers for a in u.all_input_nodes if a in inside]
        while todo:
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(a for a in n.all_input_nodes if a in inside)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(readers, key=order.__getitem__)
        again: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in [d for d in derived if d in needed]:
                copy = graph.node_copy(n, lambda a: again.get(a, a))
                copy.meta[meta.REGION] = meta.Region.BACKWARD
                again[n] = copy
        for u in set(readers):
            for old, new in again.items():
                u.replace_input_with(old, new)


def keep_recorded_gathers(graph: fx.Graph, reshard_after_forward: bool) -> None:
    """Once the GATHERED placeholders are shards: ``take_local_rows``, and with
    ``reshard_after_forward`` ``regather_for_backward``."""
    take_local_rows(graph)
    if reshard_after_forward:
        regather_for_backward(graph)
