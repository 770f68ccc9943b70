"""One compile per job (spmd_compiler/build/shared_compile.py): rank 0 builds, the others receive the
program and train as DDP does (replicate, fully_shard: the program reads the rank from its group
at each call, with uneven shards too; hybrid_shard on 2 x 2: tests/test_hybrid_shard.py); a rank
whose program differs (a branch on its batch size or on its rank) builds its own; an error while
rank 0 builds reaches every rank."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from spmd_compiler import DataParallel, spmd_compile
from spmd_compiler.errors import RankMismatchError
from tests.models import SimpleMLP, TwoLayerMLP, train_step
from tests.multirank import ParityChecker, rank_data
from tests.steps import step_with


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _received(step) -> list[bool]:
    """Per program of ``step``: was it received from another rank?"""
    return [any(s.startswith("received from rank") for s in e.stage_seconds)
            for e in step._programs]


def batch_branched(model, batch):
    """A loss whose computation depends on the local batch size (a guard on it)."""
    x, y = batch
    loss = (model(x) - y).sum()
    if x.shape[0] > 7:
        loss = loss * 2
    return loss


def rank_scaled(model, batch):
    """A loss that asks for its rank: the step's program is not handed to the other ranks."""
    x, y = batch
    return (model(x) - y).sum() * (1.0 + dist.get_rank())


batch_branch_step = step_with(batch_branched, name="batch_branch_step")
rank_branch_step = step_with(rank_scaled, name="rank_branch_step")


STEPS = {"train_step": train_step, "batch_branch": batch_branch_step,
         "rank_branch": rank_branch_step}


MODELS = {"simple": SimpleMLP,
          # 33 hidden rows: fully_shard's shards are 17 + 16 rows (padding on rank 1 only)
          "odd": lambda: TwoLayerMLP(50, 33, 8, sigmoid=True)}


def parity_job(mode: str, step_name: str, batches: list[int], optim: str = "adam",
               model_name: str = "simple") -> dict:
    """Train 4 steps against DDP (every rank its own data and local batch size); the largest
    differences, and which programs each rank received."""
    step_fn = STEPS[step_name]
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ddp = DDP(deepcopy(model))
    make = {"adam": lambda p: torch.optim.Adam(p, lr=0.01),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}[optim]
    opt, ddp_opt = make(model.parameters()), make(ddp.module.parameters())
    step = spmd_compile(DataParallel(mode))(step_fn)
    chk = ParityChecker(1e-5, 1e-6)
    b = batches[dist.get_rank()]
    for i in range(4):
        x, y = rank_data(400 + i, (b, 50), (b, 8))
        loss = step(model, opt, (x.clone(), y.clone()))
        ddp_loss = step_fn(ddp, ddp_opt, (x, y))
        chk.close("loss", f"step {i}: loss", loss, ddp_loss.detach())
        for (n, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            chk.close("param", f"step {i}: {n}", _full(p), q)
            for k, v in opt.state[p].items():
                chk.close("state", f"step {i}: {n}.{k}", _full(v), ddp_opt.state[q][k])
    return dict(problems=chk.problems, received=_received(step), compiles=step.compile_count)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_rank0_compiles_the_others_receive_and_match_ddp(pool, mode, optim):
    results = pool.run(parity_job, mode, "train_step", [8, 5], optim, timeout=300)
    for rank, res in enumerate(results):
        assert not res["problems"], f"rank {rank}: {res['problems'][:5]}"
        # Adam: its first-step state made before recording, one program; SGD with momentum:
        # the state-creating program, then the steady one
        programs = 1 if optim == "adam" else 2
        assert res["compiles"] == programs
        shared = rank > 0
        assert res["received"] == [shared] * programs, f"rank {rank}: {res['received']}"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_uneven_shards_share_the_program(pool):
    """Shards of 17 and 16 rows: every rank's padded shard has 17, the program is the same."""
    results = pool.run(parity_job, "fully_shard", "train_step", [6, 9], "adam", "odd", timeout=300)
    for rank, res in enumerate(results):
        assert not res["problems"], f"rank {rank}: {res['problems'][:5]}"
        assert res["received"] == [rank > 0], f"rank {rank}: {res['received']}"


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("step_name", ["batch_branch", "rank_branch"])
def test_a_rank_whose_program_differs_builds_its_own(pool, mode, step_name):
    results = pool.run(parity_job, mode, step_name, [8, 6], "sgd", timeout=300)
    for rank, res in enumerate(results):
        assert not res["problems"], f"rank {rank}: {res['problems'][:5]}"
        assert not any(res["received"]), f"rank {rank}: {res['received']}"


def failing_on_rank0_job() -> tuple[str, str]:
    def transformation(gm):
        if dist.get_rank() == 0:
            raise RuntimeError("the transformation failed here")
        return gm

    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_compile(DataParallel("replicate"), gm_transformation=transformation)(train_step)
    try:
        step(model, opt, rank_data(1, (8, 50), (8, 8)))
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_an_error_while_rank0_compiles_reaches_every_rank(pool):
    results = pool.run(failing_on_rank0_job, timeout=120)
    assert "the transformation failed here" in results[0][1], results[0]
    kind, message = results[1]
    assert kind == RankMismatchError.__name__, results[1]
    assert "rank 0" in message and "the transformation failed here" in message, message
