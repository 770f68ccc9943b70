"""Adam's and AdamW's first-step state made before recording (spmd_compiler/state/optimizer_state.py):
the first call compiles the steady program, and training matches DDP exactly for every variant;
optimizers whose first step is not the steady step on zero state (SGD with momentum) keep the
state-creating program; a compile that fails leaves the optimizer without state."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from spmd_compiler import DataParallel, spmd_compile
from tests.models import SimpleMLP, train_step
from tests.multirank import ParityChecker, rank_data


class WithUnused(SimpleMLP):
    """SimpleMLP and a layer the forward never calls (no gradient: the compile refuses it)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)


OPTIMIZERS = {
    "adam": ("Adam", {"lr": 0.01}),
    "adam_foreach": ("Adam", {"lr": 0.01, "foreach": True}),
    "adam_single_tensor": ("Adam", {"lr": 0.01, "foreach": False}),
    "adam_fused_amsgrad": ("Adam", {"lr": 0.01, "fused": True, "amsgrad": True}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_fused": ("AdamW", {"lr": 0.01, "weight_decay": 0.1, "fused": True}),
    "adamw_amsgrad_foreach": ("AdamW", {"lr": 0.01, "amsgrad": True, "foreach": True}),
    "sgd_momentum_dampening": ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}),
    "sgd_nesterov": ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def parity_job(mode: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        cls, kwargs = OPTIMIZERS[name]
        torch.manual_seed(0)
        model = SimpleMLP()
        ddp = DDP(deepcopy(model))
        opt = getattr(torch.optim, cls)(model.parameters(), **kwargs)
        ddp_opt = getattr(torch.optim, cls)(ddp.module.parameters(), **kwargs)
        step = spmd_compile(DataParallel(mode))(train_step)
        chk, counts = ParityChecker(1e-5, 1e-6), []
        for i in range(4):
            x, y = rank_data(500 + i, (8, 50), (8, 8))
            loss = step(model, opt, (x.clone(), y.clone()))
            counts.append(step.compile_count)
            chk.close("loss", f"step {i}: loss", loss, train_step(ddp, ddp_opt, (x, y)).detach())
            for (n, p), q in zip(model.named_parameters(), ddp.module.parameters()):
                chk.close("param", f"step {i}: {n}", _full(p), q)
                chk.check(sorted(opt.state.get(p, {})) == sorted(ddp_opt.state.get(q, {})),
                          f"step {i}: {n}: state keys {sorted(opt.state.get(p, {}))} vs "
                          f"{sorted(ddp_opt.state.get(q, {}))}")
                for k, v in ddp_opt.state.get(q, {}).items():
                    if k in opt.state.get(p, {}):
                        chk.close("state", f"step {i}: {n}.{k}", _full(opt.state[p][k]), v)
        out[name] = dict(problems=chk.problems, counts=counts)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_first_step_state_matches_eager_for_every_optimizer(pool, mode):
    for rank, res in enumerate(pool.run(parity_job, mode, list(OPTIMIZERS), timeout=900)):
        for name, r in res.items():
            assert not r["problems"], f"rank {rank}, {name}: {r['problems'][:5]}"
            # Adam and AdamW: one compile; SGD with momentum: the state-creating program first
            expected = 1 if OPTIMIZERS[name][0].startswith("Adam") else 2
            assert r["counts"] == [expected] * 4 if expected == 1 else r["counts"] == [1, 2, 2, 2], \
                f"rank {rank}, {name}: compile counts {r['counts']}"


def missing_gradient_job(name: str) -> dict:
    """A compile that fails (a parameter without gradient) leaves the optimizer without state."""
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = WithUnused()
    opt = getattr(torch.optim, cls)(model.parameters(), **kwargs)
    step = spmd_compile(DataParallel("replicate"))(train_step)
    try:
        step(model, opt, rank_data(1, (8, 50), (8, 8)))
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        return dict(error=type(e).__name__, state=len(opt.state))
    return dict(error=None, state=len(opt.state))


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_failed_compile_leaves_no_state(pool):
    for rank, res in enumerate(pool.run(missing_gradient_job, "adamw", timeout=300)):
        assert res["error"] is not None and res["state"] == 0, f"rank {rank}: {res}"
