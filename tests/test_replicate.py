"""Replicate data parallelism checked against DDP on real gloo groups (world sizes 2 and 3).

Every case builds the same initial model on every rank (``torch.manual_seed(0)``), a DDP reference
from a deepcopy of it with the same optimizer configuration, and runs several compiled steps with
different data on every rank (:func:`tests.multirank.rank_data`), the last one a short batch. After
every step it compares, on every rank, each parameter (``p.to_local()`` vs DDP's), each optimizer
state tensor, each buffer, the learning rates and the returned loss (the local loss, as DDP's).

All cases of one world size run in one worker job (each compile costs about a second); the job
returns a report per case and each case is asserted in its own test.

Tolerances (float32 round-off): ``|actual - expected| <= ATOL + RTOL * |expected|`` with RTOL and
ATOL below. Observed on torch 2.13 CPU/gloo: world size 2 is bit-exact (DDP also divides each
gradient by the world size before summing); at world size 3 gloo sums DDP's flat bucket and the
compiled step's per-parameter tensors in different orders, giving parameter errors up to ~4e-7,
optimizer-state errors up to ~1e-6 and loss errors up to ~8e-6 (on summed losses around 60).
"""

from __future__ import annotations

import traceback
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist

from spmd_compiler.runtime.agreement import exchange_objects
from tests.logs import messages as log_messages, spmd_log
from tests.models import MODELS, flexible_step, mse_step, train_step
from tests.multirank import ParityChecker, SelectedCases, assert_parity_report, rank_data

RTOL = 1e-5
ATOL = 1e-6

BATCH = 16  # local batch size of the full steps
SHORT_BATCH = 11  # the last, short batch
FULL_STEPS = 5  # full steps, then one short step

STEP_FNS = {"train_step": train_step, "mse_step": mse_step, "flexible_step": flexible_step}

# name -> case. "optim": (class name, kwargs); "groups": param groups as (fqn prefix, options);
# "scheduler": (class name, kwargs); "compiles": expected compile_count after all steps (a fresh
# optimizer that keeps state compiles twice: once creating the state, once for the steady state;
# Adam and AdamW once: their first-step state is made before recording).
CASES: dict[str, dict] = {
    # The seed's replicate cases.
    "sgd_lr": dict(model="SimpleMLP", optim=("SGD", {"lr": 0.1}), compiles=1),
    "sgd_momentum": dict(
        model="SimpleMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9}), compiles=2
    ),
    "sgd_momentum_foreach": dict(
        model="SimpleMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}), compiles=2
    ),
    "adam_fused": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.1, "fused": True}), compiles=1),
    "batch_dim_model_sgd": dict(model="BatchDimModel", optim=("SGD", {"lr": 0.1}), compiles=1),
    # More optimizers.
    "adam_default": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01}), compiles=1),
    "adam_foreach": dict(
        model="SimpleMLP", optim=("Adam", {"lr": 0.01, "foreach": True}), compiles=1
    ),
    "adamw_weight_decay": dict(
        model="SimpleMLP", optim=("AdamW", {"lr": 0.01, "weight_decay": 0.1}), compiles=1
    ),
    "sgd_nesterov_wd": dict(
        model="SimpleMLP",
        optim=("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        compiles=2,
    ),
    "sgd_nesterov_wd_fused": dict(
        model="SimpleMLP",
        optim=("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01,
                       "fused": True}),
        compiles=2,
    ),
    "two_param_groups": dict(
        model="SimpleMLP",
        optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
        groups=[("net1.", {"lr": 0.1}), ("net2.", {"lr": 0.01, "momentum": 0.5})],
        compiles=2,
    ),
    "lambda_lr_scheduler": dict(
        model="SimpleMLP",
        optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
        scheduler=("LambdaLR", {}),
        compiles=2,
    ),
    "step_lr_scheduler_adam": dict(
        model="SimpleMLP",
        optim=("Adam", {"lr": 0.02}),
        scheduler=("StepLR", {"step_size": 1, "gamma": 0.5}),
        compiles=1,
    ),
    # Models with buffers / tied weights, and a loss that averages over the batch.
    "batchnorm_buffers": dict(
        model="BatchNormMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9}), step="mse_step",
        compiles=2,
    ),
    "tied_weights": dict(model="TiedMLP", optim=("Adam", {"lr": 0.01}), compiles=1),
    # net1.weight (6.4 KB) keeps its own all_reduce (the first bucket closes at net2's gradients
    # and net1.bias), the rest share a bucket; the optimizer is the recorded foreach one, split
    # per bucket, not the fused kernel.
    "own_collective_and_bucket_unfused": dict(
        model="SimpleMLP", optim=("Adam", {"lr": 0.01, "foreach": True}), compiles=1,
        mode={"own_collective_mb": 0.004, "first_bucket_cap_mb": 1184 / 2**20,
              "fuse_optimizer": False},
    ),
    "own_collective_and_bucket_fused": dict(
        model="SimpleMLP", optim=("Adam", {"lr": 0.01}), compiles=1,
        mode={"own_collective_mb": 0.004, "first_bucket_cap_mb": 1184 / 2**20},
    ),
}


def _lambda_schedule(i: int) -> float:
    return 0.7 ** i


# --------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------


def _make_optimizer(model: torch.nn.Module, case: dict) -> torch.optim.Optimizer:
    cls_name, kwargs = case["optim"]
    cls = getattr(torch.optim, cls_name)
    if "groups" not in case:
        return cls(model.parameters(), **kwargs)
    groups = []
    for prefix, options in case["groups"]:
        params = [p for n, p in model.named_parameters() if n.startswith(prefix)]
        groups.append({"params": params, **options})
    return cls(groups, **kwargs)


def _make_scheduler(opt: torch.optim.Optimizer, case: dict):
    if "scheduler" not in case:
        return None
    name, kwargs = case["scheduler"]
    if name == "LambdaLR":
        return torch.optim.lr_scheduler.LambdaLR(opt, _lambda_schedule)
    return getattr(torch.optim.lr_scheduler, name)(opt, **kwargs)


def compare_with_ddp(chk: ParityChecker, step: int, model, opt, ddp_model, ddp_opt) -> None:
    """Parameters (Replicate DTensors on a 1-D mesh), optimizer states, lrs and buffers."""
    from torch.distributed.tensor import DTensor, Replicate

    ws = dist.get_world_size()
    ours = list(model.named_parameters())
    ref = list(ddp_model.named_parameters())
    chk.check([n for n, _ in ours] == [n for n, _ in ref],
              f"step {step}: parameter names {[n for n, _ in ours]} vs DDP {[n for n, _ in ref]}")
    for (name, p), (_, q) in zip(ours, ref):
        chk.check(isinstance(p, DTensor), f"step {step}: parameter {name} is not a DTensor")
        if isinstance(p, DTensor):
            chk.check(tuple(p.placements) == (Replicate(),),
                      f"step {step}: parameter {name} placements {p.placements}")
            chk.check(p.device_mesh.ndim == 1 and p.device_mesh.size() == ws,
                      f"step {step}: parameter {name} mesh {p.device_mesh}")
        chk.close("param", f"step {step}: parameter {name}", p, q)
        st, ref_st = opt.state.get(p, {}), ddp_opt.state.get(q, {})
        chk.check(sorted(st) == sorted(ref_st),
                  f"step {step}: optimizer state keys of {name}: {sorted(st)} "
                  f"vs DDP {sorted(ref_st)}")
        for k in ref_st:
            if k in st:
                chk.close("state", f"step {step}: optimizer state {name}.{k}", st[k], ref_st[k])
    chk.check(len(opt.param_groups) == len(ddp_opt.param_groups), f"step {step}: param group count")
    for gi, (g, rg) in enumerate(zip(opt.param_groups, ddp_opt.param_groups)):
        chk.check(g["lr"] == rg["lr"], f"step {step}: group {gi} lr {g['lr']} vs DDP {rg['lr']}")
    ref_buffers = dict(ddp_model.named_buffers())
    for name, b in model.named_buffers():
        chk.close("buffer", f"step {step}: buffer {name}", b, ref_buffers[name])


def _run_case(case: dict) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler.api import compile as spmd_api_compile
    from spmd_compiler.parallel_mode import DataParallel

    torch.manual_seed(0)  # the same initial model on every rank
    model = MODELS[case["model"]]()
    ddp = DDP(deepcopy(model))
    opt, ddp_opt = _make_optimizer(model, case), _make_optimizer(ddp.module, case)
    sched, ddp_sched = _make_scheduler(opt, case), _make_scheduler(ddp_opt, case)
    step_fn = STEP_FNS[case.get("step", "train_step")]
    # The seed's spelling.
    compiled = spmd_api_compile(parallel_mode=DataParallel("replicate", **case.get("mode", {})))(
        step_fn)

    chk = ParityChecker(RTOL, ATOL)
    counts = []
    lrs = []
    for i in range(FULL_STEPS + 1):
        b = BATCH if i < FULL_STEPS else SHORT_BATCH
        x, y = rank_data(100 + i, (b, 50), (b, 8))  # different on every rank
        if i == 0:
            sums = exchange_objects(float(x.sum()), None)
            chk.check(len(set(sums)) == len(sums), f"ranks got the same data: {sums}")
        loss = compiled(model, opt, (x.clone(), y.clone()))
        ddp_loss = step_fn(ddp, ddp_opt, (x, y))
        counts.append(compiled.compile_count)
        lrs.append([g["lr"] for g in opt.param_groups])
        chk.check(not isinstance(loss, DTensor) and loss.dim() == 0,
                  f"step {i}: loss is {type(loss).__name__} of shape {tuple(loss.shape)}")
        chk.close("loss", f"step {i}: loss", loss, ddp_loss.detach())
        if sched is not None:
            sched.step()
            ddp_sched.step()
        compare_with_ddp(chk, i, model, opt, ddp.module, ddp_opt)
    return dict(max_err=chk.max_err, problems=chk.problems, counts=counts, lrs=lrs)


def parity_job(names: list[str]) -> dict[str, dict]:
    """Run the named cases one after the other; a case that raises is reported, not fatal."""
    out = {}
    for name in names:
        try:
            out[name] = _run_case(CASES[name])
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name] = dict(exception=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            dist.barrier()  # keep the ranks together for the next case
    return out


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------

def _case_of(item) -> str | None:
    """The case a collected test reads."""
    if item.originalname == "test_scheduler_lr_takes_effect_without_recompiling":
        return "lambda_lr_scheduler"
    return item.callspec.params.get("case")


_REPORTS = SelectedCases(parity_job, _case_of, timeout=600)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("case", list(CASES))
def test_replicate_matches_ddp(pool, case):
    expected_compiles = CASES[case]["compiles"]
    for rank, reports in enumerate(_REPORTS.reports(pool)):
        rep = reports[case]
        assert "exception" not in rep, f"{case} raised on rank {rank}: {rep.get('exception')}"
        # Observed max abs errors (shown with -rP / -s).
        print(f"{case} ws{pool.world_size} rank {rank}: max abs err "
              + ", ".join(f"{k} {v:.2g}" for k, v in rep["max_err"].items()))
        assert_parity_report(rep, case, pool.world_size, rank, expected_compiles)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_scheduler_lr_takes_effect_without_recompiling(pool):
    """LambdaLR changes lr every call: the compiled step must use the new lr (parity above checks
    the values) and keep running the same graph."""
    for rank, reports in enumerate(_REPORTS.reports(pool)):
        rep = reports["lambda_lr_scheduler"]
        assert "exception" not in rep, rep.get("exception")
        assert rep["counts"][-1] == 2, rep["counts"]
        lrs = [lr[0] for lr in rep["lrs"]]
        assert lrs == pytest.approx([0.1 * 0.7 ** i for i in range(len(lrs))]), lrs
        assert len(set(lrs)) == len(lrs)
        assert not rep["problems"], rep["problems"][:5]


# --------------------------------------------------------------------------------------------------
# Caching: what recompiles and what does not
# --------------------------------------------------------------------------------------------------


def caching_job() -> dict:
    """One compiled step called with changing models, optimizers, batch structures and dtypes.

    Returns the sequence of (event, compile_count, recompile log messages) and every parity
    problem against DDP references that saw the same calls.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    with spmd_log() as records:
        compiled = spmd_compile(DataParallel("replicate"))(flexible_step)
        chk = ParityChecker(RTOL, ATOL)
        events = []
        step_no = [0]

        torch.manual_seed(0)
        model_a = MODELS["SimpleMLP"]()
        ddp_a = DDP(deepcopy(model_a))
        sgd_a = torch.optim.SGD(model_a.parameters(), lr=0.05, momentum=0.9)
        ddp_sgd_a = torch.optim.SGD(ddp_a.parameters(), lr=0.05, momentum=0.9)

        def call(event, model, opt, ddp, ddp_opt, kind="tuple", dtype=torch.float32, b=BATCH):
            i = step_no[0]
            step_no[0] += 1
            x, y = rank_data(500 + i, (b, 50), (b, 8), dtype=dtype)
            if kind == "views":  # both inputs are column slices of one (b, 58) tensor
                data = torch.cat([x, y], dim=1)
                x, y = data[:, :50], data[:, 50:]
            batch = {"x": x, "y": y} if kind == "dict" else (x, y)
            before = len(records)
            loss = compiled(model, opt, deepcopy(batch))
            ddp_loss = flexible_step(ddp, ddp_opt, batch)
            chk.close("loss", f"{event} (call {i}): loss", loss, ddp_loss.detach())
            compare_with_ddp(chk, i, model, opt, ddp.module, ddp_opt)
            events.append((event, compiled.compile_count, log_messages(records[before:])))

        call("first call", model_a, sgd_a, ddp_a, ddp_sgd_a)
        call("same again", model_a, sgd_a, ddp_a, ddp_sgd_a)
        call("same again, smaller batch", model_a, sgd_a, ddp_a, ddp_sgd_a, b=7)
        call("batch of one", model_a, sgd_a, ddp_a, ddp_sgd_a, b=1)
        call("batch of one again", model_a, sgd_a, ddp_a, ddp_sgd_a, b=1)
        call("inputs are views of one tensor", model_a, sgd_a, ddp_a, ddp_sgd_a, kind="views")
        call("inputs are views again", model_a, sgd_a, ddp_a, ddp_sgd_a, kind="views")
        call("dict batch", model_a, sgd_a, ddp_a, ddp_sgd_a, kind="dict")
        call("dict batch again", model_a, sgd_a, ddp_a, ddp_sgd_a, kind="dict")
        call("tuple batch again", model_a, sgd_a, ddp_a, ddp_sgd_a)
        call("float64 batch", model_a, sgd_a, ddp_a, ddp_sgd_a, dtype=torch.float64)
        call("float64 batch again", model_a, sgd_a, ddp_a, ddp_sgd_a, dtype=torch.float64)
        for g, dg in zip(sgd_a.param_groups, ddp_sgd_a.param_groups):
            g["momentum"] = dg["momentum"] = 0.5
        call("momentum changed", model_a, sgd_a, ddp_a, ddp_sgd_a)
        call("momentum changed, again", model_a, sgd_a, ddp_a, ddp_sgd_a)

        # Adam's first update is about lr * sign(grad): where a gradient element is as small as
        # eps (1e-8 by default) a one-ulp difference in the averaged gradient (gloo sums DDP's
        # flat bucket and the compiled step's per-parameter tensors in different orders at world
        # size 3) moves the update by ~1e-3 * lr. A larger eps keeps this test about caching; the
        # parity cases above cover Adam's default eps.
        adam_a = torch.optim.Adam(model_a.parameters(), lr=0.01, eps=1e-4)
        ddp_adam_a = torch.optim.Adam(ddp_a.parameters(), lr=0.01, eps=1e-4)
        call("new optimizer (Adam), first call", model_a, adam_a, ddp_a, ddp_adam_a)
        call("new optimizer (Adam), second call", model_a, adam_a, ddp_a, ddp_adam_a)
        call("new optimizer (Adam), again", model_a, adam_a, ddp_a, ddp_adam_a)

        torch.manual_seed(1)
        model_b = MODELS["TiedMLP"]()
        ddp_b = DDP(deepcopy(model_b))
        sgd_b = torch.optim.SGD(model_b.parameters(), lr=0.05)
        ddp_sgd_b = torch.optim.SGD(ddp_b.parameters(), lr=0.05)
        call("new model", model_b, sgd_b, ddp_b, ddp_sgd_b)
        call("new model again", model_b, sgd_b, ddp_b, ddp_sgd_b)
        call("back to the first model and Adam", model_a, adam_a, ddp_a, ddp_adam_a)
        call("back to the second model", model_b, sgd_b, ddp_b, ddp_sgd_b)
        return dict(events=events, problems=chk.problems, max_err=chk.max_err)


# event -> (compiles added by that call, what the recompile log on rank 0 must name as changed,
# relative to the previous compile)
EXPECTED_CACHING = [
    ("first call", 1, None),  # creates the momentum buffers in-graph ...
    ("same again", 1, "optimizer"),  # ... then compiles the steady state once
    ("same again, smaller batch", 0, None),
    # Size 1 may fall outside the shape guards (e.g. Ne(s0, 1) from a contiguity check): it may
    # recompile once (None: 0 or 1), but must compute the right thing.
    ("batch of one", None, None),
    ("batch of one again", 0, None),
    # Views (non-zero storage offset, row stride 58) may need their own graph, once.
    ("inputs are views of one tensor", None, None),
    ("inputs are views again", 0, None),
    ("dict batch", 1, "input structure"),
    ("dict batch again", 0, None),
    ("tuple batch again", 0, None),
    ("float64 batch", 1, "inputs"),
    ("float64 batch again", 0, None),
    ("momentum changed", 1, "param_groups[0]['momentum'] changed 0.9 -> 0.5"),  # a value guard
    ("momentum changed, again", 0, None),
    ("new optimizer (Adam), first call", 1, "optimizer"),  # its state made before recording:
    ("new optimizer (Adam), second call", 0, None),  # one compile (optimizer_state.py)
    ("new optimizer (Adam), again", 0, None),
    ("new model", 1, "module"),
    ("new model again", 0, None),
    ("back to the first model and Adam", 0, None),
    ("back to the second model", 0, None),
]


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_caching_recompiles_exactly_when_needed(pool):
    results = pool.run(caching_job, timeout=600)
    for rank, res in enumerate(results):
        assert not res["problems"], (
            f"rank {rank}: results differ from DDP:\n  " + "\n  ".join(res["problems"][:20])
        )
        events = res["events"]
        assert [e for e, _, _ in events] == [e for e, _, _ in EXPECTED_CACHING]
        prev = 0
        for (event, count, messages), (_, added, words) in zip(events, EXPECTED_CACHING):
            delta, prev = count - prev, count
            assert delta == added or (added is None and delta in (0, 1)), (
                f"rank {rank}: '{event}' added {delta} compile(s), expected "
                f"{'0 or 1' if added is None else added}; "
                f"compile_count sequence {[c for _, c, _ in events]}"
            )
            recompiles = [m for m in messages if "recompiling" in m]
            if rank == 0 and words is not None:
                changed = [
                    what.strip()
                    for m in recompiles for what in m.split("changed ", 1)[-1].split(",")
                ]
                assert words in changed or any(words in m for m in recompiles), (
                    f"'{event}': expected a recompile log saying '{words}', got {recompiles}"
                )
            if delta == 0:
                assert not recompiles, f"'{event}' logged a recompile: {recompiles}"


# --------------------------------------------------------------------------------------------------
# The LR scheduler sees the optimizer stepped, as in eager
# --------------------------------------------------------------------------------------------------

def _scheduler_warnings(step, opt, accumulate_first: bool) -> list[str]:
    """The scheduler warnings of three calls of ``step`` (``step(batch, no_sync)``), each followed
    by ``scheduler.step()``; the first call inside ``no_sync`` when ``accumulate_first``."""
    import warnings

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9 ** k)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            step(rank_data(300 + i, (8, 50), (8, 8)), accumulate_first and i == 0)
            sched.step()
    return [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]


def scheduler_warning_job(mode: str, accumulate_first: bool) -> dict[str, list[str]]:
    """Scheduler warnings under the compiled step and its eager reference (DDP; FSDP2 for
    fully_shard), with the optimizer created and wrapped by the scheduler before the first call."""
    import contextlib

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile
    from tests.models import SimpleMLP

    torch.manual_seed(0)
    model, eager = SimpleMLP(), SimpleMLP()
    eager.load_state_dict(model.state_dict())
    eager = fully_shard(eager) if mode == "fully_shard" else DDP(eager)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=0.01)
    compiled = spmd_compile(DataParallel(mode))(train_step)

    def compiled_call(batch, accumulate):
        with compiled.no_sync() if accumulate else contextlib.nullcontext():
            compiled(model, opt, batch)

    def eager_call(batch, accumulate):
        if not accumulate:
            return train_step(eager, eager_opt, batch)
        if mode == "fully_shard":
            eager.set_requires_gradient_sync(False)
        with eager.no_sync() if mode == "replicate" else contextlib.nullcontext():
            x, y = batch
            torch.nn.functional.mse_loss(eager(x), y).backward()  # forward + backward only
        if mode == "fully_shard":
            eager.set_requires_gradient_sync(True)

    return {"compiled": _scheduler_warnings(compiled_call, opt, accumulate_first),
            "eager": _scheduler_warnings(eager_call, eager_opt, accumulate_first)}


@pytest.mark.parametrize("accumulate_first", [False, True], ids=["step_first", "no_sync_first"])
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_lr_scheduler_sees_the_optimizer_stepped_on_every_rank(pool2, mode, accumulate_first):
    """torch's LR scheduler warns at its first step() unless the optimizer's step() ran before
    it (it wraps ``optimizer.step``); the compiled step leaves the optimizer as eager does on
    every rank, also on ranks that received the program instead of recording it: no warning
    after a step, the eager warning after a call inside ``no_sync`` (no optimizer step)."""
    for rank, seen in enumerate(pool2.run(scheduler_warning_job, mode, accumulate_first)):
        assert seen["compiled"] == seen["eager"], (rank, seen)
        assert bool(seen["eager"]) == accumulate_first, (rank, seen)


# ---------------------------------------------------------------------------------------------
# The optimizer as torch's fused kernel, whatever the user wrote

FUSED_KERNELS = {"Adam": "_fused_adam_", "AdamW": "_fused_adamw_", "SGD": "_fused_sgd_"}


def fused_as_written_job(name: str, options: dict) -> dict:
    """DDP with the optimizer as written and with ``fused=True`` (eager PyTorch's own
    fused-vs-written difference), and the compiled replicate step (which records the fused
    kernel), five steps on different data per rank; the largest parameter and optimizer-state
    differences between them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile
    from tests.models import SimpleMLP

    def built(extra):
        torch.manual_seed(0)
        model = SimpleMLP()
        return model, getattr(torch.optim, name)(model.parameters(), **{**options, **extra})

    (written, written_opt), (fused, fused_opt) = built({}), built({"fused": True, "foreach": None})
    written, fused = DDP(written), DDP(fused)
    model, opt = built({})
    step = spmd_compile(DataParallel("replicate"))(train_step)
    for i in range(5):
        batch = rank_data(i, (16, 50), (16, 8))
        train_step(written, written_opt, batch)
        train_step(fused, fused_opt, batch)
        step(model, opt, batch)

    def largest(a, a_opt, b, b_opt):
        pairs = list(zip(a.parameters(), b.parameters()))
        pairs += [(a_opt.state[p][k], b_opt.state[q][k]) for p, q in zip(a.parameters(), b.parameters())
                  for k in a_opt.state[p] if k != "step"]
        local = [tuple(getattr(t, "to_local", t.detach)().detach() for t in pair) for pair in pairs]
        return max(float((x - y).abs().max()) for x, y in local)

    built_here = getattr(step.last_compiled.run, "graph", None)  # rank 0 builds, shares it
    kernels = {str(n.target) for n in built_here.nodes if n.op == "call_function"} \
        if built_here is not None else None
    return {"eager fused vs written": largest(fused.module, fused_opt, written.module, written_opt),
            "compiled vs written": largest(model, opt, written.module, written_opt),
            "compiled vs fused": largest(model, opt, fused.module, fused_opt),
            "fused kernel": kernels and any(FUSED_KERNELS[name] in k for k in kernels),
            "foreach ops": kernels and sorted(k for k in kernels if "_foreach_" in k
                                              and "add_.Scalar" not in k)}


@pytest.mark.parametrize("name, options", [
    ("Adam", {"lr": 0.01}), ("Adam", {"lr": 0.01, "foreach": True}),
    ("AdamW", {"lr": 0.01, "foreach": False}), ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
], ids=["adam", "adam-foreach", "adamw-single-tensor", "sgd-momentum", "sgd-momentum-foreach"])
def test_optimizer_runs_as_the_fused_kernel_within_eager_fused_vs_written(pool2, name, options):
    """The compiled step updates with torch's fused kernel (one ``_fused_*_`` per bucket, no
    foreach update ops; the step counts' ``_foreach_add_`` stays, as in torch's fused path)
    whatever the optimizer names; its parameters and states differ from DDP's as written by at
    most eager PyTorch's own fused-vs-written difference (plus 1e-7 of gradient round-off),
    and from DDP with ``fused=True`` by at most ATOL."""
    results = pool2.run(fused_as_written_job, name, options)
    assert results[0]["fused kernel"] and results[0]["foreach ops"] == [], results[0]
    for rank, r in enumerate(results):
        assert r["compiled vs written"] <= r["eager fused vs written"] + 1e-7, (rank, r)
        assert r["compiled vs fused"] <= ATOL, (rank, r)
