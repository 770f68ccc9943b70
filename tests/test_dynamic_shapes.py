"""Dynamic sizes beyond the batch: sequence lengths that change between steps and differ across
ranks in the same step, against DDP, with a bounded number of compiles.

A small causal language model (``TinyLM``: token + position embeddings, one masked attention
block, a language-model head and a shifted cross-entropy) reads ``(batch, length)`` token ids, so
the length reaches ``arange``, a ``triu`` mask, softmax and the flattening of the loss. Parity:
every parameter and optimizer state after every step, gathered, against DDP fed the same local
batches, at the tolerances of tests/test_replicate.py (``|a - e| <= 1e-6 + 1e-5 |e|``). DDP
averages each rank's local mean loss over the ranks, whatever the ranks' lengths; so must we.
"""

from __future__ import annotations

import logging
import math
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.multirank import ParityChecker, rank_data
from tests.test_fully_shard import compare_with_reference

VOCAB, WIDTH, MAX_LEN = 50, 16, 64


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(MAX_LEN, WIDTH)
        # no bias: the key bias's gradient is zero up to round-off (softmax ignores a shift),
        # which Adam's first update divides by ~eps, comparing round-off with round-off
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        length = ids.shape[1]
        h = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(WIDTH)
        future = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)
        attn = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.head(h + self.proj(attn @ v))


def lm_step(model, optim, ids):
    optim.zero_grad()
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    return loss


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def _tokens(step: int, shape: tuple[int, int]) -> torch.Tensor:
    return rank_data(700 + step, shape, dtype=torch.int64, high=VOCAB)


def varying_lengths_job(mode: str, optimizer: str, shapes: list[list[tuple[int, int]]],
                        **options) -> dict:
    """Train ``shapes[i][rank]``-shaped token batches with the compiled step and with DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = TinyLM()
    ref = DDP(deepcopy(model))
    opt, ref_opt = _optimizer(optimizer, model), _optimizer(optimizer, ref)
    step = spmd_compile(DataParallel(mode, **options))(lm_step)
    chk, counts = ParityChecker(), []
    for i, per_rank in enumerate(shapes):
        ids = _tokens(i, per_rank[dist.get_rank()])
        loss = step(model, opt, ids)
        chk.close("loss", f"step {i}: loss", loss, lm_step(ref, ref_opt, ids).detach())
        compare_with_reference(chk, f"step {i}", model, opt, ref.module, ref_opt)
        counts.append(step.compile_count)
    return dict(problems=chk.problems, max_err=chk.max_err, counts=counts)


# (local batch, length) per step, one entry per rank. Lengths change every step; ranks differ
# in the same step (as each rank's padding-per-batch collator does), agree again, differ in the
# batch too; a length equal to the batch size (6) must not pass for the batch.
MIXES = {
    "equal first": [[(6, 12), (6, 12)], [(6, 12), (6, 16)], [(6, 20), (6, 9)], [(6, 33), (6, 33)],
                    [(6, 6), (6, 40)], [(4, 21), (6, 22)], [(6, 5), (6, 5)]],
    "differ first": [[(6, 17), (6, 40)], [(6, 12), (6, 12)], [(3, 6), (6, 30)], [(6, 64), (5, 3)]],
    # length 2 leaves one position after the shift (a size-1 dim in the loss's reshape), and a
    # batch of one: the same program as every other length and batch size
    "short": [[(6, 12), (6, 12)], [(6, 20), (6, 2)], [(6, 2), (6, 2)], [(1, 33), (6, 3)],
              [(6, 2), (1, 2)]],
}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("optimizer, mix", [("sgd", "equal first"), ("adamw", "differ first"),
                                            ("sgd", "short")])
def test_lengths_varying_across_steps_and_ranks_match_ddp(pool2, mode, optimizer, mix):
    """Any mix of lengths costs at most two compiles: the first program (its lengths static,
    unless the ranks' lengths already differ), then one with the length as a symbolic size that
    serves every later length on every rank. AdamW's first call is a program of its own (it
    creates the optimizer state) and its second call is then the symbolic one."""
    results = pool2.run(varying_lengths_job, mode, optimizer, MIXES[mix], timeout=300)
    for rank, res in enumerate(results):
        assert not res["problems"], f"rank {rank}: " + "\n".join(res["problems"][:10])
        counts = res["counts"]
        assert counts[-1] <= 2, f"rank {rank}: compile_count after each step {counts}"
        assert counts[-1] == counts[1], f"rank {rank}: compiled again after step 1: {counts}"
    assert results[0]["counts"] == results[1]["counts"]


def test_lengths_differing_across_three_ranks(pool3):
    shapes = [[(4, 10), (4, 10), (4, 10)], [(4, 10), (2, 11), (4, 30)],
              [(5, 8), (4, 8), (4, 9)], [(4, 25), (4, 3), (2, 17)]]
    for rank, res in enumerate(pool3.run(varying_lengths_job, "fully_shard", "sgd", shapes,
                                         timeout=300)):
        assert not res["problems"], f"rank {rank}: " + "\n".join(res["problems"][:10])
        assert res["counts"] == [1, 2, 2, 2], f"rank {rank}: {res['counts']}"


def declared_dynamic_job() -> dict:
    """Compile counts when the length is declared dynamic up front (the option, or
    ``torch._dynamo.mark_dynamic``), and with automatic dynamic dims turned off."""
    from spmd_compiler import DataParallel, spmd_compile

    lengths = [12, 20, 7, 33]
    out = {}
    for name, options, mark in [("dynamic_dims=1", dict(dynamic_dims=1), False),
                                ("mark_dynamic", {}, True),
                                ("automatic_dynamic=False", dict(automatic_dynamic=False), False)]:
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd_compile(DataParallel("replicate", **options))(lm_step)
        counts = []
        for i, length in enumerate(lengths):
            ids = _tokens(i, (4, length))
            if mark:
                torch._dynamo.mark_dynamic(ids, 1)
            step(model, opt, ids)
            counts.append(step.compile_count)
        out[name] = counts
    return out


def test_declared_dynamic_dims_compile_once(pool2):
    for rank, res in enumerate(pool2.run(declared_dynamic_job, timeout=300)):
        assert res["dynamic_dims=1"] == [1, 1, 1, 1], f"rank {rank}: {res}"
        assert res["mark_dynamic"] == [1, 1, 1, 1], f"rank {rank}: {res}"
        assert res["automatic_dynamic=False"] == [1, 2, 3, 4], f"rank {rank}: {res}"


# --------------------------------------------------------------------------------------------------
# A data-dependent size (the length of a nonzero result)
# --------------------------------------------------------------------------------------------------


def positive_targets_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    keep = (y > 0).nonzero().squeeze(-1)  # DATA-DEPENDENT LINE
    loss = (model(x[keep]).squeeze(-1) - y[keep]).pow(2).mean()
    loss.backward()
    optim.step()
    return loss


def data_dependent_job(mode: str) -> dict:
    """Either every rank raises an SPMDError naming the user's line, or the step matches DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, SPMDError, spmd_compile

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    ref = DDP(deepcopy(model))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = spmd_compile(DataParallel(mode))(positive_targets_step)
    chk = ParityChecker()
    for i in range(3):
        batch = rank_data(900 + i, (12, 8), 12)
        try:
            loss = step(model, opt, batch)
        except SPMDError as e:
            return dict(error=(type(e).__name__, str(e)))
        chk.close("loss", f"step {i}: loss", loss, positive_targets_step(ref, ref_opt, batch).detach())
        compare_with_reference(chk, f"step {i}", model, opt, ref.module, ref_opt)
    return dict(error=None, problems=chk.problems)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_data_dependent_size_raises_clearly_or_matches_ddp(pool2, mode):
    results = pool2.run(data_dependent_job, mode, timeout=120)
    errors = [r["error"] for r in results]
    if all(e is None for e in errors):
        for rank, r in enumerate(results):
            assert not r["problems"], f"rank {rank}: " + "\n".join(r["problems"][:10])
        return
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} ran while another raised: {errors}"
    # the rank's own compile error (the ranks fail alike) names the op and the user's line
    name, message = errors[0]
    assert "DATA-DEPENDENT LINE" in message and "nonzero" in message, message


# --------------------------------------------------------------------------------------------------
# Tracing: symbols of dynamic dims (single process)
# --------------------------------------------------------------------------------------------------


def _trace(step, args, dynamic, placements: bool = True):
    from spmd_compiler.build.pipeline import analyze
    from spmd_compiler.runtime.call_args import split_step_args
    from spmd_compiler.trace.record import trace_step

    sa = split_step_args(args, {}, 0)
    traced = trace_step(step, (), {}, step_args=sa, dynamic_dims=dynamic)
    if placements:
        analyze(traced.gm)
    return traced


def _input_placeholder(traced):
    from spmd_compiler.passes.meta import ROLE, Role

    return next(n for n in traced.gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT)


def test_length_equal_to_batch_size_gets_its_own_symbol():
    """Six sequences of length six: the length is a symbol of its own (no duck sizing), so the
    placement analysis sees one batch-sharded dim."""
    from spmd_compiler.passes.meta import INPUT_DYNAMIC_DIMS, PLACEMENT

    model = TinyLM()
    traced = _trace(lm_step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                              torch.randint(0, VOCAB, (6, 6))), {2: [1]})
    node = _input_placeholder(traced)
    b, length = node.meta["val"].shape
    assert isinstance(b, torch.SymInt) and isinstance(length, torch.SymInt)
    assert str(b.node.expr) != str(length.node.expr)
    assert node.meta[PLACEMENT].dim == 0 and node.meta[INPUT_DYNAMIC_DIMS] == (1,)
    assert traced.specialized_dims == [] and traced.entangled == []


class PairModel(nn.Module):
    """Adds the token matrix to its transpose: only defined when batch == length."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, ids):
        pair = ids.float() + ids.float().t()  # TIES LENGTH TO BATCH
        return self.lin(pair.unsqueeze(-1)).sum()


def pair_step(model, optim, ids):
    optim.zero_grad()
    loss = model(ids)
    loss.backward()
    optim.step()
    return loss


def test_length_tied_to_the_batch_is_retraced_static():
    """A step that needs length == batch: the length is traced static again (a dim holding the
    batch symbol would count as batch-sharded); the batch then specializes to the same size, so
    the program serves exactly that shape (compiled without placement analysis, see api)."""
    model = PairModel()
    traced = _trace(pair_step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                                torch.randint(0, 5, (4, 4))), {2: [1]}, placements=False)
    assert [(i, d) for i, d, _ in traced.entangled] == [(2, 1)]
    assert "TIES LENGTH TO BATCH" in traced.entangled[0][2]
    assert _input_placeholder(traced).meta["val"].shape[1] == 4
    assert traced.static_sizes[0] == ((0, 4), (1, 4)) and traced.dynamic_dims == {2: ()}
    assert traced.specialized == [(0, 0, 4)]


class FixedLengthModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 1)
        self.register_buffer("offsets", torch.arange(12.0))

    def forward(self, ids):
        h = ids.float() + self.offsets  # SPECIALIZES THE LENGTH
        return self.lin(h).sum()


def test_specialization_is_reported_with_the_user_line(caplog):
    from spmd_compiler import DataParallel
    from spmd_compiler.api import explain

    model = FixedLengthModel()
    traced = _trace(pair_step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                                torch.randint(0, 5, (3, 12))), {2: [1]})
    assert [(i, d, s) for i, d, s, _ in traced.specialized_dims] == [(2, 1, 12)]
    assert "SPECIALIZES THE LENGTH" in traced.specialized_dims[0][3]
    assert traced.static_sizes[0] == ((1, 12),)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        explain(pair_step, model, torch.optim.SGD(model.parameters(), lr=0.1),
                torch.randint(0, 5, (3, 12)), parallel_mode=DataParallel(dynamic_dims=1))
    assert any("specialized it to 12" in r.getMessage() and "SPECIALIZES THE LENGTH" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_dynamic_dims_option_is_checked():
    from spmd_compiler import DataParallel
    from spmd_compiler.errors import BatchDimError
    from spmd_compiler.runtime.call_args import split_step_args

    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, labels = torch.randint(0, 5, (3, 12)), torch.randint(0, 5, (3,))
    sa = split_step_args((model, opt, (ids, labels)), {}, 0, (1, None))
    assert sa.dynamic_dims == {2: (1,)} and sa.leaf_name(2) == "argument 2[0]"
    with pytest.raises(BatchDimError, match="dynamic_dims=1 is out of range .* shape \\(3,\\)"):
        split_step_args((model, opt, (ids, labels)), {}, 0, DataParallel(dynamic_dims=1).dynamic_dims)
