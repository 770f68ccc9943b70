"""Nothing a user writes in a step is silently dropped, and a replicate model saves like DDP's.

- Python state the step changes while it is recorded: an LR scheduler stepped at the end of the
  step (reached through a closure or passed as an argument), a module attribute or a global
  counted up there, is changed again after every call, and training matches DDP's learning rate
  and parameters; a change the compiled step cannot repeat (a scheduler stepped before the
  step's tensor work) raises a SideEffectError naming it and the line, and is left as it was.
- A scheduler passed to the step and only read is no cause for a rank disagreement.
- ``print(loss.item())`` in the step warns, naming the line; foreach Adam's own ``.item()`` does not.
- replicate: nanoGPT's checkpoint flow (``torch.save`` of ``model.state_dict()`` and
  ``optimizer.state_dict()`` on rank 0, a fresh model and optimizer loading them) resumes like DDP.
- fully_shard: ``get_model_state_dict(full_state_dict=True)`` equals DDP's parameters, loads into a
  fresh plain model, and full model+optimizer state loads into a fresh compiled step.
- Optimizer state that is DTensor while the parameters are plain again (and plain while they are
  placed) is placed correctly.
- A compile longer than a second prints one line by default; the second compile says why.

DDP is the reference, different data on every rank, tolerances rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import logging

import pytest
import warnings
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multirank import ParityChecker, rank_data

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4
COUNTER = 0
HISTORY: list = []


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batch(i):
    return rank_data(100 + i, (6, 8), (6, 4))


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _plain_step(model, opt, batch):
    opt.zero_grad()
    loss = _loss(model, batch)
    loss.backward()
    opt.step()
    return loss


def _models(make_opt):
    torch.manual_seed(0)
    model = Net()
    ref = DDP(Net())
    ref.module.load_state_dict(model.state_dict())
    return model, make_opt(model), ref, make_opt(ref.module)


def _compare(check, model, opt, ref, ref_opt, where):
    ref_params = dict(ref.module.named_parameters())
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        check.close("param", f"{where} {n}", full, ref_params[n])
        for k, v in opt.state.get(p, {}).items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            check.close("state", f"{where} {n}.{k}", v, ref_opt.state[ref_params[n]][k])
    for g, rg in zip(opt.param_groups, ref_opt.param_groups):
        check.close("param", f"{where} lr", g["lr"], rg["lr"])


def _train_both(step, model, opt, ref, ref_opt, steps, check=None, what="step"):
    """Run the compiled ``step`` and DDP on the same batches; compare after each when ``check``."""
    for i in steps:
        step(model, opt, _batch(i))
        _plain_step(ref, ref_opt, _batch(i))
        if check is not None:
            _compare(check, model, opt, ref, ref_opt, f"{what} {i}")


# --------------------------------------------------------------------------------------------------
# Python state changed inside the step


def scheduler_job(how: str, style: str = "replicate") -> dict:
    """A scheduler stepped inside the step (through a closure, or passed as an argument) keeps
    working as in eager PyTorch: the learning rate and the parameters match DDP's with the
    scheduler stepped at the end of its eager step. Passed and only read, it is no cause for a
    rank disagreement. Stepped before the step's tensor work, it raises and is left alone."""
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import SideEffectError

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    model, opt, ref, ref_opt = _models(sgd)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)

    def inside_closure(model, opt, batch):
        loss = _plain_step(model, opt, batch)
        sched.step()
        return loss

    def inside_argument(model, opt, batch, scheduler):
        loss = _plain_step(model, opt, batch)
        scheduler.step()
        return loss

    def reads_argument(model, opt, batch, scheduler):
        assert scheduler.last_epoch >= 0
        return _plain_step(model, opt, batch)

    def first_thing(model, opt, batch):
        sched.step()
        return _plain_step(model, opt, batch)

    out = {"error": None}
    if how == "before":
        try:
            spmd_compile(DataParallel("replicate"))(first_thing)(model, opt, _batch(0))
        except SideEffectError as e:
            out["error"] = str(e)
        out["left alone"] = (sched.last_epoch, sched.get_last_lr(), opt.param_groups[0]["lr"])
        return out
    fn = {"closure": inside_closure, "argument": inside_argument, "read": reads_argument}[how]
    step = spmd_compile(DataParallel(style))(fn)
    check = ParityChecker(RTOL, ATOL)
    for i in range(STEPS):
        step(model, opt, _batch(i), *(() if how == "closure" else (sched,)))
        if how == "read":
            sched.step()
        _plain_step(ref, ref_opt, _batch(i))
        ref_sched.step()
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
    out["problems"] = check.problems
    # (momentum SGD compiles twice: its first call creates the momentum buffers)
    out["lr"] = (opt.param_groups[0]["lr"], sched.last_epoch, step.compile_count)
    return out


def test_scheduler_stepped_inside_the_step_matches_ddp(pool2):
    # Reached through the step's closure, the scheduler's values are guarded: its step replaces
    # its ``_last_lr`` list, whose number then differs from the recorded one, and the step
    # compiles once more with it as an input (then never again). Passed as an argument, it is
    # not walked for guards.
    compiles = {"closure": 3, "argument": 2}
    for how, style in (("closure", "replicate"), ("argument", "replicate"), ("closure", "fully_shard")):
        for res in pool2.run(scheduler_job, how, style):
            assert not res["problems"], (how, res["problems"])
            assert res["lr"] == (0.1 * 0.5 ** STEPS, STEPS, compiles[how]), (how, res["lr"])


def test_scheduler_passed_and_read_is_no_rank_disagreement(pool2):
    for res in pool2.run(scheduler_job, "read"):
        assert not res["problems"], res["problems"]
        assert res["lr"] == (0.1 * 0.5 ** STEPS, STEPS, 2), res["lr"]


def periodic_scheduler_job(style: str) -> dict:
    """``StepLR(step_size=2)`` stepped inside the step, between the optimizer's step and an EMA
    update and ``return loss.detach()``: its learning rate changes every second call only (the
    replayed statement changes less than the recorded call did), as DDP's does."""
    from spmd_compiler import DataParallel, spmd_compile

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    model, opt, ref, ref_opt = _models(sgd)
    ema, ref_ema = Net(), Net()
    ema.load_state_dict(model.state_dict())
    ref_ema.load_state_dict(model.state_dict())

    def make_step(sched):
        def train_step(model, ema, opt, batch):
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
            return loss.detach()
        return train_step

    step = spmd_compile(DataParallel(style))(
        make_step(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)))
    train_step = make_step(torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5))
    check = ParityChecker(RTOL, ATOL)
    lrs = []
    for i in range(2 * STEPS):
        step(model, ema, opt, _batch(i))
        train_step(ref, ref_ema, ref_opt, _batch(i))
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
        lrs.append((opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"]))
    for (n, e), r in zip(ema.named_parameters(), ref_ema.parameters()):
        e = e.full_tensor() if hasattr(e, "full_tensor") else e
        check.close("param", f"ema {n}", e, r)
    return {"problems": check.problems, "lrs": lrs, "compiles": step.compile_count}


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_scheduler_stepping_every_second_call_inside_the_step_matches_ddp(pool2, style):
    for res in pool2.run(periodic_scheduler_job, style):
        assert not res["problems"], res["problems"][:5]
        assert [a for a, _ in res["lrs"]] == [b for _, b in res["lrs"]], res["lrs"]
        assert res["lrs"][-1][0] == 0.1 * 0.5 ** STEPS, res["lrs"]
        assert res["compiles"] <= 3, res["compiles"]


def test_scheduler_stepped_before_the_tensor_work_raises_naming_it(pool2):
    for res in pool2.run(scheduler_job, "before"):
        assert res["error"] is not None
        assert "StepLR" in res["error"] and "sched.step()" in res["error"], res["error"]
        assert "comes before the step's last tensor operation" in res["error"], res["error"]
        assert res["left alone"] == (0, [0.1], 0.1), res["left alone"]


def assignments_job() -> dict:
    """An attribute and a global counted up at the end of the step count on every call; a
    hyperparameter set at its start raises and is left alone."""
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import SideEffectError

    def counts_calls(model, opt, batch):
        loss = _plain_step(model, opt, batch)
        model.calls += 1
        return loss

    def counts_globally(model, opt, batch):
        global COUNTER
        loss = _plain_step(model, opt, batch)
        COUNTER += 1
        return loss

    def keeps_history(model, opt, batch):
        loss = _plain_step(model, opt, batch)
        HISTORY.append(len(HISTORY))
        return loss

    def logs_losses(model, opt, batch):
        loss = _plain_step(model, opt, batch)
        HISTORY.append(loss.item())
        return loss

    def sets_hyperparameter(model, opt, batch):
        opt.param_groups[0]["weight_decay"] = 0.1
        return _plain_step(model, opt, batch)

    out = {}
    for fn in (counts_calls, counts_globally, keeps_history, logs_losses, sets_hyperparameter):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd_compile(DataParallel("replicate"))(fn)
        out[fn.__name__] = None
        try:
            for i in range(3):
                step(model, opt, _batch(i))
        except SideEffectError as e:
            out[fn.__name__] = str(e)
        out[fn.__name__ + " left"] = (model.calls, COUNTER, opt.param_groups[0]["weight_decay"],
                                      list(HISTORY))
    return out


def test_counters_count_and_a_hyperparameter_set_first_raises(pool2):
    for res in pool2.run(assignments_job):
        assert res["counts_calls"] is None and res["counts_calls left"] == (3, 0, 0.0, []), res
        assert res["counts_globally"] is None and res["counts_globally left"] == (0, 3, 0.0, []), res
        assert res["keeps_history"] is None and res["keeps_history left"][3] == [0, 1, 2], res
        error = res["logs_losses"]
        assert "the contents of a list (global 'HISTORY')" in error, error
        assert "HISTORY.append(loss.item())" in error and "uses ['loss']" in error, error
        assert res["logs_losses left"][3] == [0, 1, 2], res
        error = res["sets_hyperparameter"]
        assert "param_groups[0]['weight_decay']" in error, error
        assert 'opt.param_groups[0]["weight_decay"] = 0.1' in error, error
        assert res["sets_hyperparameter left"] == (0, 3, 0.0, [0, 1, 2]), res


# --------------------------------------------------------------------------------------------------
# Values read in Python


def printing_job() -> dict:
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.trace.side_effects import ValueReadWarning

    def prints_loss(model, opt, batch):
        loss = _plain_step(model, opt, batch)
        print("loss", loss.item())
        return loss

    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01, foreach=True)  # noqa: E731
    model, opt, ref, ref_opt = _models(adam)
    check = ParityChecker(RTOL, ATOL)
    warned = []
    for fn in (prints_loss, _plain_step):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = spmd_compile(DataParallel("replicate", fuse_optimizer=False))(fn)
            for i in range(2):
                loss = step(model, opt, _batch(i))
                ref_loss = _plain_step(ref, ref_opt, _batch(i))
                check.close("loss", f"{fn.__name__} loss {i}", loss, ref_loss)
        warned.append([str(w.message) for w in caught if issubclass(w.category, ValueReadWarning)])
    _compare(check, model, opt, ref, ref_opt, "end")
    return {"warned": warned, "problems": check.problems}


def test_item_in_the_step_warns_naming_the_line(pool2):
    res = pool2.run(printing_job)
    assert all(not r["problems"] for r in res), res
    printed, plain = res[0]["warned"]
    # one warning per compile (Adam's first call compiles twice: its state is created)
    assert printed and all('print("loss", loss.item())' in w for w in printed), printed
    assert "only while the step is compiled" in printed[0]
    assert plain == [], plain  # foreach Adam's own step.item() is torch's, not the user's
    assert res[1]["warned"] == [[], []]  # rank 0 only


# --------------------------------------------------------------------------------------------------
# Saving and loading


def nanogpt_checkpoint_job(path: str) -> dict:
    """nanoGPT's flow: train, torch.save(raw_model.state_dict(), optimizer.state_dict()) on rank 0,
    a fresh model and optimizer load them, train on; DDP does the same."""
    from spmd_compiler import DataParallel, spmd_compile

    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)  # noqa: E731
    model, opt, ref, ref_opt = _models(adamw)
    _train_both(spmd_compile(DataParallel("replicate"))(_plain_step), model, opt, ref, ref_opt, range(3))
    out = {"types": sorted({type(v).__name__ for v in model.state_dict().values()} |
                           {type(v).__name__ for st in opt.state_dict()["state"].values()
                            for v in st.values()})}
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    ckpt = torch.load(path)
    torch.manual_seed(1)
    model2 = Net()
    model2.load_state_dict(ckpt["model"])
    opt2 = adamw(model2)
    opt2.load_state_dict(ckpt["optimizer"])
    check = ParityChecker(RTOL, ATOL)
    _train_both(spmd_compile(DataParallel("replicate"))(_plain_step), model2, opt2, ref, ref_opt,
                range(3, 6), check, "resumed step")
    out["problems"] = check.problems
    return out


def test_replicate_saves_and_resumes_like_ddp(pool2, tmp_path):
    for res in pool2.run(nanogpt_checkpoint_job, str(tmp_path / "ckpt.pt")):
        assert res["types"] == ["Tensor"], res["types"]
        assert not res["problems"], res["problems"]


def full_state_dict_job() -> dict:
    """fully_shard: full state dicts equal DDP's parameters and load into a fresh plain model and
    into a fresh compiled step, which then trains like DDP."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    from spmd_compiler import DataParallel, spmd_compile

    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    model, opt, ref, ref_opt = _models(adam)
    _train_both(spmd_compile(DataParallel("fully_shard"))(_plain_step), model, opt, ref, ref_opt, range(3))
    full = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    check = ParityChecker(RTOL, ATOL)
    out = {"types": sorted({type(v).__name__ for v in msd.values()})}
    for n, p in ref.module.named_parameters():
        check.close("param", f"full state dict {n}", msd[n], p)
    plain = Net()
    plain.load_state_dict(msd)
    for n, p in ref.module.named_parameters():
        check.close("param", f"fresh plain model {n}", dict(plain.named_parameters())[n], p)
    torch.manual_seed(1)
    model2 = Net()
    opt2 = adam(model2)
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd, options=full)
    _train_both(spmd_compile(DataParallel("fully_shard"))(_plain_step), model2, opt2, ref, ref_opt,
                range(3, 6), check, "resumed step")
    out["problems"] = check.problems
    return out


def test_fully_shard_full_state_dict_equals_ddp_and_resumes(pool2):
    for res in pool2.run(full_state_dict_job):
        assert res["types"] == ["Tensor"], res["types"]
        assert not res["problems"], res["problems"]


def mixed_state_job(style: str) -> dict:
    """Parameters plain again with the optimizer's DTensor state (a fresh model given the old
    optimizer's state dict), and plain optimizer state loaded into a placed optimizer: both are
    placed and train on like DDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from spmd_compiler import DataParallel, spmd_compile

    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    model, opt, ref, ref_opt = _models(adam)
    _train_both(spmd_compile(DataParallel(style))(_plain_step), model, opt, ref, ref_opt, range(2))
    check = ParityChecker(RTOL, ATOL)
    # a fresh plain model with the full parameters, and the old optimizer's DTensor state
    msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.manual_seed(1)
    model2 = Net()
    model2.load_state_dict(msd)
    opt2 = adam(model2)
    opt2.load_state_dict(opt.state_dict())  # DTensors under fully_shard, plain under replicate
    step2 = spmd_compile(DataParallel(style))(_plain_step)
    _train_both(step2, model2, opt2, ref, ref_opt, range(2, 4), check, "fresh model, step")
    # a DDP optimizer's (plain) state loaded into the placed optimizer of the compiled model2
    opt2.load_state_dict(deepcopy(ref_opt.state_dict()))
    _train_both(step2, model2, opt2, ref, ref_opt, range(4, 6), check, "plain state loaded, step")
    return {"problems": check.problems}


def test_mixed_plain_and_dtensor_state_is_placed(pool2):
    for style in ("replicate", "fully_shard"):
        for res in pool2.run(mixed_state_job, style):
            assert not res["problems"], (style, res["problems"])


# --------------------------------------------------------------------------------------------------
# The compile line


def compile_line_job() -> list[str]:
    import io

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.observe import compile_log

    stream = io.StringIO()
    handler, compile_log._DEFAULT = compile_log._DEFAULT, logging.StreamHandler(stream)
    notice, compile_log.NOTICE_SECONDS = compile_log.NOTICE_SECONDS, 0.0
    try:
        torch.manual_seed(0)
        model = Net()
        # SGD with momentum creates its state in a program of its own (Adam's is made before
        # recording: optimizer_state.py)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        step = spmd_compile(DataParallel("replicate"))(_plain_step)
        for i in range(3):
            step(model, opt, _batch(i))
        for length in (5, 7):  # a 3-D batch, then another size of a dim held as a constant
            step(model, opt, rank_data(200 + length, (6, length, 8), (6, length, 4)))
        logging.getLogger("spmd_compiler").setLevel(logging.WARNING)  # the usual switch
        spmd_compile(DataParallel("replicate"))(_plain_step)(model, opt, _batch(3))
    finally:
        logging.getLogger("spmd_compiler").setLevel(logging.NOTSET)
        compile_log._DEFAULT, compile_log.NOTICE_SECONDS = handler, notice
    return stream.getvalue().splitlines()


def test_a_long_compile_prints_one_line_and_why_it_compiled_again(pool2):
    lines, other = pool2.run(compile_line_job)
    assert other == [], other  # rank 0 only
    assert len(lines) == 4, lines
    assert lines[0].startswith("spmd_compiler: compiled _plain_step (replicate, ") and "traced" in lines[0]
    assert "compiled again because the optimizer created its state on the first call" in lines[1]
    assert "compiled again because the batch's dtypes, devices or dimensions changed" in lines[2]
    assert ("compiled again because argument 2[0] has size 7 in dim 1; the program was compiled "
            "for size 5 there") in lines[3], lines[3]


# --------------------------------------------------------------------------------------------------
# Gradients carried from one call into the next


def _no_reset_step(model, opt, batch):
    loss = _loss(model, batch)
    loss.backward()
    opt.step()
    return loss.detach()


def _reset_at_end_step(model, opt, batch):
    loss = _loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def carried_gradients_job(style: str) -> dict:
    """A step that never resets its gradients would, eagerly, add each call's gradient to the
    next call's: refused, naming the parameters and the step; one that resets them at its end
    trains as DDP."""
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import UnsupportedError

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    model, opt, ref, ref_opt = _models(sgd)
    out = {"error": None}
    try:
        spmd_compile(DataParallel(style))(_no_reset_step)(model, opt, _batch(0))
    except UnsupportedError as e:
        out["error"] = str(e)
    out["untouched"] = all(p.grad is None for p in model.parameters())
    step = spmd_compile(DataParallel(style))(_reset_at_end_step)
    check = ParityChecker(RTOL, ATOL)
    for i in range(STEPS):
        step(model, opt, _batch(i))
        _reset_at_end_step(ref, ref_opt, _batch(i))
        _compare(check, model, opt, ref, ref_opt, f"step {i}")
    out["problems"] = check.problems
    return out


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_gradients_carried_across_calls_are_refused(pool2, style):
    for res in pool2.run(carried_gradients_job, style):
        assert res["error"] is not None, "a step carrying gradients into the next call compiled"
        assert "_no_reset_step" in res["error"] and "a.weight" in res["error"], res["error"]
        assert "zero_grad()" in res["error"] and "no_sync()" in res["error"], res["error"]
        assert res["untouched"]
        assert not res["problems"], res["problems"][:5]
