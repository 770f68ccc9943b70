"""Long-run parity: 200 steps against DDP, replicate and fully_shard, world sizes 2 and 3.

The seed's SimpleMLP trained with Adam (lr 1e-3) on a mean-squared-error loss, different data on
every rank at every step (:func:`tests.multirank.rank_data`), a shorter batch every 50th step.
Every ``CHECK_EVERY`` steps each rank records the largest absolute difference between our
parameters (``full_tensor()`` of the DTensors) and DDP's, and the same for Adam's ``exp_avg`` /
``exp_avg_sq``. The test asserts that the difference never exceeds ``MAX_ABS`` (float32 round-off:
Adam divides by ``sqrt(exp_avg_sq) + eps``, which magnifies round-off in early steps) and that it
does not grow over the run: the difference at the end is at most ``GROWTH`` times the largest
difference seen by step 100, or below ``FLOOR``. The figures are printed (``pytest -s``).
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch

from tests.models import SimpleMLP, mse_step
from tests.multirank import SelectedCases, rank_data

STEPS = 200
CHECK_EVERY = 20
BATCH = 32
SHORT_BATCH = 17  # every 50th step: runs on the same graph (shape guards)
LR = 1e-3

MAX_ABS = 1e-5  # never exceeded, at any checkpoint, by any parameter or Adam state element
GROWTH = 4.0  # the step-200 difference is at most GROWTH x the worst one up to step 100 ...
FLOOR = 1e-6  # ... unless it is below FLOOR anyway


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _max_diff(model, opt, ref_model, ref_opt) -> tuple[float, float]:
    """(max |param - DDP param|, max |Adam state - DDP's|) over all elements."""
    param, state = 0.0, 0.0
    for p, q in zip(model.parameters(), ref_model.parameters()):
        param = max(param, float((_full(p) - q.detach()).abs().max()))
        st, ref_st = opt.state[p], ref_opt.state[q]
        for k in ("exp_avg", "exp_avg_sq"):
            state = max(state, float((_full(st[k]) - ref_st[k]).abs().max()))
    return param, state


def long_run_job(modes: list[str]) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    out = {}
    for mode in modes:
        torch.manual_seed(0)  # the same initial model on every rank
        model = SimpleMLP()
        ddp = DDP(deepcopy(model))
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        ref_opt = torch.optim.Adam(ddp.parameters(), lr=LR)
        compiled = spmd_compile(DataParallel(mode))(mse_step)
        drift, loss_diff = {}, 0.0
        for step in range(1, STEPS + 1):
            b = SHORT_BATCH if step % 50 == 0 else BATCH
            x, y = rank_data(10_000 + step, (b, 50), (b, 8))
            loss = compiled(model, opt, (x.clone(), y.clone()))
            ref_loss = mse_step(ddp, ref_opt, (x, y))
            loss_diff = max(loss_diff, abs(float(loss.detach()) - float(ref_loss.detach())))
            if step % CHECK_EVERY == 0:
                drift[step] = _max_diff(model, opt, ddp.module, ref_opt)
        out[mode] = dict(drift=drift, loss_diff=loss_diff, compiles=compiled.compile_count,
                         final_loss=float(ref_loss.detach()))
    return out


_RESULTS = SelectedCases(long_run_job, lambda item: item.callspec.params.get("mode"), timeout=600)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_200_steps_stay_close_to_ddp(pool, mode):
    for rank, results in enumerate(_RESULTS.reports(pool)):
        res = results[mode]
        drift = res["drift"]
        assert sorted(drift) == list(range(CHECK_EVERY, STEPS + 1, CHECK_EVERY)), sorted(drift)
        figures = ", ".join(f"{s}: {p:.2e}/{st:.2e}" for s, (p, st) in sorted(drift.items()))
        print(f"\n{mode} ws={pool.world_size} rank {rank} max |param diff|/|Adam state diff| by "
              f"step: {figures}; max |loss diff| {res['loss_diff']:.2e}; "
              f"final loss {res['final_loss']:.4f}")
        # Adam's state is made before recording (optimizer_state.py): one steady-state graph;
        # the short batches run on it.
        assert res["compiles"] == 1, res["compiles"]
        worst = max(max(p, st) for p, st in drift.values())
        assert worst <= MAX_ABS, f"rank {rank}: drift from DDP exceeds {MAX_ABS}: {figures}"
        early = max(max(drift[s]) for s in drift if s <= 100)
        final = max(drift[STEPS])
        assert final <= max(GROWTH * early, FLOOR), (
            f"rank {rank}: the difference from DDP grows: {final:.2e} at step {STEPS} vs at most "
            f"{early:.2e} up to step 100 ({figures})"
        )
        assert res["loss_diff"] <= MAX_ABS, res["loss_diff"]
