"""Trace-time reads of shape-only tensor values (spmd_compiler/trace/trace_values.py), single process.

A value computed only from sizes and constants is read at trace time (and the sizes it read are
guarded); a value computed from the batch, a parameter or a buffer still stops the trace with a
TraceError naming the user's line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from spmd_compiler.errors import TraceError
from spmd_compiler.trace.record import trace_step
from tests.steps import sum_step

aten = torch.ops.aten


class Masked(nn.Module):
    """Reads values of masks built in the forward, the way nn.Transformer and models do."""

    def __init__(self, read):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.read = read

    def forward(self, x):  # (b, t, 6)
        h = self.lin(x)
        return h * self.read(x) if self.read is not None else h


step = sum_step


def trace(read, x=None):
    model = Masked(read)
    x = torch.randn(3, 5, 6) if x is None else x
    return trace_step(step, (model, torch.optim.SGD(model.parameters(), lr=0.1), x), {})


def causal(t):
    return torch.triu(torch.full((t, t), float("-inf")), diagonal=1)


def _causal_check(x):
    t = x.shape[1]
    mask = causal(t)
    is_causal = bool((mask == nn.Transformer.generate_square_subsequent_mask(t)).all())
    return 2.0 if is_causal else 3.0


def _in_place_through_a_view(x):
    m = torch.zeros(x.shape[1], x.shape[1])
    m[:, 0] = 1.0  # written through a view of m
    return float(m.sum())  # 5.0 only if the write through the view is replayed


def _tensor_constant(x):
    return float(torch.tensor([1.0, 2.0]).sum().item())


@pytest.mark.parametrize("read, value", [
    (_causal_check, 2.0),
    (lambda x: 1.0 + torch.equal(causal(x.shape[1]), causal(5)), 2.0),
    (lambda x: 1.0 + bool(causal(x.shape[1]).isinf().any()), 2.0),
    (_in_place_through_a_view, 5.0),
    (_tensor_constant, 3.0),
], ids=["bool-all", "torch.equal", "any", "write-through-view", "tensor-constant"])
def test_shape_only_values_are_read_at_trace_time(read, value):
    gm = trace(read).gm
    muls = [n for n in gm.graph.nodes if n.target == aten.mul.Tensor and value in n.args]
    assert muls, f"the value {value} read at trace time is not in the graph"
    reads = [n for n in gm.graph.nodes
             if n.target in (aten._local_scalar_dense.default, aten.equal.default)]
    assert not reads  # answered at trace time, nothing left to read at run time


def test_a_read_of_a_static_size_adds_no_guard_but_a_batch_size_is_guarded():
    traced = trace(_causal_check)
    assert traced.specialized == [] and not traced.shape_env.guards
    traced = trace(lambda x: float(torch.ones(x.shape[0]).sum()))  # reads the batch size
    assert traced.specialized == [(0, 0, 3)]  # valid for that batch size only


class BufferMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("mask", torch.ones(6))

    def forward(self, x):
        if self.mask.any():  # BUFFER-READ: a buffer is state, its value may change
            return self.lin(x) * self.mask
        return self.lin(x)


@pytest.mark.parametrize("make, marker", [
    (lambda: Masked(lambda x: 2.0 if x.sum() > 0 else 1.0), "lambda x: 2.0 if x.sum() > 0"),
    (lambda: Masked(lambda x: 2.0 if torch.equal(x, x.flip(0)) else 1.0), "torch.equal(x, x"),
    (BufferMask, "BUFFER-READ"),
], ids=["batch", "torch.equal-on-batch", "buffer"])
def test_reads_of_data_still_raise_naming_the_line(make, marker):
    model = make()
    with pytest.raises(TraceError) as info:
        trace_step(step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.randn(3, 5, 6)), {})
    msg = str(info.value)
    assert __file__ in msg and marker in msg, msg


@pytest.fixture
def pg1(tmp_path):
    """A one-rank gloo default process group for the duration of one test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class MaskedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x, mask):
        return self.enc(x, mask=mask)  # checks whether the mask is causal


def masked_step(model, optim, batch):
    optim.zero_grad()
    x, mask, y = batch
    loss = (model(x, mask) - y).pow(2).sum()
    loss.backward()
    optim.step()
    return loss


def test_a_mask_passed_in_unbatched_is_read_and_guarded_by_value(pg1):
    """nn.TransformerEncoder compares a mask given as a step argument (input_batch_dim None) with
    a causal one: the trace reads its value, and the graph is reused only for equal masks."""
    from copy import deepcopy

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = MaskedEncoder()
    ref = deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    compiled = spmd_compile(DataParallel("replicate", input_batch_dim=(0, None, 0)))(masked_step)
    other = torch.zeros(5, 5)
    other[0, 1:] = float("-inf")  # not causal
    counts = []
    for i, mask in enumerate([causal(5), causal(5), other, causal(5), other]):
        batch = (torch.randn(3, 5, 8), mask, torch.randn(3, 5, 8))
        loss = compiled(model, opt, batch)
        expected = masked_step(ref, ref_opt, batch)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.to_local(), q, rtol=1e-5, atol=1e-6)
        counts.append(compiled.compile_count)
    assert counts == [1, 1, 2, 2, 2]  # one graph per mask value
    specialized = [e.traced.specialized_inputs for e in compiled._programs]
    assert [[k for k, _ in s] for s in specialized] == [[1], [1]]


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 6, batch_first=True)

    def forward(self, x):  # (b, t, 6), zero-padded
        lengths = (x.abs().sum(-1) != 0).sum(1)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.rnn(packed)[1][0]  # PACKED-LSTM: its batch sizes come from the data


def test_a_number_computed_from_data_names_the_line():
    model = PackedLSTM()
    with pytest.raises(TraceError) as info:
        trace_step(step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.randn(3, 5, 6)), {})
    msg = str(info.value)
    assert "as a Python number" in msg and "PACKED-LSTM" in msg and __file__ in msg, msg


def test_the_forward_is_recorded_as_compiling_the_rest_as_written():
    """Libraries take their traceable paths inside the model's forward
    (torch.compiler.is_compiling(), as in torch's non-strict export); the loss code and the
    optimizer run as written; the flag is restored afterwards."""
    def compiling_step(model, optim, x):
        optim.zero_grad()
        loss = model(x).sum() * (5.0 if torch.compiler.is_compiling() else 7.0)
        loss.backward()
        optim.step()
        return loss

    model = Masked(lambda x: 2.0 if torch.compiler.is_compiling() else 3.0)
    gm = trace_step(compiling_step, (model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.randn(3, 5, 6)), {}).gm
    constants = {a for n in gm.graph.nodes if n.target == aten.mul.Tensor for a in n.args
                 if isinstance(a, float)}
    assert {2.0, 7.0} <= constants and not {3.0, 5.0} & constants
    assert not torch.compiler.is_compiling()
