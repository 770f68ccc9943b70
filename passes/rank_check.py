"""Rank check: run the per-call cross-rank check inside the step, as late as is safe, in the
step's first gradient all_reduce when it can ride there."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from . import meta

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

CARRIER = "agreement carrier"  # gm.meta: (elements, dtype) of each all_reduce up to the carrier
_REDUCES = (c10d.all_reduce_.default, c10d.all_reduce.default)
_DTYPES = (torch.float32, torch.float64)  # the header's counts stay exact integers


def place_rank_check(gm: fx.GraphModule, check: Callable[[object], None],
                     carrier: Any = None) -> fx.GraphModule:
    """Insert a call to ``check(agreement)`` before the first node that communicates or changes
    live state: a collective, an in-place update of a placeholder (parameter, buffer, optimizer
    state, input) or the first optimizer node; at the end if there is none. ``agreement`` is a
    new last input of the graph: whatever the caller passes for the check to complete (the
    runtime's per-call agreement), so the graph reads no global state.

    Everything before it (typically the whole forward and backward of a replicate step) runs
    while the check's own message is in flight; if ``check`` raises, no rank has entered a
    collective or touched its state.

    With ``carrier`` (``.group``: the name of the group every rank of the step is in;
    ``.length``: header elements; ``.header(agreement, scale, dtype)`` and
    ``.check(agreement, reduced)``) the check rides in a gradient all_reduce instead when it can
    (``carry``), and ``gm.meta[CARRIER]`` lists the all_reduces up to it.

    Reads: node targets, op schemas, REGION, meta["val"]. Writes: one placeholder (last), the
    check's call_function node(s), the carrier's input and meta; recompiles.
    """
    graph = gm.graph
    first = next(n for n in graph.nodes if _stops(n))
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        agreement = graph.placeholder("agreement")
    agreement.meta[meta.REGION] = meta.Region.FORWARD
    if carrier is None or not carry(gm, agreement, carrier):
        with graph.inserting_before(first):
            graph.call_function(check, (agreement,))
    graph.lint()
    gm.recompile()
    return gm


def carry(gm: fx.GraphModule, agreement: fx.Node, carrier: Any) -> bool:
    """Let the agreement ride in the graph's first bucketed gradient all_reduce (a ``cat`` of
    gradients, maybe divided in place, summed over ``carrier.group``, float32/64, of a static
    size): ``carrier.header`` makes ``carrier.length`` elements appended to the ``cat`` and
    ``carrier.check`` reads them back from the result right after its wait, which moves up to
    come before any later collective or state update.

    Only when nothing before it changes live state and every collective issued before it is a
    sum all_reduce over the same group of a static size: a rank that runs no program joins them
    all (zeros) and the carrier. ``gm.meta[CARRIER]`` then holds (elements, dtype) of each of
    them, the carrier last. False, with the graph unchanged, when it cannot."""
    prefix, issue = [], None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output" or n.meta.get(meta.REGION) == meta.Region.OPTIMIZER \
                or _updates_placeholder(n):
            return False
        if n.target in _REDUCES:
            if _static_sum(n, carrier.group) is None:
                return False
            prefix.append(n)
            if _bucket(n) is not None and n.meta["val"].dtype in _DTYPES:
                issue = n
                break
        elif _communicates(n) and n.target is not c10d.wait_tensor.default:
            return False
    if issue is None:
        return False
    flat, scale = _bucket(issue)
    (wait,) = issue.users
    graph, val = gm.graph, issue.meta["val"]
    with graph.inserting_before(flat):
        header = graph.call_function(carrier.header, (agreement, scale, val.dtype))
    header.meta["val"] = val.new_empty(carrier.length)
    flat.args = (list(flat.args[0]) + [header],) + flat.args[1:]
    grown = val.new_empty(val.numel() + carrier.length)
    for n in {flat, issue.args[0], issue, wait}:
        n.meta["val"] = grown
    nxt = next(n for n in _after(issue) if n is wait or (
        _stops(n) and n.target is not c10d.wait_tensor.default))
    if nxt is not wait:  # another collective or update before the wait: wait before it
        nxt.prepend(wait)
    with graph.inserting_after(wait):
        graph.call_function(carrier.check, (agreement, wait))
    gm.meta[CARRIER] = tuple((_static_sum(n, carrier.group), str(n.meta["val"].dtype))
                             for n in prefix)
    return True


def _static_sum(issue: fx.Node, group: str) -> int | None:
    """The elements of ``issue``, a sum all_reduce over ``group`` of a static size with one
    wait; else None."""
    if issue.args[1] != "sum" or issue.args[2] != group or len(issue.users) != 1 \
            or next(iter(issue.users)).target is not c10d.wait_tensor.default:
        return None
    val = issue.meta.get("val")
    try:
        return int(val.numel())
    except (AttributeError, TypeError, ValueError):  # a symbolic size
        return None


def _bucket(issue: fx.Node) -> tuple[fx.Node, float] | None:
    """(the ``cat``, the divisor) of an all_reduce of ``cat(...)`` or ``cat(...).div_(n)``
    that nothing else reads; else None."""
    source = issue.args[0]
    divided = source.target is aten.div_.Tensor
    flat, scale = (source.args[0], source.args[1]) if divided else (source, 1)
    if not (isinstance(flat, fx.Node) and flat.target is aten.cat.default
            and flat.args[1:] in ((), (0,)) and isinstance(scale, (int, float))
            and len(flat.users) == 1 and len(source.users) == 1 and issue.meta["val"].dim() == 1):
        return None
    return flat, scale


def _after(node: fx.Node):
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _stops(n: fx.Node) -> bool:
    """Must the check come before ``n``? (it communicates or changes live state)"""
    return n.op == "output" or n.op != "placeholder" and (
        _communicates(n) or n.meta.get(meta.REGION) == meta.Region.OPTIMIZER
        or _updates_placeholder(n))


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
