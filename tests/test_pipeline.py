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
