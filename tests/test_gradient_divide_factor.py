"""``DataParallel(gradient_divide_factor=f)`` against FSDP2's ``set_gradient_divide_factor(f)``.

FSDP2 sums every gradient over the ranks and divides by ``f`` instead of averaging (a loss that
is a per-rank sum of a global token count, say). Several SGD steps (momentum: the update scales
with the gradient) with different data per
rank; every parameter and optimizer state compared with FSDP2's at float32 round-off (rtol 1e-5,
atol 1e-6). gloo has no premultiplied sum, so the reference also asks FSDP2 for plain sums
(``set_force_sum_reduction_for_comms``): it then sums and divides, our ``divide_gradients="after"``
order; ``"before"`` (divide, then sum) agrees to round-off.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist

from tests.models import SimpleMLP, mse_step
from tests.multirank import ParityChecker, rank_data
from tests.test_fully_shard import compare_with_reference

STEPS = 4
FACTOR = 7.0


def divide_factor_job(style: str, divide: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = SimpleMLP()
    ref = deepcopy(model)
    if style == "hybrid_shard":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(ref, mesh=mesh)
    ref.set_gradient_divide_factor(FACTOR)
    ref.set_force_sum_reduction_for_comms(True)
    # SGD: its update scales with the gradient (Adam's normalizes the factor away)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mode = DataParallel(style, gradient_divide_factor=FACTOR, divide_gradients=divide)
    compiled = spmd_compile(mode, mesh=mesh)(mse_step)
    chk = ParityChecker()
    for i in range(STEPS):
        x, y = rank_data(700 + i, (8, 50), (8, 8))
        loss = compiled(model, opt, (x, y))
        ref_loss = mse_step(ref, ref_opt, (x, y))
        chk.close("loss", f"step {i}: loss", loss, ref_loss.detach())
        compare_with_reference(chk, f"step {i}", model, opt, ref, ref_opt)
    return dict(problems=chk.problems, max_err=chk.max_err)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("divide", ["after", "before"])
def test_gradient_divide_factor_matches_fsdp2(pool, divide, record_property):
    for rank, rep in enumerate(pool.run(divide_factor_job, "fully_shard", divide, timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])


def test_gradient_divide_factor_hybrid_shard(pool4, record_property):
    for rank, rep in enumerate(pool4.run(divide_factor_job, "hybrid_shard", "after", timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])


def test_gradient_divide_factor_must_be_positive():
    from spmd_compiler import DataParallel, SPMDError

    with pytest.raises(SPMDError, match="gradient_divide_factor must be a positive number"):
        DataParallel("fully_shard", gradient_divide_factor=0)
