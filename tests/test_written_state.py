"""Python state the step both writes and reads is read on every call, as eager PyTorch reads it.

A number the step assigns and also uses in its tensor work (a KL warm-up weight on the model, a
global step counter in a loss weight, a trainer's auxiliary weight halved each step, a counter a
forward counts up on a plain object) is a program input read at every call, and the assignment
runs again after every call: training matches DDP step for step. A bound-method step
(``Trainer.step``) watches its instance like any argument: a counter on ``self`` counts on every
rank. A forward counting its calls on a plain object and using the count gets the count as an
input and its new value set after each call. A change that cannot be repeated (a forward's count
capped with ``min``: a branch on the input) raises a SideEffectError naming the line, on every
rank, and changes nothing.

DDP runs the same step eagerly on the same per-rank batches; every parameter and optimizer state
is compared after each step (rtol 1e-5, atol 1e-6); block reuse and the shared compile are on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multirank import ParityChecker, rank_data

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4
GLOBAL_STEP = 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.kl_w = 0.0

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Counter:
    """A plain object a forward counts its calls on."""

    def __init__(self):
        self.n = 0


class CountingNet(Net):
    def __init__(self):
        super().__init__()
        self.stats = Counter()

    def forward(self, x):
        self.stats.n += 1
        return self.b(torch.tanh(self.a(x))) * (1.0 + 0.5 * self.stats.n)


class CappedCountingNet(Net):
    def __init__(self):
        super().__init__()
        self.stats = Counter()

    def forward(self, x):
        self.stats.n = min(self.stats.n + 1, 3)
        return self.b(torch.tanh(self.a(x))) * (1.0 + 0.5 * self.stats.n)


FORWARD_CALLS = 0


class GlobalCountingNet(Net):
    """A forward counting its calls in a global of its module and using the count."""

    def forward(self, x):
        global FORWARD_CALLS
        FORWARD_CALLS += 1
        return self.b(torch.tanh(self.a(x))) * (1.0 + 0.25 * FORWARD_CALLS)


class AttributeCountingNet(Net):
    """A forward counting its calls in an attribute of its own and using the count."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(torch.tanh(self.a(x))) * (1.0 + 0.25 * self.calls)


def _batch(i):
    return rank_data(300 + i, (6, 8), (6, 4))


def kl_warmup_step(model, opt, batch):
    opt.zero_grad()
    x, y = batch
    out = model(x)
    loss = F.mse_loss(out, y) + model.kl_w * out.pow(2).mean()
    loss.backward()
    opt.step()
    model.kl_w = min(1, model.kl_w + .25)
    return loss


def warmup_first_step(model, opt, batch):
    model.kl_w = model.kl_w + 0.25
    opt.zero_grad()
    x, y = batch
    out = model(x)
    loss = F.mse_loss(out, y) + model.kl_w * out.pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def global_counter_step(model, opt, batch):
    global GLOBAL_STEP
    opt.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * (1.0 + 0.5 * GLOBAL_STEP)
    loss.backward()
    opt.step()
    GLOBAL_STEP += 1
    return loss


def plain_step(model, opt, batch):
    opt.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


class Trainer:
    def __init__(self):
        self.aux_w = 1.0
        self.steps = 0

    def step(self, model, opt, batch):
        opt.zero_grad()
        x, y = batch
        out = model(x)
        loss = F.mse_loss(out, y) + self.aux_w * out.abs().mean()
        loss.backward()
        opt.step()
        self.aux_w *= 0.5
        return loss

    def count(self, model, opt, batch):
        opt.zero_grad()
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        self.steps += 1
        return loss


def _compare(check, model, opt, ref, ref_opt, where):
    ref_params = dict(ref.module.named_parameters())
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        check.close("param", f"{where} {n}", full, ref_params[n])
        for k, v in opt.state.get(p, {}).items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            check.close("state", f"{where} {n}.{k}", v, ref_opt.state[ref_params[n]][k])


def _pair(cls, style_opt):
    torch.manual_seed(0)
    model = cls()
    ref = DDP(cls())
    ref.module.load_state_dict(model.state_dict())
    ref.kl_w = 0.0  # the eager step reads and writes it on the module it is given
    return model, style_opt(model), ref, style_opt(ref.module)


def _adam(m):
    return torch.optim.Adam(m.parameters(), lr=0.05)


def written_and_read_job(case: str, style: str) -> dict:
    """Train ``case`` compiled and under DDP for STEPS steps; compare after each step."""
    global GLOBAL_STEP
    from spmd_compiler import DataParallel, spmd_compile

    model, opt, ref, ref_opt = _pair(Net, _adam)
    check = ParityChecker(RTOL, ATOL)
    if case.startswith("trainer"):
        trainer, ref_trainer = Trainer(), Trainer()
        method = "step" if case == "trainer aux_w" else "count"
        step = spmd_compile(DataParallel(style))(getattr(trainer, method))
        for i in range(STEPS):
            step(model, opt, _batch(i))
            getattr(ref_trainer, method)(ref, ref_opt, _batch(i))
            _compare(check, model, opt, ref, ref_opt, f"step {i}")
        check.check(trainer.aux_w == ref_trainer.aux_w and trainer.steps == ref_trainer.steps,
                    f"trainer state {trainer.aux_w, trainer.steps} vs "
                    f"{ref_trainer.aux_w, ref_trainer.steps}")
        return {"problems": check.problems, "compiles": step.compile_count}
    fn = {"kl warm-up": kl_warmup_step, "global counter": global_counter_step,
          "warm-up first": warmup_first_step}[case]
    step = spmd_compile(DataParallel(style))(fn)
    for i in range(STEPS):
        GLOBAL_STEP = i
        step(model, opt, _batch(i))
        compiled_state = (model.kl_w, GLOBAL_STEP)
        GLOBAL_STEP = i
        fn(ref, ref_opt, _batch(i))
        ref_state = (ref.kl_w, GLOBAL_STEP)
        check.check(compiled_state == ref_state, f"step {i}: Python state {compiled_state} vs "
                                                 f"DDP's {ref_state}")
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
    return {"problems": check.problems, "compiles": step.compile_count}


def _run(pool, case, style):
    for rank, res in enumerate(pool.run(written_and_read_job, case, style)):
        assert not res["problems"], (case, style, rank, res["problems"])
        # one compile: Adam's state is made before recording, the number is an input from the
        # first program on
        assert res["compiles"] == 1, (case, style, rank, res["compiles"])


def test_kl_warmup_weight_on_the_model_is_read_on_every_call(pool2):
    _run(pool2, "kl warm-up", "replicate")
    _run(pool2, "kl warm-up", "fully_shard")


def test_a_weight_raised_before_the_tensor_work(pool2):
    _run(pool2, "warm-up first", "replicate")


def test_global_step_counter_in_the_loss_weight(pool2):
    _run(pool2, "global counter", "replicate")


def test_bound_method_step_halving_its_own_weight(pool2):
    _run(pool2, "trainer aux_w", "replicate")


def test_bound_method_step_counts_on_every_rank(pool2):
    _run(pool2, "trainer steps", "replicate")


def forward_counter_job(style: str, where: str) -> dict:
    """A forward that counts its calls (on a plain object it holds, in a global of its module,
    in its own attribute) and uses the count: the count is a program input, and its new value
    (a function of it) is set after every call."""
    global FORWARD_CALLS
    from spmd_compiler import DataParallel, spmd_compile

    cls = {"object": CountingNet, "global": GlobalCountingNet, "attribute": AttributeCountingNet}
    model, opt, ref, ref_opt = _pair(cls[where], _adam)

    def count(m):
        return {"object": lambda: m.stats.n, "global": lambda: FORWARD_CALLS,
                "attribute": lambda: m.calls}[where]()

    step = spmd_compile(DataParallel(style))(plain_step)
    check = ParityChecker(RTOL, ATOL)
    for i in range(STEPS):
        FORWARD_CALLS = i
        step(model, opt, _batch(i))
        compiled = count(model)
        FORWARD_CALLS = i
        plain_step(ref, ref_opt, _batch(i))
        check.check(compiled == count(ref.module) == i + 1,
                    f"step {i}: count {compiled} vs DDP's {count(ref.module)}")
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
    return {"problems": check.problems, "compiles": step.compile_count}


@pytest.mark.parametrize("where", ["object", "global", "attribute"])
def test_forward_counting_its_calls(pool2, where):
    for style in ("replicate", "fully_shard"):
        for rank, res in enumerate(pool2.run(forward_counter_job, style, where)):
            assert not res["problems"], (style, where, rank, res["problems"])
            assert res["compiles"] == 1, (style, where, rank, res["compiles"])


def forward_counter_refused_job() -> dict:
    """A forward that counts with a branch on the count (``min``) cannot be repeated after the
    call (the new value is not a function of the inputs alone, and no statement of the step
    makes it): the first call raises, naming the line, and leaves the counter and the model as
    they were."""
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import SideEffectError

    model, opt, *_ = _pair(CappedCountingNet, _adam)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = spmd_compile(DataParallel("replicate"))(plain_step)
    try:
        step(model, opt, _batch(0))
        error = None
    except SideEffectError as e:
        error = str(e)
    same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return {"error": error, "count": model.stats.n, "unchanged": same and not opt.state}


def test_forward_counting_that_branches_raises_on_every_rank(pool2):
    for res in pool2.run(forward_counter_refused_job):
        assert res["error"] is not None and "self.stats.n = min(" in res["error"], res
        assert "attribute(s) n" in res["error"], res["error"]
        assert res["count"] == 0 and res["unchanged"], res


# --------------------------------------------------------------------------------------------------
# Per-call scalars of the optimizer's param groups


def one_cycle_job(kind: str, style: str) -> dict:
    """OneCycleLR cycling the momentum (SGD's ``momentum``, Adam's ``betas[0]``) stepped after
    each call for 8 steps: parameters and optimizer states match DDP's after every step, and the
    step compiles no more often than without the scheduler (SGD with momentum: twice, its first
    call makes the momentum buffers; Adam: once)."""
    from spmd_compiler import DataParallel, spmd_compile

    def make(m):
        if kind == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        return torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=1e-3)

    model, opt, ref, ref_opt = _pair(Net, make)
    sched, ref_sched = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8,
                                                            cycle_momentum=True)
                        for o in (opt, ref_opt))
    step = spmd_compile(DataParallel(style))(plain_step)
    check = ParityChecker(RTOL, ATOL)
    for i in range(8):
        step(model, opt, _batch(i))
        sched.step()
        plain_step(ref, ref_opt, _batch(i))
        ref_sched.step()
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
    check.check(opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], "lr differs")
    return {"problems": check.problems, "compiles": step.compile_count}


def test_one_cycle_momentum_cycling_does_not_recompile(pool2):
    for kind, style, compiles in (("sgd", "replicate", 2), ("adam", "replicate", 1),
                                  ("adam", "fully_shard", 1)):
        for rank, res in enumerate(pool2.run(one_cycle_job, kind, style)):
            assert not res["problems"], (kind, style, rank, res["problems"])
            assert res["compiles"] == compiles, (kind, style, rank, res["compiles"])


# --------------------------------------------------------------------------------------------------
# Mixed-precision output dtypes nothing can compute in


def float8_output_job(style: str) -> dict:
    """``MixedPrecisionPolicy(output_dtype=torch.float8_e4m3fn)``: the first call raises a
    MixedPrecisionError naming the field; parameters and optimizer state are left as they were,
    and the same model then trains under a valid policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import MixedPrecisionError

    model, opt, *_ = _pair(Net, _adam)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float8_e4m3fn)
    step = spmd_compile(DataParallel(style, mp_policy=policy))(plain_step)
    error = None
    try:
        step(model, opt, _batch(0))
    except MixedPrecisionError as e:
        error = str(e)
    unchanged = (not opt.state and all(type(p) is nn.Parameter and torch.equal(p, before[n])
                                       for n, p in model.named_parameters()))
    good = spmd_compile(DataParallel(style, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32)))(plain_step)
    loss = good(model, opt, _batch(0))
    return {"error": error, "unchanged": unchanged, "trains": bool(torch.isfinite(loss))}


def test_float8_output_dtype_is_refused_at_the_first_call(pool2):
    for style in ("replicate", "fully_shard"):
        for res in pool2.run(float8_output_job, style):
            assert res["error"] and "output_dtype=torch.float8_e4m3fn" in res["error"], res
            assert res["unchanged"] and res["trains"], res


def weight_decay_schedule_job(kind: str) -> dict:
    """A weight-decay schedule set in the param groups between calls (as DINO's and others'
    training loops do) and Adam's betas changed between calls: parameters and optimizer states
    match DDP's after every step, and the step compiles once more when a value first changes,
    never once per step."""
    from spmd_compiler import DataParallel, spmd_compile

    model, opt, ref, ref_opt = _pair(Net, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05))
    step = spmd_compile(DataParallel("replicate"))(plain_step)
    check = ParityChecker(RTOL, ATOL)
    for i in range(6):
        for g in opt.param_groups + ref_opt.param_groups:
            if kind == "weight_decay":
                g["weight_decay"] = 0.01 + 0.02 * i
            else:
                g["betas"] = (0.9 - 0.01 * i, 0.999)
        step(model, opt, _batch(i))
        plain_step(ref, ref_opt, _batch(i))
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
    return {"problems": check.problems, "compiles": step.compile_count}


def test_a_weight_decay_schedule_compiles_once_more(pool2):
    for kind in ("weight_decay", "betas"):
        for rank, res in enumerate(pool2.run(weight_decay_schedule_job, kind)):
            assert not res["problems"], (kind, rank, res["problems"])
            assert res["compiles"] == 2, (kind, rank, res["compiles"])
