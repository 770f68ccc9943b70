"""Rank check: run the per-call cross-rank check inside the step, as late as is safe, in the
step's first collective when it can ride there: a gradient bucket's all_reduce, the parameters'
first gathered bucket (fully_shard) or the buffers' broadcast (made an all_reduce to which every
rank but the first adds zeros).

It is placed on the functional graph, before the eager lowering; ``describe_carrier`` then
names, on the lowered graph, the collectives a rank that runs no program joins."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from . import meta
from .gloo_collectives import _group_size
from spmd_compiler.torch_internals import _resolve_process_group

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

CARRIER = "agreement carrier"  # gm.meta: (kind, elements, dtype, source, carries) up to the carrier
CARRIES = "carries agreement"  # key of a collective's COLLECTIVE meta: the header rides in it
_REDUCES = (c10d.all_reduce_.default, c10d.all_reduce.default)
_DTYPES = (torch.float32, torch.float64)  # the header's counts stay exact integers
_GATHER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # 0/1 exact
_ISSUES = {c10d.all_reduce.default: "all_reduce", c10d.all_reduce_.default: "all_reduce",
           c10d.broadcast.default: "broadcast", c10d.broadcast_.default: "broadcast",
           c10d.all_gather_into_tensor.default: "all_gather",
           c10d.all_gather_into_tensor_out.default: "all_gather"}


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
    ``.check(agreement, result, rows)``) the check rides in the step's first collective instead
    when it can (``carry``); its issue's COLLECTIVE meta then has ``CARRIES``.

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
    """Let the agreement ride in the graph's first collective (over ``carrier.group``, of a
    static size) when it is a bucket: ``carrier.header`` makes ``carrier.length`` elements
    appended to the bucket's ``cat`` and ``carrier.check`` reads them back from the result
    right after its wait, which moves up to come before any later collective or state update.

    The carriers: a gradient bucket's sum all_reduce (float32/64; after other static sum
    all_reduces over the group, which a rank that runs no program joins with zeros); the first
    gathered bucket (every rank's header arrives in its rows); the buffers' broadcast from rank
    0, made an all_reduce to which every other rank adds zeros (exact). False, with the graph
    unchanged, when it cannot."""
    first = next((n for n in gm.graph.nodes if _stops(n)), None)
    if first is None or first.op == "output":
        return False
    if first.target is c10d.broadcast.default:
        return _carry_in_broadcast(gm, agreement, carrier, first)
    if first.target is c10d.all_gather_into_tensor.default:
        return _carry_in_gather(gm, agreement, carrier, first)
    return _carry_in_reduce(gm, agreement, carrier)


def _carry_in_reduce(gm: fx.GraphModule, agreement: fx.Node, carrier: Any) -> bool:
    """The agreement in the first bucketed gradient all_reduce (see ``carry``)."""
    issue = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output" or n.meta.get(meta.REGION) == meta.Region.OPTIMIZER \
                or _updates_placeholder(n):
            return False
        if n.target in _REDUCES:
            if _static_sum(n, carrier.group) is None:
                return False
            if _bucket(n) is not None and n.meta["val"].dtype in _DTYPES:
                issue = n
                break
        elif _communicates(n) and n.target is not c10d.wait_tensor.default:
            return False
    if issue is None:
        return False
    flat, scale = _bucket(issue)
    _append_header(gm, agreement, carrier, issue, flat, scale, rows=1)
    return True


def _carry_in_gather(gm: fx.GraphModule, agreement: fx.Node, carrier: Any,
                     issue: fx.Node) -> bool:
    """The agreement in the first gathered bucket, ``all_gather(cat(shards))`` viewed as
    ``[world, elements]`` (bucketing.py): each rank's header ends its own row."""
    shard, world, group = issue.args
    val = issue.meta.get("val")
    if group != carrier.group or len(issue.users) != 1 or not isinstance(shard, fx.Node) \
            or shard.target is not aten.cat.default or shard.args[1:] not in ((), (0,)) \
            or len(shard.users) != 1 or val is None or val.dtype not in _GATHER_DTYPES \
            or _static_sum_size(val) is None:
        return False
    (wait,) = issue.users
    if wait.target is not c10d.wait_tensor.default or len(wait.users) != 1:
        return False
    (rows,) = wait.users
    if rows.target is not aten.view.default or list(rows.args[1]) != [world, val.numel() // world]:
        return False
    _append_header(gm, agreement, carrier, issue, shard, 1, rows=world)
    rows.args = (rows.args[0], [world, val.numel() // world + carrier.length])
    rows.meta["val"] = val.new_empty(world, val.numel() // world + carrier.length)
    return True


def _carry_in_broadcast(gm: fx.GraphModule, agreement: fx.Node, carrier: Any,
                        issue: fx.Node) -> bool:
    """The agreement beside the buffers' bytes (replicate.py): their ``broadcast(cat(bytes),
    0)`` becomes ``all_reduce(bytes_of_rank0(cat(bytes, header)), sum)``: rank 0 adds its
    bytes and every other rank zeros, so the sum is rank 0's bytes and the headers' counts."""
    flat, source, group = issue.args
    val = issue.meta.get("val")
    size = _group_size(group)
    if source != 0 or group != carrier.group or size is None or size >= 256 \
            or not isinstance(flat, fx.Node) or flat.target is not aten.cat.default \
            or len(flat.users) != 1 or val is None or val.dtype != torch.uint8 \
            or _static_sum_size(val) is None or len(issue.users) != 1:
        return False
    issue.target, issue.args = c10d.all_reduce.default, (flat, "sum", group)
    _append_header(gm, agreement, carrier, issue, flat, 1, rows=1)
    with gm.graph.inserting_before(issue):  # a program may be shared: the rank is read per call
        sent = gm.graph.call_function(bytes_of_rank0, (flat, val.numel(), group))
    sent.meta.update({"val": flat.meta["val"], meta.REGION: flat.meta.get(meta.REGION)})
    issue.args = (sent,) + issue.args[1:]
    return True


def bytes_of_rank0(flat: torch.Tensor, length: int, group: str) -> torch.Tensor:
    """Graph node: ``flat`` (the buffers' bytes, then the header), its first ``length`` bytes
    zeroed in place on every rank of ``group`` but rank 0."""
    if _resolve_process_group(group).rank() != 0:
        flat[:length].zero_()
    return flat


def _append_header(gm, agreement, carrier, issue: fx.Node, flat: fx.Node, scale, rows: int):
    """Append the header (times ``scale``) to ``flat``, the ``cat`` ``issue`` communicates;
    check it right after the issue's wait (moved before any later collective or update)."""
    (wait,) = issue.users
    graph, val = gm.graph, issue.meta["val"]
    with graph.inserting_before(flat):
        header = graph.call_function(carrier.header, (agreement, scale, val.dtype))
    header.meta["val"] = val.new_empty(carrier.length)
    flat.args = (list(flat.args[0]) + [header],) + flat.args[1:]
    grown = val.new_empty(val.numel() + carrier.length * rows)
    flat.meta["val"] = flat.meta["val"].new_empty(flat.meta["val"].numel() + carrier.length)
    for n in {issue.args[0], issue, wait} - {flat}:
        n.meta["val"] = grown if n is not issue.args[0] else flat.meta["val"]
    issue.meta[meta.COLLECTIVE] = {**(issue.meta.get(meta.COLLECTIVE) or {}), CARRIES: True}
    nxt = next(n for n in _after(issue) if n is wait or (
        _stops(n) and n.target is not c10d.wait_tensor.default))
    if nxt is not wait:  # another collective or update before the wait: wait before it
        nxt.prepend(wait)
    with graph.inserting_after(wait):
        graph.call_function(carrier.check, (agreement, wait, rows))


def finish_rank_check(gm: fx.GraphModule) -> fx.GraphModule:
    """After the lowering: the ``agreement`` input last again (the lowering may add inputs),
    and ``gm.meta[CARRIER]`` the collectives up to and with the carrier as issued
    (``describe_carrier``) when the agreement rides in one. Writes: placeholder order, meta."""
    graph = gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    agreement = next((n for n in inputs if n.name == "agreement"), None)
    if agreement is not None and agreement is not inputs[-1]:
        inputs[-1].append(agreement)
        graph.lint()
        gm.recompile()
    described = describe_carrier(gm)
    if described is not None:
        gm.meta[CARRIER] = described
    return gm


def describe_carrier(gm: fx.GraphModule) -> tuple | None:
    """(kind, elements, dtype, source rank or -1, carries the header) of each collective the
    lowered graph issues up to and with its carrier (the issues with ``CARRIES``); None when
    no collective carries the agreement."""
    issued, seen = [], False
    for n in gm.graph.nodes:
        kind = _ISSUES.get(n.target)
        carries = bool((n.meta.get(meta.COLLECTIVE) or {}).get(CARRIES))
        if kind is None:
            if seen and _communicates(n) and n.target is not c10d.wait_tensor.default:
                break
            continue
        if seen and not carries:
            break
        source = n.args[1] if kind == "broadcast" else -1
        issued.append((kind, int(n.args[0].meta["val"].numel()), str(n.args[0].meta["val"].dtype),
                       source, carries))
        seen = seen or carries
    return tuple(issued) if seen else None


def _static_sum_size(val) -> int | None:
    try:
        return int(val.numel())
    except (AttributeError, TypeError, ValueError):  # a symbolic size
        return None


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
    divided = source.target in (aten.div_.Tensor, aten.div.Tensor)
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
