"""torchao's low-precision training weights under the compiled fully_shard step, against eager
FSDP2 with the same model, on gloo. Skipped without torchao (the ``test`` extra).

float8: ``convert_to_float8_training`` with ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``.

The weights are ``WeightWithDynamicFloat8CastTensor``: their pre hook casts this rank's shard to
float8 with a scale from the amax all-reduced over the shard dim, the gather moves the float8
bytes (a quarter of float32's) and the post hook wraps them with the scale as the
``Float8TrainingTensor`` the forward's matmul takes. Both sides cast the same values with the
same scales and run the same float8 matmuls; parameters and Adam states are compared at float32
round-off (rtol 1e-5, atol 1e-6) after every step.

int8 mixed precision: ``quantize_(model, int8_mixed_precision_training())`` (its int8 matmuls run
on CPU). Its weights' hooks gather the float32 data with the config as metadata and rebuild the
weight whose dispatch quantizes in the matmuls; same tolerances.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.multirank import ParityChecker, rank_data
from tests.test_gather_extensions import compare, fsdp2, gathers, sum_step

pytest.importorskip("torchao")

STEPS = 4


def float8_model() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    # biases (float32) in every FSDP2 group: FSDP2 then gathers the group as bytes, which gloo
    # moves (it has no float8 dtype); the compiled step moves float8 as bytes itself
    # rows divisible by 2 and 3: torchao's pre hook returns the shard unpadded, which FSDP2
    # (and the compiled step) refuse for an uneven shard
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 24))
    return convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def int8_model() -> nn.Module:
    from torchao import quantize_
    from torchao.prototype.quantized_training import int8_mixed_precision_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 24))
    quantize_(model, int8_mixed_precision_training())
    return model


def torchao_job(kind: str, reshard_after_forward: bool) -> dict:
    from spmd_compiler import DataParallel, spmd_compile

    model = float8_model() if kind == "float8" else int8_model()
    ref = deepcopy(model)
    fsdp2(ref, [ref[0], ref[2]], reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    compiled = spmd_compile(DataParallel(
        "fully_shard", reshard_after_forward=reshard_after_forward))(sum_step)
    chk = ParityChecker()
    for i in range(STEPS):
        x = rank_data(900 + i, (8, 48))  # the same data for both kinds
        loss = compiled(model, optim, x)
        ref_loss = sum_step(ref, ref_optim, x)
        chk.close("loss", f"step {i}: loss", loss, ref_loss.detach())
        compare(chk, f"step {i}", model, optim, ref, ref_optim)
    return dict(problems=chk.problems, max_err=chk.max_err, gathers=gathers(compiled),
                types=sorted({type(p.to_local()).__name__ for p in model.parameters()
                              if p.dim() == 2}))


WEIGHTS = {"0.weight": 96 * 48, "2.weight": 24 * 96}  # elements


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_float8_weights_match_fsdp2(pool, reshard_after_forward, record_property):
    for rank, rep in enumerate(pool.run(torchao_job, "float8", reshard_after_forward, timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
        assert rep["types"] == ["WeightWithDynamicFloat8CastTensor"], rep
        # one byte per element: the float8 data, moved as bytes (gloo moves no float8 dtype)
        assert rep["gathers"] and all(d == "torch.uint8" for _, _, d in rep["gathers"]), rep
        assert {fqn for fqn, _, _ in rep["gathers"]} == set(WEIGHTS), rep
        assert all(nbytes == WEIGHTS[fqn] for fqn, nbytes, _ in rep["gathers"]), rep


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_int8_mixed_precision_weights_match_fsdp2(pool, record_property):
    for rank, rep in enumerate(pool.run(torchao_job, "int8", True, timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
        assert rep["types"] == ["Int8MixedPrecisionTrainingLinearWeight"], rep
        # the hooks gather the float32 data (torchao quantizes in the matmuls)
        assert all(d == "torch.float32" for _, _, d in rep["gathers"]), rep
        assert all(nbytes == 4 * WEIGHTS[fqn] for fqn, nbytes, _ in rep["gathers"]), rep
