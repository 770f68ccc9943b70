"""Every error the compiler raises on a bad step: its type and the words that tell the user what
to fix (and, for tracing failures, the user's file and line).

Single process. All these errors are raised while compiling, before any collective, so a
one-rank gloo group (FileStore in the test's tmp_path, destroyed after the test) is enough; the
first test checks the error when no group is initialized at all.
"""

from __future__ import annotations

import inspect
import linecache

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from spmd_compiler import DataParallel, SPMDError, spmd_compile
from spmd_compiler.errors import (
    BatchDimError,
    MissingGradientError,
    NoProcessGroupError,
    StepSignatureError,
    TraceError,
)
from tests.models import SimpleMLP, UnusedParamMLP, train_step
from tests.test_replicate import ATOL, RTOL


@pytest.fixture
def pg1(tmp_path):
    """A one-rank gloo default process group for the duration of one test."""
    assert not dist.is_initialized(), "a default process group leaked into this test"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def setup(model_cls=SimpleMLP):
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(16, 50), torch.randn(16, 8))
    return model, opt, batch


def line_of(fn, marker: str) -> int:
    """The line number (in this file) of the line of ``fn`` that contains ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, hits
    return hits[0]


def assert_untouched(compiled, model):
    """A failed compile changes nothing: no compile counted, parameters still plain tensors."""
    assert compiled.compile_count == 0
    assert not any(isinstance(p, DTensor) for p in model.parameters())


# --------------------------------------------------------------------------------------------------


def test_no_process_group():
    assert not dist.is_initialized(), "this test needs a process without a default group"
    model, opt, batch = setup()
    compiled = spmd_compile(DataParallel("replicate"))(train_step)
    with pytest.raises(NoProcessGroupError) as ei:
        compiled(model, opt, batch)
    msg = str(ei.value)
    assert "process group" in msg and "init_process_group" in msg, msg
    assert_untouched(compiled, model)


def _no_module_step(optim, batch):
    optim.zero_grad()
    return batch[0].sum()


def _two_module_step(model, other, optim, batch):
    optim.zero_grad()
    loss = (other(model(batch[0]) - batch[1])).sum()
    loss.backward()
    optim.step()
    return loss


def _no_optimizer_step(model, batch):
    loss = (model(batch[0]) - batch[1]).sum()
    loss.backward()
    return loss


def _stray_optimizer(model, opt, batch):
    """An optimizer that also holds the parameters of a module the step does not receive."""
    other = nn.Linear(8, 8)
    return model, torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1), batch


SIGNATURE_ERRORS = {  # case -> (step, its arguments given (model, opt, batch), words of the message)
    "no_module": (_no_module_step, lambda model, opt, batch: (opt, batch),
                  ["torch.nn.Module", "none found"]),
    "same_module_twice": (_two_module_step, lambda model, opt, batch: (model, model, opt, batch),
                          ["same module", "SimpleMLP", "'model'", "'other'", "twice"]),
    "optimizer_holds_a_parameter_of_no_module": (
        train_step, _stray_optimizer,
        ["optimizer 0", "SGD", "shape (8, 8)", "no module passed to the step"]),
    "no_optimizer": (_no_optimizer_step, lambda model, opt, batch: (model, batch),
                     ["torch.optim.Optimizer", "none found"]),
}


@pytest.mark.parametrize("case", SIGNATURE_ERRORS)
def test_step_signature_error(pg1, case):
    step, args, words = SIGNATURE_ERRORS[case]
    model, opt, batch = setup()
    compiled = spmd_compile(DataParallel("replicate"))(step)
    with pytest.raises(StepSignatureError) as ei:
        compiled(*args(model, opt, batch))
    msg = str(ei.value)
    assert all(w in msg for w in words), msg
    assert_untouched(compiled, model)


def _branch_on_loss_step(model, optim, batch):
    optim.zero_grad()
    loss = (model(batch[0]) - batch[1]).sum()
    if loss > 0:  # BRANCH-ON-TENSOR
        loss = loss * 2
    loss.backward()
    optim.step()
    return loss


def _branch_on_item_step(model, optim, batch):
    optim.zero_grad()
    loss = (model(batch[0]) - batch[1]).sum()
    value = loss.item()
    if value > 0:  # ITEM-BRANCH
        loss = loss * 2
    loss.backward()
    optim.step()
    return loss


@pytest.mark.parametrize(
    "step, marker",
    [(_branch_on_loss_step, "BRANCH-ON-TENSOR"), (_branch_on_item_step, "ITEM-BRANCH")],
    ids=["if_loss_gt_0", "item"],
)
def test_data_dependent_control_flow_names_user_line(pg1, step, marker):
    model, opt, batch = setup()
    compiled = spmd_compile(DataParallel("replicate"))(step)
    with pytest.raises(TraceError) as ei:
        compiled(model, opt, batch)
    msg = str(ei.value)
    assert __file__ in msg, f"the message does not name the user's file {__file__}: {msg}"
    line = line_of(step, marker)
    assert f"line {line}" in msg, f"the message does not name line {line}: {msg}"
    assert step.__name__ in msg, msg
    assert "control flow" in msg and ".item()" in msg, msg
    source = linecache.getline(__file__, line).strip()
    assert source in msg, f"the message does not show the condition {source!r}: {msg}"
    # torch's internals (a guard on an unnamed symbol) are the cause, not the message
    assert "Could not guard" not in msg and "u0" not in msg, msg
    assert msg.endswith("move it out of the step."), msg
    assert_untouched(compiled, model)


def test_parameter_without_gradient(pg1):
    model, opt, batch = setup(UnusedParamMLP)
    compiled = spmd_compile(DataParallel("replicate"))(train_step)
    with pytest.raises(MissingGradientError) as ei:
        compiled(model, opt, batch)
    msg = str(ei.value)
    assert "unused.weight" in msg and "unused.bias" in msg, msg
    assert "mlp.net1.weight" not in msg, msg
    assert "no gradient" in msg and "requires_grad=False" in msg, msg
    assert_untouched(compiled, model)


def test_frozen_parameter_is_not_an_error(pg1):
    """The fix the message above suggests works: a frozen unused parameter compiles and runs."""
    model, opt, batch = setup(UnusedParamMLP)
    model.unused.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    compiled = spmd_compile(DataParallel("replicate"))(train_step)
    expected = (model(batch[0]) - batch[1]).sum().detach()
    loss = compiled(model, opt, batch)
    assert compiled.compile_count == 1
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)


def test_batch_dims_disagree(pg1):
    model, opt, _ = setup()
    batch = (torch.randn(16, 50), torch.randn(12, 8))
    compiled = spmd_compile(DataParallel("replicate"))(train_step)
    with pytest.raises(BatchDimError) as ei:
        compiled(model, opt, batch)
    msg = str(ei.value)
    assert "disagree" in msg and "(16, 50)" in msg and "(12, 8)" in msg, msg
    assert_untouched(compiled, model)


@pytest.mark.parametrize("dim", [2, -3])
def test_input_batch_dim_out_of_range(pg1, dim):
    model, opt, batch = setup()
    compiled = spmd_compile(DataParallel("replicate", input_batch_dim=dim))(train_step)
    with pytest.raises(BatchDimError) as ei:
        compiled(model, opt, batch)
    msg = str(ei.value)
    assert "out of range" in msg and f"input_batch_dim={dim}" in msg and "(16, 50)" in msg, msg
    assert_untouched(compiled, model)


def test_input_batch_dim_tree_does_not_match_batch(pg1):
    model, opt, batch = setup()
    compiled = spmd_compile(DataParallel("replicate", input_batch_dim=(0, 0, 0)))(train_step)
    with pytest.raises(BatchDimError) as ei:
        compiled(model, opt, batch)
    assert "does not match the structure" in str(ei.value), str(ei.value)
    assert_untouched(compiled, model)


def test_unknown_parallel_style():
    with pytest.raises(SPMDError) as ei:
        DataParallel("pipeline")
    assert "'pipeline'" in str(ei.value) and "replicate" in str(ei.value)


@pytest.mark.parametrize("kwargs, named", [
    (dict(input_batch_dim="0"), "input_batch_dim"),
    (dict(input_batch_dim=(0, 1.0)), "input_batch_dim"),
    (dict(input_batch_dim=True), "input_batch_dim"),
    (dict(dynamic_dims=1.5), "dynamic_dims"),
    (dict(dynamic_dims=[None, "seq"]), "dynamic_dims"),
    (dict(bucket_cap_mb=-1), "bucket_cap_mb"),
    (dict(prefetch_cap_mb="16"), "prefetch_cap_mb"),
    (dict(first_bucket_cap_mb=float("nan")), "first_bucket_cap_mb"),
    (dict(overlap=1), "overlap"),
    (dict(keep_grads="yes"), "keep_grads"),
    (dict(param_init_fn=3), "param_init_fn"),
    (dict(parallel_style=None), "parallel_style"),
])
def test_data_parallel_checks_every_argument_when_constructed(kwargs, named):
    with pytest.raises(SPMDError, match=named):
        DataParallel(**kwargs)


def test_data_parallel_accepts_pytrees_of_dims():
    DataParallel(input_batch_dim=((0, None), {"mask": None, "ids": 1}), dynamic_dims=(1, None),
                 bucket_cap_mb=None, prefetch_cap_mb=0, param_init_fn=lambda m: None)


def test_errors_are_spmd_errors():
    for cls in (NoProcessGroupError, StepSignatureError, TraceError, MissingGradientError,
                BatchDimError):
        assert issubclass(cls, SPMDError)


def test_compiled_step_usable_after_an_error(pg1):
    """A failed call leaves the CompiledStep and the live state ready for a correct call."""
    model, opt, batch = setup()
    compiled = spmd_compile(DataParallel("replicate"))(train_step)
    with pytest.raises(BatchDimError):
        compiled(model, opt, (batch[0], batch[1][:12]))
    expected = (model(batch[0]) - batch[1]).sum().detach()
    loss = compiled(model, opt, batch)
    assert compiled.compile_count == 1
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
