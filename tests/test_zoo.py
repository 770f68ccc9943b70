"""The model zoo (tests/zoo.py) compiled in both modes against eager DDP, world size 2.

Every case builds the same initial model on every rank (``torch.manual_seed(0)``), a DDP reference
from a deepcopy of it, Adam for both, and runs ``STEPS`` compiled steps with different data on every
rank, the last one a shorter batch. After every step it compares, on every rank, the returned loss,
every parameter (``full_tensor()`` of fully_shard's shards) and every optimizer state tensor with
DDP's. Dropout cases seed the global generator identically before both runs: the compiled step must
draw the same random numbers as the eager one (and, as a control, two seeds must give different
outputs).

The selected cases of both modes run in one worker job (tests/multirank.SelectedCases), so the pool
and the imports are paid once; the Hugging Face cases skip without transformers.

Tolerances: ``|actual - expected| <= ATOL + RTOL * |expected|`` with RTOL = 1e-5 and ATOL = 1e-6 for
parameters and optimizer states (float32 round-off; the compiled step records the same aten ops
the eager step runs, and averages each gradient the way DDP does, dividing before summing), and for
the loss. The observed maxima are printed per case (``-rP``) and listed in docs/batch_dim.md.
"""

from __future__ import annotations

import math
import time
import traceback
import importlib.util
import warnings
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from tests.multirank import SelectedCases
from tests.zoo import CASES, make_batch

RTOL = 1e-5
ATOL = 1e-6
BATCH = 4  # local batch size
SHORT_BATCH = 3  # the last step's
STEPS = 3  # Adam steps, the last one on the short batch
MODES = ("replicate", "fully_shard")


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Diff:
    def __init__(self, atol: float = ATOL):
        self.atol = atol
        self.max_err = 0.0
        self.problems: list[str] = []

    def close(self, where: str, actual, expected) -> None:
        actual, expected = _full(actual).detach(), _full(expected).detach()
        if actual.shape != expected.shape:
            self.problems.append(f"{where}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
            return
        a, e = actual.double(), expected.double()
        err = float((a - e).abs().max()) if a.numel() else 0.0
        self.max_err = max(self.max_err, math.inf if math.isnan(err) else err)
        if not torch.allclose(a, e, rtol=RTOL, atol=self.atol):
            self.problems.append(f"{where}: max abs err {err:.3g}")


def _run_case(name: str, style: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    case = CASES[name]
    torch.manual_seed(0)  # the same initial model on every rank
    model = case.build()
    ddp = DDP(deepcopy(model))
    opt = torch.optim.Adam(model.parameters(), lr=case.lr, fused=True)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=case.lr, fused=True)
    compiled = spmd_compile(DataParallel(style, input_batch_dim=case.input_batch_dim))(case.step)
    rank = dist.get_rank()
    diff = _Diff(case.atol)
    for i in range(STEPS):
        batch = make_batch(name, i, BATCH if i < STEPS - 1 else SHORT_BATCH, rank)
        torch.manual_seed(100 + i)  # dropout: the same random stream for both
        loss = compiled(model, opt, deepcopy(batch))
        torch.manual_seed(100 + i)
        ref_loss = case.step(ddp, ddp_opt, batch)
        diff.close(f"step {i}: loss", loss, ref_loss)
        ref_params = dict(ddp.module.named_parameters())
        for pname, p in model.named_parameters():
            q = ref_params[pname]
            diff.close(f"step {i}: parameter {pname}", p, q)
            state, ref_state = opt.state[p], ddp_opt.state[q]
            if sorted(state) != sorted(ref_state):
                diff.problems.append(f"step {i}: state keys of {pname}: {sorted(state)}")
            for k in ref_state:
                if k in state:
                    diff.close(f"step {i}: optimizer state {pname}.{k}", state[k], ref_state[k])
        ref_buffers = dict(ddp.module.named_buffers())
        for bname, b in model.named_buffers():
            diff.close(f"step {i}: buffer {bname}", b, ref_buffers[bname])
    if case.dropout:  # the control: the step's result does depend on the random stream
        outs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            with torch.no_grad():
                out = ddp.module(**batch) if isinstance(batch, dict) else ddp.module(batch[0])
            outs.append([t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
        if all(torch.equal(a, b) for a, b in zip(*outs)):
            diff.problems.append("dropout draws nothing: two seeds give the same output")
    return dict(max_err=diff.max_err, problems=diff.problems, compiles=compiled.compile_count)


def zoo_job(cases: list[tuple[str, str]]) -> dict:
    """The (name, style) cases, style by style; a case that raises is reported, not fatal."""
    warnings.filterwarnings("ignore")
    out = {}
    for name, style in sorted(cases, key=lambda c: MODES.index(c[1])):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            out[name, style] = _run_case(name, style)
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name, style] = dict(
                exception=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            dist.barrier()  # keep the ranks together for the next case
        out[name, style]["seconds"] = time.perf_counter() - start
        out[name, style]["cpu_seconds"] = time.process_time() - cpu
    return out


def _case_of(item) -> tuple[str, str] | None:
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return (params["name"], params["style"]) if "name" in params and "style" in params else None


_REPORTS = SelectedCases(zoo_job, _case_of, timeout=900)
# Hugging Face cases need transformers (an optional test dependency)
_NO_TRANSFORMERS = importlib.util.find_spec("transformers") is None
_CASE_PARAMS = [pytest.param(name, marks=pytest.mark.skipif(
    _NO_TRANSFORMERS and name.startswith("hf_"), reason="transformers is not installed"))
    for name in CASES]


@pytest.mark.parametrize("style", MODES)
@pytest.mark.parametrize("name", _CASE_PARAMS)
def test_zoo_model_matches_ddp(pool2, name, style):
    for rank, reports in enumerate(_REPORTS.reports(pool2)):
        rep = reports[name, style]
        assert "exception" not in rep, f"{name} ({style}) raised on rank {rank}: {rep['exception']}"
        print(f"{name} {style} rank {rank}: max |diff| {rep['max_err']:.2g}, "
              f"{rep['compiles']} compiles, {rep['seconds']:.1f}s ({rep['cpu_seconds']:.1f}s CPU)")
        assert not rep["problems"], (
            f"{name} ({style}) differs from DDP on rank {rank}:\n  " + "\n  ".join(rep["problems"][:10]))


def test_a_loop_over_data_dependent_experts_raises_naming_the_line():
    """Hugging Face's "eager" experts loop runs once per expert hit (``for expert_idx in
    expert_hit``): a Python loop whose trip count is data. It cannot be one graph; the error names
    the loop. (The default "grouped_mm" experts compile: hf_mixtral_moe above.)"""
    transformers = pytest.importorskip("transformers")

    from spmd_compiler.errors import TraceError
    from spmd_compiler.trace.record import trace_step
    from tests.zoo import VOCAB, hf_step

    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation="eager")
    model = transformers.MixtralForCausalLM(cfg)
    batch = make_batch("hf_mixtral_moe", 0, BATCH, 0)
    with pytest.raises(TraceError) as info:
        trace_step(hf_step, (model, torch.optim.Adam(model.parameters()), batch), {})
    assert "modeling_mixtral.py" in str(info.value)
    assert "for expert_idx in expert_hit" in str(info.value)
