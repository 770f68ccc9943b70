"""spmd_compiler/torch_internals.py: the torch internals the compiler relies on still have the
shape it relies on (a torch upgrade fails here first), every optional patch's probe passes on
the pinned torch, and a failed probe or SPMD_NO_TORCH_PATCHES turns the patch off without
changing what is recorded."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch.distributed.tensor import DTensor
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, _MakefxTracer
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from spmd_compiler import torch_internals as ti
from spmd_compiler.trace.record import trace_step
from tests.models import IN_FEATURES, OUT_FEATURES, SimpleMLP, train_step


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_pinned_torch():
    assert ti.version_supported(), f"torch {torch.__version__}, pinned {ti.PINNED}"


@pytest.mark.parametrize("patch", sorted(ti.OPTIONAL))
def test_probe_passes_on_the_pinned_torch(patch):
    assert ti.OPTIONAL[patch](), patch


def test_signatures_relied_on():
    # the optional patches
    assert _params(SymNode.__init__)[:8] == ["self", "expr", "shape_env", "pytype", "hint",
                                             "constant", "fx_node", "optimized_summation"]
    assert _params(_CacheKeyState.convert_sym_int) == ["self", "result", "arg"]
    assert _params(proxy_tensor.set_meta) == ["proxy", "val"]
    assert _params(proxy_tensor.extract_val)[:2] == ["val", "include_real"]
    assert _params(ti._compute_stride) == ["old_shape", "old_stride", "new_shape", "size_oblivious"]
    assert _params(ti.in_kernel_invocation_manager) == ["fake_mode"]
    assert _params(ti.FakeTensor.__new__)[:4] == ["cls", "fake_mode_or_elem", "elem", "device"]
    # the required ones
    assert _params(_MakefxTracer.__init__)[:8] == [
        "self", "decomposition_table", "tracing_mode", "_allow_non_fake_inputs", "pre_dispatch",
        "record_module_stack", "_allow_fake_constant", "_error_on_data_dependent_ops"]
    assert "_disable_torch_fn_metadata_mode" in _params(_MakefxTracer.__init__)
    assert _params(_MakefxTracer._construct_modes_with_fx_tracer) == ["self", "fx_tracer"]
    assert hasattr(PythonKeyTracer(), "module_stack")
    assert _params(ShapeEnv._set_replacement) == ["self", "a", "tgt", "msg"]
    assert _params(ti._reparametrize_module)[:4] == ["module", "parameters_and_buffers",
                                                    "tie_weights", "strict"]
    assert isinstance(torch.compiler._is_compiling_flag, bool)
    from torch.utils.checkpoint import CheckpointFunction

    assert callable(CheckpointFunction.apply) and callable(torch.autograd.backward)
    assert {"_local_tensor", "_spec"} <= set(DTensor.__slots__) | set(dir(DTensor))
    # optimizer_state.py: Adam's (and AdamW's, a subclass) lazy state initialisation
    assert issubclass(torch.optim.AdamW, torch.optim.Adam)
    assert _params(torch.optim.Adam._init_group) == [
        "self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs",
        "max_exp_avg_sqs", "state_steps"]
    # rank_queries: what a step calls to learn its rank
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import DeviceMesh

    assert torch.distributed.get_rank is distributed_c10d.get_rank
    assert all(callable(getattr(DeviceMesh, n)) for n in ("get_rank", "get_local_rank",
                                                           "get_coordinate"))


def _recorded():
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(6, IN_FEATURES), torch.randn(6, OUT_FEATURES))
    tr = trace_step(train_step, (model, opt, batch), {}, 0)
    return tr.gm.code, [str(g.expr) for g in tr.shape_env.guards]


def test_switch_turns_every_optional_patch_off(monkeypatch):
    on = _recorded()
    monkeypatch.setenv(ti.OFF_ENV, "1")
    assert not any(ti.enabled(p) for p in ti.OPTIONAL)
    own = SymNode._add
    with ti.faster_symbolic_recording(), ti.size_oblivious_reshape():
        assert SymNode._add is own
        assert ti._COMPOSITE not in torch.ops.aten.reshape.default.py_kernels
    assert _recorded() == on


def test_failed_probe_turns_its_patch_off_with_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(ti.OPTIONAL, "symnode_memo", lambda: False)
    ti._probed.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
            assert not ti.enabled("symnode_memo")
        assert "symnode_memo" in caplog.text and "off" in caplog.text
        own = SymNode._add
        with ti.faster_symbolic_recording():
            assert SymNode._add is own  # off
            assert proxy_tensor.set_meta is ti._set_meta_without_tensor_meta  # still on
    finally:
        ti._probed.cache_clear()
