"""Unit tests of single passes on small hand-built graphs (one process, no tracing): cleanup,
grad_outputs, gloo_collectives, dedup_collectives, bucketing of a plan's collectives, schedule, memory_plan and recompute. Each graph is written node
by node with the meta the pass reads (REGION, ROLE, COLLECTIVE, SYNCED_GRAD, fake ``val``s)."""

from __future__ import annotations

import pytest
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd_compiler.passes import meta
from spmd_compiler.passes.bucketing import bucket_collectives
from spmd_compiler.passes.cleanup import eliminate_dead_code, remove_profiler_nodes
from spmd_compiler.passes.collectives import aten, c10d
from spmd_compiler.passes.dedup_collectives import deduplicate_collectives
from spmd_compiler.passes.gloo_collectives import all_reduce_scatters, broadcast_gathers, group_rank
from spmd_compiler.passes.grad_outputs import output_gradients
from spmd_compiler.passes.memory_plan import plan_static_memory
from spmd_compiler.passes.recompute import recompute_activations, saved_activations
from spmd_compiler.passes.schedule import schedule_for_memory

FWD, BWD, OPT = meta.Region.FORWARD, meta.Region.BACKWARD, meta.Region.OPTIMIZER


class _Builder:
    """A graph written node by node; every node gets a fake ``val`` (computed by its op on the
    inputs' fake values unless given) and a REGION."""

    def __init__(self):
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def input(self, name: str, *shape: int, role=meta.Role.INPUT, **extra) -> fx.Node:
        n = self.graph.placeholder(name)
        with self.mode:
            n.meta["val"] = torch.empty(shape)
        n.meta.update({meta.REGION: FWD, meta.ROLE: role, **extra})
        return n

    def call(self, target, *args, region=FWD, val=None, kwargs=None, **extra) -> fx.Node:
        n = self.graph.call_function(target, args, kwargs or {})
        if val is None:
            with self.mode:
                val = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args],
                             **(kwargs or {}))
        n.meta.update({"val": val, meta.REGION: region, **extra})
        return n

    def collective(self, target, *args, region, val, kind, params=(), **extra) -> tuple[fx.Node, fx.Node]:
        issue = self.call(target, *args, region=region, val=val, **{
            meta.ROLE: meta.Role.COLLECTIVE, meta.COLLECTIVE: dict(kind=kind, params=list(params))})
        wait = self.call(c10d.wait_tensor.default, issue, region=region, val=val,
                         **{meta.ROLE: meta.Role.COLLECTIVE, **extra})
        return issue, wait

    def done(self, *outputs) -> fx.GraphModule:
        self.graph.output(list(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ----------------------------------------------------------------------------------- cleanup


def test_remove_profiler_nodes_and_dead_code_keep_in_place_ops():
    b = _Builder()
    x = b.input("x", 4)
    enter = b.graph.call_function(torch.ops.profiler._record_function_enter_new.default, ("step", None))
    b.call(aten.add.Tensor, x, x)  # dead
    doubled = b.call(aten.mul.Tensor, x, 2)
    b.call(aten.copy_.default, x, doubled)  # in place: its result is unused, it stays
    b.graph.call_function(torch.ops.profiler._record_function_exit._RecordFunction, (enter,))
    gm = remove_profiler_nodes(b.done(x))
    assert _targets(gm) == [aten.mul.Tensor, aten.copy_.default]
    gm.graph.lint()


def test_eliminate_dead_code_keeps_collectives():
    b = _Builder()
    x = b.input("x", 4)
    b.collective(c10d.all_reduce.default, x, "sum", "g", region=BWD, val=x.meta["val"],
                 kind="all_reduce")  # its wait is unused: still communicates
    b.call(aten.neg.default, x)
    gm = eliminate_dead_code(b.done(x))
    assert c10d.all_reduce.default in _targets(gm)
    assert aten.neg.default not in _targets(gm)


# ------------------------------------------------------------------------------ grad_outputs


def test_output_gradients_appends_synced_gradients_in_graph_order():
    b = _Builder()
    x = b.input("x", 4)
    loss = b.call(aten.sum.default, x)
    g2 = b.call(aten.mul.Tensor, x, 2, region=BWD, **{meta.SYNCED_GRAD: "b.weight"})
    g1 = b.call(aten.mul.Tensor, x, 3, region=BWD, **{meta.SYNCED_GRAD: "a.weight"})
    gm = output_gradients(b.done(loss))
    (outputs,) = next(n for n in gm.graph.nodes if n.op == "output").args
    assert list(outputs) == [loss, g2, g1]
    assert gm.meta[meta.KEPT_GRADS] == ["b.weight", "a.weight"]


# --------------------------------------------------------------------------- gloo_collectives


@pytest.fixture
def one_rank_gloo():
    """A real one-rank gloo process group, named as the collectives name it."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _gather_graph(group: str) -> fx.GraphModule:
    b = _Builder()
    shard = b.input("shard", 3, 2)
    buf = b.call(aten.empty.memory_format, [3, 2], kwargs=dict(dtype=torch.float32, device="cpu"))
    issue = b.call(c10d.all_gather_into_tensor_out.default, shard, 1, group, kwargs=dict(out=buf),
                   val=buf.meta["val"], **{meta.ROLE: meta.Role.COLLECTIVE,
                                           meta.COLLECTIVE: dict(kind="all_gather", params=["w"])})
    wait = b.call(c10d.wait_tensor.default, issue, val=buf.meta["val"])
    return b.done(b.call(aten.mul.Tensor, wait, 2))


def test_broadcast_gathers_builds_the_gather_from_broadcasts(one_rank_gloo):
    gm = broadcast_gathers(_gather_graph(one_rank_gloo))
    targets = _targets(gm)
    assert c10d.all_gather_into_tensor_out.default not in targets
    assert targets.count(c10d.broadcast_.default) == 1 and aten.copy_.default in targets
    assert group_rank in targets  # this rank's rows found per call: the program holds no rank
    assert all(n.meta[meta.COLLECTIVE]["kind"] == "broadcast" for n in gm.graph.nodes
               if n.target is c10d.broadcast_.default)
    shard = torch.arange(6.0).reshape(3, 2)
    torch.testing.assert_close(gm(shard)[0], shard * 2)


def test_broadcast_gathers_leaves_graphs_outside_a_process_group():
    gm = broadcast_gathers(_gather_graph("no such group"))
    assert c10d.all_gather_into_tensor_out.default in _targets(gm)


def test_all_reduce_scatters_reduces_in_place_then_copies_own_rows(one_rank_gloo):
    b = _Builder()
    x = b.input("x", 4, 2)
    doubled = b.call(aten.mul.Tensor, x, 2)
    _, wait = b.collective(c10d.reduce_scatter_tensor.default, doubled, "sum", 1, one_rank_gloo,
                           region=BWD, val=doubled.meta["val"], kind="reduce_scatter")
    gm = all_reduce_scatters(b.done(wait), owned=lambda value, reader: value is doubled)
    targets = _targets(gm)
    assert c10d.reduce_scatter_tensor.default not in targets
    assert c10d.all_reduce_.default in targets and aten.empty.memory_format in targets
    assert group_rank in targets
    x = torch.arange(8.0).reshape(4, 2)
    torch.testing.assert_close(gm(x)[0], x * 2)


# ---------------------------------------------------------------------------------- schedule


def _gather_then_compute() -> fx.GraphModule:
    """A shard gathered first in traced order; two computes before the first use of the gather."""
    b = _Builder()
    shard = b.input("w", 2, 4, role=meta.Role.PARAM, **{meta.PARAM_FQN: "w"})
    x = b.input("x", 3, 4)
    with b.mode:
        full = torch.empty(4, 4)
    _, gathered = b.collective(c10d.all_gather_into_tensor.default, shard, 2, "g", region=FWD,
                               val=full, kind="all_gather", params=["w"])
    a = b.call(aten.relu.default, x)
    c = b.call(aten.neg.default, a)
    return b.done(b.call(aten.mm.default, c, gathered))


def _order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_schedule_issues_a_gather_just_before_its_use_without_prefetch():
    gm = schedule_for_memory(_gather_then_compute(), prefetch_cap_mb=0)
    assert _order(gm) == ["relu_default", "neg_default", "all_gather_into_tensor_default",
                          "wait_tensor_default", "mm_default"]


def test_schedule_prefetches_a_gather_within_the_cap():
    gm = schedule_for_memory(_gather_then_compute(), prefetch_cap_mb=1)
    assert _order(gm) == ["relu_default", "all_gather_into_tensor_default", "neg_default",
                          "wait_tensor_default", "mm_default"]


def test_schedule_without_overlap_waits_right_after_issuing():
    gm = schedule_for_memory(_gather_then_compute(), prefetch_cap_mb=1, overlap=False)
    order = _order(gm)
    assert order.index("wait_tensor_default") == order.index("all_gather_into_tensor_default") + 1


# ------------------------------------------------------------------------------- memory_plan


def _two_temporaries(n: int = 64) -> fx.GraphModule:
    b = _Builder()
    x = b.input("x", n, n)
    a = b.call(aten.mul.Tensor, x, 2)
    c = b.call(aten.add.Tensor, a, 1)
    return b.done(b.call(aten.sum.default, c))


def _workspaces(gm) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "workspace"]


def test_memory_plan_puts_temporaries_in_the_workspace_without_overlap():
    gm = plan_static_memory(_two_temporaries(), min_bytes=1)
    nbytes = 64 * 64 * 4
    (ws,) = _workspaces(gm)  # an input after the graph's own, not state the graph reads
    assert [n.op for n in gm.graph.nodes][:2] == ["placeholder", "placeholder"] and ws.prev.name == "x"
    assert gm.meta[meta.WORKSPACES] == [("cpu", 2 * nbytes)]  # both alive at the add: side by side
    assert tuple(ws.meta["val"].shape) == (2 * nbytes,) and ws.meta["val"].dtype == torch.uint8
    planned = [n for n in gm.graph.nodes if "out" in n.kwargs]
    assert [n.target for n in planned] == [aten.mul.out, aten.add.out]
    for n in gm.graph.nodes:  # every view of the workspace has the value its op computes
        val = n.meta.get("val")
        if n.op == "call_function" and isinstance(val, torch.Tensor):
            assert val.device.type == "cpu", n
    slices = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert sorted(s.args[2] for s in slices) == [0, nbytes]
    x = torch.randn(64, 64)
    buffer = torch.zeros(3 * nbytes, dtype=torch.uint8)  # the runtime's, possibly larger
    torch.testing.assert_close(gm(x, buffer)[0], (x * 2 + 1).sum())
    assert buffer[:2 * nbytes].any() and not buffer[2 * nbytes:].any()  # the ops wrote into it


def test_graph_nodes_read_no_module_state():
    """Links from a graph to the runtime are its inputs: no node of a lowered graph calls a
    Python function that reads a module global of spmd_compiler (the workspace, the per-call
    agreement); the only Python functions left in it are pure."""
    from spmd_compiler.runtime.agreement import await_agreement
    from spmd_compiler.passes.collectives import joined
    from spmd_compiler.build.pipeline import lower
    from spmd_compiler.runtime.program import WORKSPACES
    from spmd_compiler.runtime.signature import StepSignature

    nbytes = 512 * 512 * 4  # 1 MiB each: planned
    gm = lower(_two_temporaries(512), "eager", rank_check=(await_agreement, None))
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "workspace", "agreement"]
    assert gm.meta[meta.WORKSPACES] == [("cpu", 2 * nbytes)]
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {t for t in targets if not isinstance(t, torch._ops.OpOverload)} <= {await_agreement, joined}
    x = torch.randn(512, 512)
    sig = StepSignature((), (), (), (), (0,), workspaces=tuple(gm.meta[meta.WORKSPACES]))
    WORKSPACES.free()
    out = gm(x, *WORKSPACES.buffers(sig.workspaces), None)  # no agreement in flight
    torch.testing.assert_close(out[0], (x * 2 + 1).sum())
    assert WORKSPACES.nbytes() == 2 * nbytes


def test_memory_plan_keeps_a_buffer_alive_through_the_views_split_makes():
    """``split`` returns a list of views of its input: the buffer lives until their last reader,
    so the ``cat`` reading them writes elsewhere (an alias made torch refuse the ``cat.out``)."""
    n = 64
    b = _Builder()
    x = b.input("x", 2 * n, n)
    doubled = b.call(aten.mul.Tensor, x, 2)
    parts = b.call(aten.split.Tensor, doubled, n)
    first, second = b.call(operator.getitem, parts, 0), b.call(operator.getitem, parts, 1)
    joined = b.call(aten.cat.default, [first, second], 1,
                    val=torch.cat([first.meta["val"], second.meta["val"]], 1))
    gm = plan_static_memory(b.done(b.call(aten.sum.default, joined)), min_bytes=1)
    slices = sorted(s.args[2] for s in gm.graph.nodes if s.target is aten.slice.Tensor)
    assert slices == [0, 2 * n * n * 4], slices  # side by side, not both at offset 0
    x = torch.randn(2 * n, n)
    buffer = torch.zeros(4 * n * n * 4, dtype=torch.uint8)
    torch.testing.assert_close(gm(x, buffer)[0], (2 * x).sum())


def test_memory_plan_leaves_small_tensors_to_malloc():
    gm = plan_static_memory(_two_temporaries())  # 16 KiB each, under the default 1 MiB
    assert not _workspaces(gm) and not gm.meta.get(meta.WORKSPACES)


# ---------------------------------------------------------------------------------- subgraph


def test_insert_traced_records_a_function_with_its_ops_values_and_meta():
    from spmd_compiler.passes.subgraph import insert_traced

    b = _Builder()
    x = b.input("x", 6, 4)
    out = b.call(aten.sum.default, x)
    gm = b.done(out)

    def reduce(t, world, group):
        flat = aten.reshape.default(aten.div.Tensor(t, world), [-1])
        return c10d.wait_tensor.default(c10d.all_reduce.default(flat, "sum", group)), t

    done, same = insert_traced(gm.graph, reduce, (x, 2, "g"), before=out, region=BWD,
                               collective=dict(kind="all_reduce", params=["w"]), **{meta.BUCKET: 3})
    assert same is x  # an argument returned as it is stays that node
    new = [n for n in gm.graph.nodes if n.op == "call_function" and n is not out]
    # ops as called (reshape not decomposed), before ``before``, each with the value its op gives
    assert [n.target for n in new] == [aten.div.Tensor, aten.reshape.default,
                                       c10d.all_reduce.default, c10d.wait_tensor.default]
    assert new[-1] is done and done.next is out
    assert all(n.meta[meta.REGION] == BWD and tuple(n.meta["val"].shape) == ((6, 4) if i == 0 else (24,))
               for i, n in enumerate(new))
    issue = new[2]
    assert issue.meta[meta.COLLECTIVE] == dict(kind="all_reduce", bytes=96, params=["w"])
    assert issue.meta[meta.ROLE] == done.meta[meta.ROLE] == meta.Role.COLLECTIVE
    assert issue.meta[meta.BUCKET] == done.meta[meta.BUCKET] == 3
    assert meta.ROLE not in new[0].meta
    meta.check(gm, "insert_traced")
    gm.graph.lint()


# --------------------------------------------------------------------------------- recompute


def _saved_activation() -> fx.GraphModule:
    b = _Builder()
    x = b.input("x", 8, 8)
    h = b.call(aten.relu.default, x)
    y = b.call(aten.mul.Tensor, h, 2)
    loss = b.call(aten.sum.default, y)
    grad = b.call(aten.mul.Tensor, y, 3, region=BWD)  # the backward reads y
    return b.done(loss, b.call(aten.sum.default, grad, region=BWD))


def test_recompute_with_no_budget_recomputes_in_the_backward():
    gm = _saved_activation()
    assert list(saved_activations(gm)) == [n for n in gm.graph.nodes if n.name == "mul_tensor"]
    gm = recompute_activations(gm, budget=0.0)
    backward_reader = next(n for n in gm.graph.nodes if n.name == "mul_tensor_1")
    (copy,) = [a for a in backward_reader.all_input_nodes]
    assert copy.meta[meta.REGION] == BWD and copy.target is aten.mul.Tensor
    assert copy.args[0].meta[meta.REGION] == BWD and copy.args[0].target is aten.relu.default
    x = torch.randn(8, 8)
    expected = (x.relu() * 2 * 3).sum()
    torch.testing.assert_close(gm(x)[1], expected)


def test_recompute_with_full_budget_changes_nothing():
    gm = _saved_activation()
    before = _order(gm)
    assert _order(recompute_activations(gm, budget=1.0)) == before


def test_insert_traced_reuses_a_recording_with_fresh_values(monkeypatch):
    from torch.multiprocessing.reductions import StorageWeakRef

    from spmd_compiler.passes import subgraph

    recorded = []
    record = subgraph._record
    monkeypatch.setattr(subgraph, "_record", lambda *a, **k: recorded.append(1) or record(*a, **k))
    mode = FakeTensorMode()
    graph = fx.Graph()
    xs = []
    for name, rows in (("a", 6), ("b", 6), ("c", 3), ("d", 6)):
        xs.append(graph.placeholder(name))
        xs[-1].meta["val"] = mode.from_tensor(torch.randn(rows, 4))
    out = graph.output(tuple(xs))

    def reducer(world):
        def reduce(t):
            flat = aten.div.Tensor(aten.reshape.default(t, [-1]), world)
            return c10d.wait_tensor.default(c10d.all_reduce.default(flat, "sum", "g"))
        return reduce

    def insert(x, world):
        before = len(recorded)
        done = subgraph.insert_traced(graph, reducer(world), (x,), before=out, region=BWD,
                                      collective=dict(kind="all_reduce"))
        chain = [done]
        while chain[-1] is not x:
            chain.append(chain[-1].args[0])
        return chain[-2::-1], len(recorded) > before

    first, missed = insert(xs[0], 2)
    again, hit_missed = insert(xs[1], 2)  # same code, closure value and argument metadata
    assert missed and not hit_missed
    assert [(n.target, n.args[1:], n.kwargs) for n in again] == \
        [(n.target, n.args[1:], n.kwargs) for n in first]
    assert [n.meta[meta.ROLE] for n in again[2:]] == [meta.Role.COLLECTIVE] * 2
    assert again[2].meta[meta.COLLECTIVE] == dict(kind="all_reduce", bytes=96)
    for old, new in zip(first, again):  # a value of its own, as its op computed it, same mode
        assert new.meta["val"] is not old.meta["val"]
        assert new.meta["val"].fake_mode is mode
        assert (new.meta["val"].shape, new.meta["val"].stride(), new.meta["val"].dtype) == \
            (old.meta["val"].shape, old.meta["val"].stride(), old.meta["val"].dtype)
    issue, wait = again[2:]  # a collective's value is a new tensor, as its meta function gives
    storages = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in (issue.args[0], issue, wait)}
    assert len(storages) == 3
    vals = [n.meta["val"] for n in graph.nodes if "val" in n.meta]
    assert len({id(v) for v in vals}) == len(vals)
    assert insert(xs[2], 2)[1]  # another shape: recorded
    assert insert(xs[3], 3)[1]  # another closure value: recorded
    assert not insert(xs[3], 2)[1]
    graph.lint()


def _recording(graph: fx.Graph) -> list:
    """A recorded graph as text, placeholders by position (make_fx names them after the
    function's parameters)."""
    names = {n: f"input{i}" for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    rename = lambda a: fx.node.map_arg(a, lambda n: names.get(n, n.name))  # noqa: E731
    return [(n.op, n.target, rename(n.args), rename(n.kwargs), str(n.meta["val"].shape))
            if n.op == "call_function" else (n.op, rename(n.args)) for n in graph.nodes
            if n.op != "placeholder"]


def test_operator_recorder_records_the_passes_functions_as_make_fx_does():
    """The operator recorder (the fast path of insert_traced) gives make_fx's pre-dispatch
    graph of each function the passes insert: the same ops, normalized arguments (defaults
    left out, keyword-only as keywords, tuples as lists), names and values; a function it does
    not record as make_fx would is left to make_fx."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from spmd_compiler.passes import bucketing, subgraph
    from spmd_compiler.passes.collectives import to_dtype, waited
    from spmd_compiler.passes.fully_shard import pad_rows

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        odd = [torch.empty(5, 3), torch.empty(4, 3), torch.empty(7)]
        even = [torch.empty(6, 3), torch.empty(4, 3), torch.empty(8)]
    symbolic = mode.from_tensor(torch.empty(6, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    cases = [
        (lambda *s: bucketing._all_gather_bucket(list(s), 2, "g", [15, 12, 7],
                                                 [[10, 3], [8, 3], [14]]), odd),
        (lambda *s: bucketing._reduce_scatter_bucket(list(s), 2, 2, "g", [9, 6, 4],
                                                     [[3, 3], [2, 3], [4]]), even),
        (lambda *s: bucketing._all_reduce_bucket(list(s), 2, "g", [15, 12, 7],
                                                 [[5, 3], [4, 3], [7]]), odd),
        (lambda x: waited(c10d.all_gather_into_tensor.default,
                          to_dtype(pad_rows(x, 2), torch.bfloat16), 2, "g"), odd[:1]),
        (lambda x: (x, aten.slice.Tensor(x, 0, None, 4, 1), aten.sum.dim_IntList(x, (0,))), odd[:1]),
        (lambda x: aten.pow.Tensor_Scalar(aten.div.Tensor(x, 2), 1.0 / 3), odd[:1]),
    ]
    for fn, vals in cases:
        fast = subgraph._recorded_by_ops(fn, vals, mode)
        with mode:
            slow = make_fx(fn, pre_dispatch=True)(*vals).graph
        assert fast is not None and _recording(fast) == _recording(slow)
        assert [n.name for n in fast.nodes if n.op == "call_function"] == \
            [n.name for n in slow.nodes if n.op == "call_function"]
    unrecordable = [
        lambda x: aten.add_.Tensor(x, 1),  # in place
        lambda x: torch.cat([x, x]),  # a Python-level torch function
        lambda x: aten.reshape.default(x, [x.shape[0] * 3]),  # a symbolic size
    ]
    for fn in unrecordable:
        with mode:
            x = torch.empty(6, 3) if fn is not unrecordable[2] else symbolic
        assert subgraph._recorded_by_ops(fn, [x], mode) is None
        assert len(subgraph._record(fn, [x], mode).find_nodes(op="placeholder")) == 1


# ------------------------------------------------------------------------- dedup_collectives


def _twice_reduced(second_group: str = "g", second_op: str = "sum", write=None,
                   late_first_wait: bool = False) -> fx.GraphModule:
    """x all-reduced twice (the second on ``second_group`` with ``second_op``), each result read
    once; ``write(b, x)`` adds nodes between the two; ``late_first_wait``: the first wait after
    the second collective's."""
    b = _Builder()
    x = b.input("x", 4)
    val = x.meta["val"]
    issue1 = b.call(c10d.all_reduce.default, x, "sum", "g", val=val, **{meta.ROLE: meta.Role.COLLECTIVE})
    wait1 = None if late_first_wait else b.call(c10d.wait_tensor.default, issue1, val=val)
    if write is not None:
        write(b, x)
    _, wait2 = b.collective(c10d.all_reduce.default, x, second_op, second_group, region=FWD,
                            val=val, kind="all_reduce")
    if late_first_wait:
        wait1 = b.call(c10d.wait_tensor.default, issue1, val=val)
    return b.done(b.call(aten.mul.Tensor, wait1, 2), b.call(aten.add.Tensor, wait2, 1))


def _all_reduces(gm) -> int:
    return _targets(gm).count(c10d.all_reduce.default)


@pytest.mark.parametrize("late_first_wait", [False, True])
def test_dedup_reduces_a_value_once(one_rank_gloo, late_first_wait):
    def build():
        gm = _twice_reduced(late_first_wait=late_first_wait)
        for n in gm.graph.nodes:  # the real one-rank group
            if n.target is c10d.all_reduce.default:
                n.args = (n.args[0], n.args[1], one_rank_gloo)
        gm.recompile()
        return gm

    x = torch.arange(4.0)
    want = build()(x)
    gm = deduplicate_collectives(build())
    gm.graph.lint()
    assert _all_reduces(gm) == 1 and _targets(gm).count(c10d.wait_tensor.default) == 1
    assert "1 collective" in gm.meta[meta.NOTES]["dedup"]
    for got, expected in zip(gm(x), want):
        torch.testing.assert_close(got, expected)


def _write_x(b, x):
    b.call(aten.add_.Tensor, x, 1)


def _write_a_view_of_x(b, x):
    b.call(aten.mul_.Tensor, b.call(aten.view.default, x, [2, 2]), 3)


@pytest.mark.parametrize("variant", [dict(second_group="h"), dict(second_op="max"),
                                     dict(write=_write_x), dict(write=_write_a_view_of_x)],
                         ids=["other group", "other reduction", "input written between",
                              "a view of the input written between"])
def test_dedup_keeps_collectives_that_differ(variant):
    gm = deduplicate_collectives(_twice_reduced(**variant))
    assert _all_reduces(gm) == 2 and meta.NOTES not in gm.meta


# ------------------------------------------------------------ bucketing: a plan's all_reduces


def _plan_reduce(b, x, group):
    """DTensor's all_reduce of ``x`` on ``group``, as the tracer marks it."""
    marks = {meta.ROLE: meta.Role.COLLECTIVE, meta.MODEL_PARALLEL: group}
    issue = b.call(c10d.all_reduce.default, x, "sum", group, region=BWD, val=x.meta["val"],
                   **marks, **{meta.PLAN_PLACEMENT: ("tp", "P(sum)", "R")})
    return issue, b.call(c10d.wait_tensor.default, issue, region=BWD, val=x.meta["val"], **marks)


def test_plan_all_reduces_bucket_within_their_group_only():
    """Three independent reductions on "tp" and one on "tp2": the "tp" ones become one
    all_reduce, the other group's keeps its own; a reduction whose result is read before a
    later one is issued, or that reads an earlier one's, starts a new bucket."""
    b = _Builder()
    xs = [b.input(f"x{i}", 3, role=meta.Role.INPUT) for i in range(6)]
    _, w0 = _plan_reduce(b, xs[0], "tp")
    _, w1 = _plan_reduce(b, xs[1], "tp")
    _, other = _plan_reduce(b, xs[2], "tp2")
    _, w2 = _plan_reduce(b, xs[3], "tp")
    early = b.call(aten.mul.Tensor, w2, 2, region=BWD)  # read before the next one is issued
    _, w3 = _plan_reduce(b, xs[4], "tp")
    _, w4 = _plan_reduce(b, b.call(aten.add.Tensor, w3, xs[5], region=BWD), "tp")  # reads w3
    gm = bucket_collectives(b.done(w0, w1, other, early, w4), first_bucket_cap_mb=1.0)
    gm.graph.lint()
    issues = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    by_group = [(n.args[2], n.meta.get(meta.BUCKET) is not None) for n in issues]
    # w0 + w1 + w2 in one bucket; w3 alone (w2 is read before it); w4 alone (reads w3)
    assert by_group == [("tp2", False), ("tp", True), ("tp", False), ("tp", False)], by_group
    assert all(n.meta[meta.MODEL_PARALLEL] == n.args[2] for n in issues)


def _graph_as_data(gm: fx.GraphModule) -> list:
    """Every node of ``gm`` as plain data: op, target, arguments (nodes by name), the pass meta
    and its value's metadata, with the first node whose value shares its storage."""
    from torch.multiprocessing.reductions import StorageWeakRef

    owner: dict = {}
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        desc = None
        if isinstance(val, torch.Tensor):
            storage = StorageWeakRef(val.untyped_storage())
            desc = (tuple(val.shape), val.stride(), val.storage_offset(), val.dtype,
                    str(val.device), val.requires_grad, type(val).__name__,
                    owner.setdefault(storage, n.name))
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", a.name))
        out.append((n.op, n.name, str(n.target), repr(args), desc,
                    {k: repr(v) for k, v in n.meta.items() if k.startswith("spmd_")}))
    return out


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_inserted_ops_valued_by_meta_kernels_equal_fake_dispatch(style, monkeypatch):
    """The graph the passes build, with the values of their inserted ops (bucket copies and
    pieces, gathers, padding, the collectives of a cached recording) from meta kernels, equals
    node for node, value metadata and storage sharing included, the graph built with every
    inserted op run in fake mode."""
    from spmd_compiler import DataParallel, explain
    from spmd_compiler.api import CompiledStep
    from spmd_compiler.passes import subgraph

    graphs, calls = [], []
    meta_value, new_fake = subgraph.meta_kernel_value, subgraph.new_fake

    def counted(*args):
        calls.append(args[1])
        return meta_value(*args)

    def counted_new(*args):
        calls.append("new")
        return new_fake(*args)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 6))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = CompiledStep(_mse_step, DataParallel(style, bucket_cap_mb=1e-4,
                                                    first_bucket_cap_mb=1e-4),
                            gm_transformation=lambda gm: graphs.append(_graph_as_data(gm)) or gm)
        explain(step, model, opt, (torch.randn(4, 8), torch.randn(4, 6)))

    monkeypatch.setattr(subgraph, "meta_kernel_value", counted)
    monkeypatch.setattr(subgraph, "new_fake", counted_new)
    build()
    assert {aten.slice.Tensor, aten.cat.default, c10d.wait_tensor.default, "new"} <= set(calls)
    monkeypatch.setattr(subgraph, "meta_kernel_value", lambda *args: None)  # as when off
    monkeypatch.setattr(subgraph, "new_fake", lambda *args: None)
    build()
    assert len(graphs[0]) > 60 and graphs[0] == graphs[1]


def _mse_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()


@pytest.mark.parametrize("shape", [(5,), (7, 3), (4, 0, 2), (3, 1, 5), (1,)])
def test_shard_val_equals_new_empty(shape):
    """fully_shard's shard value, made without fake dispatch, is what ``new_empty`` makes in
    fake mode: shape, strides, dtype, device, grad flag and fake mode."""
    from spmd_compiler.passes.fully_shard import shard_rows, shard_val

    mode = FakeTensorMode()
    with mode:
        val = torch.empty(shape, dtype=torch.bfloat16)
    made = shard_val(val, 2)
    want = val.new_empty((shard_rows(shape[0], 2),) + shape[1:])
    describe = lambda t: (type(t), t.fake_mode, tuple(t.shape), t.stride(), t.storage_offset(),  # noqa: E731
                          t.dtype, t.device, t.requires_grad)
    assert made is not val and describe(made) == describe(want)
