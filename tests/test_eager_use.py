"""The placed model outside the compiled step, as with DDP and FSDP2: ``model(x)`` in train and
eval mode, with and without grad, an eager backward, ``unsharded``, ``state_dict`` /
``load_state_dict``, a Hugging Face ``generate()``; compiled steps afterwards still match DDP;
``DataParallel(keep_grads=True)`` leaves DDP's ``p.grad``.

Every case trains next to a DDP reference with different data on every rank. Tolerances (float32
round-off): ``|actual - expected| <= ATOL + RTOL * |expected|``; world size 2 is bit-exact in
practice, 3 sums in other orders than DDP's bucket.
"""

from __future__ import annotations

import logging
import time
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.logs import spmd_log
from tests.models import mse_step
from tests.multirank import assert_close_all, rank_data
from tests.steps import clip_norm, mse, step_with

RTOL = 1e-5
ATOL = 1e-6


class EagerModel(nn.Module):
    """What binding must handle: a weight shared by two layers, uneven shards and an empty one
    at world size 3 (``mid`` has 2 rows), a 0-d parameter (never sharded), BatchNorm buffers,
    and a child's weight read by the parent's own forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(50, 5, bias=False)  # a bias before BatchNorm gets only round-off
        self.bn = nn.BatchNorm1d(5)
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.b.weight = self.a.weight
        self.mid = nn.Linear(5, 2)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.out = nn.Linear(2, 8)

    def forward(self, x):
        h = torch.tanh(self.bn(self.inp(x)))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        h = torch.tanh(self.mid(h)) * self.scale
        return self.out(h) + 0.1 * F.linear(h, self.out.weight)


# clipping at 0.05 is active: it changes p.grad in place
clip_step = step_with(mse, between=clip_norm(0.05, returned=False), name="clip_step")


def _pair(mode: str, **options):
    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = EagerModel()
    ref = DDP(deepcopy(model))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    return model, opt, ref, ref_opt, DataParallel(mode, **options), spmd_compile


def _same_state(model, opt, ref, ref_opt, what: str) -> None:
    params = dict(model.named_parameters())
    assert_close_all(params, dict(ref.module.named_parameters()), RTOL, ATOL, what=f"{what}: param")
    assert_close_all(dict(model.named_buffers()), dict(ref.module.named_buffers()), RTOL, ATOL,
                     what=f"{what}: buffer")
    ref_params = dict(ref.module.named_parameters())
    for name, p in params.items():
        st, ref_st = opt.state[p], ref_opt.state[ref_params[name]]
        assert_close_all({k: st[k] for k in ref_st}, dict(ref_st), RTOL, ATOL,
                         what=f"{what}: {name} state")


def eager_use_job(mode: str) -> dict:
    """Compiled steps, then everything users do with a DDP/FSDP2 model between steps, then more
    compiled steps (also in eval mode: a recompile that traces the placed model); every stage
    compared with DDP. Counts the bindings made inside compiled steps and compiles (must be 0)."""
    from spmd_compiler.state.eager import EagerUse, unsharded

    rank = dist.get_rank()
    model, opt, ref, ref_opt, dp, spmd_compile = _pair(mode)
    step = spmd_compile(dp)(mse_step)
    binds = {"n": 0}
    real_bind = EagerUse.bind

    def counting_bind(self):
        binds["n"] += 1
        return real_bind(self)

    def steps(seeds, train=True):
        model.train(train)
        ref.train(train)
        before = binds["n"]
        for s in seeds:
            batch = rank_data(s, (16, 50), (16, 8))
            step(model, opt, batch)
            mse_step(ref, ref_opt, batch)
        return binds["n"] - before

    EagerUse.bind = counting_bind
    try:
        out = {"binds in compiled steps": steps(range(100, 103))}
        _same_state(model, opt, ref, ref_opt, "after 3 steps")
        x = rank_data(200, (5, 50))

        # Evaluation, as users write it.
        model.eval()
        ref.eval()
        with torch.no_grad():
            y = model(x)
        assert type(y) is torch.Tensor and not y.requires_grad
        assert_close_all(y, ref.module(x).detach(), RTOL, ATOL, what="eval no_grad output")
        y = model(x)  # eval without no_grad: differentiable, as DDP's
        assert y.requires_grad
        assert_close_all(y.detach(), ref.module(x).detach(), RTOL, ATOL, what="eval output")
        if mode == "replicate" and rank == 0:  # local tensors: one rank may evaluate alone
            assert_close_all(model(x).detach(), ref.module(x).detach(), RTOL, ATOL,
                             what="rank 0 alone")
        before = binds["n"]
        model(x)
        out["binds per eval call"] = binds["n"] - before

        # A train-mode forward and an eager backward: gradients averaged as DDP's.
        model.train()
        ref.train()
        ref_opt.zero_grad(set_to_none=True)
        xb, yb = rank_data(201, (6, 50), (6, 8))
        F.mse_loss(model(xb), yb).backward()
        F.mse_loss(ref(xb), yb).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(type(g).__name__ == "DTensor" and g.placements == p.placements
                   for g, p in zip(grads.values(), model.parameters()))
        assert_close_all(grads, {n: p.grad for n, p in ref.module.named_parameters()}, RTOL, ATOL,
                         what="eager backward grad")

        # unsharded: one binding for several calls.
        before = binds["n"]
        with torch.no_grad(), unsharded(model):
            assert all(type(p) is torch.Tensor for p in model.parameters())
            assert model.b.weight is model.a.weight
            y1, y2 = model.eval()(x), model(x)
        model.train()
        out["binds in unsharded"] = binds["n"] - before
        assert torch.equal(y1, y2)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())

        # state_dict: plain tensors under replicate (as DDP's module), DTensors when sharded
        # (as FSDP2's); a plain (DDP-style) state dict loads too, and so do DTensors.
        sd = model.state_dict()
        kind = "Tensor" if mode == "replicate" else "DTensor"
        assert all(type(v).__name__ == kind for k, v in sd.items() if "bn." not in k)
        plain = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in sd.items()}
        before = {n: p.full_tensor() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.0)
        model.load_state_dict(plain)
        assert_close_all(dict(model.named_parameters()), before, 0, 0, what="plain load")
        model.load_state_dict({k: v.detach().clone() if hasattr(v, "full_tensor") else v
                               for k, v in sd.items()})
        assert_close_all(dict(model.named_parameters()), before, 0, 0, what="DTensor load")

        # More compiled steps: a recompile in eval mode (traces the placed model), then train.
        out["binds in later compiled steps"] = steps(range(300, 302), train=False) + steps(range(302, 305))
        _same_state(model, opt, ref, ref_opt, "after eager use and 5 more steps")
        out["grads after a compiled step"] = [n for n, p in model.named_parameters() if p.grad is not None]
        out["compiles"] = step.compile_count
    finally:
        EagerUse.bind = real_bind
    return out


@pytest.mark.parametrize("mode, pool", [("replicate", 2), ("fully_shard", 2), ("fully_shard", 3)],
                         indirect=["pool"], ids=["replicate-ws2", "fully_shard-ws2", "fully_shard-ws3"])
def test_eager_use_between_compiled_steps_matches_ddp(pool, mode):
    for rank, out in enumerate(pool.run(eager_use_job, mode)):
        assert out["binds in compiled steps"] == 0, rank
        assert out["binds in later compiled steps"] == 0, rank
        assert out["binds per eval call"] == 1, rank  # per top-level call, none per submodule
        assert out["binds in unsharded"] == 1, rank
        assert out["grads after a compiled step"] == [], rank  # the eager backward's are gone
        assert out["compiles"] == 2, rank  # steady (Adam's state made first), eval: eager use adds none


def keep_grads_job(mode: str) -> list[str]:
    """keep_grads=True: after every step p.grad is DDP's (averaged, clipped in place); a
    DTensor placed like the parameter. Default: no gradient is kept."""
    model, opt, ref, ref_opt, dp, spmd_compile = _pair(mode, keep_grads=True)
    step = spmd_compile(dp)(clip_step)
    plain = spmd_compile(type(dp)(mode))(clip_step)
    other = EagerModel()
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    seen = []
    for i in range(4):
        b = 12 if i == 3 else 16  # a short last batch
        batch = rank_data(400 + i, (b, 50), (b, 8))
        step(model, opt, batch)
        clip_step(ref, ref_opt, batch)
        plain(other, other_opt, batch)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(type(g).__name__ == "DTensor" and g.placements == p.placements
                   for g, p in zip(grads.values(), model.parameters()))
        assert_close_all(grads, {n: p.grad for n, p in ref.module.named_parameters()}, RTOL, ATOL,
                         what=f"step {i} grad")
        _same_state(model, opt, ref, ref_opt, f"step {i}")
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        seen.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    assert all(p.grad is None for p in other.parameters())
    return seen


@pytest.mark.parametrize("mode, pool", [("replicate", 2), ("fully_shard", 2), ("fully_shard", 3)],
                         indirect=["pool"], ids=["replicate-ws2", "fully_shard-ws2", "fully_shard-ws3"])
def test_keep_grads_leaves_ddps_grads(pool, mode):
    norms = pool.run(keep_grads_job, mode)
    # Clipping to 0.05 was active: the kept gradients are the clipped ones, as in DDP's p.grad.
    assert all(n == pytest.approx(0.05, rel=1e-4) for n in norms[0]), norms
    assert norms.count(norms[0]) == len(norms)


def generate_job(mode: str) -> dict:
    """A tiny Hugging Face causal LM (built from a config, nothing downloaded): two compiled
    steps, then greedy generate() on the placed model against the same weights in a plain copy;
    under fully_shard, unsharded() makes one gather for the whole generation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.state.eager import EagerUse, unsharded

    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=63, pad_token_id=63)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def lm_step(model, opt, ids):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    step = spmd_compile(DataParallel(mode))(lm_step)
    for i in range(2):
        step(model, opt, rank_data(500 + i, (4, 16), dtype=torch.long, high=64))
    plain = GPT2LMHeadModel(config).eval()
    plain.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                           for k, v in model.state_dict().items()})
    model.eval()
    prompt = rank_data(600, (2, 5), dtype=torch.long, high=63)  # no pad/eos token in it
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                  pad_token_id=63)
    binds = {"n": 0}
    real_bind = EagerUse.bind

    def counting_bind(self):
        binds["n"] += 1
        return real_bind(self)

    EagerUse.bind = counting_bind
    try:
        with torch.no_grad():
            tokens = model.generate(prompt, **kwargs)
            per_call = binds["n"]
            with unsharded(model):
                again = model.generate(prompt, **kwargs)
            once = binds["n"] - per_call
            expected = plain.generate(prompt, **kwargs)
    finally:
        EagerUse.bind = real_bind
    return dict(equal=torch.equal(tokens, expected) and torch.equal(again, expected),
                new_tokens=tokens.shape[1] - prompt.shape[1], per_call=per_call, once=once)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_hugging_face_generate_on_the_placed_model(pool2, mode):
    pytest.importorskip("transformers")
    for out in pool2.run(generate_job, mode, timeout=300):
        assert out["equal"], out
        assert out["new_tokens"] == 6
        assert out["per_call"] >= 6  # one binding (one gather under fully_shard) per forward
        assert out["once"] == 1


def one_rank_job(patience: float) -> dict:
    """fully_shard: rank 1 calls the model while rank 0 is busy elsewhere; after ``patience``
    seconds rank 1 logs why it waits; once rank 0 makes the call too both get the right result."""
    from spmd_compiler.state import eager

    model, opt, ref, ref_opt, dp, spmd_compile = _pair("fully_shard")
    spmd_compile(dp)(mse_step)(model, opt, rank_data(700, (8, 50), (8, 8)))
    mse_step(ref, ref_opt, rank_data(700, (8, 50), (8, 8)))
    old = eager.COLLECTIVE_PATIENCE_S
    eager.COLLECTIVE_PATIENCE_S = patience
    try:
        with spmd_log(logging.WARNING) as records:
            if dist.get_rank() == 0:
                time.sleep(4 * patience)
            x = rank_data(701, (3, 50))
            with torch.no_grad():
                y = model.eval()(x)
            assert_close_all(y, ref.module.eval()(x), RTOL, ATOL, what="output")
    finally:
        eager.COLLECTIVE_PATIENCE_S = old
    return {"warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}


def test_a_rank_waiting_alone_in_an_eager_gather_says_why(pool2):
    r0, r1 = pool2.run(one_rank_job, 0.5)
    assert r0["warnings"] == []
    assert len(r1["warnings"]) == 1
    text = r1["warnings"][0]
    assert "rank 1 has waited" in text and "every rank must make the same calls" in text


def step_inside_unsharded_job(mode: str) -> dict:
    from spmd_compiler import SPMDError
    from spmd_compiler.state.eager import unsharded

    model, opt, ref, ref_opt, dp, spmd_compile = _pair(mode)
    step = spmd_compile(dp)(mse_step)
    batch = rank_data(800, (8, 50), (8, 8))
    step(model, opt, batch)
    mse_step(ref, ref_opt, batch)
    error = None
    with unsharded(model):
        try:
            step(model, opt, rank_data(801, (8, 50), (8, 8)))
        except SPMDError as e:
            error = f"{type(e).__name__}: {e}"
    step(model, opt, batch)  # outside the block it trains on, unchanged by the failed call
    mse_step(ref, ref_opt, batch)
    _same_state(model, opt, ref, ref_opt, "after the refused call")
    return {"error": error}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_compiled_step_inside_unsharded_is_refused(pool2, mode):
    for out in pool2.run(step_inside_unsharded_job, mode):
        assert out["error"] and "unsharded(model)" in out["error"], out


def _alone_rank(rank: int, port: int, timeout_s: float, results) -> None:
    """Rank 1 calls a fully_shard model outside the step; rank 0 never does (it sleeps)."""
    import os
    import sys
    import traceback
    from datetime import timedelta
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from spmd_compiler import DataParallel, spmd_compile
    from tests.models import SimpleMLP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=timeout_s))
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spmd_compile(DataParallel("fully_shard"))(mse_step)(model, opt, (torch.randn(4, 50), torch.randn(4, 8)))
    started = time.monotonic()
    try:
        if rank == 0:
            time.sleep(timeout_s + 2)  # past rank 1's timeout, so that is what ends its wait
            return
        with torch.no_grad():
            model(torch.randn(2, 50))
        results.put((rank, "ran", "", time.monotonic() - started))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put((rank, type(e).__name__, str(e) + traceback.format_exc(), time.monotonic() - started))
    finally:
        os._exit(0)


def test_a_rank_alone_in_an_eager_gather_gets_a_clear_error_not_a_hang():
    """With the process group's timeout (3 s here) the lone rank raises a CollectiveError that
    says why, well before the 30 s patience warning would be due."""
    from tests.test_faults import run_two_ranks

    timeout_s = 3.0
    reports, procs = run_two_ranks(_alone_rank, timeout_s)
    assert 1 in reports, f"rank 1 reported nothing (exit codes {[p.exitcode for p in procs]})"
    kind, message, seconds = reports[1]
    assert kind == "CollectiveError", (kind, message)
    assert "every rank must make the same calls" in message and "all_gather" in message, message
    assert seconds < timeout_s * 3, f"rank 1 waited {seconds:.1f}s with a {timeout_s}s timeout"
