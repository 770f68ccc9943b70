"""Graph dumps and the summary table of spmd_compiler.visualize, on small traced steps."""

import logging
import re
import shutil
import subprocess

import graphviz
import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.passes.meta import BUCKET, COLLECTIVE, PARAM_FQN, PLACEMENT, REGION, ROLE, Region, Role
from spmd_compiler.observe import visualize
from spmd_compiler.trace.record import trace_step
from tests.models import SimpleMLP, train_step

c10d = torch.ops._c10d_functional
DOT = shutil.which("dot")
needs_dot = pytest.mark.skipif(DOT is None, reason="graphviz `dot` binary not installed")


def _traced(batch=128):
    torch.manual_seed(0)
    model = SimpleMLP()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    args = (model, optim, (torch.randn(batch, 50), torch.randn(batch, 8)))
    return model, trace_step(train_step, args, {}, input_batch_dim=0).gm


def _insert_all_reduce(gm, node, bucket=None):
    """all_reduce + wait_tensor after ``node``, later uses read the wait (as an expansion does)."""
    users = list(node.users)
    with gm.graph.inserting_after(node):
        issue = gm.graph.call_function(c10d.all_reduce.default, (node, "avg", "0"))
    with gm.graph.inserting_after(issue):
        wait = gm.graph.call_function(c10d.wait_tensor.default, (issue,))
    for user in users:
        user.replace_input_with(node, wait)
    for n in (issue, wait):
        n.meta.update({"val": node.meta["val"], ROLE: Role.COLLECTIVE, REGION: node.meta[REGION],
                       PLACEMENT: Replicate()})
    issue.meta[COLLECTIVE] = dict(kind="all_reduce", bytes=None,
                                  params=[node.meta[PARAM_FQN]] if PARAM_FQN in node.meta else [])
    if bucket is not None:
        issue.meta[BUCKET] = bucket
    return issue


@pytest.fixture
def expanded():
    """SimpleMLP's step with one all_reduce per gradient (two buckets) and one on an activation."""
    model, gm = _traced()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            sym = [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt)]
            n.meta[PLACEMENT] = Shard(sym[0]) if sym else Replicate()
    grads = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.GRAD]
    for i, g in enumerate(grads):
        g.meta[PLACEMENT] = Partial("avg")
        _insert_all_reduce(gm, g, bucket=i // 2)
    relu = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default)
    _insert_all_reduce(gm, relu)
    gm.recompile()
    return model, gm, grads, relu


def _dot_nodes_with_class(text, cls):
    return len(re.findall(rf"\bclass={cls}\b", text))


def _graph_collectives(gm):
    issuing = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
               c10d.reduce_scatter_tensor.default}
    return [n for n in gm.graph.nodes if n.target in issuing]


def test_dump_stage_numbers_stages_in_order(tmp_path, expanded):
    _, gm, _, _ = expanded
    for stage in ("traced", "expanded", "optimized"):
        visualize.dump_stage(gm, stage, tmp_path)
    dots = sorted(p.name for p in tmp_path.glob("*.dot"))
    assert dots == ["00_traced.collapsed.dot", "00_traced.dot", "01_expanded.collapsed.dot",
                    "01_expanded.dot", "02_optimized.collapsed.dot", "02_optimized.dot"]
    written = visualize.dump_stage(gm, "lowered", tmp_path, index=7)
    assert written[0].name == "07_lowered.dot"
    assert all(p.exists() and p.stat().st_size > 0 for p in written)
    assert len(written) == (4 if DOT else 2)


@needs_dot
def test_dot_files_render_with_graphviz(tmp_path, expanded):
    _, gm, _, _ = expanded
    for path in visualize.dump_stage(gm, "expanded", tmp_path):
        if path.suffix != ".dot":
            continue
        source = graphviz.Source(path.read_text())
        res = subprocess.run([DOT, "-Tsvg"], input=source.source, capture_output=True, text=True)
        assert res.returncode == 0 and not res.stderr.strip(), res.stderr  # not even a warning
        assert res.stdout.lstrip().startswith("<?xml")


def test_every_collective_drawn_once(tmp_path, expanded):
    _, gm, grads, _ = expanded
    expected = len(_graph_collectives(gm))
    assert expected == len(grads) + 1
    full = visualize.graph_to_dot(gm, "expanded").source
    assert _dot_nodes_with_class(full, "collective") == expected
    assert _dot_nodes_with_class(full, "wait") == expected
    # two gradient buckets of two collectives each become clusters
    assert len(re.findall(r"subgraph cluster_backward_bucket\d", full)) == 2
    if DOT:
        svg = next(p for p in visualize.dump_stage(gm, "x", tmp_path) if p.name == "00_x.svg")
        assert svg.read_text().count('class="node collective"') == expected


def test_real_replicate_expansion_is_drawn_and_summarized():
    from spmd_compiler.passes.expand import expand_replicate

    model, gm = _traced()
    gm = expand_replicate(gm, group_name="0", world_size=2)
    issued = _graph_collectives(gm)
    assert len(issued) == len(list(model.parameters()))
    assert _dot_nodes_with_class(visualize.graph_to_dot(gm, "x").source, "collective") == len(issued)
    (stat,) = visualize.summarize(gm).collectives
    assert (stat.kind, stat.count, stat.batch_dependent) == ("all_reduce", len(issued), False)
    assert stat.bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def _clusters(dot_source):
    """cluster name -> names of the nodes declared directly or nested inside it."""
    out, stack = {}, []
    for line in dot_source.splitlines():
        line = line.strip()
        m = re.match(r"subgraph (cluster_\w+) \{", line)
        if m:
            stack.append(m.group(1))
            out[m.group(1)] = set()
        elif line == "}" and stack:
            stack.pop()
        elif stack and (m := re.match(r'"?([\w.]+)"? \[', line)) and "->" not in line:
            for c in stack:
                out[c].add(m.group(1))
    return out


def test_regions_are_clusters_and_cross_region_reads_are_copies(expanded):
    _, gm, _, _ = expanded
    text = visualize.graph_to_dot(gm, "x").source
    clusters = _clusters(text)
    params = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.PARAM]
    hparam = next(n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.HPARAM)
    region_of = {name: c for c in ("cluster_forward", "cluster_backward", "cluster_optimizer")
                 for name in clusters[c]}
    assert all(region_of[p.name] == "cluster_forward" for p in params)
    assert region_of[hparam.name] == "cluster_optimizer"  # only the optimizer reads the lr
    # the optimizer updates every parameter: it reads a dashed copy, not the forward node
    for p in params:
        assert region_of[f"{p.name}__optimizer"] == "cluster_optimizer"
    for a, b, attrs in re.findall(r"^\s*([\w.]+) -> ([\w.]+)(.*)$", text, re.M):
        if a in region_of and b in region_of and "invis" not in attrs:  # not the order hints
            assert region_of[a] == region_of[b], (a, b)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert region_of[n.name] == f"cluster_{n.meta[REGION].value}", n


def test_full_view_caps_large_graphs(expanded):
    _, gm, _, _ = expanded
    capped = visualize.graph_to_dot(gm, "big", max_nodes=10).source
    drawn = len(re.findall(r"\bclass=(?!copy)\w+", capped))
    assert drawn == 10
    assert f"showing the first 10 of {len(gm.graph.nodes)} nodes" in capped
    full = visualize.graph_to_dot(gm, "big").source
    assert "capped" not in full
    assert len(re.findall(r"\bclass=(?!copy)\w+", full)) == len(gm.graph.nodes)


def test_edges_carry_symbolic_shapes(expanded):
    _, gm, _, relu = expanded
    batch = str(relu.meta["val"].shape[0])
    full = visualize.graph_to_dot(gm, "x").source
    assert f'label="{batch}×50"' in full and f'label="{batch}×32"' in full
    assert 'label="32×50"' in full


def test_collapsed_view_groups_by_module():
    model = SimpleMLP()

    def forward(x):
        return model(x).sum()

    forward._orig_mod = model  # lets make_fx record nn_module_stack relative to the model
    gm = make_fx(forward, record_module_stack=True)(torch.randn(4, 50))
    by_module = {}
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            by_module.setdefault(list(stack.values())[-1][0], []).append(n)
    assert {"net1", "relu", "net2"} <= set(by_module)
    text = visualize.collapsed_to_dot(gm, "fwd").source
    for path, members in by_module.items():
        label = re.search(rf'"?mod_{path}"? \[label="([^"]*)"', text).group(1)
        assert f"{len(members)} ops" in label
    for n in by_module["net1"]:  # individual ops are not drawn in the collapsed view
        assert not re.search(rf"^\s*{n.name} \[", text, re.M)


def test_collapsed_view_attributes_backward_ops_to_modules():
    model = SimpleMLP()

    def fwd_bwd(params, x):
        loss = torch.func.functional_call(model, params, (x,)).sum()
        return torch.autograd.grad(loss, list(params.values()))

    fwd_bwd._orig_mod = model
    params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    gm = make_fx(fwd_bwd, record_module_stack=True)(params, torch.randn(4, 50))
    region = Region.FORWARD
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[REGION] = region
            if n.target == torch.ops.aten.sum.default:  # the loss: what follows is backward
                region = Region.BACKWARD
    grads = {tuple(n.meta["val"].shape): n for n in gm.graph.output_node().args[0]}
    modules = visualize._modules(gm, visualize._assign_regions(gm))
    # each weight gradient is computed in its own Linear's backward, from that Linear's input
    assert modules[grads[(32, 50)]][0] == "net1"
    assert modules[grads[(8, 32)]][0] == "net2"
    sig_bwd = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sigmoid_backward.default)
    assert modules[sig_bwd][:1] == ("",) and modules[sig_bwd][2] == "backward"
    text = visualize.collapsed_to_dot(gm, "x").source
    for title in ("net1 · Linear backward", "net2 · Linear backward", "relu · ReLU backward"):
        assert title in text


def test_collapsed_view_without_module_stack_groups_by_region(expanded):
    _, gm, _, _ = expanded
    text = visualize.collapsed_to_dot(gm, "x").source
    for region in Region:
        members = [n for n in gm.graph.nodes if n.op == "call_function"
                   and n.meta.get(REGION) == region and ROLE not in n.meta
                   and not visualize.is_collective(n)]
        if members:
            assert f"{region.value} (no module)" in text
    assert _dot_nodes_with_class(text, "collective") == 3  # bucket 0, bucket 1, the relu one


def test_summary_counts_and_bytes_match_the_graph(expanded):
    model, gm, _, relu = expanded
    batch_sym = str(relu.meta["val"].shape[0])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    act_bytes = 128 * 32 * 4  # relu output (batch × 32 float32) at the traced batch size

    s = visualize.summarize(gm, compile_times={"trace": 0.25, "expand": 0.5})
    (stat,) = s.collectives
    assert (stat.kind, stat.count) == ("all_reduce", 5)
    assert stat.bytes == grad_bytes + act_bytes
    assert stat.batch_dependent
    assert s.size_hints == {batch_sym: 128}
    assert [(b.bucket, b.count) for b in s.buckets] == [(0, 2), (1, 2)]
    assert sum(b.bytes for b in s.buckets) == grad_bytes
    assert sorted(p for b in s.buckets for p in b.params) == sorted(
        n for n, _ in model.named_parameters())
    assert {p.fqn: (p.placement, p.local_shape) for p in s.params} == {
        n: ("Replicate()", tuple(p.shape)) for n, p in model.named_parameters()}
    assert s.persistent_bytes["params"] == grad_bytes
    assert s.persistent_bytes["grads"] == 0  # freed in the step (kept only with keep_grads)
    assert s.persistent_bytes["total persistent"] == grad_bytes

    half = visualize.summarize(gm, size_hints={batch_sym: 64})
    assert half.collectives[0].bytes == grad_bytes + act_bytes // 2
    assert half.peak_bytes < s.peak_bytes

    text, md = s.to_text(), s.to_markdown()
    assert "all_reduce" in text and f"{batch_sym}=128" in text and "0.250" in text
    assert "| all_reduce" in md and "net1.weight" in md


def test_peak_memory_liveness_walk():
    def f(x):
        a = x * 2  # +16 B
        b = a + 1  # +16 B, then a dies
        c = b.view(-1)  # alias of b: no allocation
        d = c * 3  # +16 B, then b (and c) die
        d.add_(1)  # in place: no allocation
        return d

    gm = make_fx(f)(torch.randn(4))
    peak, _ = visualize.estimate_peak_memory(gm)
    # x (16, live throughout) + a + b = 48; later x + b + d = 48 as well.
    assert peak == 48

    def g(x):
        a = x * 2
        b = a * 3  # a still live for the output
        return a, b

    assert visualize.estimate_peak_memory(make_fx(g)(torch.randn(4)))[0] == 48


def test_write_summary(tmp_path, expanded):
    _, gm, _, _ = expanded
    paths = visualize.write_summary(visualize.summarize(gm), tmp_path / "dump")
    assert [p.name for p in paths] == ["summary.txt", "summary.md"]
    assert "collectives per step" in paths[0].read_text()
    assert "### parameters" in paths[1].read_text()


def test_missing_dot_logs_once(tmp_path, expanded, monkeypatch, caplog):
    _, gm, _, _ = expanded
    monkeypatch.setattr(visualize.shutil, "which", lambda name: None)
    monkeypatch.setattr(visualize, "_svg_skip_logged", False)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        a = visualize.dump_stage(gm, "a", tmp_path)
        b = visualize.dump_stage(gm, "b", tmp_path)
    assert all(p.suffix == ".dot" for p in a + b) and len(a + b) == 4
    assert sum("not found" in r.getMessage() for r in caplog.records) == 1


def test_placement_text():
    assert visualize.dtensor_str(Shard(1)) == "Shard(1)"
    assert visualize.dtensor_str(Replicate()) == "Replicate()"
    assert visualize.dtensor_str(Partial("avg")) == "Partial(avg)"
    assert visualize.placement_counts([Replicate()] * 4 + [Shard(0), None]) == {
        "Replicate()": 4, "Shard(0)": 1}
    assert visualize.placement_str(Shard(1)) == "S(1)"
    assert visualize.placement_str(Replicate()) == "R"
    assert visualize.placement_str(Partial("avg")) == "P(avg)"
    assert visualize.placement_str([Shard(0), None]) == "S(0),-"
    assert visualize.placement_kind([Partial("sum")]) == "partial"


def test_issued_per_call_says_what_it_counts_beyond_the_collectives_per_step():
    """The step table's "collectives issued per call" adds up from the "collectives per step"
    table: gloo's lowering (an all_gather issued as one broadcast per rank) and the per-call
    agreement between ranks are named, so the two counts cannot look contradictory."""
    stats = [visualize.CollectiveStat("all_gather", 2, 8608, False),
             visualize.CollectiveStat("reduce_scatter", 1, 7584, False)]

    def issued(total, agreements):
        return visualize.Summary(1, {}, stats, [], [], {}, 0, "x", issued_per_call=total,
                                 agreements_per_call=agreements).issued_text()

    assert issued(6, 1) == ("6 = 3 per step (below) + 2 from the lowering for gloo (an all_gather "
                            "issued as one broadcast per rank) + 1 agreement between ranks")
    assert issued(4, 1) == "4 = 3 per step (below) + 1 agreement between ranks"
    assert issued(3, 0) == "3: the collectives per step below"
    assert issued(None, 0) == "-"


def test_explain_counts_collectives_without_a_process_group_as_gloo_issues_them():
    """Without a process group explain builds on a stand-in group of the world size, as rank 0
    of a gloo run: each all_gather is issued as one broadcast per rank, the agreement rides in
    the first collective; the summary says what another world size changes."""
    from spmd_compiler import DataParallel, explain

    model = SimpleMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    summary = explain(train_step, model, opt, (torch.randn(8, 50), torch.randn(8, 8)),
                      parallel_mode=DataParallel("fully_shard"), world_size=3)
    per_step = sum(c.count for c in summary.collectives)
    gathers = sum(c.count for c in summary.collectives if c.kind == "all_gather")
    assert summary.issued_per_call == per_step + gathers * (3 - 1)
    assert summary.agreements_per_call == 0
    assert "one broadcast per rank of its group (3 here)" in summary.at_other_sizes[
        "collectives issued per call"]
    assert summary.to_text().startswith("at world size 3\n")


def _cluster_boxes(svg: str) -> dict[str, tuple[float, float, float, float]]:
    """(x0, x1, y0, y1) of each region cluster of a rendered SVG."""
    boxes = {}
    for name, points in re.findall(r"<title>cluster_(forward|backward|optimizer)</title>\s*"
                                   r"<polygon[^>]*points=\"([^\"]+)\"", svg):
        xy = [tuple(map(float, p.split(","))) for p in points.split()]
        xs, ys = [x for x, _ in xy], [y for _, y in xy]
        boxes[name] = (min(xs), max(xs), min(ys), max(ys))
    return boxes


@needs_dot
def test_pictures_of_a_fully_shard_step_read_as_they_should(tmp_path):
    """The demo's fully_shard step, as dumped: the full view's regions are columns in step
    order (no staircase), buckets are numbered in execution order, collapsed edges carry sizes
    with units, placements read as DTensor spells them, and Graphviz renders every view
    without a warning."""
    from spmd_compiler import DataParallel, explain

    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    summary = explain(train_step, model, opt, (torch.randn(16, 50), torch.randn(16, 8)),
                      parallel_mode=DataParallel("fully_shard"), dump_dir=str(tmp_path))
    assert [b.kinds for b in summary.buckets] == ["all_gather", "all_gather", "reduce_scatter"]
    folder = tmp_path / "train_step" / "compile_0"
    lowered = next(folder.glob("*_lowered.dot"))
    res = subprocess.run([DOT, "-Tsvg", str(lowered)], capture_output=True, text=True)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    boxes = _cluster_boxes(res.stdout)
    assert list(boxes) == ["forward", "backward", "optimizer"], boxes
    (_, f1, _, _), (b0, b1, _, _), (o0, _, _, _) = boxes.values()
    assert f1 <= b0 and b1 <= o0, boxes  # side by side, left to right
    collapsed = next(folder.glob("*_lowered.collapsed.dot")).read_text()
    assert re.search(r'label="[^"]*\n[0-9.]+ (B|KiB|MiB)"', collapsed)  # edge sizes with units
    assert "Shard(0)" in collapsed and "Replicate()" in collapsed and "S(0)" not in collapsed
    assert re.search(r"bucket 0\nall_gather", collapsed)
    res = subprocess.run([DOT, "-Tsvg"], input=collapsed, capture_output=True, text=True)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    # the timeline: a lane per collective the program issues (gloo's all_gather: a broadcast
    # per rank), from its issue to its wait, beside the compute in step order
    timeline = (folder / "timeline.svg").read_text()
    assert timeline.count('class="collective"') == summary.issued_per_call == 5
    assert "broadcast from rank 1" in timeline and "reduce_scatter 7.41 KiB" in timeline
    waits = [(int(a), int(b)) for a, b in re.findall(r"issued at op (\d+), waited at op (\d+)", timeline)]
    assert len(waits) == 5 and all(a < b for a, b in waits)
    assert {"forward", "backward", "optimizer"} <= set(re.findall(r"<title>(\w+): ops", timeline))
