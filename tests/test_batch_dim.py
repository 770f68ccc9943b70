"""Batch-dim analysis (passes/batch_dim.py) on traced training steps, single process."""

from __future__ import annotations

import operator
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from tabulate import tabulate
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from spmd_compiler.passes.batch_dim import PlacementError, annotate_placements
from spmd_compiler.passes.meta import PLACEMENT, REGION, ROLE, Region, Role
from spmd_compiler.trace.record import trace_step
from tests.models import BatchDimModel, SimpleMLP, TransposedMLP, train_step
from tests.steps import clip_norm, diff_sum, step_with, sum_step

aten = torch.ops.aten
R, AVG = Replicate(), Partial("avg")


def annotated(model, optim, batch, step=train_step, input_batch_dim=0):
    gm = trace_step(step, (model, optim, batch), {}, input_batch_dim=input_batch_dim).gm
    return annotate_placements(gm)


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def placement(node):
    return node.meta[PLACEMENT]


def size_exprs(node):
    return [str(s) for s in node.meta["val"].shape]


def check_roles(gm):
    """Parameters and optimizer state are Replicate, gradients Partial(avg)."""
    grads = 0
    for n in gm.graph.nodes:
        role = n.meta.get(ROLE)
        if role in (Role.PARAM, Role.OPT_STATE, Role.BUFFER):
            assert placement(n) == R, n
        if role == Role.GRAD:
            assert placement(n) == AVG, n
            grads += 1
    return grads


def test_seed_batch_dim_model():
    model = BatchDimModel()
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   (torch.randn(16, 50), torch.randn(16, 8)))
    x, y = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT]
    assert placement(x) == placement(y) == Shard(0)
    b = size_exprs(x)[0]

    flat = calls(gm, aten.view.default)[0]  # output.clone().view(-1)
    assert size_exprs(flat) == [f"8*{b}"] and placement(flat) == Shard(0)
    unsq = calls(gm, aten.unsqueeze.default)[0]  # squeezed_out.unsqueeze(0)
    assert size_exprs(unsq) == ["1", f"8*{b}"] and placement(unsq) == Shard(1)
    back = calls(gm, aten.view.default)[1]  # .view(output.shape[0], -1)
    assert size_exprs(back) == [b, "8"] and placement(back) == Shard(0)
    (arange,) = calls(gm, aten.arange.default)
    assert placement(arange) == R
    (ones,) = calls(gm, aten.ones.default)
    assert placement(ones) == Shard(0)
    (zeros,) = calls(gm, aten.zeros.default)
    assert placement(zeros) == R
    (repeat,) = calls(gm, aten.repeat.default)
    assert placement(repeat.args[0]) == R and placement(repeat) == Shard(0)
    # the weight gradients contract over the batch
    weight_grads = [mm for mm in calls(gm, aten.mm.default) if size_exprs(mm)[0] != b]
    assert weight_grads and all(placement(mm) == AVG for mm in weight_grads)
    assert check_roles(gm) == 4
    loss = gm.graph.output_node().args[0][0]
    assert placement(loss) == AVG


def test_non_zero_batch_dim_fused_adam():
    model = TransposedMLP()
    optim = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    gm = annotated(model, optim, (torch.randn(50, 16), torch.randn(8, 16)), input_batch_dim=1)
    x, y = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT]
    assert placement(x) == placement(y) == Shard(1)
    t_in = next(n for n in calls(gm, aten.t.default) if n.args[0] is x)
    assert placement(t_in) == Shard(0)
    out_t = next(n for n in calls(gm, aten.t.default) if n.args[0].target == aten.sigmoid.default)
    assert placement(out_t) == Shard(1)
    check_roles(gm)
    (adam,) = calls(gm, aten._fused_adam_.tensor_lr)
    assert placement(adam) == [AVG] * 4  # what it writes into each parameter / state


def test_feature_dim_equal_to_batch_size_is_not_sharded():
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                   (torch.randn(16, 16), torch.randn(16, 16)))
    for n in gm.graph.nodes:
        p = placement(n)
        if isinstance(p, Shard):
            assert size_exprs(n)[p.dim] != "16", n  # only the symbolic batch size is sharded
        if isinstance(n.meta.get("val"), torch.Tensor) and "s" not in "".join(size_exprs(n)):
            assert not isinstance(p, Shard), n
    addmms = calls(gm, aten.addmm.default)
    assert [placement(n) for n in addmms] == [Shard(0), Shard(0)]
    weight_grads = [n for n in calls(gm, aten.mm.default) if size_exprs(n) == ["16", "16"]]
    assert weight_grads and all(placement(n) == AVG for n in weight_grads)
    assert check_roles(gm) == 4


class TinyBlock(nn.Module):
    """Embedding, causal self-attention, MLP and an LM head: batch x seq flattened for the loss."""

    def __init__(self, vocab=11, dim=8, heads=2, seq=5):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, idx):
        b, t = idx.shape
        h = self.tok(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(h)).split(h.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        att = att.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        h = h + self.proj(y)
        h = h + self.mlp(self.ln2(h))
        return self.head(h)


def lm_loss(model, batch):
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


lm_step = step_with(lm_loss)


def test_transformer_block_flattens_batch_and_seq():
    model = TinyBlock()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gm = annotated(model, optim, (torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))),
                   step=lm_step)
    idx = next(n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT)
    b = size_exprs(idx)[0]
    (nll,) = calls(gm, aten.nll_loss_forward.default)
    logits, targets = nll.args[0].args[0], nll.args[1]
    assert size_exprs(targets) == [f"5*{b}"] and placement(targets) == Shard(0)
    assert size_exprs(logits) == [f"5*{b}", "11"] and placement(logits) == Shard(0)
    assert placement(nll) == [AVG, AVG]
    scores = [n for n in calls(gm, aten.bmm.default) if size_exprs(n)[1:] == ["5", "5"]]
    assert scores and all(placement(n) == Shard(0) for n in scores)  # [b*heads, t, t]
    (buf,) = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.BUFFER]
    assert placement(buf) == R
    assert check_roles(gm) == len(list(model.parameters()))
    # exp_avg_sq is created as zeros (Replicate) and then written in place from the gradients:
    # its later reader sees what was written
    (sqrt,) = calls(gm, aten._foreach_sqrt.default)
    assert placement(sqrt) == [AVG] * len(list(model.parameters()))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(x, 1))


def ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


ce_step = step_with(ce_loss)


def test_conv_net_with_batch_norm_and_flatten():
    model = ConvNet()
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                   (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))), step=ce_step)
    b = size_exprs(next(n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT))[0]
    (conv,) = calls(gm, aten.convolution.default)
    assert placement(conv) == Shard(0)
    flat = next(n for n in gm.graph.nodes if n.target == aten.view.default
                and size_exprs(n) == [b, "64"])
    assert placement(flat) == Shard(0)
    bn = next(n for n in gm.graph.nodes if "batch_norm" in str(n.target)
              and "backward" not in str(n.target))
    assert placement(bn)[0] == Shard(0) and placement(bn)[1:] == [AVG, AVG]  # local statistics
    (conv_bwd,) = calls(gm, aten.convolution_backward.default)
    grad_in, grad_w, grad_b = placement(conv_bwd)
    assert grad_in in (Shard(0), None) and grad_w == grad_b == AVG
    assert check_roles(gm) == len(list(model.parameters()))  # buffers Replicate too


def test_unbatched_extra_input_is_replicate():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x, mask):
            return self.lin(x) * mask

    def masked_mse(model, batch):
        x, mask, y = batch
        return F.mse_loss(model(x, mask), y)

    step = step_with(masked_mse)
    model = Masked()
    batch = (torch.randn(4, 6), torch.ones(6), torch.randn(4, 6))
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=step,
                   input_batch_dim=(0, None, 0))
    x, mask, y = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT]
    assert (placement(x), placement(mask), placement(y)) == (Shard(0), R, Shard(0))
    mul = next(n for n in calls(gm, aten.mul.Tensor) if mask in n.args)
    assert placement(mul) == Shard(0)
    (mse,) = calls(gm, aten.mse_loss.default)
    assert placement(mse) == AVG
    assert check_roles(gm) == 2


def _raising_step(forward):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return forward(self.lin(x))

    model = M()
    return trace_step(sum_step, (model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(6, 8)),
                      {}, input_batch_dim=0).gm


def _strided(dim, factor):
    return _StridedShard(dim, split_factor=factor)


@pytest.mark.parametrize("forward, op, expected", [
    # [8, b] flattened: the batch is inside dim 0, after 8 chunks
    (lambda h: h.t().reshape(-1), aten._unsafe_view.default, _strided(0, 8)),
    (lambda h: h[0], aten.select.int, AVG),  # one rank-local sample
    (lambda h: h[1:], aten.slice.Tensor, Shard(0)),  # each rank drops its first sample
    (lambda h: h @ h.t(), aten.mm.default, Shard(0)),  # [b, b]: local pairs
    (lambda h: torch.cat([h, h]), aten.cat.default, _strided(0, 2)),
    (lambda h: h.repeat(2, 1), aten.repeat.default, _strided(0, 2)),
    (lambda h: h.cumsum(0), aten.cumsum.default, Shard(0)),
    (lambda h: h.softmax(0), aten._softmax.default, Shard(0)),
    (lambda h: h + torch.arange(h.shape[0])[:, None], aten.arange.default, Shard(0)),
    (lambda h: h.flip(0), aten.flip.default, Shard(0)),
    (lambda h: h + h.max(0).indices, aten.max.dim, [AVG, AVG]),  # positions of local samples
    (lambda h: h + h.any(0), aten.any.dim, AVG),
    (lambda h: h[torch.arange(h.shape[0]), torch.zeros(h.shape[0], dtype=torch.long)],
     aten.index.Tensor, Shard(0)),  # per-sample indexing with local indices
    (lambda h: torch.zeros_like(h).scatter(0, torch.zeros_like(h, dtype=torch.long), h),
     aten.scatter.src, Shard(0)),
], ids=["flatten-batch-inner", "select", "slice", "outer", "cat", "repeat", "cumsum", "softmax",
        "arange", "flip", "argmax-over-batch", "any-over-batch", "arange-index", "scatter"])
def test_local_ops_are_described_not_refused(forward, op, expected):
    """What DDP runs, the analysis describes: local positions and local selections get the
    placement their shape and inputs prove, nothing raises."""
    gm = annotate_placements(_raising_step(forward))
    (node,) = calls(gm, op)[:1]
    assert placement(node) == expected, (node, placement(node))
    assert check_roles(gm) == 2


def test_flatten_of_a_time_major_batch_is_a_strided_shard_as_dtensor_says():
    """(T, b, E) -> (T*b, E) inside nn.MultiheadAttention: DTensor's own view rule gives the same
    _StridedShard on concrete shapes (global batch 2 * 3, mesh of 2)."""
    from torch.distributed.tensor._ops._view_ops import propagate_shape_and_sharding, view_groups

    mha = nn.MultiheadAttention(8, 2)

    class TimeMajor(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):  # (T, b, E)
            return self.mha(x, x, x, need_weights=False)[0]

    model = TimeMajor()
    gm = trace_step(train_step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    (torch.randn(5, 3, 8), torch.randn(5, 3, 8))), {},
                    input_batch_dim=1).gm
    annotate_placements(gm)
    b = size_exprs(next(n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.INPUT))[1]
    flats = [n for n in gm.graph.nodes if n.target in (aten.view.default, aten._unsafe_view.default)
             and size_exprs(n) == [f"5*{b}", "8"]]
    assert flats and all(placement(n) == _strided(0, 5) for n in flats)
    rule = view_groups([5, 6, 8], [30, 8])  # aten.view: DTensor's strict view rule
    _, (expected,) = propagate_shape_and_sharding([Shard(1)], (5, 6, 8), rule, (2,), strict_view=True)
    assert expected == _strided(0, 5)
    assert check_roles(gm) == len(list(model.parameters()))


def test_split_factor_follows_a_symbolic_sequence_length():
    """With the sequence length symbolic too, (T, b, E) -> (T*b, E) -> (T, b, E) is
    _StridedShard(0, T) then Shard(1): the factor comes from the input's shape, not from the
    product T*b (which is the same for (b, T))."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    from spmd_compiler.passes.meta import INPUT_BATCH_DIM

    def f(x):
        t, b, e = x.shape
        flat = x.reshape(t * b, e) * 2
        other = x.transpose(0, 1).reshape(b * t, e)  # batch-major: the same size t*b, Shard(0)
        return flat.view(t, b, e), other

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC,
                                                  DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(5, 3, 4), symbolic_context=ctx)
    with mode:
        gm = make_fx(f, tracing_mode="symbolic")(x)
    (inp,) = gm.graph.find_nodes(op="placeholder")
    inp.meta.update({ROLE: Role.INPUT, INPUT_BATCH_DIM: 1})
    annotate_placements(gm)
    t_sym = inp.meta["val"].shape[0]
    flat = next(n for n in gm.graph.nodes if n.target == aten.mul.Tensor)
    p = placement(flat)
    assert isinstance(p, _StridedShard) and p.dim == 0 and p.split_factor == t_sym
    back, other = gm.graph.output_node().args[0]
    assert placement(back) == Shard(1) and placement(other) == Shard(0)
    assert str(inp.meta["val"].shape[0].node.expr) in str(p)


def test_data_dependent_sizes_from_the_batch_are_batch_sizes():
    """nonzero / boolean masks over batch data select each rank's own samples: their unbacked
    size is a batch size (Shard); a size read from a rank-local value is rank-local (Partial)."""
    def step(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        out = model(x)
        keep = y > 0
        (rows,) = torch.where(keep[:, 0])
        n = keep.sum().item()  # a size read from a rank-local value
        loss = (out[keep] - y[keep]).pow(2).sum() + out[rows].sum() + torch.ones(n).sum()
        loss.backward()
        optim.step()
        return loss

    model = SimpleMLP()
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   (torch.randn(6, 50), torch.randn(6, 8)), step=step)
    masked = [n for n in calls(gm, aten.index.Tensor) if n.meta.get("unbacked_bindings")]
    assert masked and all(placement(n) == Shard(0) for n in masked)
    (nonzero,) = calls(gm, aten.nonzero.default)
    assert placement(nonzero) == Shard(0)
    (ones,) = calls(gm, aten.ones.default)
    assert placement(ones) == AVG
    assert check_roles(gm) == 4


def test_nonlinear_reductions_over_batch_are_rank_local_partials():
    gm = _raising_step(lambda h: h.amax(0) + h.detach().max(0).values + h.var(0) + h.norm()
                       + torch.zeros(3, 8).index_put([torch.zeros(h.shape[0], dtype=torch.long)],
                                                     h, accumulate=True).sum(0))
    annotate_placements(gm)
    for op in (aten.amax.default, aten.max.dim, aten.var.correction,
               aten.linalg_vector_norm.default, aten.index_put.default):
        (node,) = calls(gm, op)
        p = placement(node)
        assert (p[0] if isinstance(p, list) else p) == AVG, node
    (max_dim,) = calls(gm, aten.max.dim)
    assert placement(max_dim) == [AVG, AVG]  # the indices are positions of local samples
    assert check_roles(gm) == 2


def test_local_statistics_feed_sharded_results():
    """A hand-written batch norm: each rank normalizes with its own batch statistics."""
    gm = annotate_placements(_raising_step(lambda h: (h - h.mean(0)) / (h.var(0) + 1e-5).sqrt()))
    mean = calls(gm, aten.mean.dim)[0]  # the forward's (var's backward has its own)
    (centered,) = [n for n in calls(gm, aten.sub.Tensor) if mean in n.args]
    normalized = next(n for n in calls(gm, aten.div.Tensor) if centered in n.args)
    assert placement(mean) == AVG and placement(centered) == placement(normalized) == Shard(0)
    assert check_roles(gm) == 2


def test_functional_collectives_after_expansion():
    """all_reduce makes Partial gradients Replicate, so the optimizer region is Replicate."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from spmd_compiler.passes.expand import expand_replicate

    model = SimpleMLP()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gm = trace_step(train_step, (model, optim, (torch.randn(8, 50), torch.randn(8, 8))),
                    {}, input_batch_dim=0).gm
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = dist.group.WORLD.group_name
        gm = annotate_placements(expand_replicate(gm, group_name=group, world_size=2))
    finally:
        dist.destroy_process_group()
    c10d = torch.ops._c10d_functional
    reduces = calls(gm, c10d.all_reduce.default)
    assert len(reduces) == 4
    for ar in reduces:
        assert placement(ar.args[0]) == AVG and placement(ar) == R
        (wait,) = [u for u in ar.users if u.target == c10d.wait_tensor.default]
        assert placement(wait) == R
    optimizer_updates = [n for n in gm.graph.nodes
                         if n.target in (aten.add_.Tensor, aten.mul_.Tensor)
                         and n.meta["val"].dim() > 0]
    assert optimizer_updates and all(placement(n) == R for n in optimizer_updates)


clip_step = step_with(diff_sum, between=clip_norm(1.0, returned=False))


@pytest.mark.parametrize("make_optim", [
    lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["adam-fused", "adamw-foreach", "sgd-momentum"])
def test_fully_shard_expanded_graph(make_optim):
    """Stored shards stay Shard(0) through the optimizer; gathered parameters are Replicate;
    reduce_scatter turns Partial gradients into shards; a grad norm over shards is a Partial sum
    of squares until its all_reduce."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from spmd_compiler.passes.expand import expand_fully_shard

    model = SimpleMLP()
    gm = trace_step(clip_step, (model, make_optim(model.parameters()),
                                (torch.randn(8, 50), torch.randn(8, 8))), {}, input_batch_dim=0).gm
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        gm = expand_fully_shard(gm, group_name=dist.group.WORLD.group_name, world_size=3)
    finally:
        dist.destroy_process_group()
    annotate_placements(gm)
    c10d = torch.ops._c10d_functional
    params = [n for n in gm.graph.nodes if n.meta.get(ROLE) == Role.PARAM]
    assert all(placement(p) == Shard(0) for p in params)
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    assert gathers and all(placement(g) == R for g in gathers)
    assert placement(calls(gm, aten.addmm.default)[0]) == Shard(0)
    scatters = calls(gm, c10d.reduce_scatter_tensor.default)
    assert len(scatters) == 4
    for rs in scatters:
        assert placement(rs.args[0]) == AVG and placement(rs) == Shard(0)
    assert all(placement(n) == AVG for n in gm.graph.nodes if n.meta.get(ROLE) == Role.GRAD)
    norms = [n for n in gm.graph.nodes if n.target in (aten.linalg_vector_norm.default,
                                                         aten._foreach_norm.Scalar)]
    assert norms
    pows = [n for n in calls(gm, aten.pow.Tensor_Scalar) if n.args[0] in norms
            or n.args[0].target is operator.getitem and n.args[0].args[0] in norms]
    assert pows and all(placement(n) == Partial("sum") for n in pows)
    writes = [n for n in gm.graph.nodes if str(n.target).startswith(
        ("aten._fused_adam_", "aten._foreach_addcdiv_", "aten.add_.Tensor"))
        and any(p in params for p in (n.args[0] if isinstance(n.args[0], list) else [n.args[0]]))]
    assert writes
    for n in writes:
        ps = placement(n) if isinstance(placement(n), list) else [placement(n)]
        assert ps and all(p == Shard(0) for p in ps), n


def _fully_shard_graph(step, model, optim):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from spmd_compiler.passes.expand import expand_fully_shard

    gm = trace_step(step, (model, optim, (torch.randn(8, 50), torch.randn(8, 8))), {},
                    input_batch_dim=0).gm
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        return expand_fully_shard(gm, group_name=dist.group.WORLD.group_name, world_size=3)
    finally:
        dist.destroy_process_group()


def test_masked_writes_on_parameter_shards_are_elementwise():
    """Rprop's ``grad[mask] = 0`` (index_put_ with a boolean mask of the shard's shape) keeps
    the shard; a cumsum over a shard's rows would compute something else and raises."""
    model = SimpleMLP()
    gm = annotate_placements(_fully_shard_graph(train_step, model,
                                                torch.optim.Rprop(model.parameters(), lr=0.01)))
    writes = [n for n in gm.graph.nodes if n.target in (aten.index_put_.default,
                                                        aten.index_put.default)]
    assert writes and all(placement(n) == Shard(0) for n in writes)

    def cumsum_step(model, optim, batch):
        loss = train_step(model, optim, batch)
        for p in model.parameters():
            p.data.copy_(p.data.cumsum(0))  # CUMSUM-ON-SHARDS
        return loss

    gm = _fully_shard_graph(cumsum_step, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PlacementError, match="cumsum on parameter shards is not covered") as info:
        annotate_placements(gm)
    assert "CUMSUM-ON-SHARDS" in (info.value.stack_trace or "")


# -- property: random chains of shape ops against eager ground truth -------------------------

BASE = (3, 4)  # the non-batch dims of the input


def _chain_ops(data):
    """Draw a chain of shape ops; each op is a function of a tensor, independent of batch size."""
    ops = []
    shapes = {2: (2, *BASE), 3: (3, *BASE)}  # the running shape at two batch sizes

    def apply(op):
        ops.append(op)
        for bs, s in shapes.items():
            shapes[bs] = tuple(op(torch.empty(s, device="meta")).shape)

    for _ in range(data.draw(st.integers(1, 6), label="length")):
        nd = len(shapes[2])
        kind = data.draw(st.sampled_from(
            ["view_flat", "flatten", "permute", "transpose", "unsqueeze", "squeeze", "repeat",
             "unflatten", "t", "select", "narrow", "cat", "stack", "expand"]), label="kind")
        if kind == "view_flat":
            apply(lambda x: x.contiguous().view(-1))
        elif kind == "flatten" and nd > 1:
            start = data.draw(st.integers(0, nd - 2))
            end = data.draw(st.integers(start + 1, nd - 1))
            apply(lambda x, s=start, e=end: x.flatten(s, e))
        elif kind == "permute":
            perm = data.draw(st.permutations(range(nd)))
            apply(lambda x, p=tuple(perm): x.permute(p).contiguous())
        elif kind == "transpose" and nd > 1:
            d0, d1 = data.draw(
                st.lists(st.integers(0, nd - 1), min_size=2, max_size=2, unique=True))
            apply(lambda x, a=d0, b=d1: x.transpose(a, b))
        elif kind == "t" and nd == 2:
            apply(lambda x: x.t())
        elif kind == "unsqueeze":
            d = data.draw(st.integers(0, nd))
            apply(lambda x, d=d: x.unsqueeze(d))
        elif kind == "squeeze":
            ones = [i for i, s in enumerate(shapes[2]) if s == 1]
            if ones:
                d = data.draw(st.sampled_from(ones))
                apply(lambda x, d=d: x.squeeze(d))
        elif kind == "repeat":
            reps = data.draw(st.lists(st.integers(1, 2), min_size=nd, max_size=nd))
            apply(lambda x, r=tuple(reps): x.repeat(r))
        elif kind == "select" and nd > 1:
            d = data.draw(st.integers(0, nd - 1))
            apply(lambda x, d=d: x.select(d, 0))
        elif kind == "narrow":
            d = data.draw(st.integers(0, nd - 1))
            apply(lambda x, d=d: x.narrow(d, 0, 1))
        elif kind in ("cat", "stack"):
            d = data.draw(st.integers(0, nd - 1 if kind == "cat" else nd))
            apply(lambda x, d=d, f=getattr(torch, kind): f([x, 2 * x], d))
        elif kind == "expand":
            d = data.draw(st.integers(0, nd))
            apply(lambda x, d=d: x.unsqueeze(d).expand(*[-1] * d, 2, *[-1] * (x.dim() - d)))
        elif kind == "unflatten":
            d = data.draw(st.integers(0, nd - 1))
            sizes = (shapes[2][d], shapes[3][d])
            factors = [k for k in (2, 3, 4, 6) if all(s % k == 0 for s in sizes)]
            if factors:
                k = data.draw(st.sampled_from(factors))
                apply(lambda x, d=d, k=k: x.unflatten(d, (-1, k)))
    return ops


def _run(ops, x):
    for op in ops:
        x = op(x)
    return x


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))


def _assemble(parts, p):
    """The global tensor that the ranks' local tensors ``parts`` make under placement ``p``:
    concatenated along ``p.dim`` (Shard), or, for ``_StridedShard(d, k)``, each local tensor cut
    into k chunks along d and chunk j of every rank placed before chunk j + 1 of any."""
    if isinstance(p, Shard):
        return torch.cat(parts, p.dim)
    chunks = [part.tensor_split(p.split_factor, p.dim) for part in parts]
    return torch.cat([c[j] for j in range(p.split_factor) for c in chunks], p.dim)


LOCAL_BATCHES = (2, 3)  # each rank's batch size, in the two worlds the ground truth compares


def _batch_dim(splits) -> int | None:
    """The dim whose size differs between the local batches of 2 and 3 (None: no batch dim)."""
    small, large = (parts[0].shape for parts, _ in splits)
    changing = [i for i, (a, b) in enumerate(zip(small, large)) if a != b]
    assert len(changing) <= 1, (small, large)
    return changing[0] if changing else None


def _split_factor(p):
    return p.split_factor if isinstance(p, _StridedShard) else 1


def _exact(splits, p) -> bool:
    """Whether ``p`` assembles the ranks' tensors into the global one in every split."""
    sizes = [parts[0].shape[p.dim] for parts, _ in splits]
    return (all(size % _split_factor(p) == 0 for size in sizes)
            and all(torch.equal(_assemble(parts, p), whole) for parts, whole in splits))


def _exact_placement_exists(splits, d) -> bool:
    """Whether a Shard or _StridedShard on dim ``d`` gives the global tensor in every split."""
    size = splits[0][0][0].shape[d]
    candidates = [Shard(d)] + [_strided(d, k) for k in range(2, size + 1)]
    return any(_exact(splits, p) for p in candidates)


def _ground_truth(ops, seed=0):
    """Each world's two ranks' outputs of ``ops`` and the global tensor they must assemble into.

    That is the whole batch's output while some Shard / _StridedShard gives it exactly. An op
    after which none does (a reshape whose rows mix the samples of two ranks) leaves the most
    general placement the analysis can prove, the concatenation of the ranks' tensors on the
    batch dim: from there on the global tensor is that concatenation carried through the rest
    of the chain."""
    gen = torch.Generator().manual_seed(seed)
    splits = []
    for local in LOCAL_BATCHES:
        whole = torch.randn(2 * local, *BASE, generator=gen)
        splits.append((list(whole.split(local)), whole))
    for op in ops:
        splits = [([op(part) for part in parts], op(whole)) for parts, whole in splits]
        d = _batch_dim(splits)
        if d is not None and not _exact_placement_exists(splits, d):
            splits = [(parts, torch.cat(parts, d)) for parts, _ in splits]
    return splits


def _chain_placement(ops):
    """The placement the analysis gives the output of ``ops`` in a traced training step."""

    def step(model, optim, x):
        optim.zero_grad()
        out = _run(ops, x * model.w)
        out.sum().backward()
        optim.step()
        return out

    model = Scale()
    gm = trace_step(step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                           torch.randn(4, *BASE)), {}, input_batch_dim=0).gm
    annotate_placements(gm)
    check_roles(gm)
    return placement(gm.graph.output_node().args[0][0])


def check_chain(ops):
    """The analysis's placement of the chain's output against eager ground truth; returns it."""
    p = _chain_placement(ops)
    splits = _ground_truth(ops)
    d = _batch_dim(splits)
    if d is None:
        assert p == AVG, p  # a chain that leaves no batch-sized dim selected a sample
        return p
    assert isinstance(p, (Shard, _StridedShard)) and p.dim == d, p
    assert _exact(splits, p), p
    return p


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_shape_op_chains_match_eager_sharding(data):
    """Random chains of shape ops on a batched input, against eager ground truth: the output dim
    whose size changes with the batch size carries the Shard / _StridedShard, and the ranks'
    outputs (two ranks, local batches of 2 and of 3), assembled by that placement, are the output
    of the whole batch, or, after a reshape that mixes samples of two ranks in one row, the
    concatenation there carried on (see _ground_truth). A chain that leaves no batch-sized dim
    (it selected a sample) is rank-local: Partial("avg")."""
    check_chain(_chain_ops(data))


def _permute(*dims):
    return lambda x: x.permute(dims).contiguous()


def _view_flat(x):
    return x.contiguous().view(-1)


def _unflatten(d, k):
    return lambda x: x.unflatten(d, (-1, k))


@pytest.mark.parametrize("ops, expected", [
    # [3, b, 4] -> [12b]: three chunks, each sharded; [12b] -> [4b, 3] puts the last element of
    # one sample and the first two of the next in one row: only the concatenation is proven
    ([_permute(1, 0, 2), _view_flat, _unflatten(0, 3)], Shard(0)),
    ([_permute(1, 0, 2), _view_flat], _strided(0, 3)),
    ([_permute(1, 0, 2), _view_flat, _unflatten(0, 4)], _strided(0, 3)),  # [3b, 4]: whole rows
    ([_permute(1, 0, 2), _view_flat, _unflatten(0, 2)], _strided(0, 3)),  # [6b, 2]
    # [4, 3, b] -> [12b] -> [6b, 2]: a row holds the samples of two ranks once b is odd
    ([lambda x: x.transpose(0, 2), _view_flat, _unflatten(0, 2)], Shard(0)),
    # after the concatenation, the rules stay exact relative to it
    ([_permute(1, 0, 2), _view_flat, _unflatten(0, 3), lambda x: x.t(), _view_flat],
     _strided(0, 3)),
], ids=["time-major-rows-of-3", "time-major-flat", "time-major-rows-of-4", "time-major-rows-of-2",
        "batch-last-rows-of-2", "mixed-rows-transposed-flat"])
def test_reshapes_that_mix_samples_in_a_row_prove_only_the_concatenation(ops, expected):
    """Found by the property test: a reshape keeps the batch factor exactly only when the dims
    after the batch dim split each sample's elements (no row holds elements of two samples)."""
    assert check_chain(ops) == expected


# -- the placement table in docs/batch_dim.md ------------------------------------------------

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "batch_dim.md"


def seed_placement_table() -> str:
    """Every node of the seed's batch-dim model step (SGD, batch 16) with its placement."""
    torch.manual_seed(0)
    model = BatchDimModel()
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   (torch.randn(16, 50), torch.randn(16, 8)))
    rows = []
    for n in gm.graph.nodes:
        p = n.meta.get(PLACEMENT)
        if p is None:
            continue
        val = n.meta["val"]
        shape = "[" + ", ".join(str(s) for s in val.shape) + "]" if isinstance(val, torch.Tensor) \
            else "list"
        target = n.target if n.op == "call_function" else n.op
        region = n.meta.get(REGION)
        role = n.meta.get(ROLE)
        rows.append([n.name, str(target).removeprefix("aten."), shape, str(p),
                     (region.value if region else "") + (f" ({role.value})" if role else "")])
    return tabulate(rows, headers=["node", "op", "shape", "placement", "region (role)"],
                    tablefmt="github")


class TimeMajorAttention(nn.Module):
    """One ``nn.MultiheadAttention`` (time-major, the default layout) with a causal mask."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x):  # (T, b, 8)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


def attention_placement_table() -> str:
    """The forward of one nn.MultiheadAttention (T = 5, batch b, embedding 8, 2 heads), with the
    placement text the dumps print on every node."""
    from spmd_compiler.observe.visualize import placement_str

    torch.manual_seed(0)
    model = TimeMajorAttention()
    gm = annotated(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   (torch.randn(5, 4, 8), torch.randn(5, 4, 8)), input_batch_dim=1)
    rows = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.meta.get(REGION) != Region.FORWARD or not isinstance(val, torch.Tensor):
            continue
        if n.meta.get(ROLE) in (Role.PARAM, Role.BUFFER) or n.target == aten.sub.Tensor:
            continue  # the weights are R; the loss follows
        target = str(n.target).removeprefix("aten.") if n.op == "call_function" else n.op
        rows.append([n.name, target, "[" + ", ".join(str(s) for s in val.shape) + "]",
                     placement_str(placement(n))])
    return tabulate(rows, headers=["node", "op", "shape", "placement"], tablefmt="github")


DOC_TABLES = {"seed": seed_placement_table, "attention": attention_placement_table}


@pytest.mark.parametrize("name", list(DOC_TABLES))
def test_doc_table_is_generated_from_the_code(name):
    text = DOC.read_text()
    doc_table = text.split(f"<!-- {name}-table-begin -->")[1].split(f"<!-- {name}-table-end -->")[0]
    assert doc_table.strip() == DOC_TABLES[name](), (
        "docs/batch_dim.md is stale: regenerate with `python -m tests.test_batch_dim`")


if __name__ == "__main__":
    for name, table in DOC_TABLES.items():
        print(f"<!-- {name}-table-begin -->\n{table()}\n<!-- {name}-table-end -->\n")
