"""The faster symbolic recording (spmd_compiler/torch_internals.py) records exactly what make_fx
records without it: the same graph code, the same values (shapes and strides, symbolic sizes
included) on every node, the same ShapeEnv guards, replacements and ranges; and torch's own
SymNode operations are back in place afterwards."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.sym_node import SymNode

import spmd_compiler.trace.record as tracing
from spmd_compiler.torch_internals import PURE_BINARY, faster_symbolic_recording
from tests.test_dynamic_shapes import VOCAB, TinyLM, lm_step


def _record(dynamic_dims, fast: bool, monkeypatch):
    monkeypatch.setattr(tracing, "faster_symbolic_recording",
                        faster_symbolic_recording if fast else contextlib.nullcontext)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, VOCAB, (6, 13))
    tr = tracing.trace_step(lm_step, (model, opt, ids), {}, 0, fuse_optimizer=True,
                            dynamic_dims=dynamic_dims)
    env = tr.shape_env

    def described(v):
        if isinstance(v, torch.Tensor):
            return (str(v.dtype), str(tuple(v.shape)), str(v.stride()), str(v.storage_offset()))
        return str(v)

    return dict(
        code=tr.gm.code,
        vals=[described(n.meta.get("val")) for n in tr.gm.graph.nodes],
        guards=[str(g.expr) for g in env.guards],
        replacements=str(env.replacements),
        ranges=str(env.var_to_range),
        guard_code=env.produce_guards_expression(tr.fake_inputs),
        tensor_meta=[n for n in tr.gm.graph.nodes if "tensor_meta" in n.meta],
    )


@pytest.mark.parametrize("dynamic_dims", [None, {2: (1,)}], ids=["batch", "batch+length"])
def test_faster_recording_records_the_same(dynamic_dims, monkeypatch):
    slow = _record(dynamic_dims, False, monkeypatch)
    fast = _record(dynamic_dims, True, monkeypatch)
    assert slow["tensor_meta"], "make_fx itself writes tensor_meta"
    assert fast["tensor_meta"] == []
    for key in ("code", "vals", "guards", "replacements", "ranges", "guard_code"):
        assert fast[key] == slow[key], key


def test_torch_functions_restored_after_recording():
    before = {m: getattr(SymNode, f"_{m}") for m in PURE_BINARY}
    set_meta, convert = proxy_tensor.set_meta, _CacheKeyState.convert_sym_int
    with faster_symbolic_recording():
        assert all(getattr(SymNode, f"_{m}") is not before[m] for m in PURE_BINARY)
        with faster_symbolic_recording():  # re-entrant: the inner one changes nothing
            pass
        assert proxy_tensor.set_meta is not set_meta
    assert {m: getattr(SymNode, f"_{m}") for m in PURE_BINARY} == before
    assert proxy_tensor.set_meta is set_meta and _CacheKeyState.convert_sym_int is convert
    with pytest.raises(RuntimeError), faster_symbolic_recording():
        raise RuntimeError("restored on errors too")
    assert {m: getattr(SymNode, f"_{m}") for m in PURE_BINARY} == before
