"""Collectives per step: spmd replicate issues no more than DDP, counted on real gloo ranks.

Both sides are counted the same way: torch.profiler records every collective gloo runs
(``gloo:*`` events) over a few steps after the warm-up. The summary's "collectives issued per
call" must equal what was counted. Every benchmark model (benchmarks/models.py) is counted too,
with the per-call agreement on (it rides in the step's first collective, none of its own):
replicate's collectives are at most DDP's, fully_shard's at most FSDP2's (per block, then root).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import SimpleMLP, mse_step, train_step
from tests.multirank import rank_data

pytestmark = pytest.mark.multirank

STEPS = 3


class ConvBN(nn.Module):
    """Two conv-BatchNorm-ReLU stages and a linear head: six BatchNorm buffers, two dtypes."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        return self.head(self.features(x).mean([-2, -1]))


CASES = {"simple_mlp": (SimpleMLP, train_step, (16, 50), (16, 8)),
         "conv_bn": (ConvBN, mse_step, (4, 3, 8, 8), (4, 8))}


def _gloo_collectives(step, batches) -> float:
    """Collectives gloo ran per call of ``step`` (counted by torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches:
            step(b)
    counts = Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))
    return sum(counts.values()) / len(batches)


def _count_job(case: str, check_ranks: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.api import entry_summary

    build, fn, x_shape, y_shape = CASES[case]
    batches = [rank_data(i, x_shape, y_shape) for i in range(8)]
    torch.manual_seed(0)
    ddp = DDP(build())
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = spmd_compile(DataParallel("replicate"), check_ranks=check_ranks)(fn)
    for b in batches[:3]:  # warm-up: compiles (the optimizer state appears after the first)
        fn(ddp, ddp_opt, b)
        step(model, opt, b)
    return {
        "ddp": _gloo_collectives(lambda b: fn(ddp, ddp_opt, b), batches[3:3 + STEPS]),
        "spmd": _gloo_collectives(lambda b: step(model, opt, b), batches[3:3 + STEPS]),
        "summary": entry_summary(step.last_compiled).issued_per_call,
    }


def _benchmark_count_job(name: str, style: str = "replicate") -> dict:
    from benchmarks.models import MODELS, make_train_step
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.api import entry_summary

    spec = MODELS[name]
    fn = make_train_step(spec.loss_fn)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [spec.make_batch(gen, 2) for _ in range(3 + STEPS)]
    torch.manual_seed(0)
    ref = _reference(spec, style)
    ref_opt = spec.optim.build(ref.parameters())
    torch.manual_seed(0)
    model = spec.build()
    opt = spec.optim.build(model.parameters())
    step = spmd_compile(DataParallel(style), check_ranks=True)(fn)
    for b in batches[:3]:
        fn(ref, ref_opt, b)
        step(model, opt, b)
    return {
        "reference": _gloo_collectives(lambda b: fn(ref, ref_opt, b), batches[3:]),
        "spmd": _gloo_collectives(lambda b: step(model, opt, b), batches[3:]),
        "summary": entry_summary(step.last_compiled).issued_per_call,
        "carrier": step._carrier,
    }


def _reference(spec, style: str) -> nn.Module:
    """DDP of the model, or FSDP2 (each of the spec's blocks, then the root)."""
    if style == "replicate":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(spec.build())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = spec.build()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in [m for m in model.modules() if spec.is_block(m) and m is not model]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _benchmark_models() -> list[str]:
    from benchmarks.models import MODELS

    return [name for name, spec in MODELS.items() if spec.speed]


# fully_shard on gloo gathers each bucket as one broadcast per rank (passes/gloo_collectives.py):
# the toy model's 12 gathers (6 forward, 6 backward, under the 16 MiB prefetch cap) and 6
# reduce-scatters are 30 collectives per step (toy_sgd: 31) where FSDP2 issues 29 (19 gathers,
# 10 reduce-scatters; measured at world size 2), the agreement riding in the first gather; fewer,
# larger gather buckets (more memory) or gloo's own all_gather (slower, scratch copies) would
# close it
_ABOVE_FSDP2 = {("toy", "fully_shard"), ("toy_sgd", "fully_shard")}


def _cases() -> list:
    return [pytest.param(name, style, marks=pytest.mark.xfail(
                strict=True, reason="gathers as one broadcast per rank: 30-31 vs FSDP2's 29"))
            if (name, style) in _ABOVE_FSDP2 else (name, style)
            for name in _benchmark_models() for style in ("replicate", "fully_shard")]


@pytest.mark.parametrize("name, style", _cases())
def test_benchmark_models_issue_no_more_collectives_than_ddp_and_fsdp2(pool2, name, style):
    if name == "hf_llama":
        pytest.importorskip("transformers")
    # the toy model's 18 M parameters under DDP and two compiles take minutes on a loaded machine
    counts = pool2.run(_benchmark_count_job, name, style, timeout=900)[0]
    assert counts["spmd"] == counts["summary"], counts
    assert counts["carrier"] is not None, counts  # the agreement rides in a data collective
    assert counts["spmd"] <= counts["reference"], counts


@pytest.mark.parametrize("case", list(CASES))
def test_replicate_issues_no_more_collectives_than_ddp(pool2, case):
    for check_ranks in (False, True):
        counts = pool2.run(_count_job, case, check_ranks)[0]
        assert counts["spmd"] == counts["summary"], (check_ranks, counts)
        # the per-call agreement rides in the first gradient all_reduce (SimpleMLP) or beside
        # the buffers' bytes (ConvBN)
        assert counts["spmd"] <= counts["ddp"], (check_ranks, counts)


def clip_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    optim.step()
    return loss


def _clip_count_job(style: str) -> dict:
    """gloo's collectives per call of a clipping step (seven parameters), by kind, and the
    summary's count."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.api import entry_summary

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                          nn.Linear(16, 4, bias=False))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mesh = (init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
            if style == "hybrid_shard" else None)
    step = spmd_compile(DataParallel(style), mesh=mesh)(clip_step)
    batches = [rank_data(i, (8, 12), (8, 4)) for i in range(2 + STEPS)]
    for b in batches[:2]:
        step(model, opt, b)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches[2:]:
            step(model, opt, b)
    counts = Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))
    return {"per_call": {k: v / STEPS for k, v in counts.items()},
            "summary": entry_summary(step.last_compiled).issued_per_call,
            "kinds": {c.kind: c.count for c in entry_summary(step.last_compiled).collectives}}


@pytest.mark.parametrize("style", ["replicate", "fully_shard", "hybrid_shard"])
def test_clipping_issues_one_all_reduce_for_the_norm(pool2, style):
    """clip_grad_norm_ over parameter shards completes the per-parameter norms with one
    all_reduce of them stacked, not one per parameter (seven here); over replicated gradients
    (already averaged) the norm needs none: the step issues DDP's one gradient all_reduce."""
    counts = pool2.run(_clip_count_job, style)[0]
    kinds = counts["kinds"]
    if style == "replicate":
        assert kinds == {"all_reduce": 1} and counts["summary"] == 1, counts
        assert counts["per_call"] == {"gloo:all_reduce": 1.0}, counts
        return
    # hybrid_shard: the norm's on the shard dim (the gradients' all_reduce runs on the other)
    assert kinds["all_reduce" if style == "fully_shard" else "all_reduce (mesh dim 1)"] == 1, counts
    assert sum(counts["per_call"].values()) == counts["summary"], counts
    # gloo runs each reduce_scatter as an in-place all_reduce (passes/gloo_collectives.py), and
    # the per-call agreement may need one of its own
    reduces = sum(n for k, n in kinds.items() if k.startswith(("all_reduce", "reduce_scatter")))
    assert counts["per_call"]["gloo:all_reduce"] <= reduces + 1, counts
