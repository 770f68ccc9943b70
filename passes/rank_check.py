"""Rank check: run the per-call cross-rank check inside the step, as late as is safe."""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from . import meta


def place_rank_check(gm: fx.GraphModule, check: Callable[[object], None]) -> fx.GraphModule:
    """Insert a call to ``check(agreement)`` before the first node that communicates or changes
    live state: a collective, an in-place update of a placeholder (parameter, buffer, optimizer
    state, input) or the first optimizer node; at the end if there is none. ``agreement`` is a
    new last input of the graph: whatever the caller passes for the check to complete (the
    runtime's per-call agreement), so the graph reads no global state.

    Everything before it (typically the whole forward and backward of a replicate step) runs
    while the check's own message is in flight; if ``check`` raises, no rank has entered a
    collective or touched its state.

    Reads: node targets, op schemas, REGION. Writes: one placeholder (last) and one
    call_function node; recompiles.
    """
    graph = gm.graph
    first = next(
        (n for n in graph.nodes if n.op == "output" or n.op != "placeholder" and (
            _communicates(n) or n.meta.get(meta.REGION) == meta.Region.OPTIMIZER
            or _updates_placeholder(n))),
    )
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        agreement = graph.placeholder("agreement")
    agreement.meta[meta.REGION] = meta.Region.FORWARD
    with graph.inserting_before(first):
        graph.call_function(check, (agreement,))
    graph.lint()
    gm.recompile()
    return gm


def _communicates(node: fx.Node) -> bool:
    """A collective (functional or in place) or its wait."""
    return (node.meta.get(meta.ROLE) == meta.Role.COLLECTIVE
            or getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d"))


def _updates_placeholder(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(_views_placeholder(v) for v in values):
                return True
    return False


def _views_placeholder(value) -> bool:
    """Does ``value`` share storage with a placeholder (through view and in-place ops)?"""
    while isinstance(value, fx.Node) and value.op == "call_function":
        schema = getattr(value.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return False
        value = value.args[0]
    return isinstance(value, fx.Node) and value.op == "placeholder"
