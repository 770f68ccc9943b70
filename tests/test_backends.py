"""The ``inductor`` backend keeps parity with DDP (one case: Inductor compiles take tens of
seconds on CPU, so the other parity tests use the ``eager`` backend). The model ends in a dropout:
with the same seed the compiled step must draw the same random numbers as eager DDP."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.models import SimpleMLP, train_step
from tests.multirank import rank_data

RTOL, ATOL = 1e-5, 1e-6  # float32 round-off; Inductor fuses the elementwise math differently


def inductor_parity_job(style: str) -> dict:
    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = torch.nn.Sequential(SimpleMLP(), torch.nn.Dropout(0.25))
    ddp = DDP(deepcopy(model))
    # stateless: one compile; the fused SGD kernel runs between the compiled regions, and the
    # scheduler's learning rates reach it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sched, ddp_sched = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ddp_opt))
    step = spmd_compile(DataParallel(style), backend="inductor")(train_step)
    worst = 0.0
    for i, batch_size in enumerate([16, 16, 16, 11]):
        batch = tuple(rank_data(100 + i, (batch_size, 50), (batch_size, 8)))
        torch.manual_seed(10 + i)
        loss = step(model, opt, batch)
        torch.manual_seed(10 + i)
        ref = train_step(ddp, ddp_opt, batch)
        sched.step()
        ddp_sched.step()
        assert torch.allclose(loss, ref, rtol=RTOL, atol=ATOL * 100), (i, loss, ref)
        for p, q in zip(model.parameters(), ddp.parameters()):
            full = p.full_tensor()
            assert torch.allclose(full, q, rtol=RTOL, atol=ATOL), (i, (full - q).abs().max())
            worst = max(worst, (full - q).abs().max().item())
    return dict(worst=worst, compiles=step.compile_count)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_inductor_backend_matches_ddp(pool2, style):
    for rank, rep in enumerate(pool2.run(inductor_parity_job, style, timeout=900)):
        assert rep["compiles"] == 1, f"rank {rank}: {rep}"  # the short batch did not recompile
