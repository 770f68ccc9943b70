"""Recompute: keep at most a budget of the activations the backward reads; recompute the rest.

The backward reads forward values (activations) that autograd saved; they are alive from the
forward to their last use in the backward, and at a large batch they dominate a step's
memory. This pass chooses, under ``activation_memory_budget`` (a fraction of the saved bytes),
which of them to keep; the others die after their last forward use and are computed again in
the backward from what is kept (and the parameters), just before the backward reads them, as
activation checkpointing does. It runs on the traced graph, before expansion, so under
fully_shard a recomputed matmul reads the parameter the backward gathers.

Choice: greedy by bytes freed per unit of recomputation cost (views cost nothing, pointwise
ops 1, other ops 5, matmuls, convolutions and attention 100 per node), until the kept bytes fit
the budget. Random ops (dropout) and in-place ops are never recomputed (their values would
differ or their inputs have changed); activations the step returns are kept.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

from . import meta
from .collectives import aten
from .memory_plan import alias_source

_COMPUTE_INTENSIVE = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.convolution.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
}


def _region(n: fx.Node):
    return n.meta.get(meta.REGION)


def _nbytes(val) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for s in val.shape:
        numel *= optimization_hint(s) if isinstance(s, torch.SymInt) else int(s)
    return numel * val.element_size()


def _is_view(n: fx.Node) -> bool:
    return alias_source(n) is not None


def _cost(n: fx.Node) -> int:
    if _is_view(n) or n.target.__class__.__name__ == "builtin_function_or_method":
        return 0
    tags = getattr(n.target, "tags", ())
    if torch.Tag.pointwise in tags:
        return 1
    return 100 if n.target in _COMPUTE_INTENSIVE else 5


def _recomputable(n: fx.Node) -> bool:
    """Computing ``n`` again gives the same value: no randomness, no in-place writes."""
    if n.op != "call_function":
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                  for a in schema.arguments):
        return False
    if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
        dropout = dict(zip((a.name for a in schema.arguments), n.args)).get("dropout_p", None)
        return dropout == 0.0  # attention without dropout is deterministic
    return True


def saved_activations(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Forward allocations (alias roots) some alias of which the backward reads, and their bytes."""
    root: dict[fx.Node, fx.Node] = {}
    saved: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        source = alias_source(n)
        root[n] = root[source] if source is not None else n
        r = root[n]
        if (r.op == "call_function" and _region(r) == meta.Region.FORWARD
                and any(_region(u) == meta.Region.BACKWARD for u in n.users)):
            saved[r] = _nbytes(r.meta.get("val"))
    return saved


def recompute_activations(gm: fx.GraphModule, *, budget: float) -> fx.GraphModule:
    """Keep at most ``budget`` (0..1) of the saved activation bytes; recompute the others in
    the backward (see the module docstring).

    Reads: REGION, node.meta["val"], op schemas and tags. Writes: copies of forward nodes in
    the backward region (just before their first backward reader); backward readers of the
    recomputed activations read the copies; recompiles.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root = {}
    for n in nodes:
        source = alias_source(n)
        root[n] = root[source] if source is not None else n
    saved = saved_activations(gm)
    escapes = {root[a] for a in next(n for n in reversed(nodes) if n.op == "output").all_input_nodes}
    total, kept = sum(saved.values()), sum(saved.values())
    chosen: set[fx.Node] = set()

    def available(n: fx.Node) -> bool:
        return n.op == "placeholder" or (root[n] in saved and root[n] not in chosen) or (
            root[n].op == "placeholder")

    def closure(r: fx.Node) -> list[fx.Node] | None:
        """Forward nodes to compute again for ``r``'s backward readers, or None if impossible."""
        need = set()
        todo = [n for n in nodes if root[n] is r and any(_region(u) == meta.Region.BACKWARD
                                                          for u in n.users)] + [r]
        while todo:
            n = todo.pop()
            if n in need:
                continue
            if n.op != "call_function" or _region(n) != meta.Region.FORWARD or not _recomputable(n):
                return None
            need.add(n)
            todo.extend(a for a in n.all_input_nodes if not (available(a) and root[a] is not r))
        return sorted(need, key=pos.__getitem__)

    while kept > budget * total:
        best, best_score = None, 0.0
        for r, nbytes in saved.items():
            if r in chosen or r in escapes or nbytes == 0:
                continue
            need = closure(r)
            if need is None:
                continue
            score = nbytes / (1 + sum(_cost(n) for n in need))
            if score > best_score:
                best, best_score = r, score
        if best is None:
            break
        chosen.add(best)
        kept -= saved[best]
    if not chosen:
        return gm
    _rewrite(graph, nodes, pos, root, chosen, available)
    graph.lint()
    gm.recompile()
    return gm


def _rewrite(graph, nodes, pos, root, chosen, available) -> None:
    """Copy the recomputed nodes into the backward, before their first backward reader."""
    copies: dict[fx.Node, fx.Node] = {}

    def copy(n: fx.Node, before: fx.Node) -> fx.Node:
        if n in copies:
            return copies[n]
        for a in n.all_input_nodes:
            if a.op == "call_function" and not (available(a) and root[a] not in chosen):
                copy(a, before)
        with graph.inserting_before(before):
            c = graph.node_copy(n, lambda a: copies.get(a, a))
        c.meta = {k: v for k, v in n.meta.items() if k != meta.PLACEMENT}
        c.meta[meta.REGION] = meta.Region.BACKWARD
        copies[n] = c
        return c

    readers = sorted(
        {(u, n) for n in nodes if root[n] in chosen for u in n.users
         if _region(u) == meta.Region.BACKWARD},
        key=lambda un: (pos[un[0]], pos[un[1]]))
    for user, n in readers:
        user.replace_input_with(n, copy(n, user))
