"""Repeated blocks recorded once (spmd_compiler/trace/block_reuse.py) give the graph a plain recording
gives: the same nodes (ops, arguments, values with their symbolic sizes, roles, regions, module
paths and source lines) in the same order. The one difference allowed: autograd stores each
parameter's gradient (an ``aten.detach`` of it, where the parameter's ``.grad`` is bound) after
the whole block's backward rather than right after the op that made it; so detach nodes are
compared as a set, attached to what they detach."""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from torch import nn

import spmd_compiler.trace.block_reuse as block_reuse
from spmd_compiler.passes import meta
from spmd_compiler.errors import SideEffectError
from spmd_compiler.trace import record
from spmd_compiler.trace.record import trace_step
from tests.steps import mse_step as supervised_mse_step
from tests.steps import self_labelled, step_with
from tests.zoo import CASES as ZOO

_DETACH = torch.ops.aten.detach.default
_COPY = block_reuse._Call._copy_forward
_RECORD = block_reuse._Call._record
_RECORD_STEP = record._record_step


def _described(v):
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), str(tuple(v.shape)), str(v.stride()), str(v.storage_offset()))
    if isinstance(v, (tuple, list)):
        return tuple(_described(x) for x in v)
    return str(v)


def _canonical(gm: torch.fx.GraphModule):
    """(nodes in order without detaches, detaches as a multiset): every argument named by the
    position of the node it refers to (a detach by what it detaches)."""
    index, order, detaches = {}, [], collections.Counter()

    def ref(a):
        return index[a] if isinstance(a, torch.fx.Node) else a

    for n in gm.graph.nodes:
        if n.target is _DETACH:
            index[n] = ("detach of", ref(n.args[0]))
        else:
            index[n] = len(order)
        stack = n.meta.get("nn_module_stack") or {}
        row = (n.op, str(n.target), str(torch.fx.map_arg((n.args, n.kwargs), ref)),
               _described(n.meta.get("val")), str(n.meta.get(meta.ROLE)),
               str(n.meta.get(meta.REGION)), n.meta.get(meta.PARAM_FQN),
               tuple(p for p, _ in stack.values()), n.meta.get("stack_trace"))
        if n.target is _DETACH:
            detaches[row] += 1
        else:
            order.append(row)
    return order, detaches


def _trace(build, step, batch, reuse: bool, monkeypatch, input_batch_dim=0, recorded=None,
           dynamic_dims=None):
    """The step's recording and the blocks copied in it; ``recorded`` (a list) gets the path of
    every block recorded as it ran, and "step" for every recording of the whole step."""
    monkeypatch.setattr(block_reuse, "_switched_off", not reuse)
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    copies, recorded = [], recorded if recorded is not None else []

    def counted(self, flat):
        copies.append(self.path)
        return _COPY(self, flat)

    def recording(self, flat):
        recorded.append(self.path)
        return _RECORD(self, flat)

    def whole_step(*args):
        recorded.append("step")
        return _RECORD_STEP(*args)

    monkeypatch.setattr(block_reuse._Call, "_copy_forward", counted)
    monkeypatch.setattr(block_reuse._Call, "_record", recording)
    monkeypatch.setattr(record, "_record_step", whole_step)
    traced = trace_step(step, (model, opt, batch), {}, input_batch_dim, fuse_optimizer=True,
                        dynamic_dims=dynamic_dims)
    return traced, copies


def _assert_same(build, step, batch, monkeypatch, input_batch_dim=0, recorded=None,
                 dynamic_dims=None):
    plain, none = _trace(build, step, batch, False, monkeypatch, input_batch_dim,
                         dynamic_dims=dynamic_dims)
    reused, copies = _trace(build, step, batch, True, monkeypatch, input_batch_dim, recorded,
                            dynamic_dims)
    assert none == []
    assert len(reused.gm.graph.nodes) == len(plain.gm.graph.nodes)
    order, detaches = _canonical(reused.gm)
    plain_order, plain_detaches = _canonical(plain.gm)
    for k, (a, b) in enumerate(zip(order, plain_order)):
        assert a == b, f"node {k}: {a} != {b}"
    assert len(order) == len(plain_order) and detaches == plain_detaches
    assert [str(g.expr) for g in reused.shape_env.guards] == [
        str(g.expr) for g in plain.shape_env.guards]
    assert reused.signature == plain.signature
    nodes = set(reused.gm.graph.nodes)
    assert all(u in nodes for n in nodes for u in n.users)  # no user outside the graph
    return copies


def _gpt2(layers: int, **config):
    def build():
        import transformers

        transformers.logging.set_verbosity_error()
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
            **{"use_cache": False, **config}))

    return build


_lm_step = step_with(self_labelled, name="_lm_step")


def test_gpt2_blocks_copied_and_graph_unchanged(monkeypatch):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 16))
    copies = _assert_same(_gpt2(4), _lm_step, ids, monkeypatch)
    assert copies == ["transformer.h.1", "transformer.h.2", "transformer.h.3"]


class _Scaled(nn.Module):
    """A block whose forward reads a Python number that differs between instances."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * torch.tanh(self.lin(x))


class _Stack(nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.layers = nn.ModuleList(_Scaled(s) for s in scales)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _mse_step(model, optim, x):
    optim.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    return loss


def test_block_copied_only_where_what_it_read_is_equal(monkeypatch):
    x = torch.randn(4, 8)
    copies = _assert_same(lambda: _Stack([0.5, 0.5, 2.0, 0.5, 0.5]), _mse_step, x, monkeypatch)
    # layers.0 takes an input that does not require grad (another key); layers.2 reads another
    # scale: both are recorded, layers.3 and 4 copy layers.1
    assert copies == ["layers.3", "layers.4"]


def test_block_with_a_hook_is_recorded(monkeypatch):
    def build():
        model = _Stack([0.5] * 4)
        model.layers[2].register_forward_hook(lambda m, i, o: o * 2)
        return model

    copies = _assert_same(build, _mse_step, torch.randn(4, 8), monkeypatch)
    assert copies == ["layers.3"]


class _Counting(_Scaled):
    """A block that changes its own Python state when called: a copy would not."""

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


class _CountingStack(_Stack):
    def __init__(self):
        super().__init__([0.5] * 4)
        self.layers = nn.ModuleList(_Counting(0.5) for _ in range(4))


@pytest.mark.parametrize("reuse", [False, True])
def test_block_that_sets_an_attribute_is_refused_as_before(reuse, monkeypatch):
    # a block setting its attributes is never copied (block_reuse._WRITTEN); the step is
    # refused for changing Python state while recorded, naming the first block, either way
    with pytest.raises(SideEffectError, match="attribute 'calls' of module 'layers.0'"):
        _trace(_CountingStack, _mse_step, torch.randn(4, 8), reuse, monkeypatch)


def test_off_switch(monkeypatch):
    from spmd_compiler.trace.reads import Reads

    monkeypatch.setenv("SPMD_NO_BLOCK_REUSE", "1")
    assert block_reuse.for_recording(_Stack([0.5] * 3), Reads()) is None
    monkeypatch.delenv("SPMD_NO_BLOCK_REUSE")
    assert block_reuse.for_recording(_Stack([0.5] * 3), Reads()) is not None
    assert block_reuse.for_recording(_Stack([0.5] * 3)) is None  # reads not watched: off


_ZOO_SKIP = {"routed_moe_masked_loss"}  # its step cannot be recorded (data-dependent sizes)


@pytest.mark.parametrize("name", sorted(set(ZOO) - _ZOO_SKIP))
def test_zoo_graph_unchanged(name, monkeypatch):
    case = ZOO[name]
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    batch = case.make_batch(torch.Generator().manual_seed(0), 4)
    _assert_same(case.build, case.step, batch, monkeypatch, case.input_batch_dim)


def _ce_step(model, optim, batch):
    x, labels = batch
    optim.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    optim.step()
    return loss


@pytest.mark.parametrize("step, labels", [
    (supervised_mse_step, lambda b: torch.randn(b, 3)),
    (_ce_step, lambda b: torch.randint(0, 3, (b,))),
], ids=["mse", "cross_entropy"])
def test_supervised_step_records_each_block_once(step, labels, monkeypatch):
    # the label's batch size is another symbol than the input's, which the loss proves equal:
    # the blocks' incoming gradients carry it, and the copies still fit
    batch = (torch.randn(4, 8), labels(4))
    recorded = []
    copies = _assert_same(lambda: _Stack([0.5] * 6), step, batch, monkeypatch,
                          recorded=recorded)
    assert recorded == ["step", "layers.0", "layers.1"]  # layers.0's input needs no grad
    assert copies == ["layers.2", "layers.3", "layers.4", "layers.5"]


class _TwoStacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Stack([0.5] * 3), _Stack([0.5] * 3)


def _two_batches_step(model, optim, batch):
    """Blocks of the same structure run on the input and on a second tensor with a batch size
    of its own."""
    x, y = batch
    optim.zero_grad()
    loss = model.a(x).pow(2).mean() + model.b(y).pow(2).mean()
    loss.backward()
    optim.step()
    return loss


def test_a_batch_size_not_proven_equal_is_another_template(monkeypatch):
    batch = (torch.randn(4, 8), torch.randn(6, 8))
    leaf_of_y = 3  # (model, optim, (x, y)): the step's argument leaves
    recorded = []
    copies = _assert_same(_TwoStacks, _two_batches_step, batch, monkeypatch,
                          input_batch_dim=(0, None), dynamic_dims={leaf_of_y: [0]},
                          recorded=recorded)
    assert recorded == ["step", "a", "b"] and copies == []  # b meets another size: recorded
    traced, _ = _trace(_TwoStacks, _two_batches_step, batch, True, monkeypatch,
                       (0, None), dynamic_dims={leaf_of_y: [0]})
    x, y = traced.fake_inputs
    assert str(x.shape[0]) != str(y.shape[0])


def test_static_labels_with_a_symbolic_input_batch(monkeypatch, caplog):
    # labels not batched (input_batch_dim None): their static size meets the input's symbol in
    # the loss, which makes the batch size that number; the copies, made with the symbol, are
    # abandoned and the step recorded again (a plain recording uses the number)
    batch = (torch.randn(4, 8), torch.randn(4, 3))
    recorded = []
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        _assert_same(lambda: _Stack([0.5] * 4), supervised_mse_step, batch, monkeypatch,
                     input_batch_dim=(0, None), recorded=recorded)
    assert recorded.count("step") == 2
    assert "recorded again without it: the gradients reaching block layers.3" in caplog.text


# --------------------------------------------------------------------------------------------------
# Hugging Face's default config: a DynamicCache passed through every block
# --------------------------------------------------------------------------------------------------


def test_gpt2_default_config_records_each_block_once(monkeypatch):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 16))
    recorded = []
    copies = _assert_same(_gpt2(4, use_cache=True), _lm_step, ids, monkeypatch,
                          recorded=recorded)
    # h.1 is recorded too: it reads another layer_idx (only the cache's methods use it), and
    # its recording is compared with h.0's before any copy
    assert recorded == ["step", "transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    assert copies == ["transformer.h.2", "transformer.h.3"]


def _cache_read_step(model, optim, ids):
    """Uses the keys the blocks stored in the cache (the model's output carries it)."""
    optim.zero_grad()
    out = model(ids, labels=ids)
    loss = out.loss + sum(layer.keys.square().mean() for layer in out.past_key_values.layers)
    loss.backward()
    optim.step()
    return loss


def test_gpt2_cache_read_after_the_blocks_is_recorded_without_reuse(monkeypatch, caplog):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 16))
    recorded = []
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        copies = _assert_same(_gpt2(3, use_cache=True), _cache_read_step, ids, monkeypatch,
                              recorded=recorded)
    assert copies == ["transformer.h.2"]  # then abandoned:
    assert recorded.count("step") == 2
    assert "recorded again without it: the step read DynamicCache.layers after block " \
        "transformer.h.2 was copied" in caplog.text


def _whole_output_step(model, optim, ids):
    """Returns the model's whole output, its cache included (which then outlives the step)."""
    optim.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    optim.step()
    return out


def test_gpt2_cache_outliving_the_step_is_recorded_without_reuse(monkeypatch, caplog):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 16))
    recorded = []
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        _assert_same(_gpt2(3, use_cache=True), _whole_output_step, ids, monkeypatch,
                     recorded=recorded)
    assert recorded.count("step") == 2
    assert "outlives the step" in caplog.text


def _prefilled_step(model, optim, ids):
    """A cache the step fills (another past for each layer) before the model reads it."""
    import transformers

    optim.zero_grad()
    cache = transformers.DynamicCache(config=model.config)
    past = ids[:, :4].float()[:, None, :, None].expand(-1, 2, -1, 16) / 100
    for layer in range(model.config.n_layer):
        cache.update(past * layer, past * 2, layer)
    loss = model(ids, past_key_values=cache, labels=ids).loss
    loss.backward()
    optim.step()
    return loss


def test_gpt2_cache_filled_before_the_blocks(monkeypatch, caplog):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 16))
    recorded = []
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        copies = _assert_same(_gpt2(4, use_cache=True), _prefilled_step, ids, monkeypatch,
                              recorded=recorded)
    assert copies == [] and recorded.count("step") == 1
    assert "transformer.h.1, transformer.h.2, transformer.h.3 recorded as they ran" in caplog.text


def test_gpt2_per_layer_config_read_in_the_block(monkeypatch, caplog):
    # scale_attn_by_inverse_layer_idx: each layer's attention scales by 1 / (layer_idx + 1)
    pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (4, 16))
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        copies = _assert_same(_gpt2(3, use_cache=True, scale_attn_by_inverse_layer_idx=True),
                              _lm_step, ids, monkeypatch)
    assert copies == []
    assert "it reads attn.scaling, which differs" in caplog.text


class _Memo:
    """A per-step object the blocks write to, as a cache is."""

    def __init__(self, n):
        self.seen = [None] * n

    def put(self, i, x):
        self.seen[i] = x
        return x


class _IndexedBlock(nn.Module):
    def __init__(self, index, use_index):
        super().__init__()
        self.lin, self.index, self.use_index = nn.Linear(8, 8), index, use_index

    def forward(self, x, memo):
        x = memo.put(self.index, torch.tanh(self.lin(x)))
        if self.use_index == "python":
            return x * (self.index + 1)
        return x * self.index if self.use_index == "torch" else x  # (torch reads the int)


class _IndexedStack(nn.Module):
    def __init__(self, use_index):
        super().__init__()
        self.layers = nn.ModuleList(_IndexedBlock(i, use_index) for i in range(5))

    def forward(self, x):
        memo = _Memo(len(self.layers))
        for layer in self.layers:
            x = layer(x, memo)
        return x


@pytest.mark.parametrize("use_index", ["no", "python", "torch"])
def test_block_index_used_outside_the_objects_methods(use_index, monkeypatch, caplog):
    # the index only the memo's method reads: any will do (once a second block recorded the
    # same nodes); used in the block's own arithmetic, or read by torch: each block its own
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        copies = _assert_same(lambda: _IndexedStack(use_index), _mse_step, torch.randn(4, 8),
                              monkeypatch)
    # layers.0 gets an input that needs no grad (its own key); layers.2 checks layers.1
    assert copies == (["layers.3", "layers.4"] if use_index == "no" else [])
    if use_index == "python":
        assert "it reads index, which differs" in caplog.text
    if use_index == "torch":
        assert "blocks layers.3, layers.4 recorded as they ran, not copied: block layers.2 " \
            "records aten.mul.Tensor otherwise than block layers.1" in caplog.text
