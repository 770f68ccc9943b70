"""The pipeline's runner (spmd_compiler/build/pipeline.py): the stages that apply run in the declared
order, each timed; SPMD_DISABLE_PASSES skips a named optional stage; a failure names its stage
and the ones before it; the meta contract check catches a graph that breaks it. Single process:
``explain`` builds the program without a process group."""

from __future__ import annotations

import pytest
import torch

from spmd_compiler import DataParallel, explain
from spmd_compiler.passes import meta
from spmd_compiler.build.pipeline import CHECK_ENV, DISABLE_ENV, STAGES
from tests.models import IN_FEATURES, OUT_FEATURES, SimpleMLP, train_step


def _explain(style: str = "replicate", **kwargs):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(8, IN_FEATURES), torch.randn(8, OUT_FEATURES))
    return explain(train_step, model, opt, batch, parallel_mode=DataParallel(style), **kwargs)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_stages_run_in_declared_order(style):
    ran = list(_explain(style).compile_times)
    order = [s.name for s in STAGES]
    assert ran == sorted(ran, key=order.index)
    assert ran[0] == "traced" and ran[-1] == "lowered"
    assert ("schedule" in ran) == (style == "fully_shard")
    assert ("overlap" in ran) == (style == "replicate")


def test_disable_switch_skips_a_named_optional_stage(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "overlap,no_such_stage,expanded")  # expanded is not optional
    ran = list(_explain().compile_times)
    assert "overlap" not in ran and "expanded" in ran and "bucketing" in ran


def test_a_failing_stage_is_named_with_the_stages_before_it():
    def broken(gm):
        raise RuntimeError("broken transformation")

    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from spmd_compiler.api import CompiledStep

    step = CompiledStep(train_step, DataParallel("replicate"), gm_transformation=broken)
    with pytest.raises(RuntimeError, match="broken transformation") as info:
        explain(step, model, opt, (torch.randn(8, IN_FEATURES), torch.randn(8, OUT_FEATURES)))
    (note,) = info.value.__notes__
    assert "'gm_transformation'" in note and "traced, analyzed, expanded" in note


def test_meta_check_names_the_stage_and_the_node(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")

    def drop_region(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        del node.meta[meta.REGION]
        return gm

    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from spmd_compiler.api import CompiledStep

    step = CompiledStep(train_step, DataParallel("replicate"), gm_transformation=drop_region)
    with pytest.raises(meta.MetaContractError, match="after stage 'gm_transformation'.*no spmd_region"):
        explain(step, model, opt, (torch.randn(8, IN_FEATURES), torch.randn(8, OUT_FEATURES)))


def _clipped_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    return loss


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_placements_after_expansion_are_derived_once_and_equal_a_fresh_analysis(style, monkeypatch):
    """The analysis after the expansion reuses the placements of the nodes the expansion left
    alone; every placement equals what a fresh analysis of the expanded graph derives."""
    from spmd_compiler.build import pipeline
    from spmd_compiler.passes import batch_dim

    derived = []
    node_placement = batch_dim._Analysis.node_placement
    monkeypatch.setattr(batch_dim._Analysis, "node_placement",
                        lambda self, node: derived.append(node) or node_placement(self, node))
    runs = []
    analyze = pipeline.analyze

    def checked(gm):
        derived.clear()
        gm = analyze(gm)
        again = [n for n in derived if n.op == "call_function"]
        runs.append(({n.name for n in again}, [n.name for n in gm.graph.nodes if n.op == "call_function"]))
        reused = {n: n.meta[meta.PLACEMENT] for n in gm.graph.nodes}
        record = gm.meta.pop(meta.PLACEMENT_INPUTS)
        batch_dim.annotate_placements(gm)  # from scratch
        fresh = {n: n.meta[meta.PLACEMENT] for n in gm.graph.nodes}
        assert [n.name for n in fresh if not batch_dim._same(fresh[n], reused[n])] == []
        gm.meta[meta.PLACEMENT_INPUTS] = record
        return gm

    monkeypatch.setattr(pipeline, "analyze", checked)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    explain(_clipped_step, model, opt, (torch.randn(8, 8), torch.randn(8, 4)),
            parallel_mode=DataParallel(style))
    (first, calls), (second, expanded) = runs
    assert first == set(calls)  # the traced graph: every node derived
    # the expanded graph: the collectives derived, the nodes the expansion left alone reused
    assert {"wait_tensor", "linalg_vector_norm", "_fused_adamw_"} <= second < set(expanded)
    assert not second & {"relu", "mse_loss", "mse_loss_backward", "threshold_backward"}
