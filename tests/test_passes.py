"""Unit tests of the expansion and optimization passes on small traced graphs (one process).

The graphs are transformed, not run: each test counts and inspects the nodes a pass writes.
"""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.passes import meta
from spmd_compiler.passes.bucketing import bucket_collectives
from spmd_compiler.passes.collectives import COLLECTIVE_OPS, c10d
from spmd_compiler.passes.expand import expand_fully_shard
from spmd_compiler.passes.fully_shard import shard_rows
from spmd_compiler.passes.identity_views import skip_identity_views
from spmd_compiler.passes.inplace import gather_into_preallocated, produce_into_buckets, reduce_in_place
from spmd_compiler.passes.memory_plan import out_variant
from spmd_compiler.passes.overlap import sink_waits
from spmd_compiler.passes.rank_check import finish_rank_check, place_rank_check
from spmd_compiler.passes.split_optimizer import split_optimizer_by_bucket
from spmd_compiler.passes.expand import expand_replicate
from spmd_compiler.trace.record import trace_step
from tests.models import BatchNormMLP, SimpleMLP, train_step

WORLD = 3

def _traced(model=None, opt_cls=torch.optim.SGD, clip=False, **opt_kwargs):
    torch.manual_seed(0)
    model = model or SimpleMLP()
    opt = opt_cls(model.parameters(), lr=0.1, **opt_kwargs)

    def step(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        loss = (model(x) - y).sum()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        return loss

    batch = (torch.randn(16, 50), torch.randn(16, 8))
    return trace_step(step if clip else train_step, (model, opt, batch), {})

def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]

def _order(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}

def test_replicate_averages_every_gradient_before_the_optimizer_reads_it():
    tr = _traced()
    grads = {n.meta[meta.PARAM_FQN]: n for n in tr.gm.graph.nodes if n.meta.get(meta.ROLE) == meta.Role.GRAD}
    gm = expand_replicate(tr.gm, group_name="g", world_size=WORLD)
    reduces = _calls(gm, c10d.all_reduce.default)
    assert len(reduces) == len(grads) == 4
    for r in reduces:
        scaled = r.args[0]
        assert scaled.target is torch.ops.aten.div.Tensor and scaled.args[1] == WORLD
        assert scaled.args[0] is grads[r.meta[meta.COLLECTIVE]["params"][0]]
        assert r.args[1:] == ("sum", "g")
    for fqn, g in grads.items():  # the local gradient feeds only the division now
        assert [u.target for u in g.users] == [torch.ops.aten.div.Tensor], fqn
    gm.graph.lint()

def test_replicate_broadcasts_every_buffer_from_rank0_first_in_one_collective():
    model = BatchNormMLP()
    # read-only in the step, but a forward outside it may have changed it on one rank alone
    model.register_buffer("table", torch.arange(4.0))
    model.forward = lambda x, f=model.forward: f(x) + model.table.sum()
    tr = _traced(model)
    gm = expand_replicate(tr.gm, group_name="g", world_size=2)
    (cast,) = _calls(gm, c10d.broadcast.default)
    assert cast.args[1:] == (0, "g")
    assert sorted(cast.meta[meta.COLLECTIVE]["params"]) == [
        "bn.num_batches_tracked", "bn.running_mean", "bn.running_var", "table"]
    # every dtype in one uint8 tensor
    assert cast.meta[meta.COLLECTIVE]["bytes"] == 32 * 4 * 2 + 8 + 4 * 4
    def from_cast(node):  # through the unpacking views and the wait to the broadcast
        while node is not cast and node.op == "call_function":
            node = node.args[0]
        return node is cast

    written = {n.args[0].meta[meta.PARAM_FQN] for n in _calls(gm, torch.ops.aten.copy_.default)
               if n.args[0].meta.get(meta.ROLE) == meta.Role.BUFFER and from_cast(n.args[1])}
    assert written == set(cast.meta[meta.COLLECTIVE]["params"])
    first_compute = next(n for n in gm.graph.nodes if n.op != "placeholder"
                         and n.meta.get(meta.ROLE) != meta.Role.COLLECTIVE
                         and n.target not in (torch.ops.aten.copy_.default, torch.ops.aten.reshape.default,
                                              torch.ops.aten.view.dtype, torch.ops.aten.cat.default,
                                              torch.ops.aten.slice.Tensor, torch.ops.aten.view.default))
    order = _order(gm)
    assert order[cast] < order[first_compute]
    gm.graph.lint()

@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_gathers_and_reduce_scatters(reshard):
    tr = _traced()
    gm = expand_fully_shard(tr.gm, group_name="g", world_size=WORLD, reshard_after_forward=reshard)
    gathers = _calls(gm, c10d.all_gather_into_tensor.default)
    scatters = _calls(gm, c10d.reduce_scatter_tensor.default)
    assert len(scatters) == 4 and not _calls(gm, c10d.all_reduce.default)
    # net2.weight is needed again in the backward (input gradient of net2); net1's is not.
    assert len(gathers) == (5 if reshard else 4)
    regions = sorted(g.meta[meta.REGION].value for g in gathers)
    assert regions.count("backward") == (1 if reshard else 0)
    for node in gm.graph.nodes:  # placeholders became padded dim-0 shards
        if node.meta.get(meta.ROLE) == meta.Role.PARAM:
            full = {"net1.weight": (32, 50), "net1.bias": (32,), "net2.weight": (8, 32), "net2.bias": (8,)}[
                node.meta[meta.PARAM_FQN]]
            assert tuple(node.meta["val"].shape) == (shard_rows(full[0], WORLD),) + full[1:]
    # 8 rows over 3 ranks pad to 9: the gathered net2.bias is narrowed back to 8 rows.
    narrowed = [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor and n.args[3] == 8]
    assert narrowed
    gm.graph.lint()

def test_fully_shard_completes_gradient_norm_over_shards():
    tr = _traced(clip=True)
    gm = expand_fully_shard(tr.gm, group_name="g", world_size=WORLD)
    reduces = _calls(gm, c10d.all_reduce.default)
    params = len(list(tr.gm.graph.find_nodes(op="placeholder")))
    # one all_reduce: the squared per-shard norms of every gradient stacked (one number per
    # parameter), never a full gradient
    assert len(reduces) == 1, reduces
    (r,) = reduces
    assert r.args[1] == "sum"
    assert r.args[0].target is torch.ops.aten.stack.default, r.args[0].target
    parts = r.args[0].args[0]
    assert 1 < len(parts) < params and r.args[0].meta["val"].numel() == len(parts)
    assert all(p.target is torch.ops.aten.pow.Tensor_Scalar and p.args[1] == 2.0 for p in parts)

def test_bucketing_merges_gradients_in_production_order_with_a_small_first_bucket():
    tr = _traced(opt_cls=torch.optim.Adam)
    gm = expand_replicate(tr.gm, group_name="g", world_size=WORLD)
    produced = [n.meta[meta.COLLECTIVE]["params"][0] for n in _calls(gm, c10d.all_reduce.default)]
    # net2's grads (1056 bytes) fill a tiny first bucket, which closes once it holds its cap
    # (DDP's rule); net1's (6.4 KiB) go to the next.
    gm = bucket_collectives(gm, bucket_cap_mb=1.0, first_bucket_cap_mb=1056 / 2**20)
    reduces = _calls(gm, c10d.all_reduce.default)
    assert [r.meta[meta.COLLECTIVE]["params"] for r in reduces] == [produced[:2], produced[2:]]
    assert [r.args[0].meta["val"].numel() for r in reduces] == [8 + 256, 32 + 1600]
    assert [r.meta[meta.BUCKET] for r in reduces] == [0, 1]
    gm.graph.lint()

def test_bucketing_fully_shard_packs_shards_per_rank():
    tr = _traced()
    gm = expand_fully_shard(tr.gm, group_name="g", world_size=WORLD)
    gm = bucket_collectives(gm)
    scatters = _calls(gm, c10d.reduce_scatter_tensor.default)
    gathers = _calls(gm, c10d.all_gather_into_tensor.default)
    assert len(scatters) == 1 and len(gathers) == 2  # forward bucket, backward re-gather
    rows = {"net1.weight": 11 * 50, "net1.bias": 11, "net2.weight": 3 * 32, "net2.bias": 3}
    assert scatters[0].args[0].meta["val"].numel() == WORLD * sum(rows.values())
    assert gathers[0].args[0].meta["val"].numel() == sum(rows.values())

@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_bucketing_leaves_large_tensors_their_own_collective(style):
    """net1.weight (6.4 KB) is at least own_collective_mb, and the caps put it in a bucket of its
    own anyway: its collectives are not merged (no copy into a bucket); the three small tensors
    still share one bucket per collective kind."""
    tr = _traced()
    if style == "replicate":
        gm = expand_replicate(tr.gm, group_name="g", world_size=WORLD)
        caps = dict(first_bucket_cap_mb=1184 / 2**20)  # net2's grads and net1.bias fill it
    else:
        gm = expand_fully_shard(tr.gm, group_name="g", world_size=WORLD)
        caps = dict(gather_cap_mb=6400 / 2**20, scatter_cap_mb=6400 / 2**20)
    gm = bucket_collectives(gm, own_collective_mb=4000 / 2**20, **caps)
    kinds = ([c10d.all_reduce.default] if style == "replicate"
             else [c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default])
    for kind in kinds:
        params = [n.meta[meta.COLLECTIVE]["params"] for n in _calls(gm, kind)]
        alone = [p for p in params if p == ["net1.weight"]]
        merged = [p for p in params if p != ["net1.weight"]]
        assert alone and all("net1.weight" not in p for p in merged)
        assert sorted(merged[0]) == ["net1.bias", "net2.bias", "net2.weight"]  # (forward) bucket
        for n in _calls(gm, kind):  # the large tensor's collective reads no bucket ``cat``
            if n.meta[meta.COLLECTIVE]["params"] == ["net1.weight"]:
                assert meta.BUCKET not in n.meta
                assert torch.ops.aten.cat.default not in {a.target for a in n.all_input_nodes}
    gm.graph.lint()


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_bucketing_keeps_a_large_tensor_apart_only_when_that_adds_no_collective(style):
    """Under the default caps every tensor fits one bucket: net1.weight, though at least
    own_collective_mb, joins it (one collective per kind and region, as DDP's reducer)."""
    tr = _traced()
    expand = expand_replicate if style == "replicate" else expand_fully_shard
    gm = bucket_collectives(expand(tr.gm, group_name="g", world_size=WORLD),
                            own_collective_mb=4000 / 2**20)
    kinds = ([c10d.all_reduce.default] if style == "replicate"
             else [c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default])
    for kind in kinds:
        per_region = {}
        for n in _calls(gm, kind):
            per_region.setdefault(n.meta.get(meta.REGION), []).append(n)
        assert all(len(nodes) == 1 for nodes in per_region.values()), per_region
        assert all(meta.BUCKET in n.meta for nodes in per_region.values() for n in nodes)
    gm.graph.lint()


def test_sink_waits_moves_each_wait_to_its_first_user():
    tr = _traced()
    gm = expand_replicate(tr.gm, group_name="g", world_size=WORLD)
    gm = sink_waits(gm)
    order = _order(gm)
    waits = _calls(gm, c10d.wait_tensor.default)
    assert waits
    for w in waits:
        first = min(w.users, key=order.__getitem__)
        assert w.next is first
        assert order[w.args[0]] < order[w]
    issues = [w.args[0] for w in waits]
    # Issued in the backward, waited in the optimizer: the rest of the backward overlaps.
    assert any(i.meta[meta.REGION] == meta.Region.BACKWARD and w.next.meta[meta.REGION] == meta.Region.OPTIMIZER
               for i, w in zip(issues, waits))
    gm.graph.lint()


def test_reduce_in_place_reuses_bucket_buffers_only():
    tr = _traced()
    gm = bucket_collectives(expand_replicate(tr.gm, group_name="g", world_size=WORLD))
    (reduce,) = _calls(gm, c10d.all_reduce.default)
    divs_before = len(_calls(gm, torch.ops.aten.div.Tensor))
    gm = reduce_in_place(gm)
    assert reduce.target is c10d.all_reduce_.default
    scaled = reduce.args[0]  # the bucket's cat, divided in place, reduced in place
    assert scaled.target is torch.ops.aten.div_.Tensor and scaled.args[0].target is torch.ops.aten.cat.default
    assert not _calls(gm, c10d.all_reduce.default)
    # Other divisions read tensors that something else reads too: they stay out of place.
    assert len(_calls(gm, torch.ops.aten.div.Tensor)) == divs_before - 1
    gm.graph.lint()
    # fully_shard: the bucket's division works in place through the flattening view of its cat
    gm = reduce_in_place(bucket_collectives(expand_fully_shard(_traced().gm, group_name="g", world_size=WORLD)))
    (scatter,) = _calls(gm, c10d.reduce_scatter_tensor.default)
    assert scatter.args[0].target is torch.ops.aten.div_.Tensor


def _rank_check():
    """Stands in for the per-call agreement in the graphs below."""


@pytest.mark.parametrize("model", ["mlp", "batchnorm"])
def test_rank_check_runs_before_any_collective_or_state_update(model):
    tr = _traced(BatchNormMLP() if model == "batchnorm" else None, momentum=0.9)
    gm = expand_replicate(tr.gm, group_name="g", world_size=WORLD)
    gm = place_rank_check(reduce_in_place(bucket_collectives(gm)), _rank_check)  # as lowered
    (check,) = _calls(gm, _rank_check)
    nodes = list(gm.graph.nodes)
    before, after = nodes[:nodes.index(check)], nodes[nodes.index(check) + 1:]
    assert not [n for n in before if n.target in COLLECTIVE_OPS or n.target is c10d.all_reduce_.default]
    assert not [n for n in before if n.meta.get(meta.REGION) == meta.Region.OPTIMIZER]
    mutating = [n for n in before if n.op == "call_function" and n.target._schema.is_mutable
                and n.args[0].op == "placeholder"]  # live state (temporaries may be reused)
    assert after[0].target in COLLECTIVE_OPS or after[0].target is c10d.all_reduce_.default
    assert not mutating
    if model == "mlp":  # the whole forward and backward overlap the check's message
        assert [n for n in before if n.meta.get(meta.ROLE) == meta.Role.GRAD]
    else:  # buffers are broadcast first: the check goes before that (after their packing)
        packing = {torch.ops.aten.reshape.default, torch.ops.aten.view.dtype, torch.ops.aten.cat.default}
        assert not [n for n in before if n.op == "call_function" and n.target not in packing]
    gm.graph.lint()


class _Carrier:
    """Stands in for agreement.RankCheck: the agreement's header rides in an all_reduce."""

    group, length = "g", 18

    @staticmethod
    def header(agreement, scale, dtype):
        return torch.zeros(18, dtype=dtype)

    @staticmethod
    def check(agreement, reduced, rows):
        pass


@pytest.mark.parametrize("model", ["mlp", "batchnorm"])
def test_rank_check_rides_in_the_first_gradient_bucket(model):
    """The header joins the bucket's cat; the check follows the bucket's wait, before any other
    collective or state update. BatchNorm's buffers are broadcast first: outside a process
    group (no rank to tell whose bytes are sent) no carrier there."""
    tr = _traced(BatchNormMLP() if model == "batchnorm" else None, momentum=0.9)
    gm = bucket_collectives(expand_replicate(tr.gm, group_name="g", world_size=WORLD))
    sizes = [int(n.meta["val"].numel()) for n in _calls(gm, c10d.all_reduce.default)]
    gm = finish_rank_check(reduce_in_place(place_rank_check(gm, _rank_check, _Carrier)))
    if model == "batchnorm":
        assert _calls(gm, _rank_check) and not _calls(gm, _Carrier.check)
        assert "agreement carrier" not in gm.meta
        return
    assert not _calls(gm, _rank_check)
    (header,) = _calls(gm, _Carrier.header)
    (check,) = _calls(gm, _Carrier.check)
    (cat,) = header.users
    assert cat.target is torch.ops.aten.cat.default and cat.args[0][-1] is header
    (bucket,) = _calls(gm, c10d.all_reduce_.default)
    assert bucket.args[0].args[0] is cat and header.args[1] == WORLD  # divided in place by it
    assert check.args[1].target is c10d.wait_tensor.default and check.prev is check.args[1]
    assert gm.meta["agreement carrier"] == (("all_reduce", sizes[0] + 18, "torch.float32", -1, True),)
    nodes = list(gm.graph.nodes)
    before = nodes[:nodes.index(check)]
    assert not [n for n in before if n.meta.get(meta.REGION) == meta.Region.OPTIMIZER]
    gm.graph.lint()


@pytest.mark.parametrize("model", ["mlp", "batchnorm"])
def test_gradients_are_produced_into_their_bucket(model):
    """After the eager lowering's in-place reduction, no bucket is a ``cat``: the bucket is an
    ``empty`` buffer made before its first gradient, and every Linear gradient's op (``mm``,
    ``sum``) writes into its slice of it through ``out=``, at the offset the cat had given it;
    BatchNorm's (one multi-output op, no out= variant) are copied into theirs."""
    tr = _traced(BatchNormMLP() if model == "batchnorm" else None, momentum=0.9)
    gm = reduce_in_place(bucket_collectives(expand_replicate(tr.gm, group_name="g", world_size=WORLD)))
    buckets = [n.args[0].args[0] for n in _calls(gm, c10d.all_reduce_.default)
               if n.args[0].target is torch.ops.aten.div_.Tensor]
    layouts = [[int(m.meta["val"].numel()) for m in cat.args[0]] for cat in buckets]
    gm = produce_into_buckets(gm, out_variant)
    gm.graph.lint()
    assert not [c for c in buckets if c in gm.graph.nodes]  # every gradient cat is gone
    reduced = [n.args[0].args[0] for n in _calls(gm, c10d.all_reduce_.default)
               if n.args[0].target is torch.ops.aten.div_.Tensor]
    for buf, sizes in zip(reduced, layouts):
        assert buf.target is torch.ops.aten.empty.memory_format
        slices = [u for u in buf.users if u.target is torch.ops.aten.slice.Tensor]
        assert sorted((s.args[2], s.args[3]) for s in slices) == \
            [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        writers = [w for s in slices for v in s.users for w in v.users if "out" in w.kwargs]
        copies = [u for s in slices for u in s.users if u.target is torch.ops.aten.copy_.default]
        assert len(writers) == 4 and len(copies) == len(sizes) - 4, (writers, copies)
        nodes = list(gm.graph.nodes)
        assert all(nodes.index(buf) < nodes.index(w) for w in writers)


def test_bucketing_never_merges_a_collective_with_one_it_depends_on():
    """b's input reads a's averaged result, so a and b must stay separate collectives."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)

    def averaged(t, fqn):
        scaled = graph.call_function(torch.ops.aten.div.Tensor, (t, 2))
        scaled.meta["val"] = torch.empty(4)
        issue = graph.call_function(c10d.all_reduce.default, (scaled, "sum", "g"))
        issue.meta.update({"val": torch.empty(4), meta.COLLECTIVE: dict(kind="all_reduce", bytes=16, params=[fqn])})
        wait = graph.call_function(c10d.wait_tensor.default, (issue,))
        wait.meta["val"] = torch.empty(4)
        return wait

    a = averaged(x, "a")
    shifted = graph.call_function(torch.ops.aten.add.Tensor, (a, 1))
    shifted.meta["val"] = torch.empty(4)
    b = averaged(shifted, "b")
    c = averaged(x, "c")
    graph.output((b, c))
    gm = bucket_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))
    groups = [r.meta[meta.COLLECTIVE]["params"] for r in _calls(gm, c10d.all_reduce.default)]
    assert groups == [["a"], ["b", "c"]]
    gm.graph.lint()


def test_split_optimizer_updates_the_first_bucket_first():
    tr = _traced(opt_cls=torch.optim.Adam)
    gm = expand_replicate(tr.gm, group_name="g", world_size=WORLD)
    # net2's gradients (produced first) fill bucket 0, net1's bucket 1.
    gm = bucket_collectives(gm, bucket_cap_mb=1.0, first_bucket_cap_mb=1056 / 2**20)
    reduces = _calls(gm, c10d.all_reduce.default)
    assert [r.meta[meta.COLLECTIVE]["params"] for r in reduces] == [
        ["net2.bias", "net2.weight"], ["net1.bias", "net1.weight"]]

    def first_reader(gm, fqn):  # the optimizer's in-place update of the parameter
        (update,) = [u for n in gm.graph.nodes if n.op == "placeholder"
                     and n.meta.get(meta.ROLE) == meta.Role.PARAM and n.meta[meta.PARAM_FQN] == fqn
                     for u in n.users if u.target._schema.is_mutable and u.args[0] is n]
        return update

    assert _order(gm)[first_reader(gm, "net1.weight")] < _order(gm)[first_reader(gm, "net2.weight")]
    code_before = gm.code
    gm = sink_waits(split_optimizer_by_bucket(gm))
    order = _order(gm)
    assert order[first_reader(gm, "net2.weight")] < order[first_reader(gm, "net1.weight")]
    # bucket 1 is waited for only after bucket 0's parameters have been updated
    wait1 = next(iter(reduces[1].users))
    assert max(order[first_reader(gm, f)] for f in ("net2.weight", "net2.bias")) < order[wait1]
    assert gm.code != code_before
    gm.graph.lint()


@pytest.mark.parametrize("kwargs", [{"fused": True}, {"foreach": True}])
def test_split_optimizer_splits_fused_and_foreach_updates_per_bucket(kwargs):
    """A fused (or foreach) update over every parameter becomes one update per gradient bucket,
    the first-issued bucket's first, each after its own bucket's wait and before the next
    bucket's; the split graph computes exactly what the unsplit one does."""
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, **kwargs)
    batch = (torch.randn(16, 50), torch.randn(16, 8))
    train_step(model, opt, batch)  # state exists: the steady-state graph
    tr = trace_step(train_step, (model, opt, batch), {})
    gm = expand_replicate(tr.gm, group_name="g", world_size=1)
    gm = bucket_collectives(gm, bucket_cap_mb=1.0, first_bucket_cap_mb=1056 / 2**20)
    reduces = _calls(gm, c10d.all_reduce.default)
    assert len(reduces) == 2

    def list_updates(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"
                and hasattr(n.target, "_schema")
                and n.target._schema.name.startswith(("aten::_fused_adam_", "aten::_foreach_addcdiv_"))]

    assert len(list_updates(gm)) == 1
    flat = [p.detach().clone() for p in model.parameters()]
    flat += [v.clone() for p in model.parameters() for v in opt.state[p].values()]
    flat += [torch.tensor(0.1, dtype=torch.float64) if kwargs.get("fused") else 0.1, *batch]
    unsplit = [t.clone() if isinstance(t, torch.Tensor) else t for t in flat]
    _run_with_identity_collectives(gm, unsplit)

    gm = sink_waits(split_optimizer_by_bucket(gm))
    updates = list_updates(gm)
    assert len(updates) == 2
    order = _order(gm)
    waits = [next(iter(r.users)) for r in reduces]
    assert order[waits[0]] < order[updates[0]] < order[waits[1]] < order[updates[1]]
    params = [[p.meta[meta.PARAM_FQN] for p in u.args[0]] for u in updates]
    assert sorted(params[0]) == ["net2.bias", "net2.weight"]
    assert sorted(params[1]) == ["net1.bias", "net1.weight"]
    gm.graph.lint()
    split = [t.clone() if isinstance(t, torch.Tensor) else t for t in flat]
    _run_with_identity_collectives(gm, split)
    for a, b in zip(unsplit, split):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


def _run_with_identity_collectives(gm, flat):
    """Run ``gm`` in one process, each all_reduce replaced by its input (world size 1)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.target is c10d.wait_tensor.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.target is c10d.all_reduce.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)(*flat)


def test_gather_into_preallocated_uses_the_out_form_on_an_empty_of_the_gathered_shape():
    tr = _traced()
    gm = bucket_collectives(expand_fully_shard(tr.gm, group_name="g", world_size=WORLD))
    shapes = [list(n.meta["val"].shape) for n in _calls(gm, c10d.all_gather_into_tensor.default)]
    assert shapes
    gm = gather_into_preallocated(gm)
    assert not _calls(gm, c10d.all_gather_into_tensor.default)
    outs = _calls(gm, c10d.all_gather_into_tensor_out.default)
    assert [n.kwargs["out"].args[0] for n in outs] == shapes
    for n in outs:  # the same input, group size and group; the wait reads the filled buffer
        assert n.kwargs["out"].target is torch.ops.aten.empty.memory_format
        assert n.args[1:] == (WORLD, "g")
        assert [u.target for u in n.users] == [c10d.wait_tensor.default]
    gm.graph.lint()


def test_identity_views_dropped():
    """detach, t(t(w)) and a view to its own shape are gone from the lowered graph (the parity
    tests run graphs lowered so), and a view that is an output stays."""
    tr = _traced(momentum=0.9)
    gm = reduce_in_place(bucket_collectives(expand_replicate(tr.gm, group_name="g", world_size=1)))
    aten = torch.ops.aten
    before = len(gm.graph.nodes)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    slim = skip_identity_views(torch.fx.GraphModule(gm, graph))
    assert not _calls(slim, aten.detach.default)
    assert len(slim.graph.nodes) < before
    for node in _calls(slim, aten.t.default):
        assert node.args[0].target is not aten.t.default
    for node in _calls(slim, aten.view.default) + _calls(slim, aten.reshape.default):
        assert list(node.args[1]) != list(node.args[0].meta["val"].shape)
    # an output that is a detach keeps it
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3)
    d = g.call_function(aten.detach.default, (x,))
    g.output((d,))
    kept = skip_identity_views(torch.fx.GraphModule(torch.nn.Module(), g))
    assert _calls(kept, aten.detach.default)


def _described(gm) -> list:
    """Every node: name, op, target, arguments by name, its value's metadata and its meta keys."""
    def val(n):
        v = n.meta.get("val")
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype) if isinstance(v, torch.Tensor) else v
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), str(val(n)), sorted(map(str, n.meta)))
            for n in gm.graph.nodes]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_the_passes_insert_the_graph_make_fx_would_record(monkeypatch, mode):
    """The expansion and bucketing insert the same graph, node for node (names, arguments,
    values' metadata, meta keys), whether their functions are recorded by the operator
    recorder with collective values made from the cached recording, or each by make_fx with
    every op run again (clipping adds the fully_shard norm's completion)."""
    from spmd_compiler.passes import subgraph

    def compiled():
        tr = _traced(opt_cls=torch.optim.AdamW, clip=True)
        gm = (expand_replicate if mode == "replicate" else expand_fully_shard)(
            tr.gm, group_name="g", world_size=WORLD)
        return _described(bucket_collectives(gm, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005))

    fast = compiled()
    monkeypatch.setattr(subgraph, "_recorded_by_ops", lambda *a: None)
    monkeypatch.setattr(subgraph, "_rerun", subgraph._run)
    assert compiled() == fast
