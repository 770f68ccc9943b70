"""Python values the step reads while it is recorded (spmd_compiler/trace/guards.py): a change between
calls recompiles (logged with the value's name and the line that read it) or, for a number that
keeps changing, becomes an input of the program; never a stale constant. Each case trains
against DDP on a real gloo group (world size 2) and changes the value on both the compiled and
the reference side between steps.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.logs import messages, spmd_log
from tests.models import train_step
from tests.steps import weighted_mse_step
from tests.test_robustness import Report, _adam, _sgd, parity_run, xy

LOSS_WEIGHT = 1.0  # read by weighted_step: a module-level setting a schedule changes
CONFIG = {"label_shift": 0.0}  # read by config_step: a config dict


class TemperatureMLP(nn.Module):
    """Dropout with p=0.1 and a temperature attribute on a submodule, both read in forward."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 32)
        self.drop = nn.Dropout(0.1)
        self.head = Head()

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.net1(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.net2 = nn.Linear(32, 8)
        self.temperature = 1.0
        self.calls = 0  # a counter set from outside every step

    def forward(self, x):
        return self.net2(x) / self.temperature + 1e-3 * self.calls


def weighted_step(model, optim, batch):
    return weighted_mse_step(model, optim, batch, LOSS_WEIGHT)


def config_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y + CONFIG["label_shift"])
    loss.backward()
    optim.step()
    return loss


def scaled_step_and_setter():
    """A step reading a closure variable, and the function that changes it."""
    scale = 1.0

    def scaled_step(model, optim, batch):
        return weighted_mse_step(model, optim, batch, scale)

    def set_scale(value):
        nonlocal scale
        scale = value

    return scaled_step, set_scale


class Trainer:
    """A bound-method step: its instance's attributes are read."""

    def __init__(self):
        self.aux_weight = 0.0

    def step(self, model, optim, batch):
        optim.zero_grad()
        x, y = batch
        out = model(x)
        loss = nn.functional.mse_loss(out, y) + self.aux_weight * out.pow(2).mean()
        loss.backward()
        optim.step()
        return loss


def _temperature(m):
    torch.manual_seed(0)
    return TemperatureMLP()


def _logged(fn):
    """Run ``fn()``; return the spmd_compiler log lines it wrote."""
    with spmd_log() as records:
        fn()
    return messages(records)


def _run(rep, mode, step, change, steps=5, opt_fn=_sgd):
    """Train ``steps`` steps against DDP, calling ``change(model, ddp_module, opt, ref_opt)``
    before step 2; facts: compile counts and the recompile log lines."""
    def before_each(i, model, ddp, opt, ref_opt):
        if i == 2:
            change(model, ddp.module, opt, ref_opt)

    rep.facts["log"] = [m for m in _logged(lambda: parity_run(
        rep, mode, lambda: _temperature(None), opt_fn, step, [xy(i) for i in range(steps)],
        before_each=before_each)) if "recompiling" in m]


def case_dropout_p(rep, mode):
    def change(model, ref, opt, ref_opt):
        model.drop.p = ref.drop.p = 0.3

    _run(rep, mode, train_step, change)


def case_temperature(rep, mode):
    def change(model, ref, opt, ref_opt):
        model.head.temperature = ref.head.temperature = 2.0

    _run(rep, mode, train_step, change)


def case_global_loss_weight(rep, mode):
    def change(model, ref, opt, ref_opt):
        global LOSS_WEIGHT
        LOSS_WEIGHT = 3.0

    global LOSS_WEIGHT
    try:
        _run(rep, mode, weighted_step, change)
    finally:
        LOSS_WEIGHT = 1.0


def case_config_dict(rep, mode):
    def change(*_):
        CONFIG["label_shift"] = 0.5

    try:
        _run(rep, mode, config_step, change)
    finally:
        CONFIG["label_shift"] = 0.0


def case_closure(rep, mode):
    step, set_scale = scaled_step_and_setter()
    _run(rep, mode, step, lambda *_: set_scale(0.25))


def case_bound_method(rep, mode):
    trainer = Trainer()

    def change(*_):
        trainer.aux_weight = 0.5

    _run(rep, mode, trainer.step, change)


def case_optimizer_hyperparameter(rep, mode):
    def change(model, ref, opt, ref_opt):
        for g in opt.param_groups + ref_opt.param_groups:
            g["weight_decay"] = 0.1
            g["betas"] = (0.8, 0.9)

    _run(rep, mode, train_step, change, opt_fn=_adam)


def case_counter(rep, mode):
    """A number that changes every call: one more compile (it becomes an input), not one per
    call."""
    def before_each(i, model, ddp, opt, ref_opt):
        model.head.calls = ddp.module.head.calls = i

    parity_run(rep, mode, lambda: _temperature(None), _sgd, train_step,
               [xy(i) for i in range(6)], before_each=before_each)


CASES = {
    "dropout_p": case_dropout_p, "temperature": case_temperature,
    "global_loss_weight": case_global_loss_weight, "closure": case_closure,
    "config_dict": case_config_dict,
    "bound_method": case_bound_method, "optimizer_hyperparameter": case_optimizer_hyperparameter,
    "counter": case_counter,
}


def cases_job(mode: str) -> dict:
    out = {}
    for name, case in CASES.items():
        rep = Report()
        try:
            case(rep, mode)
        except Exception as e:  # noqa: BLE001 - reported per case
            rep.facts["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            dist.barrier()
        for k in ("model", "ddp", "compiled"):
            rep.facts.pop(k, None)
        out[name] = rep.as_dict()
    return out


_REPORTS: dict = {}


def _case(pool, mode: str, name: str) -> list[dict]:
    if mode not in _REPORTS:
        _REPORTS[mode] = pool.run(cases_job, mode, timeout=600)
    reps = [r[name] for r in _REPORTS[mode]]
    for rank, rep in enumerate(reps):
        assert "exception" not in rep["facts"], f"rank {rank}: {rep['facts']['exception']}"
        assert not rep["problems"], f"{name}/{mode} differs from DDP on rank {rank}:\n  " + \
            "\n  ".join(rep["problems"][:10])
    return reps


CHANGED = {  # case -> (name in the log, the line that read it: a piece of its text)
    "dropout_p": ("model.drop.p", "dropout.py"),
    "temperature": ("model.head.temperature", "test_guards.py"),
    "global_loss_weight": ("LOSS_WEIGHT", "in weighted_step"),
    "closure": ("<closure scale>", "in scaled_step"),
    "config_dict": ("CONFIG['label_shift']", "in config_step"),
    "bound_method": ("self.aux_weight", "in step"),
    "optimizer_hyperparameter": ("['weight_decay']", "Adam.step()"),
}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("name", sorted(CHANGED))
def test_changed_value_recompiles_logged_and_matches_ddp(pool2, mode, name):
    """Step 0 compiles, step 1 (optimizer state now exists) compiles the steady program; the
    change before step 2 compiles once more, logged with the value's name and reading line."""
    what, where = CHANGED[name]
    for rank, rep in enumerate(_case(pool2, mode, name)):
        counts = rep["facts"]["counts"]
        assert counts[2] == counts[1] + 1 and counts[-1] == counts[2], counts
        if rank == 0:  # logged on rank 0
            lines = [m for m in rep["facts"]["log"] if what in m]
            assert lines and where in lines[0], rep["facts"]["log"]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_counter_becomes_an_input(pool2, mode):
    for rep in _case(pool2, mode, "counter"):
        # the counter changes every call: its first change records it as an input
        assert rep["facts"]["counts"] == [1, 2, 2, 2, 2, 2], rep["facts"]["counts"]


def test_module_walk_lists_what_named_members_list():
    """The step key's one walk over the model (module_walk.py) gives the modules, parameters
    and buffers, names and order of named_modules / named_parameters / named_buffers, with
    tied weights, a module used twice, a None child and a None parameter."""
    from spmd_compiler.state.module_walk import walk
    from tests.models import BatchNormMLP, TiedMLP

    shared = nn.Linear(4, 4)
    model = nn.Sequential(TiedMLP(), BatchNormMLP(), shared, nn.ReLU(), shared,
                          nn.Sequential(shared, nn.Linear(4, 2, bias=False)))
    model.add_module("empty", None)
    tree = walk(model)
    assert tree.modules == list(model.modules())
    assert [(n, id(p)) for n, p in tree.params] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in tree.buffers] == [(n, id(b)) for n, b in model.named_buffers()]
    from spmd_compiler.state.module_walk import tensors

    assert [id(p) for p in tensors(model)] == [id(p) for p in model.parameters()]
    assert [id(b) for b in tensors(model, "_buffers")] == [id(b) for b in model.buffers()]
