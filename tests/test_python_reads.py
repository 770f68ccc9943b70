"""Every Python read a recording depends on is seen (spmd_compiler/trace/reads.py), and the three
shortcuts built on it hold or are not taken: value guards (a value changed between steps
recompiles), block reuse (a block whose reads differ from its template's is recorded, not
copied) and the shared compile (a rank whose reads differ builds its own program).

Each case trains several steps against DDP on a real gloo group of 2 ranks, with different data
per rank, comparing the loss, every parameter and every optimizer state after every step
(tests/test_robustness.parity_run), with block reuse and the shared compile on (the default).
The launched-script cases write a training script and run it as users do (``__main__`` under
torchrun, ``__mp_main__`` in workers made by ``torch.multiprocessing.spawn``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import get_rank

from tests.test_robustness import Report, _sgd, parity_run, xy

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------
# Value guards: a value read through the type, getattr, a container item


class Scaled(nn.Module):
    """Reads a class-level default (``scale``), a value through ``getattr`` with a constant name
    (``alpha``) and with a name computed at run time (``beta``)."""

    scale = 1.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)
        self.alpha = 1.0
        self.beta = 0.0
        self.which = "be" + "ta"

    def forward(self, x):
        out = self.lin(x) * self.scale * getattr(self, "alpha")
        return out + getattr(self, self.which) * out.pow(2)


WEIGHTS = {0: 1.0, 1: 1.0}  # a dict with int keys, read by its key
SCALES = [1.0, 1.0]  # a list, read by its index


def dict_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * WEIGHTS[1]
    loss.backward()
    optim.step()
    return loss


def list_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * SCALES[1]
    loss.backward()
    optim.step()
    return loss


def plain_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss


def _guard_run(rep, step, change, undo=lambda: None, steps=4):
    """Train ``steps`` steps against DDP (the same ``Scaled`` model), calling
    ``change(model, ddp_module)`` before step 2."""
    def before_each(i, model, ddp, opt, ref_opt):
        if i == 2:
            change(model, ddp.module)

    try:
        parity_run(rep, "replicate", Scaled, _sgd, step, [xy(i) for i in range(steps)],
                   before_each=before_each)
    finally:
        undo()


def case_class_attribute(rep):
    _guard_run(rep, plain_step, lambda m, r: setattr(Scaled, "scale", 2.0),
               lambda: setattr(Scaled, "scale", 1.0))


def case_instance_shadows_class_default(rep):
    def change(m, r):
        m.scale = r.scale = 2.0

    _guard_run(rep, plain_step, change)


def case_getattr_constant_name(rep):
    def change(m, r):
        m.alpha = r.alpha = 3.0

    _guard_run(rep, plain_step, change)


def case_getattr_computed_name(rep):
    def change(m, r):
        m.beta = r.beta = 0.5

    _guard_run(rep, plain_step, change)


def case_dict_int_key(rep):
    _guard_run(rep, dict_step, lambda m, r: WEIGHTS.__setitem__(1, 3.0),
               lambda: WEIGHTS.__setitem__(1, 1.0))


def case_list_element(rep):
    _guard_run(rep, list_step, lambda m, r: SCALES.__setitem__(1, 3.0),
               lambda: SCALES.__setitem__(1, 1.0))


# A global rebound to a new object, a class reached through a global, a function replaced in a
# container, a partial step's arguments, a method replaced on the instance or the class: each
# changes what the step computes without changing anything the first program's guards were
# bound to, so each is checked through the path it was read by.


class LossConfig:
    def __init__(self, w: float):
        self.w = w


class Nested:
    def __init__(self, w: float):
        self.loss = LossConfig(w)


class Weights:
    """A class whose attribute the step reads through the class's global name."""

    mse = 1.0


CONFIG = LossConfig(1.0)
NESTED = Nested(1.0)
LOSS_FNS = {"main": lambda out, y: F.mse_loss(out, y)}


def _weighted_step(weight):
    def step(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        loss = F.mse_loss(model(x), y) * weight()
        loss.backward()
        optim.step()
        return loss
    return step


config_step = _weighted_step(lambda: CONFIG.w)
nested_step = _weighted_step(lambda: NESTED.loss.w)
class_step = _weighted_step(lambda: Weights.mse)


def fn_table_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = LOSS_FNS["main"](model(x), y)
    loss.backward()
    optim.step()
    return loss


def weighted_by(model, optim, batch, weights):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * weights["w"]
    loss.backward()
    optim.step()
    return loss


def _rebind(name, value):
    def change(m, r):
        globals()[name] = value
    return change


def case_global_rebound(rep):
    _guard_run(rep, config_step, _rebind("CONFIG", LossConfig(3.0)),
               lambda: _rebind("CONFIG", LossConfig(1.0))(None, None))


def case_nested_member_rebound(rep):
    _guard_run(rep, nested_step, lambda m, r: setattr(NESTED, "loss", LossConfig(3.0)),
               lambda: setattr(NESTED, "loss", LossConfig(1.0)))


def case_class_through_global(rep):
    _guard_run(rep, class_step, lambda m, r: setattr(Weights, "mse", 3.0),
               lambda: setattr(Weights, "mse", 1.0))


def case_function_replaced_in_dict(rep):
    original = LOSS_FNS["main"]
    _guard_run(rep, fn_table_step,
               lambda m, r: LOSS_FNS.__setitem__("main", lambda out, y: F.l1_loss(out, y)),
               lambda: LOSS_FNS.__setitem__("main", original))


def case_partial_step_argument(rep):
    import functools

    weights = {"w": 1.0}
    _guard_run(rep, functools.partial(weighted_by, weights=weights),
               lambda m, r: weights.__setitem__("w", 3.0))


def case_forward_replaced_on_instance(rep):
    def change(m, r):
        for net in (m, r):
            lin = net.lin
            lin.forward = lambda x, lin=lin: F.linear(x, lin.weight, lin.bias) * 2.0

    _guard_run(rep, plain_step, change)


def case_forward_replaced_on_class(rep):
    original = Scaled.forward

    def doubled(self, x):
        return original(self, x) * 2.0

    _guard_run(rep, plain_step, lambda m, r: setattr(Scaled, "forward", doubled),
               lambda: setattr(Scaled, "forward", original))


# --------------------------------------------------------------------------------------------------
# The shared compile: a rank-dependent read that is not an instance attribute


class RankScaled(nn.Module):
    """Its forward reads a class attribute each rank sets to its own value."""

    factor = 1.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 8)

    def forward(self, x):
        return self.lin(x) * self.factor


def environ_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * float(os.environ["SPMD_TEST_LOSS_SCALE"])
    loss.backward()
    optim.step()
    return loss


def group_rank_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * (1.0 + dist.group.WORLD.rank())
    loss.backward()
    optim.step()
    return loss


def imported_rank_step(model, optim, batch):
    """Asks for its rank through a name bound at import (``from torch.distributed import
    get_rank``)."""
    optim.zero_grad()
    x, y = batch
    loss = F.mse_loss(model(x), y) * (1.0 + get_rank())
    loss.backward()
    optim.step()
    return loss


def _received(compiled) -> bool:
    return any(s.startswith("received from rank") for e in compiled._programs
               for s in e.stage_seconds)


def _shared_run(rep, model_fn, step):
    parity_run(rep, "replicate", model_fn, _sgd, step, [xy(i) for i in range(3)])
    rep.facts["received"] = _received(rep.facts["compiled"])


def case_class_attribute_per_rank(rep):
    RankScaled.factor = 1.0 + 2 * dist.get_rank()
    try:
        _shared_run(rep, RankScaled, plain_step)
    finally:
        RankScaled.factor = 1.0


def case_environ_per_rank(rep):
    os.environ["SPMD_TEST_LOSS_SCALE"] = str(1.0 + 2 * dist.get_rank())
    try:
        _shared_run(rep, Scaled, environ_step)
    finally:
        del os.environ["SPMD_TEST_LOSS_SCALE"]


def case_group_rank(rep):
    _shared_run(rep, Scaled, group_rank_step)


def case_imported_get_rank(rep):
    _shared_run(rep, Scaled, imported_rank_step)


# --------------------------------------------------------------------------------------------------
# Block reuse: a block is copied only when what it reads is what its template read

GAIN = 1.0  # a global the blocks read, rebound by the outer forward before each block


class Config:
    """A plain object shared by the blocks."""

    def __init__(self):
        self.gain = 1.0


class Block(nn.Module):
    scale = 0.5  # a class-level default one instance may override

    def __init__(self, config):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.config = config

    def forward(self, x):
        gain = getattr(self, "gain", 1.0) * self.config.gain * GAIN
        return x + self.scale * gain * torch.tanh(self.lin(x))


class Memo:
    """An object the step makes and passes through the blocks, which store their outputs in it
    by their index (as a Hugging Face cache stores keys and values by ``layer_idx``)."""

    def __init__(self, n: int):
        self.outputs = [None] * n

    def put(self, index, x):
        self.outputs[index] = x
        return x


class MemoBlock(Block):
    def __init__(self, config, index: int):
        super().__init__(config)
        self.index = index

    def forward(self, x, memo):
        return memo.put(self.index, super().forward(x))


def _negated_forward(self, x):
    return x - self.scale * torch.tanh(self.lin(x))


class Stack(nn.Module):
    """Five blocks between a linear input and a head; every block's output reaches the loss.
    ``vary`` names what differs between the blocks (one of BLOCK_CASES)."""

    def __init__(self, vary: str):
        super().__init__()
        self.vary = vary
        self.config = Config()
        self.inp = nn.Linear(50, 16)
        self.blocks = nn.ModuleList(MemoBlock(self.config, i) if vary == "step_object" else
                                    Block(self.config) for i in range(5))
        self.head = nn.Linear(16, 8)
        if vary == "class_default_overridden":
            self.blocks[2].scale = 2.0
        elif vary == "getattr_default":
            self.blocks[2].gain = 3.0
        elif vary == "forward_replaced":
            self.blocks[2].forward = types.MethodType(_negated_forward, self.blocks[2])

    def forward(self, x):
        global GAIN
        h = self.inp(x)
        memo = Memo(len(self.blocks))
        for i, block in enumerate(self.blocks):
            if self.vary == "global_rebound":
                GAIN = 1.0 + 0.5 * i
            elif self.vary == "shared_object_changed":
                self.config.gain = 1.0 + 0.5 * i
            if self.vary == "cpu_autocast" and i >= 3:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    h = block(h).float()
            elif self.vary == "step_object":
                h = block(h, memo)
            else:
                h = block(h)
        GAIN = self.config.gain = 1.0
        return self.head(h)


# what differs -> (blocks copied with reuse on: layers recorded once and copied)
BLOCK_CASES = {
    "class_default_overridden": ["blocks.1", "blocks.3", "blocks.4"],
    "getattr_default": ["blocks.1", "blocks.3", "blocks.4"],
    "forward_replaced": ["blocks.1", "blocks.3", "blocks.4"],
    "global_rebound": [],
    "shared_object_changed": [],
    "cpu_autocast": ["blocks.1", "blocks.2"],
    "step_object": ["blocks.2", "blocks.3", "blocks.4"],  # (blocks.1 checks blocks.0)
}


def _block_case(name: str):
    def case(rep):
        import spmd_compiler.trace.block_reuse as block_reuse

        copy, copies = block_reuse._Call._copy_forward, []
        reuse_off, abandoned = block_reuse.reuse_off, []

        def counted(self, flat):
            copies.append(self.path)
            return copy(self, flat)

        def counted_off():
            abandoned.append(1)
            return reuse_off()

        block_reuse._Call._copy_forward, block_reuse.reuse_off = counted, counted_off
        try:
            parity_run(rep, "replicate", lambda: Stack(name), _sgd, plain_step,
                       [xy(i) for i in range(3)])
        finally:
            block_reuse._Call._copy_forward, block_reuse.reuse_off = copy, reuse_off
        rep.facts["copies"] = sorted(set(copies))
        rep.facts["abandoned"] = len(abandoned)  # recordings started again without reuse
    return case


CASES = {
    "class_attribute": case_class_attribute,
    "instance_shadows_class_default": case_instance_shadows_class_default,
    "getattr_constant_name": case_getattr_constant_name,
    "getattr_computed_name": case_getattr_computed_name,
    "dict_int_key": case_dict_int_key,
    "list_element": case_list_element,
    "global_rebound": case_global_rebound,
    "nested_member_rebound": case_nested_member_rebound,
    "class_through_global": case_class_through_global,
    "function_replaced_in_dict": case_function_replaced_in_dict,
    "partial_step_argument": case_partial_step_argument,
    "forward_replaced_on_instance": case_forward_replaced_on_instance,
    "forward_replaced_on_class": case_forward_replaced_on_class,
    "class_attribute_per_rank": case_class_attribute_per_rank,
    "environ_per_rank": case_environ_per_rank,
    "group_rank": case_group_rank,
    "imported_get_rank": case_imported_get_rank,
    **{f"block_{name}": _block_case(name) for name in BLOCK_CASES},
}


def cases_job() -> dict:
    out = {}
    for name, case in CASES.items():
        rep = Report()
        try:
            case(rep)
        except Exception as e:  # noqa: BLE001 - reported per case
            rep.facts["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            dist.barrier()
        for k in ("model", "ddp", "compiled"):
            rep.facts.pop(k, None)
        out[name] = rep.as_dict()
    return out


_REPORTS: list = []


def _case(pool, name: str) -> list[dict]:
    if not _REPORTS:
        _REPORTS.append(pool.run(cases_job, timeout=900))
    reps = [r[name] for r in _REPORTS[0]]
    for rank, rep in enumerate(reps):
        assert "exception" not in rep["facts"], f"rank {rank}: {rep['facts']['exception']}"
        assert not rep["problems"], f"{name} differs from DDP on rank {rank}:\n  " + \
            "\n  ".join(rep["problems"][:10])
    return reps


GUARD_CASES = ["class_attribute", "instance_shadows_class_default", "getattr_constant_name",
               "getattr_computed_name", "dict_int_key", "list_element", "global_rebound",
               "nested_member_rebound", "class_through_global", "function_replaced_in_dict",
               "partial_step_argument", "forward_replaced_on_instance",
               "forward_replaced_on_class"]


@pytest.mark.parametrize("name", GUARD_CASES)
def test_a_value_changed_between_steps_recompiles(pool2, name):
    for rep in _case(pool2, name):
        counts = rep["facts"]["counts"]  # SGD without momentum: one program, then the change
        assert counts == [1, 1, 2, 2], counts


@pytest.mark.parametrize("name", ["class_attribute_per_rank", "environ_per_rank", "group_rank",
                                  "imported_get_rank"])
def test_a_rank_dependent_read_is_not_shared(pool2, name):
    reps = _case(pool2, name)
    assert not reps[1]["facts"]["received"]


@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_a_block_is_copied_only_where_its_reads_are_equal(pool2, name):
    reps = _case(pool2, f"block_{name}")  # (rank 1 receives the program rank 0 recorded)
    assert reps[0]["facts"]["copies"] == BLOCK_CASES[name]
    assert reps[0]["facts"]["abandoned"] == 0  # the (x, y) loss's gradients fit the copies


# --------------------------------------------------------------------------------------------------
# The launched script: its globals are read as ``__main__`` / ``__mp_main__`` globals

SCRIPT = '''
import os, sys
from copy import deepcopy
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from spmd_compiler import DataParallel, spmd_compile

W = 1.0
TABLE = {0: 1.0, 1: 1.0}


def step(model, opt, batch):
    opt.zero_grad()
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y) * W * TABLE[1]
    loss.backward()
    opt.step()
    return loss


def main(rank=None, port=None):
    global W
    if rank is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    compiled = spmd_compile(DataParallel("replicate"))(step)
    worst = 0.0
    for i in range(5):
        if i == 2:
            W = 5.0
        if i == 3:
            TABLE[1] = 0.5
        g = torch.Generator().manual_seed(10 * i + dist.get_rank())
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        compiled(model, opt, (x, y))
        step(ddp, ref_opt, (x, y))
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            worst = max(worst, (p - q).abs().max().item())
    print(f"rank {dist.get_rank()} module {__name__} worst {worst:.3g} "
          f"compiles {compiled.compile_count}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "spawn":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(int(sys.argv[2]),), nprocs=2)
    else:
        main()
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launch", ["torchrun", "spawn"])
def test_a_global_of_the_launched_script_is_guarded(launch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if launch == "torchrun":
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
               "2", str(script), "torchrun"]
        module = "__main__"
    else:
        cmd = [sys.executable, str(script), "spawn", str(_free_port())]
        module = "__mp_main__"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # (the ranks' lines may interleave in torchrun's output)
    lines = re.findall(r"rank (\d) module (\S+) worst (\S+) compiles (\d+)", out.stdout)
    assert sorted(r for r, *_ in lines) == ["0", "1"], out.stdout[-3000:] + out.stderr[-3000:]
    for rank, name, worst, compiles in lines:
        assert name == module, lines
        assert float(worst) < 1e-5, lines  # every parameter as DDP's
        assert compiles == "3", lines  # the first program, W changed, TABLE[1] changed
