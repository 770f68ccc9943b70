"""Python the step reaches in ways ordinary training code has: a list of functions indexed, a
helper method that sets an attribute from a counter, a closure over placements, plain tensors
that are not parameters or buffers, a dataclass argument mutated in place, a function swapped in
a global, on an ``argparse.Namespace``, on the model, or in ``torch.nn.functional``. Each case
trains several steps against DDP on a real gloo group of 2 ranks with different data per rank
(tests/test_robustness.parity_run), changing the value on both sides between calls: it matches
DDP and recompiles when (and only when) the change asks for it, or every rank raises a clear
``SPMDError``.
"""

from __future__ import annotations

import argparse
import functools
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.test_python_reads import _weighted_step
from tests.test_robustness import Report, _sgd, parity_run, xy


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)

    def forward(self, x):
        return self.lin(x)


def _run(rep, step, change=None, at=2, steps=4, model_fn=Lin, undo=None, mode="replicate", **kw):
    """Train ``steps`` steps against DDP, calling ``change(model, ddp_module)`` before step
    ``at``."""
    def before_each(i, model, ddp, opt, ref_opt):
        if change is not None and i == at:
            change(model, ddp.module)

    try:
        parity_run(rep, mode, model_fn, _sgd, step, [xy(i) for i in range(steps)],
                   before_each=before_each, **kw)
    finally:
        if undo is not None:
            undo()


_loss_step = _weighted_step  # the step weighted by weight(), as the value-guard tests write it


# ---------------------------------------------------------------------------------------------
# A list of user functions the step indexes

def _one():
    return 1.0


def _three():
    return 3.0


FNS = [_one]
fns_step = _loss_step(lambda: FNS[-1]())


def case_function_list_unchanged(rep):
    _run(rep, fns_step)


def case_function_list_appended(rep):
    _run(rep, fns_step, lambda m, r: FNS.append(_three), undo=lambda: FNS.__setitem__(
        slice(None), [_one]))


# ---------------------------------------------------------------------------------------------
# A helper method the forward calls sets an attribute from a counter

class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)
        self.calls = 0
        self.scale = 1.0

    def _advance(self):
        self.calls += 1
        self.scale = 1.0 / self.calls

    def forward(self, x):
        self._advance()
        return self.lin(x) * self.scale


def plain_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss


def case_counter_helper(rep):
    _run(rep, plain_step, model_fn=Counted, steps=5)
    rep.facts["calls"] = rep.facts["model"].calls


class Stats:
    """A plain object the model holds, updated by the forward."""

    def __init__(self):
        self.n = 0
        self.scale = 1.0

    def update(self):
        self.n += 1
        self.scale = 1.0 + 0.1 * self.n


class WithStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)
        self.stats = Stats()

    def forward(self, x):
        self.stats.update()
        return self.lin(x) * self.stats.scale


def case_held_object_updated(rep):
    _run(rep, plain_step, model_fn=WithStats, steps=5)
    rep.facts["calls"] = rep.facts["model"].stats.n


def test_a_held_object_the_forward_updates_trains_as_ddp(pool2):
    for rep in _case(pool2, "held_object_updated"):
        assert rep["facts"]["calls"] == 5
        assert rep["facts"]["counts"][-1] <= 3, rep["facts"]["counts"]


# ---------------------------------------------------------------------------------------------
# Plain tensors the step reads: an attribute that is not a buffer, a global, a dataclass field

class Rotary(nn.Module):
    """Keeps a plain tensor attribute (as Meta's Llama keeps ``freqs_cis``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)
        self.freqs = torch.linspace(0.5, 1.5, 8)

    def forward(self, x):
        return self.lin(x) * self.freqs


MASK = torch.linspace(1.0, 2.0, 8)


def global_tensor_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x) * MASK, y)
    loss.backward()
    optim.step()
    return loss


@dataclass
class LossCfg:
    aux_w: float
    target_scale: torch.Tensor


def cfg_step(model, optim, batch, cfg):
    optim.zero_grad()
    x, y = batch
    out = model(x)
    loss = F.mse_loss(out, y * cfg.target_scale) + cfg.aux_w * out.pow(2).mean()
    loss.backward()
    optim.step()
    return loss


def case_tensor_attribute(rep):
    def change(m, r):
        for net in (m, r):
            net.freqs = torch.linspace(2.0, 3.0, 8)

    _run(rep, plain_step, change, model_fn=Rotary)


def case_tensor_attribute_fully_shard(rep):
    def change(m, r):
        for net in (m, r):
            net.freqs = torch.linspace(2.0, 3.0, 8)

    _run(rep, plain_step, change, model_fn=Rotary, mode="fully_shard")


def case_tensor_attribute_in_place(rep):
    def change(m, r):
        with torch.no_grad():
            for net in (m, r):
                net.freqs.mul_(2.0)

    _run(rep, plain_step, change, model_fn=Rotary)


def case_global_tensor(rep):
    global MASK

    def change(m, r):
        global MASK
        MASK = torch.linspace(3.0, 4.0, 8)

    saved = MASK
    try:
        _run(rep, global_tensor_step, change)
    finally:
        MASK = saved


def case_dataclass_tensor_field(rep):
    cfg = LossCfg(0.0, torch.full((8,), 2.0))

    def change(m, r):
        cfg.target_scale = torch.full((8,), 0.5)

    _run(rep, functools.partial(cfg_step, cfg=cfg), change)


def case_dataclass_mutated(rep):
    cfg = LossCfg(0.0, torch.full((8,), 1.0))

    def change(m, r):
        cfg.aux_w = 2.0

    _run(rep, functools.partial(cfg_step, cfg=cfg), change)


@dataclass
class AuxCfg:
    aux_w: float


def cfg_arg_step(model, optim, batch, cfg):
    optim.zero_grad()
    x, y = batch
    out = model(x)
    loss = F.mse_loss(out, y) + cfg.aux_w * out.pow(2).mean()
    loss.backward()
    optim.step()
    return loss


def _argument_run(rep, step, make_cfg, change):
    """Train against DDP passing the same ``make_cfg()`` object on every call (one per side),
    calling ``change(cfg)`` on both before step 2."""
    from tests.test_robustness import compare, with_ddp

    model, opt, compiled, ddp, ref_opt = with_ddp("replicate", Lin, _sgd, step)
    cfg, ref_cfg = make_cfg(), make_cfg()
    counts = []
    for i in range(4):
        if i == 2:
            change(cfg)
            change(ref_cfg)
        compiled(model, opt, xy(i), cfg)
        step(ddp, ref_opt, xy(i), ref_cfg)
        counts.append(compiled.compile_count)
        compare(rep, f"step {i}", model, opt, ddp.module, ref_opt)
    rep.facts["counts"] = counts


def case_dataclass_argument_mutated(rep):
    """The same dataclass object passed on every call, one field assigned before step 2."""
    _argument_run(rep, cfg_arg_step, lambda: AuxCfg(0.0), lambda c: setattr(c, "aux_w", 2.0))


def case_dataclass_argument_tensor_in_place(rep):
    """A tensor field of a dataclass argument, changed in place before step 2."""
    def change(c):
        c.target_scale.mul_(0.5)

    _argument_run(rep, cfg_step, lambda: LossCfg(0.0, torch.full((8,), 2.0)), change)


# ---------------------------------------------------------------------------------------------
# Functions swapped: a global, an argparse.Namespace in the closure, a model attribute, torch's

ACT = F.silu


def act_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(ACT(model(x)), y)
    loss.backward()
    optim.step()
    return loss


def case_global_function_swapped(rep):
    def change(m, r):
        global ACT
        ACT = F.gelu

    def undo():
        global ACT
        ACT = F.silu

    _run(rep, act_step, change, undo=undo)


def case_global_builtin_swapped(rep):
    def change(m, r):
        global ACT
        ACT = torch.tanh

    def undo():
        global ACT
        ACT = F.silu

    _run(rep, act_step, change, undo=undo)


def _namespace_step():
    args = argparse.Namespace(mse_weight=1.0, aux_weight=0.0)

    def step(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        out = model(x)
        losses = {"mse": F.mse_loss(out, y), "aux": out.pow(2).mean()}
        loss = sum(getattr(args, f"{k}_weight") * v for k, v in losses.items())
        loss.backward()
        optim.step()
        return loss
    return step, args


def case_namespace_getattr(rep):
    step, args = _namespace_step()
    _run(rep, step, lambda m, r: setattr(args, "aux_weight", 0.5))


class Activated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def forward(self, x):
        return self.act(self.lin(x))


def case_partial_attribute_replaced(rep):
    def change(m, r):
        m.act = r.act = functools.partial(F.leaky_relu, negative_slope=0.5)

    _run(rep, plain_step, change, model_fn=Activated)


class Gelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return F.gelu(self.lin(x)) + self.act(self.lin(x))


def case_torch_function_patched(rep):
    original = F.gelu

    def change(m, r):
        F.gelu = lambda x, approximate="none": original(x, approximate="tanh")

    _run(rep, plain_step, change, model_fn=Gelu, undo=lambda: setattr(F, "gelu", original))


def case_job(name: str) -> dict:
    rep = Report()
    try:
        globals()[f"case_{name}"](rep)
    except Exception as e:  # noqa: BLE001 - reported per case
        rep.facts["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        dist.barrier()
    for k in ("model", "ddp", "compiled"):
        rep.facts.pop(k, None)
    return rep.as_dict()


def _case(pool, name: str) -> list[dict]:
    reps = pool.run(case_job, name, timeout=300)
    for rank, rep in enumerate(reps):
        assert "exception" not in rep["facts"], f"rank {rank}: {rep['facts']['exception']}"
        assert not rep["problems"], f"{name} differs from DDP on rank {rank}:\n  " + \
            "\n  ".join(rep["problems"][:10])
    return reps


# case -> compile counts after each step (SGD without momentum: one program until a change)
EXPECTED = {
    "function_list_unchanged": [1, 1, 1, 1],
    "function_list_appended": [1, 1, 2, 2],
    "tensor_attribute": [1, 1, 2, 2],
    "tensor_attribute_in_place": [1, 1, 2, 2],
    "tensor_attribute_fully_shard": [1, 1, 2, 2],
    "global_tensor": [1, 1, 2, 2],
    "dataclass_tensor_field": [1, 1, 2, 2],
    "dataclass_mutated": [1, 1, 2, 2],
    "dataclass_argument_mutated": [1, 1, 2, 2],
    "dataclass_argument_tensor_in_place": [1, 1, 2, 2],
    "global_function_swapped": [1, 1, 2, 2],
    "global_builtin_swapped": [1, 1, 2, 2],
    "namespace_getattr": [1, 1, 2, 2],
    "partial_attribute_replaced": [1, 1, 2, 2],
    "torch_function_patched": [1, 1, 2, 2],
    "default_dtype": [1, 1, 2, 2],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_change_recompiles_and_matches_ddp(pool2, name):
    for rep in _case(pool2, name):
        assert rep["facts"]["counts"] == EXPECTED[name], rep["facts"]["counts"]


def test_a_counter_set_by_a_helper_trains_as_ddp(pool2):
    for rep in _case(pool2, "counter_helper"):
        assert rep["facts"]["calls"] == 5
        assert rep["facts"]["counts"][-1] <= 3, rep["facts"]["counts"]



DEEP = {"a": {"b": {"c": {"d": torch.linspace(1.0, 2.0, 8)}}}}  # deeper than guards follow


def deep_tensor_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x) * DEEP["a"]["b"]["c"]["d"], y)
    loss.backward()
    optim.step()
    return loss


def case_unreached_tensor(rep):
    def change(m, r):
        DEEP["a"]["b"]["c"]["d"] = torch.linspace(3.0, 4.0, 8)

    saved = DEEP["a"]["b"]["c"]["d"]
    _run(rep, deep_tensor_step, change, undo=lambda: DEEP["a"]["b"]["c"].__setitem__("d", saved))


def test_a_tensor_no_guard_reaches_serves_one_call(pool2):
    """Matches DDP, recompiling on every call (logged once), never a stale constant."""
    for rep in _case(pool2, "unreached_tensor"):
        assert rep["facts"]["counts"] == [1, 2, 3, 4], rep["facts"]["counts"]


# ---------------------------------------------------------------------------------------------
# The recompile limit

TAG = "a0"


def tag_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * (2.0 if TAG.endswith("!") else 1.0)
    loss.backward()
    optim.step()
    return loss


def case_recompile_limit(rep):
    """A string the step reads, changed before every call, with a limit of 3 programs."""
    import os

    def change(i):
        global TAG
        TAG = f"a{i}"

    os.environ["SPMD_RECOMPILE_LIMIT"] = "3"
    try:
        parity_run(rep, "replicate", Lin, _sgd, tag_step, [xy(i) for i in range(6)],
                   before_each=lambda i, *_: change(i), stop_on_error=True)
    finally:
        del os.environ["SPMD_RECOMPILE_LIMIT"]
        change(0)


def test_a_step_past_its_recompile_limit_raises_on_every_rank(pool2):
    for rep in _case(pool2, "recompile_limit"):
        step, kind, message, _ = rep["facts"]["raised"]
        assert (step, kind) == (3, "RecompileLimitError"), rep["facts"]["raised"]
        assert "TAG changed 'a2' -> 'a3'" in message and "program 3" in message, message
        assert rep["facts"]["untouched"] == [], rep["facts"]["untouched"]


def constant_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * torch.tensor(1 / 3)  # of torch's default dtype
    loss.backward()
    optim.step()
    return loss


def case_default_dtype(rep):
    try:
        _run(rep, constant_step, lambda m, r: torch.set_default_dtype(torch.bfloat16))
    finally:
        torch.set_default_dtype(torch.float32)


# ---------------------------------------------------------------------------------------------
# Reads that differ across ranks: the program one rank built is not used where they differ

def case_rank1_patches_gelu(rep):
    original = F.gelu
    if dist.get_rank() == 1:
        F.gelu = lambda x, approximate="none": original(x, approximate="tanh")
    try:
        _run(rep, plain_step, model_fn=Gelu, steps=3)
    finally:
        F.gelu = original


def environ_get_step(model, optim, batch):
    import os

    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * float(os.environ.get("SPMD_TEST_GUARD_SCALE", "1.0"))
    loss.backward()
    optim.step()
    return loss


def case_environ_get_per_rank(rep):
    import os

    os.environ["SPMD_TEST_GUARD_SCALE"] = str(1.0 + 2 * dist.get_rank())
    try:
        _run(rep, environ_get_step, steps=3)
    finally:
        del os.environ["SPMD_TEST_GUARD_SCALE"]


@pytest.mark.parametrize("name", ["rank1_patches_gelu", "environ_get_per_rank"])
def test_a_read_that_differs_on_one_rank_matches_ddp(pool2, name):
    _case(pool2, name)
