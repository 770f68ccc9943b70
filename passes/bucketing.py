"""Bucketing: merge per-parameter gradient collectives (and fully_shard's parameter all-gathers)
into a few large flat ones, as DDP's reducer and FSDP's groups do. Few large collectives beat many
small ones on every transport: each collective pays a fixed latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from . import meta
from .collectives import aten, c10d, replace_inputs
from .subgraph import insert_traced, tensor_bytes

MB = 2**20


@dataclass
class _Member:
    """One per-parameter collective: ``issue(source / scale)`` followed by ``wait``."""

    issue: fx.Node
    wait: fx.Node
    source: fx.Node  # the tensor before the division by the world size (or the shard, for gathers)
    scale: fx.Node | None  # the div node, erased with the collective
    nbytes: int
    whole: int  # bytes of the larger of its input and output (a gather's output is world x)


def _members(graph: fx.Graph, target, plan: bool = False) -> list[_Member]:
    """The per-parameter collectives of ``target`` that may join a bucket; with ``plan``, a
    tensor-parallel plan's summing collectives (MODEL_PARALLEL) instead."""
    out = []
    for node in graph.nodes:
        if node.target is not target or meta.BUCKET in node.meta or meta.GATHERED in node.meta:
            continue  # a bucket already, or a gather of what all-gather extensions computed
        if (not plan and not (node.meta.get(meta.COLLECTIVE) or {}).get("params")) or (
                plan and (meta.MODEL_PARALLEL not in node.meta or node.args[1] != "sum"
                          or not _static(node.args[0]))):
            continue  # (a plan's reduction of an activation: its shape follows the batch)
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        if len(waits) != 1 or len(node.users) != 1:
            continue
        inp = node.args[0]
        scale = inp if inp.target is aten.div.Tensor and len(inp.users) == 1 else None
        source = scale.args[0] if scale is not None else inp
        nbytes = tensor_bytes(source.meta.get("val"))
        if nbytes is None:
            continue
        whole = max(nbytes, tensor_bytes(waits[0].meta.get("val")) or 0)  # a gather's output
        out.append(_Member(node, waits[0], source, scale, nbytes, whole))
    return out


def _static(node: fx.Node) -> bool:
    """Is ``node``'s shape free of symbols (a bucket's views hold plain sizes)?"""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape)


def _own_collectives(members: list[_Member], own_cap: int | None, plan) -> set[int]:
    """Which members keep their own collective: the largest of those of at least ``own_cap``
    bytes (copying them into a bucket costs more than the collective it saves), as long as the
    step still issues no more collectives than bucketing every member would (``plan(members)``
    gives the buckets): the collective count is a budget, spent on the costliest copies."""
    if own_cap is None:
        return set()
    budget = len(plan(members))
    own: set[int] = set()
    for i in sorted((i for i, m in enumerate(members) if m.whole >= own_cap),
                    key=lambda i: -members[i].whole):
        rest = [m for j, m in enumerate(members) if j not in own and j != i]
        if len(own) + 1 + len(plan(rest)) <= budget:
            own.add(i)
    return own


def _by_dtype(members: list[_Member]) -> list[list[_Member]]:
    """The members split by dtype (a flat bucket holds one dtype; mixed precision gathers some
    parameters in bf16 next to others in fp32) and by micro-batch (MICRO_BATCH: a bucket never
    waits for a later micro-batch's gradients), each list in graph order."""
    groups: dict[tuple, list[_Member]] = {}
    for m in members:
        key = (m.source.meta["val"].dtype, m.issue.meta.get(meta.MICRO_BATCH))
        groups.setdefault(key, []).append(m)
    return list(groups.values())


def _optimizer_phases(graph: fx.Graph) -> dict[fx.Node, int]:
    """Per node, how many optimizer regions come before it: a step with several backward calls
    steps an optimizer between two forwards, and a parameter gathered after it is the updated
    one."""
    phases, phase, previous = {}, 0, None
    for node in graph.nodes:
        region = node.meta.get(meta.REGION)
        if region == meta.Region.OPTIMIZER and previous != meta.Region.OPTIMIZER:
            phase += 1
        phases[node], previous = phase, region
    return phases


def _by_phase(members: list[_Member], phases: dict[fx.Node, int]) -> list[list[_Member]]:
    """The gathers split by the optimizer phase they run in (a bucket goes where its first
    member was: never before an optimizer that updates a later member's parameter)."""
    groups: dict[int, list[_Member]] = {}
    for m in members:
        groups.setdefault(phases[m.issue], []).append(m)
    return list(groups.values())


def _kind(m: _Member) -> tuple:
    """Members merge only with others on the same process group (the same mesh dim) and the
    same divisor."""
    return m.issue.args[-1], m.scale.args[1] if m.scale is not None else 1


def _buckets(members: list[_Member], cap: int, first_cap: int, depends_on,
             strict: bool = False) -> list[list[_Member]]:
    """Per process group: consecutive members (graph order); a bucket closes once it holds at
    least ``cap`` bytes (``first_cap`` for that group's first bucket), as DDP's reducer assigns
    buckets, or, ``strict`` (a memory cap), before a member's ``whole`` bytes would take it past
    ``cap``; a member whose input depends on an earlier member's result starts a new bucket."""
    kinds = list(dict.fromkeys(_kind(m) for m in members))
    if len(kinds) > 1:
        return [b for k in kinds for b in _buckets([m for m in members if _kind(m) == k], cap,
                                                     first_cap, depends_on, strict)]
    buckets: list[list[_Member]] = []
    current: list[_Member] = []
    size = 0
    for m in members:
        if current and (depends_on(m, current) or strict and size + m.whole > cap):
            buckets.append(current)
            current, size = [], 0
        current.append(m)
        size += m.whole if strict else m.nbytes
        if not strict and size >= (first_cap if not buckets else cap):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _plan(graph: fx.Graph, members: list[_Member], cap: int, first_cap: int,
          own_cap: int | None, strict: bool = False, at_last: bool = False) -> list[list[_Member]]:
    """The buckets of ``members`` (one dtype), in graph order; the members that keep their own
    collective (see ``_own_collectives``) are in none. ``at_last``: a bucket goes where its
    last member's collective was, so no member may be read before that (an optimizer stepping
    between two backward calls reads the first backward's gradients)."""
    reads = _dependency_check(graph, members)
    order = {n: i for i, n in enumerate(graph.nodes)}

    def depends_on(m: _Member, others: list[_Member]) -> bool:
        return reads(m, others) or at_last and any(
            order[u] < order[m.issue] for o in others for u in _readers(o.wait))

    plan = lambda ms: _buckets(ms, cap, first_cap, depends_on, strict)  # noqa: E731
    own = _own_collectives(members, own_cap, plan)
    return plan([m for i, m in enumerate(members) if i not in own])


def _readers(wait: fx.Node) -> list[fx.Node]:
    """What reads a collective's result: its users, and through an all_reduce of it over the
    next mesh dim (hybrid sharding's, merged with the bucket) that one's readers."""
    out = []
    for u in wait.users:
        chained = _chained_all_reduce(wait) if u.target is c10d.all_reduce.default else None
        out += _readers(chained[1]) if chained else [u]
    return out


def _dependency_check(graph: fx.Graph, members: list[_Member]):
    """``depends_on(m, others)``: does ``m``'s collective read the result of one of ``others``?

    One pass in graph order gives every node the set of member waits it (transitively) reads,
    as a bit mask, instead of a graph search per pair.
    """
    bit = {m.wait: 1 << i for i, m in enumerate(members)}
    reads: dict[fx.Node, int] = {}
    for node in graph.nodes:
        mask = bit.get(node, 0)
        for inp in node.all_input_nodes:
            mask |= reads.get(inp, 0)
        reads[node] = mask

    def depends_on(m: _Member, others: list[_Member]) -> bool:
        return bool(reads[m.issue] & sum(bit[o.wait] for o in others))

    return depends_on


def _numel(node: fx.Node) -> int:
    return int(node.meta["val"].numel())


def bucket_collectives(
    gm: fx.GraphModule, *, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
    own_collective_mb: float | None = 1.0, gather_cap_mb: float | None = None,
    scatter_cap_mb: float | None = None,
) -> fx.GraphModule:
    """Merge gradient all_reduces (replicate), gradient reduce_scatters and parameter all_gathers
    (fully_shard) into flat buckets.

    Gradient buckets are assigned as DDP's reducer does: in graph (production) order, a bucket
    closing once it holds ``bucket_cap_mb`` MiB (``first_bucket_cap_mb`` for the first, so
    communication starts early). Under fully_shard a bucket is alive as a whole, so memory caps
    it instead: a gather bucket's gathered bytes stay within ``gather_cap_mb`` (the prefetch
    cap) and a reduce-scatter bucket's full-size gradient bytes within ``scatter_cap_mb`` (the
    reduce cap); one tensor larger than its cap is a bucket of its own. Each is the fewest
    collectives its cap allows, in order of use.

    A tensor of at least ``own_collective_mb`` MiB keeps its own collective when that does not
    add a collective: copying it into the bucket (and, for gathers, out again) costs more than
    the one collective's latency saved (benchmarks/bucket_costs.py measures both; the default
    is this machine's figure). The largest such tensors go first. ``None`` buckets every tensor.

    Reads: COLLECTIVE meta (per-parameter collectives have a non-empty ``params`` list),
    MODEL_PARALLEL / PLAN_PLACEMENT, the
    ``div`` before each gradient collective, node.meta["val"]. Writes: per bucket one ``cat`` of
    the flattened inputs, one division, one collective + ``wait_tensor`` (BUCKET meta = bucket
    index), and per member a slice + view of the result replacing the member's wait; the
    per-member collectives are erased. Buckets never merge collectives that depend on each
    other, nor ones over different process groups or divisors; a bucket holds one dtype. A
    tensor-parallel plan's summing all_reduces (MODEL_PARALLEL: DTensor's reductions of Partial
    values, e.g. sequence parallelism's norm gradients) are bucketed the same way within their
    own group (``_bucket_plan_all_reduces``); the merged ones keep MODEL_PARALLEL and
    PLAN_PLACEMENT.
    """
    graph = gm.graph
    cap, first_cap = int(bucket_cap_mb * MB), int(first_bucket_cap_mb * MB)
    own_cap = int(own_collective_mb * MB) if own_collective_mb else None
    index = 0
    for target, merge, memory_cap in (  # reduce-scatters first: hybrid sharding all-reduces them
        (c10d.reduce_scatter_tensor.default, _merge_reduce_scatter, scatter_cap_mb),
        (c10d.all_reduce.default, _merge_all_reduce, None),
    ):
        limits = (int(memory_cap * MB),) * 2 + (True,) if memory_cap else (cap, first_cap, False)
        for members in _by_dtype(_members(graph, target)):
            for bucket in _plan(graph, members, *limits[:2], own_cap, limits[2], at_last=True):
                merge(graph, bucket, index)
                index += 1
    index = _bucket_plan_all_reduces(graph, cap, first_cap, index)
    limits = (int(gather_cap_mb * MB),) * 2 + (True,) if gather_cap_mb else (cap, cap, False)
    phases = _optimizer_phases(graph)
    for region in (meta.Region.FORWARD, meta.Region.BACKWARD):
        gathers = [m for m in _members(graph, c10d.all_gather_into_tensor.default)
                   if m.issue.meta.get(meta.REGION) == region]
        for members in (g for ms in _by_dtype(gathers) for g in _by_phase(ms, phases)):
            for bucket in _plan(graph, members, *limits[:2], own_cap, limits[2]):
                _merge_all_gather(graph, bucket, index)
                index += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _bucket_plan_all_reduces(graph: fx.Graph, cap: int, first_cap: int, index: int) -> int:
    """A tensor-parallel plan's all_reduces (DTensor's, each on the plan's group) merged like
    gradients, per group: those that neither read another's result nor have a reader before
    the bucket is issued (the bucket goes where its last member was). Returns the next index."""
    for members in _by_dtype(_members(graph, c10d.all_reduce.default, plan=True)):
        reads = _dependency_check(graph, members)
        order = {n: i for i, n in enumerate(graph.nodes)}

        def blocked(m: _Member, others: list[_Member]) -> bool:
            return reads(m, others) or any(order[u] < order[m.issue] for o in others
                                           for u in o.wait.users)

        for bucket in _buckets(members, cap, first_cap, blocked):
            if len(bucket) > 1:
                plan_meta = {k: bucket[-1].issue.meta[k] for k in
                             (meta.MODEL_PARALLEL, meta.PLAN_PLACEMENT) if k in bucket[-1].issue.meta}
                _merge_all_reduce(graph, bucket, index)
                for n in graph.nodes:  # the bucket's all_reduce and wait
                    if n.meta.get(meta.BUCKET) == index and meta.ROLE in n.meta:
                        n.meta.update(plan_meta)
                        if n.target is c10d.wait_tensor.default:
                            n.meta.pop(meta.PLAN_PLACEMENT, None)  # on the issue node only
                index += 1
    return index


def _flat(sources: list, shapes: list, dim: int):
    """The sources reshaped to ``shapes`` and concatenated along ``dim``."""
    return aten.cat.default([aten.reshape.default(x, shape) for x, shape in zip(sources, shapes)], dim)


def _pieces(flat, dim: int, sizes: list[int], shapes: list, reshape) -> list:
    """``flat`` cut along ``dim`` into ``sizes``, each shaped to its ``shapes`` entry."""
    out, offset = [], 0
    for n, shape in zip(sizes, shapes):
        out.append(_shaped(aten.slice.Tensor(flat, dim, offset, offset + n), shape, reshape))
        offset += n
    return out


def _shaped(piece, shape: list, reshape):
    """``reshape(piece, shape)``, or ``piece`` when it has that shape already (a bias's, a norm
    weight's): the lowering drops such an identity view anyway (passes/identity_views.py), and
    each op inserted here costs a meta kernel call per parameter. (A member's flattening
    ``reshape`` stays: the eager lowering produces the gradient into the bucket through it,
    passes/inplace.py.)"""
    return piece if list(piece.shape) == list(shape) else reshape(piece, shape)


def _all_reduce_bucket(sources, world, group, sizes, shapes):
    flat = _flat(sources, [[-1]] * len(sources), 0)
    if world != 1:
        flat = aten.div.Tensor(flat, world)
    done = c10d.wait_tensor.default(c10d.all_reduce.default(flat, "sum", group))
    return _pieces(done, 0, sizes, shapes, aten.view.default)


def _reduce_scatter_bucket(sources, divisor, world, group, sizes, shapes):
    flat = aten.view.default(_flat(sources, [[world, -1]] * len(sources), 1), [-1])
    if divisor != 1:
        flat = aten.div.Tensor(flat, divisor)
    done = c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(flat, "sum", world, group))
    return done, _pieces(done, 0, sizes, shapes, aten.view.default)


def _all_gather_bucket(sources, world, group, sizes, shapes):
    flat = _flat(sources, [[-1]] * len(sources), 0)
    done = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(flat, world, group))
    rows = aten.view.default(done, [world, sum(sizes)])
    return _pieces(rows, 1, sizes, shapes, aten.reshape.default)


def _insert_bucket(graph, build, bucket: list[_Member], args: tuple, index: int, before: fx.Node,
                   anchor: fx.Node, kind: str):
    """Trace ``build(sources, *args)`` before ``before`` in ``anchor``'s region, its collective
    marked as the bucket's (COLLECTIVE, BUCKET = index)."""
    params = [p for m in bucket for p in node_params(m.issue)]
    return insert_traced(graph, build, ([m.source for m in bucket], *args), before=before,
                         region=anchor.meta.get(meta.REGION),
                         collective=dict(kind=kind, params=params), **{meta.BUCKET: index})


def node_params(node: fx.Node) -> list[str]:
    return list((node.meta.get(meta.COLLECTIVE) or {}).get("params", []))


def _replace_members(graph, bucket: list[_Member], new: list[fx.Node], keys=None) -> None:
    """Each member's wait replaced by its piece, which keeps the wait's region and its meta
    ``keys`` (None: all but its value, role and collective); the member's collective and
    division erased."""
    swaps: dict[fx.Node, dict[fx.Node, fx.Node]] = {}
    for m, piece in zip(bucket, new):
        piece.meta[meta.REGION] = m.wait.meta.get(meta.REGION)
        if keys is None:
            _inherit_meta(piece, m.wait)
        piece.meta.update({k: m.wait.meta[k] for k in keys or () if k in m.wait.meta})
        for user in m.wait.users:
            swaps.setdefault(user, {})[m.wait] = piece
    replace_inputs(swaps)
    for m in bucket:
        graph.erase_node(m.wait)
        graph.erase_node(m.issue)
        if m.scale is not None and not m.scale.users:
            graph.erase_node(m.scale)


def _merge_all_reduce(graph: fx.Graph, bucket: list[_Member], index: int) -> None:
    last = bucket[-1].issue
    world = bucket[0].scale.args[1] if bucket[0].scale is not None else 1
    pieces = _insert_bucket(graph, _all_reduce_bucket, bucket, (world, last.args[2], *_layout(bucket, 1)),
                            index, last.next, last, "all_reduce")
    _replace_members(graph, bucket, pieces, keys=(meta.PLACEMENT,))


def _layout(bucket: list[_Member], world: int) -> tuple[list[int], list]:
    """Each member's elements in the bucket's result (its source's, over ``world``) and its
    wait's shape."""
    return ([_numel(m.source) // world for m in bucket],
            [list(m.wait.meta["val"].shape) for m in bucket])


def _merge_reduce_scatter(graph: fx.Graph, bucket: list[_Member], index: int) -> None:
    last = bucket[-1].issue
    _, _, world, group = last.args
    divisor = bucket[0].scale.args[1] if bucket[0].scale is not None else 1
    done, pieces = _insert_bucket(graph, _reduce_scatter_bucket, bucket,
                                  (divisor, world, group, *_layout(bucket, world)), index,
                                  last.next, last, "reduce_scatter")
    _replace_members(graph, bucket, pieces)
    _merge_chained_all_reduces(graph, done, pieces, index)


def _inherit_meta(node: fx.Node, wait: fx.Node) -> None:
    """A member's wait's meta (but its value, role and collective) on what replaces it."""
    for key, value in wait.meta.items():
        if key not in node.meta and key not in ("val", meta.ROLE, meta.COLLECTIVE):
            node.meta[key] = value


def _chained_all_reduce(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(issue, wait) of the per-parameter all_reduce that is ``node``'s only user, if any."""
    users = list(node.users)
    if len(users) != 1 or users[0].target is not c10d.all_reduce.default or len(users[0].users) != 1:
        return None
    wait = next(iter(users[0].users))
    return (users[0], wait) if wait.target is c10d.wait_tensor.default else None


def _merge_chained_all_reduces(graph: fx.Graph, flat: fx.Node, pieces: list[fx.Node],
                               index: int) -> None:
    """When every piece of a reduced bucket ``flat`` is next all-reduced over another mesh dim
    (hybrid sharding: the gradient shards, over the replicate dim), all-reduce ``flat`` itself
    once instead: the bucket on the next dim is the same bucket, with no copy into a new one."""
    chained = [_chained_all_reduce(p) for p in pieces]
    if not chained or any(c is None for c in chained) or \
            len({issue.args[1:] for issue, _ in chained}) != 1:
        return
    done = insert_traced(
        graph, lambda x, *args: c10d.wait_tensor.default(c10d.all_reduce.default(x, *args)),
        (flat, *chained[0][0].args[1:]), before=flat.next, region=flat.meta.get(meta.REGION),
        collective=dict(kind="all_reduce", params=[p for issue, _ in chained for p in node_params(issue)]),
        **{meta.BUCKET: index})
    first = chained[0][0]  # a plan's all_reduce (context parallelism's) stays the plan's
    if meta.MODEL_PARALLEL in first.meta:
        done.meta[meta.MODEL_PARALLEL] = first.meta[meta.MODEL_PARALLEL]
        done.args[0].meta.update({k: first.meta[k] for k in (meta.MODEL_PARALLEL, meta.PLAN_PLACEMENT)
                                  if k in first.meta})
    for piece, (issue, wait) in zip(pieces, chained):
        cut = piece if piece.target is aten.slice.Tensor else piece.args[0]  # (or a view of it)
        cut.replace_input_with(flat, done)  # its slice reads the all-reduced bucket
        for key, value in wait.meta.items():
            if key not in ("val", meta.ROLE, meta.COLLECTIVE):
                piece.meta[key] = value
        wait.replace_all_uses_with(piece)
        graph.erase_node(wait)
        graph.erase_node(issue)


def _merge_all_gather(graph: fx.Graph, bucket: list[_Member], index: int) -> None:
    first = bucket[0].issue
    _, world, group = first.args
    for m in bucket:  # a shard cast to the gather dtype (mixed precision) moves to the bucket
        if m.source.op == "call_function" and all(
                a.op == "placeholder" for a in m.source.all_input_nodes):
            first.prepend(m.source)
    pieces = _insert_bucket(graph, _all_gather_bucket, bucket, (world, group, *_layout(bucket, 1)),
                            index, first, first, "all_gather")
    _replace_members(graph, bucket, pieces)
