"""Training features checked against torch's own data parallelism on real gloo groups.

- Mixed precision (``DataParallel(mp_policy=MixedPrecisionPolicy(...))``): fully_shard against
  FSDP2 ``fully_shard`` with the same policy (on the root module); replicate against
  ``replicate`` from ``torch.distributed._composable.replicate_with_fsdp`` with the same policy.
  Several steps of Adam with different data on every rank; every parameter (fp32 master weights)
  and every optimizer state compared after every step, and the loss.
- The collectives' dtypes and bytes in the compiled graph: parameters gathered in
  ``param_dtype`` (half the bytes for bfloat16), gradients reduced in the reduce dtype.
- A policy the backend cannot honour raises before any state changes.

Tolerances. Both sides compute the forward and backward in bfloat16 with the same ops on the same
values, but FSDP2 averages with ``ReduceOp.AVG`` where we divide and then sum, and (in bfloat16
reductions) the rounding of those differs by an ulp of bfloat16 (2**-8 relative); Adam then
normalizes the update, so a one-ulp gradient difference moves a parameter by at most about
``lr``. Parameters and states: ``|a - e| <= MP_ATOL + MP_RTOL * |e|`` with MP_RTOL = 1e-2 and
MP_ATOL = 2 * LR (two steps' worth of one flipped update sign) for a bfloat16 reduce dtype;
MP_RTOL = 1e-5, MP_ATOL = 1e-6 (float32 round-off) for a float32 reduce dtype, where both sides
reduce the same float32 values. The measured maxima are returned and recorded.
"""

from __future__ import annotations

import contextlib
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist

from tests.models import SimpleMLP, mse_step
from tests.multirank import ParityChecker, rank_data
from tests.test_fully_shard import compare_with_reference

STEPS = 4
BATCH = 16
LR = 1e-3


def _tolerance(reduce_dtype) -> tuple[float, float]:
    return (1e-5, 1e-6) if reduce_dtype == torch.float32 else (1e-2, 2 * LR)


def _policy(param_dtype, reduce_dtype, output_dtype=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                output_dtype=output_dtype, cast_forward_inputs=True)


def mixed_precision_job(style: str, reduce_dtype, output_dtype, divide: str) -> dict:
    """The compiled step with ``param_dtype=bfloat16`` against FSDP2 (fully_shard) or composable
    replicate with the same policy, from the same model, with the same data."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spmd_compiler import DataParallel, spmd_compile

    ws = dist.get_world_size()
    policy = _policy(torch.bfloat16, reduce_dtype, output_dtype)
    torch.manual_seed(0)
    model = SimpleMLP()
    ref = deepcopy(model)
    mesh = init_device_mesh("cpu", (ws,))
    if style == "fully_shard":  # the root only: the policy's casts at the model's boundary
        fully_shard(ref, mesh=mesh, mp_policy=policy)
    else:
        replicate(ref, mesh=mesh, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    compiled = spmd_compile(DataParallel(style, mp_policy=policy, divide_gradients=divide))(
        mse_step)

    chk = ParityChecker(*_tolerance(reduce_dtype))
    for i in range(STEPS):
        x, y = rank_data(400 + i, (BATCH, 50), (BATCH, 8))
        loss = compiled(model, opt, (x.clone(), y.clone()))
        ref_loss = mse_step(ref, ref_opt, (x, y))
        chk.close("loss", f"step {i}: loss", loss, ref_loss.detach())
        compare_with_reference(chk, f"step {i}", model, opt, ref, ref_opt)
        for name, p in model.named_parameters():
            chk.check(p.dtype == torch.float32, f"step {i}: {name} is {p.dtype}, not float32")
    return dict(max_err=chk.max_err, problems=chk.problems,
                collectives=_collective_dtypes(compiled.last_compiled.traced.gm)
                if dist.get_rank() == 0 else None)  # rank 0 builds; the others may receive it


def _collective_dtypes(gm) -> dict[str, dict[str, int]]:
    """Per collective kind: bytes per step by dtype, from the graph's collective meta."""
    from spmd_compiler.passes import meta

    out: dict[str, dict[str, int]] = {}
    for node in gm.graph.nodes:
        info = node.meta.get(meta.COLLECTIVE)
        if info and node.meta.get("val") is not None:
            per = out.setdefault(info["kind"], {})
            dtype = str(node.meta["val"].dtype)
            per[dtype] = per.get(dtype, 0) + (info["bytes"] or 0)
    return out


MP_CASES = {
    "fully_shard-reduce_fp32": ("fully_shard", torch.float32, None, "after"),
    "fully_shard-reduce_bf16": ("fully_shard", None, torch.float32, "after"),
    "fully_shard-reduce_bf16-divide_before": ("fully_shard", None, torch.float32, "before"),
    "replicate-reduce_fp32": ("replicate", torch.float32, None, "after"),
    "replicate-reduce_bf16": ("replicate", None, torch.float32, "after"),
}


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("case", list(MP_CASES))
def test_mixed_precision_matches_fsdp2(pool, case, record_property):
    style, reduce_dtype, output_dtype, divide = MP_CASES[case]
    reports = pool.run(mixed_precision_job, style, reduce_dtype, output_dtype, divide,
                       timeout=600)
    for rank, rep in enumerate(reports):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], (
            f"{case} differs from the reference on rank {rank}:\n  "
            + "\n  ".join(rep["problems"][:20]))
    rep = reports[0]
    grad_kind = "reduce_scatter" if style == "fully_shard" else "all_reduce"
    assert set(rep["collectives"][grad_kind]) == {str(reduce_dtype or torch.bfloat16)}, rep
    if style == "fully_shard":
        assert set(rep["collectives"]["all_gather"]) == {"torch.bfloat16"}, rep


def refused_policy_job() -> dict:
    """A float8 param_dtype (gloo cannot gather it) and a non-floating reduce_dtype: a
    MixedPrecisionError (an SPMDError) naming the field, with the model and optimizer as they
    were (plain tensors, no state)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from spmd_compiler import DataParallel, SPMDError, spmd_compile

    out = {}
    try:
        DataParallel("replicate", mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int32))
        out["int32"] = "accepted"
    except SPMDError as e:
        out["int32"] = str(e)
    torch.manual_seed(0)
    model = SimpleMLP()
    before = deepcopy(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    policy = MixedPrecisionPolicy(param_dtype=torch.float8_e4m3fn)
    compiled = spmd_compile(DataParallel("fully_shard", mp_policy=policy))(mse_step)
    try:
        compiled(model, opt, rank_data(7, (BATCH, 50), (BATCH, 8)))
        out["float8"] = "accepted"
    except SPMDError as e:
        out["float8"] = f"{type(e).__name__}: {e}"
    out["untouched"] = (not any(isinstance(p, DTensor) for p in model.parameters())
                        and not opt.state and all(torch.equal(v, before[k])
                                                  for k, v in model.state_dict().items()))
    return out


def test_policy_the_backend_cannot_honour_is_refused(pool2):
    for rep in pool2.run(refused_policy_job, timeout=300):
        assert "reduce_dtype must be a floating-point" in rep["int32"], rep
        assert rep["float8"].startswith("MixedPrecisionError"), rep
        assert "param_dtype=torch.float8_e4m3fn" in rep["float8"] and "gloo" in rep["float8"], rep
        assert rep["untouched"], rep


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce_fp32", "reduce_bf16"])
def test_bfloat16_params_halve_the_gathered_bytes(reduce_dtype):
    """The summary (explain, world size 2, no process group): fully_shard gathers in
    ``param_dtype``: half the all-gather bytes of the float32 step; gradients are reduced in the
    reduce dtype (bfloat16 when the policy names none: half the bytes again)."""
    from spmd_compiler import DataParallel, explain

    def summary(policy, style):
        torch.manual_seed(0)
        model = SimpleMLP()
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        batch = (torch.randn(BATCH, 50), torch.randn(BATCH, 8))
        s = explain(mse_step, model, opt, batch, world_size=2,
                    parallel_mode=DataParallel(style, mp_policy=policy))
        return {c.kind: c.bytes for c in s.collectives}

    policy = _policy(torch.bfloat16, reduce_dtype)
    plain, mixed = summary(None, "fully_shard"), summary(policy, "fully_shard")
    assert mixed["all_gather"] * 2 == plain["all_gather"], (plain, mixed)
    grads = 1 if reduce_dtype == torch.float32 else 2
    assert mixed["reduce_scatter"] * grads == plain["reduce_scatter"], (plain, mixed)
    plain, mixed = summary(None, "replicate"), summary(policy, "replicate")
    assert mixed["all_reduce"] * grads == plain["all_reduce"], (plain, mixed)


# --------------------------------------------------------------------------------------------------
# Gradient accumulation inside one step
# --------------------------------------------------------------------------------------------------

MICRO_BATCHES = 3


def accumulate_step(model, optim, micro_batches):
    """Zero the gradients, one forward/backward per micro-batch, then one optimizer step."""
    optim.zero_grad()
    total = 0.0
    for x, y in micro_batches:
        loss = torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)
        loss.backward()
        total = total + loss.detach()
    optim.step()
    return total


def _reference_accumulate(model, optim, micro_batches, no_sync):
    """The same with torch's data parallelism: no gradient sync but for the last micro-batch."""
    optim.zero_grad()
    total = 0.0
    for k, (x, y) in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with no_sync(not last):
            loss = torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)
            loss.backward()
        total = total + loss.detach()
    optim.step()
    return total


def _model_and_reference(style: str, mixed: bool, sync_every_call: bool = False):
    """SimpleMLP, its reference (FSDP2 for fully_shard, DDP for replicate; bf16 parameters and
    fp32 reduction when ``mixed``), the policy, and ``no_sync(skip)``: the reference's way to
    skip the gradient sync (FSDP2's ``set_requires_gradient_sync``, DDP's ``no_sync``), a no-op
    when ``sync_every_call`` (FSDP2 syncing every micro-batch, its default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    ws = dist.get_world_size()
    torch.manual_seed(0)
    model = SimpleMLP()
    ref = deepcopy(model)
    policy = _policy(torch.bfloat16, torch.float32) if mixed else None
    if style == "fully_shard":
        if mixed:
            fully_shard(ref, mesh=init_device_mesh("cpu", (ws,)), mp_policy=policy)
        else:
            fully_shard(ref, mesh=init_device_mesh("cpu", (ws,)))

        @contextlib.contextmanager
        def no_sync(skip):
            ref.set_requires_gradient_sync(not skip or sync_every_call)
            yield
            ref.set_requires_gradient_sync(True)
    else:
        ref = DDP(ref)
        no_sync = lambda skip: ref.no_sync() if skip else contextlib.nullcontext()  # noqa: E731
    return model, ref, policy, no_sync


def accumulation_job(style: str, mixed: bool = False, per_micro_batch: bool = False) -> dict:
    """The compiled micro-batch step against DDP with ``no_sync()`` (replicate) or FSDP2 with
    ``set_requires_gradient_sync(False)`` (fully_shard) for all but the last micro-batch. Also
    returns the number of gradient collectives in the compiled graph. ``mixed``: both sides with
    bf16 parameters and fp32 reduction (fully_shard only). ``per_micro_batch``: fully_shard with
    ``reduce_cap_mb=0`` reduce-scatters every micro-batch, bucketed (one bucket per micro-batch
    at this size); the reference is FSDP2 syncing every micro-batch (its default)."""
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.passes import meta

    model, ref, policy, no_sync = _model_and_reference(style, mixed, sync_every_call=per_micro_batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    bucket_cap_mb = 25.0 if per_micro_batch else None  # buckets must not mix micro-batches
    compiled = spmd_compile(DataParallel(style, bucket_cap_mb=bucket_cap_mb, mp_policy=policy,
                                         divide_gradients="after" if mixed else "before",
                                         reduce_cap_mb=0 if per_micro_batch else 16.0))(
        accumulate_step)

    chk = ParityChecker(1e-5, 1e-6)
    for i in range(STEPS):
        mbs = [rank_data(500 + 10 * i + k, (BATCH, 50), (BATCH, 8))
               for k in range(MICRO_BATCHES)]
        loss = compiled(model, opt, [(x.clone(), y.clone()) for x, y in mbs])
        ref_loss = _reference_accumulate(ref, ref_opt, mbs, no_sync)
        chk.close("loss", f"step {i}: loss", loss, ref_loss)
        if style == "fully_shard":
            compare_with_reference(chk, f"step {i}", model, opt, ref, ref_opt)
        else:
            from tests.test_replicate import compare_with_ddp

            compare_with_ddp(chk, i, model, opt, ref.module, ref_opt)
    gm = compiled.last_compiled.traced.gm  # None on a rank that received the program
    grad_syncs = None if gm is None else [
        n for n in gm.graph.nodes
        if (n.meta.get(meta.COLLECTIVE) or {}).get("kind") in ("all_reduce", "reduce_scatter")]
    from spmd_compiler.api import entry_summary

    return dict(max_err=chk.max_err, problems=chk.problems,
                grad_syncs=None if grad_syncs is None else len(grad_syncs),
                params=len(list(model.parameters())), compiles=compiled.compile_count,
                notes=entry_summary(compiled.last_compiled).notes)


# replicate, fully_shard, fully_shard with bfloat16 parameters; at world sizes 2 and 3
STYLES = pytest.mark.parametrize("style,mixed", [("replicate", False), ("fully_shard", False),
                                                 ("fully_shard", True)],
                                 ids=["replicate", "fully_shard", "fully_shard-bf16"])
WORLD_SIZES = pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])


@WORLD_SIZES
@STYLES
def test_micro_batch_accumulation_syncs_once(pool, style, mixed, record_property):
    for rank, rep in enumerate(pool.run(accumulation_job, style, mixed, timeout=600)):
        if style == "fully_shard":
            assert "accumulated unsharded" in rep["notes"]["fully_shard"], rep["notes"]
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], (
            f"{style} accumulation differs on rank {rank}:\n  " + "\n  ".join(rep["problems"][:20]))
        # one gradient collective per parameter (bucketing off), not one per micro-batch; read
        # on rank 0, which builds the program (the others may receive it, without its graph)
        assert rep["grad_syncs"] == rep["params"] or rank and rep["grad_syncs"] is None, rep


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_micro_batches_reduce_scattered_each_beyond_the_cap(pool, mixed, record_property):
    for rank, rep in enumerate(pool.run(accumulation_job, "fully_shard", mixed, True,
                                        timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], (
            f"per-micro-batch reduce-scatter differs from FSDP2 on rank {rank}:\n  "
            + "\n  ".join(rep["problems"][:20]))
        # one bucket per micro-batch (rank 0 builds and has the graph)
        assert rep["grad_syncs"] == MICRO_BATCHES or rank and rep["grad_syncs"] is None, rep
        assert "each micro-batch's gradients reduce-scattered" in rep["notes"]["fully_shard"], rep


# --------------------------------------------------------------------------------------------------
# Gradient accumulation across calls: step.no_sync()
# --------------------------------------------------------------------------------------------------

CALLS_PER_UPDATE = 3


def no_sync_job(style: str, mixed: bool = False) -> dict:
    """``CALLS_PER_UPDATE - 1`` calls of the compiled step inside ``no_sync()``, then one outside,
    against DDP (``no_sync()`` around forward+backward) or FSDP2
    (``set_requires_gradient_sync(False)``) doing the same forward/backwards and one optimizer
    step; parameters must not move inside ``no_sync``. ``mixed``: bf16 parameters, fp32
    reduction on both sides (fully_shard)."""
    from spmd_compiler import DataParallel, spmd_compile

    model, ref, policy, no_sync = _model_and_reference(style, mixed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    compiled = spmd_compile(DataParallel(style, mp_policy=policy,
                                         divide_gradients="after" if mixed else "before"))(mse_step)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    chk = ParityChecker(1e-5, 1e-6)
    for i in range(STEPS):
        ref_opt.zero_grad()
        for k in range(CALLS_PER_UPDATE):
            x, y = rank_data(600 + 10 * i + k, (BATCH, 50), (BATCH, 8))
            skip = k < CALLS_PER_UPDATE - 1
            before = [full(p).clone() for p in model.parameters()] if skip else None
            with compiled.no_sync() if skip else contextlib.nullcontext():
                loss = compiled(model, opt, (x.clone(), y.clone()))
            with no_sync(skip):
                ref_loss = torch.nn.functional.mse_loss(ref(x), y)
                ref_loss.backward()
            chk.close("loss", f"update {i} call {k}: loss", loss, ref_loss.detach())
            if skip:
                chk.check(all(torch.equal(a, full(p)) for a, p in zip(before, model.parameters())),
                          f"update {i} call {k}: parameters moved inside no_sync")
        ref_opt.step()
        if style == "fully_shard":
            compare_with_reference(chk, f"update {i}", model, opt, ref, ref_opt)
        else:
            from tests.test_replicate import compare_with_ddp

            compare_with_ddp(chk, i, model, opt, ref.module, ref_opt)
    return dict(max_err=chk.max_err, problems=chk.problems, compiles=compiled.compile_count)


@WORLD_SIZES
@STYLES
def test_no_sync_accumulates_across_calls(pool, style, mixed, record_property):
    for rank, rep in enumerate(pool.run(no_sync_job, style, mixed, timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], (
            f"{style} no_sync differs on rank {rank}:\n  " + "\n  ".join(rep["problems"][:20]))
        # accumulate and apply with a fresh optimizer (apply creates Adam's state), then both
        # again with the optimizer's state as inputs; none after that
        assert rep["compiles"] == 4, rep


def two_models_no_sync_job() -> dict:
    """Two models trained through one compiled step, interleaved: inside ``no_sync()`` a call
    for A, then one for B, then one each outside. Each model's accumulated gradients are its
    own (against a DDP model each)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile
    from tests.test_replicate import compare_with_ddp

    compiled = spmd_compile(DataParallel("replicate"))(mse_step)
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = SimpleMLP()
        ref = DDP(deepcopy(model))
        runs.append((model, torch.optim.SGD(model.parameters(), lr=LR), ref,
                     torch.optim.SGD(ref.parameters(), lr=LR)))
    chk = ParityChecker(1e-5, 1e-6)
    for i in range(2):
        for _, _, _, ref_opt in runs:
            ref_opt.zero_grad()
        for k in range(2):
            skip = k == 0
            for m, (model, opt, ref, _) in enumerate(runs):
                x, y = rank_data(700 + 10 * i + 3 * k + m, (BATCH, 50), (BATCH, 8))
                with compiled.no_sync() if skip else contextlib.nullcontext():
                    compiled(model, opt, (x.clone(), y.clone()))
                with ref.no_sync() if skip else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(ref(x), y).backward()
        for m, (model, opt, ref, ref_opt) in enumerate(runs):
            ref_opt.step()
            compare_with_ddp(chk, f"model {m} update {i}", model, opt, ref.module, ref_opt)
    return dict(problems=chk.problems)


def test_no_sync_gradients_belong_to_their_model(pool2):
    for rank, rep in enumerate(pool2.run(two_models_no_sync_job, timeout=600)):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
