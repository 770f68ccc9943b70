"""Everything spmd_compiler takes from torch beyond its public API, in one module.

The rest of spmd_compiler and passes/ import torch's private names from here and patch torch
only through the functions here. It imports only torch and the standard library (a leaf: any
module, passes/ too, can import it without a circle). Pinned: torch 2.13 (``PINNED``); tests/test_torch_internals.py
asserts the signatures relied on, so a torch upgrade fails there, loudly, first.

Two kinds of patch:

- **Optional speed-ups** (``OPTIONAL``): each has a probe that checks the shape of the torch code
  it replaces. It runs only on the pinned torch, when its probe passes and when
  ``SPMD_NO_TORCH_PATCHES`` is not set; otherwise it is off (logged once as a warning) and the
  recording is torch's own, slower or with a few more guards, never different in results.

  - ``symnode_memo``: pure ``SymNode`` arithmetic made outside the proxy tracer is memoized;
  - ``free_symbols_memo``: the free symbols of a size are memoized in the fake tensor cache key;
  - ``no_tensor_meta``: make_fx's best-effort ``node.meta["tensor_meta"]`` is not written;
  - ``size_oblivious_reshape``: ``aten.reshape`` of symbolically sized tensors is recorded
    without guards on a size being 1;
  - ``direct_op_calls``: the eager program's generated code calls each op overload's C++
    callable (``OpOverload._op``) instead of the overload's Python ``__call__``, which only
    forwards to it (``direct_op_calls``, used by runtime.program.CompiledGraph).
  - ``below_autograd``: that code runs with autograd's dispatch keys excluded
    (``torch._C._AutoDispatchBelowAutograd``): the program runs under ``no_grad`` and records
    nothing, so each op's autograd kernel would only forward to the one below (the functional
    collectives' ``wait_tensor`` through a Python kernel); version counters and views
    (ADInplaceOrView) are kept.
  - ``meta_kernel_values``: the ops a pass inserts (passes/subgraph.py: bucket copies, views,
    functional collectives on static shapes) get their fake values from the op's meta kernel run
    as fake mode runs it, without fake mode's dispatch around it (``meta_kernel_value``);
  - ``block_reuse``: repeated blocks are recorded once and copied (spmd_compiler/trace/block_reuse.py,
    which uses make_fx's proxy slots and lazy size nodes through the functions here); also off
    with ``SPMD_NO_BLOCK_REUSE``.

- **Required** (the step cannot be recorded without them; their signatures are in the test):
  ``tag_regions`` (``torch.autograd.backward`` wrapped while recording), ``refuse_reentrant_
  checkpoint`` (``CheckpointFunction.apply``), ``compiling_forward`` (torch.compiler's
  is-compiling flag), ``StepRecorder`` (make_fx's private ``_MakefxTracer`` with the step's own
  tracer), ``InputShapeEnv`` (``ShapeEnv._set_replacement`` observed).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import logging
import os
import sys
import types
from typing import Callable

import torch
import torch._logging._internal as logging_internal
import torch.distributed._functional_collectives as funcol
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._C._profiler import _EventType
from torch._dynamo.source import ConstantSource
from torch._guards import detect_fake_mode
from torch._library._out_variant import get_out_arg_names, to_out_variant
from torch._ops import OpOverload
from torch._prims_common import infer_size, is_contiguous_or_false
from torch._subclasses._fake_tensor_utils import _CacheKeyState, _InputBackref, _PySymInputStub
from torch._subclasses.fake_impls import _compute_stride
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    in_kernel_invocation_manager,
    unset_fake_temporarily,
)
from torch.distributed import _broadcast_coalesced
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx._lazy_graph_module import (
    _LazyGraphModule,
    _make_graph_module,
    _use_lazy_graph_module,
)
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, _MakefxTracer, get_proxy_mode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_slot
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_symbols, uninteresting_files
from torch.fx.proxy import _STACK_TRACE_ANCHORS, _register_stack_trace_anchor
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim.optimizer import _get_fused_kernels_supported_devices
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [  # torch's private names the rest of spmd_compiler and passes/ use
    "OpOverload", "_NormPartial", "_broadcast_coalesced", "_resolve_process_group",
    "detect_fake_mode", "funcol", "get_out_arg_names", "is_traceable_wrapper_subclass",
    "to_out_variant", "ConstantSource", "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor",
    "FakeTensorMode", "TorchDispatchMode", "_EventType", "_LazyGraphModule", "_StridedShard",
    "_get_fused_kernels_supported_devices", "_make_graph_module", "_register_stack_trace_anchor",
    "_reparametrize_module", "_use_lazy_graph_module", "get_proxy_mode", "pytree",
    "unset_fake_temporarily", "backed_size_oblivious", "dtensor_spec", "has_kernel",
    "local_tensor", "marked_dynamic_dims", "register_group_alias",
    # and the patches
    "InputShapeEnv", "StepRecorder", "compiling_forward", "faster_symbolic_recording",
    "refuse_reentrant_checkpoint", "size_oblivious_reshape", "symbolic_floats_unhashable",
    "lstm_recorded_for_training", "gradient_resets", "meta_kernel_value", "new_fake",
    "tag_regions", "direct_op_calls",
    # block reuse (spmd_compiler/trace/block_reuse.py)
    "BLOCK_REUSE_OFF_ENV", "block_reuse_enabled", "proxy_node", "bind_proxy", "untraced", "sym_node",
    "recording_into", "module_hooks",
]

log = logging.getLogger("spmd_compiler")

PINNED = "2.13"
OFF_ENV = "SPMD_NO_TORCH_PATCHES"


def version_supported() -> bool:
    """Is the running torch the pinned one?"""
    return torch.__version__.split("+")[0].rsplit(".", 1)[0] == PINNED


# ---------------------------------------------------------------------------------------------
# Private attributes read


def local_tensor(dt: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (``to_local()`` goes through autograd)."""
    return dt._local_tensor


def dtensor_spec(dt: torch.Tensor):
    """A DTensor's ``DTensorSpec`` (mesh, placements, global shape)."""
    return dt._spec


def marked_dynamic_dims(t: torch.Tensor) -> set[int]:
    """The dims ``torch._dynamo.mark_dynamic`` marked on ``t``."""
    return set(getattr(t, "_dynamo_dynamic_indices", ()))


def backed_size_oblivious():
    """torch.fx's config while recording: shape checks on a backed size symbol do not
    specialize it on 0 or 1."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Has the operator ``op`` (``"aten::name.overload"``) a kernel for ``dispatch_key``?"""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


# ---------------------------------------------------------------------------------------------
# Probes of the optional patches: does torch's code still have the shape each one replaces?

# Binary SymNode operations whose result depends only on their operands
PURE_BINARY = ("add", "sub", "mul", "int_floordiv", "eq", "ne", "gt", "lt", "le", "ge",
               "sym_max", "sym_min", "and_", "or_")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _probe_symnode_memo() -> bool:
    env = ShapeEnv()
    return (all(callable(getattr(SymNode, f"_{m}", None)) for m in PURE_BINARY)
            and _params(SymNode.__init__)[:8] == ["self", "expr", "shape_env", "pytype", "hint",
                                                  "constant", "fx_node", "optimized_summation"]
            and hasattr(env, "_replacements_version_counter")
            and hasattr(env, "_translation_validation_enabled")
            and hasattr(logging_internal, "GET_DTRACE_STRUCTURED"))


def _probe_free_symbols_memo() -> bool:
    state = _CacheKeyState()
    return (_params(_CacheKeyState.convert_sym_int) == ["self", "result", "arg"]
            and all(hasattr(state, a) for a in ("sym_node_lookup", "known_symbols", "shape_env")))


def _probe_no_tensor_meta() -> bool:
    return (_params(proxy_tensor.set_meta) == ["proxy", "val"]
            and "include_real" in _params(proxy_tensor.extract_val))


def _probe_size_oblivious_reshape() -> bool:
    op = torch.ops.aten.reshape.default
    return (isinstance(op.py_kernels, dict) and hasattr(op, "_dispatch_cache")
            and hasattr(op, "_op_dk") and "size_oblivious" in _params(_compute_stride))


def _probe_direct_op_calls() -> bool:
    op = torch.ops.aten.detach.default
    source = inspect.getsource(torch._ops.OpOverload.__call__)
    return callable(getattr(op, "_op", None)) and "return self._op(*args, **kwargs)" in source


def _probe_below_autograd() -> bool:
    """Below autograd, an in-place op still bumps the version counter and a view knows its
    base (ADInplaceOrView runs), and nothing records a gradient."""
    t = torch.zeros(4, requires_grad=True)
    with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
        u = t.mul(2)
        view = u[1:]
        u.add_(1)
    return u._version == 1 and view._base is u and u.grad_fn is None and not u.requires_grad


OPTIONAL: dict[str, Callable[[], bool]] = {
    "symnode_memo": _probe_symnode_memo,
    "free_symbols_memo": _probe_free_symbols_memo,
    "no_tensor_meta": _probe_no_tensor_meta,
    "size_oblivious_reshape": _probe_size_oblivious_reshape,
    "direct_op_calls": _probe_direct_op_calls,
    "below_autograd": _probe_below_autograd,
    "block_reuse": lambda: _probe_block_reuse(),
    "meta_kernel_values": lambda: _probe_meta_kernel_values(),
}


def enabled(patch: str) -> bool:
    """Does the optional ``patch`` run? (See the module docstring; an off patch is logged once
    per process and reason.)"""
    if os.environ.get(OFF_ENV):
        return False
    return _probed(patch)


@functools.cache
def _probed(patch: str) -> bool:
    if not version_supported():
        log.warning("spmd_compiler: torch %s is not the pinned %s: optional patch %s is off",
                    torch.__version__, PINNED, patch)
        return False
    try:
        ok = OPTIONAL[patch]()
    except Exception as e:  # noqa: BLE001 - a probe that cannot run is a failed probe
        log.warning("spmd_compiler: probe of %s raised %r", patch, e)
        ok = False
    if not ok:
        log.warning("spmd_compiler: torch's code differs from what optional patch %s replaces: "
                    "it is off (recording as torch does, slower)", patch)
    return ok


# ---------------------------------------------------------------------------------------------
# Faster symbolic recording (symnode_memo, free_symbols_memo, no_tensor_meta)
#
# With a symbolic batch size (and sequence length) the recording of a step costs about 2.5
# times the same recording with static sizes, and the difference is not in the ops: every fake
# tensor an op returns has symbolic sizes, so building it (its storage size, contiguity, numel)
# runs dozens of SymNode operations (s0*2048, Eq(s0*2048, 2048), ...) through Python, the same
# few expressions again and again, layer after layer.
#
# - SymNode arithmetic made outside the proxy tracer (inside fake kernels and fake tensor
#   construction: the ones that record nothing in the graph) is a pure function of the operands'
#   expressions, the ShapeEnv's replacements (keyed by its version counter), the operands'
#   hints, types and summation flags. The memo returns a new SymNode with the result's expression
#   and hint, as the operation would. Not memoized: operations under the proxy tracer (they
#   record graph nodes), mod (it reads the ShapeEnv's value ranges, which guards refine), and
#   everything while translation validation or structured tracing of expressions is on.
# - The free symbols of a size are memoized where the fake tensor cache builds its key.
# - node.meta["tensor_meta"] is not written (make_fx calls it "best effort; prefer using val"):
#   nothing in the compiler reads it; meta["val"] is written as before.
#
# On a 24-block GPT-2 this cut the recording's CPU time by about 30% (7.7 s to 5.3 s); the
# first call at world size 2 by 11-20% (docs/compile_time.md).


def _memoized(method: str, impl, memo: dict):
    def operation(self, other):
        env = self.shape_env
        if (env is None or type(other) is not SymNode or env._translation_validation_enabled
                or logging_internal.GET_DTRACE_STRUCTURED
                or proxy_tensor.get_proxy_mode() is not None):
            return impl(self, other)
        key = (method, id(env), env._replacements_version_counter, self._expr, other._expr,
               self.pytype, other.pytype, self._hint, other._hint,
               self._optimized_summation, other._optimized_summation)
        r = memo.get(key)
        if r is None:
            r = memo[key] = impl(self, other)
        return SymNode(r._expr, env, r.pytype, r._hint, r.constant, r.fx_node,
                       r._optimized_summation)

    return operation


def _convert_sym_int_memoized(memo: dict):
    def convert_sym_int(self, result, arg):  # torch's _CacheKeyState.convert_sym_int, memoized
        node_id = id(arg.node)
        if node_id in self.sym_node_lookup:
            result.append(_InputBackref(self.sym_node_lookup[node_id]))
            return
        self.sym_node_lookup[node_id] = len(result)
        expr = arg.node.expr
        symbols = memo.get(expr)
        if symbols is None:
            symbols = memo[expr] = frozenset(expr.free_symbols)
        self.known_symbols.update(symbols)
        if self.shape_env is None:
            self.shape_env = arg.node.shape_env
        result.append(_PySymInputStub(arg))

    return convert_sym_int


def _set_meta_without_tensor_meta(proxy, val):
    proxy.node.meta["val"] = proxy_tensor.extract_val(
        val, include_real=(proxy.node.op == "placeholder"))
    return proxy


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    # a class's own entry as it is stored (a pybind method is an instancemethod there; getattr
    # would give the plain function, which does not bind)
    saved = vars(owner)[name] if isinstance(owner, type) and name in vars(owner) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def faster_symbolic_recording():
    """While recording: the optional patches symnode_memo, free_symbols_memo and
    no_tensor_meta (those that are enabled). Restores torch's own functions on exit;
    re-entrant."""
    global _recording_faster
    if _recording_faster:
        yield
        return
    with contextlib.ExitStack() as stack:
        if enabled("free_symbols_memo"):
            stack.enter_context(_swapped(_CacheKeyState, "convert_sym_int",
                                         _convert_sym_int_memoized({})))
        if enabled("symnode_memo"):
            memo: dict = {}
            for m in PURE_BINARY:
                impl = getattr(SymNode, f"_{m}")
                stack.enter_context(_swapped(SymNode, f"_{m}", _memoized(m, impl, memo)))
        if enabled("no_tensor_meta"):
            stack.enter_context(_swapped(proxy_tensor, "set_meta", _set_meta_without_tensor_meta))
        _recording_faster = True
        try:
            yield
        finally:
            _recording_faster = False


_recording_faster = False  # inside faster_symbolic_recording()


# ---------------------------------------------------------------------------------------------
# size_oblivious_reshape
#
# ATen's reshape (a C++ composite) asks whether its input is contiguous, and whether the new
# shape can be a view of the old strides, with plain guards: a size that could be 1 or 0 gets a
# guard (Ne(s1 - 1, 1) for logits[:, :-1].reshape(-1, vocab), Ne(s0, 1) for the batch), so a
# sequence of length 2 or a batch of one falls outside the program and compiles one of its own.
# While recording, reshape of symbolically sized tensors runs as the same three cases, decided
# size-obliviously (the tracer runs with backed_size_oblivious): a view when the input is
# contiguous or the new shape fits its strides for every size, otherwise a contiguous copy
# viewed in the new shape (clone + _unsafe_view, what ATen records). The copy is correct for
# every size; only for the sizes where ATen could have viewed does the program copy instead
# (reshape promises neither). Statically sized tensors take ATen's own kernel.

_aten = torch.ops.aten
_COMPOSITE = DispatchKey.CompositeImplicitAutograd


def _reshape(a: torch.Tensor, shape):
    if not any(isinstance(s, torch.SymInt) for s in (*a.shape, *a.stride(), *shape)):
        return _aten.reshape.default._op_dk(_COMPOSITE, a, shape)  # ATen's own
    if is_contiguous_or_false(a):
        return _aten.view.default(a, shape)  # as ATen: the proposed shape, -1 and all
    shape = infer_size(shape, a.numel())
    if _compute_stride(a.shape, a.stride(), shape, size_oblivious=True) is not None:
        return _aten.view.default(a, shape)
    return _aten._unsafe_view.default(
        _aten.clone.default(a, memory_format=torch.contiguous_format), shape)


@contextlib.contextmanager
def size_oblivious_reshape():
    """While recording (symbolic make_fx runs the Python dispatcher): ``aten.reshape`` as
    above, when the optional patch is enabled."""
    op = _aten.reshape.default
    if not enabled("size_oblivious_reshape") or _COMPOSITE in op.py_kernels:
        yield  # off, or already on (or torch registered its own): leave it
        return
    op.py_kernels[_COMPOSITE] = _reshape
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        del op.py_kernels[_COMPOSITE]
        op._dispatch_cache.clear()


# ---------------------------------------------------------------------------------------------
# Symbolic floats in DTensor's sharding propagation
#
# While recording, an optimizer's update hands DTensor ops symbolic floats: the learning rate
# (lifted as a SymFloat, ``param.add_(grad, alpha=-lr)``, AdamW's ``param.mul_(1 - lr * wd)``)
# and single-tensor Adam's step count read as a Python number (``step_t.item()``, data-dependent).
# DTensor's sharding propagation caches its expanded strategy by the op's schema, scalars
# included (single_dim_strategy.py, ``functools.lru_cache``), and skips the cache when hashing
# raises a TypeError ("unhashable types (SymInts)"). Hashing a SymFloat instead asks for its
# value: a guard that specializes the learning rate, or that the tracer cannot answer for the
# step count (GuardOnDataDependentSymNode). While recording, a symbolic float is unhashable
# (TypeError): DTensor computes the strategy uncached, which does not depend on the scalar's
# value, and the graph keeps the value symbolic.


def _unhashable_if_symbolic(original):
    def __hash__(self):
        if free_symbols(self):
            raise TypeError("a symbolic float is not hashable while the step is recorded")
        return original(self)

    return __hash__


@contextlib.contextmanager
def gradient_resets(on_reset: Callable[[torch.Tensor], None]):
    """While recording: ``on_reset(p)`` for every reset of a fake parameter's gradient the step
    makes: ``p.grad = ...`` (``zero_grad()``'s default sets None), and every parameter of an
    optimizer's or a module's ``zero_grad()`` (``set_to_none=False`` zeroes in place)."""
    slot = torch._C.TensorBase.grad

    def set_grad(self, value):
        on_reset(self)
        slot.__set__(self, value)

    def zeroing(original, params_of):
        def zero_grad(self, *args, **kwargs):
            for p in params_of(self):
                on_reset(p)
            return original(self, *args, **kwargs)
        return zero_grad

    FakeTensor.grad = property(slot.__get__, set_grad)
    try:
        with _swapped(torch.optim.Optimizer, "zero_grad", zeroing(
                torch.optim.Optimizer.zero_grad,
                lambda opt: [p for g in opt.param_groups for p in g["params"]])), \
                _swapped(torch.nn.Module, "zero_grad", zeroing(
                    torch.nn.Module.zero_grad, lambda m: list(m.parameters()))):
            yield
    finally:
        del FakeTensor.grad


@contextlib.contextmanager
def lstm_recorded_for_training():
    """While recording: mkldnn off, so that ``aten.lstm``'s decomposition records the recurrent
    layers it can differentiate. With mkldnn on, an input that needs no gradient makes it pick
    ``mkldnn_rnn_layer`` with ``train=False``, whose backward then fails ("Expected a proper
    Tensor but got None ... 'workspace'")."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def symbolic_floats_unhashable():
    """While recording: ``hash()`` of a symbolic SymFloat raises TypeError."""
    original = torch.SymFloat.__hash__
    torch.SymFloat.__hash__ = _unhashable_if_symbolic(original)
    try:
        yield
    finally:
        torch.SymFloat.__hash__ = original


# ---------------------------------------------------------------------------------------------
# Required patches


def user_line_here() -> str:
    """The innermost live frame in the user's code (not torch's, not ours)."""
    here = os.path.dirname(__file__)
    roots = (os.path.dirname(torch.__file__), here,
             os.path.join(os.path.dirname(here), "passes"), os.path.dirname(contextlib.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        f = frame.f_code.co_filename
        if not f.startswith(roots) and not f.startswith("<"):
            line = linecache.getline(f, frame.f_lineno).strip()
            return f'File "{f}", line {frame.f_lineno}, in {frame.f_code.co_name}: {line}'
        frame = frame.f_back
    return "<unknown location>"


def _ours_or_torch(filename: str) -> bool:
    here = os.path.dirname(__file__)
    return filename.startswith((os.path.dirname(torch.__file__), here,
                                os.path.join(os.path.dirname(here), "passes"),
                                os.path.dirname(contextlib.__file__)))


def _asking_line(frame) -> str | None:
    """The user's line that asked, through ``frame``, for a rank: the first frame outwards that
    is not in torch.distributed nor the standard library, when it is not torch's or ours."""
    inside = os.path.join(os.path.dirname(torch.__file__), "distributed", "")
    stdlib = os.path.dirname(contextlib.__file__)
    while frame is not None:  # (this file's frames: a question watched twice, nested)
        name = frame.f_code.co_filename
        if not name.startswith((inside, stdlib)) and name != __file__:
            return None if _ours_or_torch(name) else f'File "{name}", line {frame.f_lineno}'
        frame = frame.f_back
    return None


@contextlib.contextmanager
def rank_queries():
    """Yields a list that collects, while the block runs, the source line of every question the
    user's code asks about this process's rank: ``torch.distributed.get_rank`` (also bound
    under another name before the block), a process group's ``rank()`` (``dist.group.WORLD``),
    ``get_node_local_rank``, a DeviceMesh's ``get_rank``, ``get_local_rank`` or
    ``get_coordinate`` (torch's own questions and ours are left out): a step that asks for its
    rank may record another program on every rank."""
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import DeviceMesh

    seen: list[str] = []

    def watched(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            line = _asking_line(sys._getframe(1))
            if line is not None and line not in seen:
                seen.append(line)
            return fn(*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        for owner in (torch.distributed, distributed_c10d):
            for name in ("get_rank", "get_node_local_rank"):
                if hasattr(owner, name):
                    stack.enter_context(_swapped(owner, name, watched(getattr(distributed_c10d, name))))
        stack.enter_context(_swapped(ProcessGroup, "rank", watched(ProcessGroup.rank)))
        for name in ("get_rank", "get_local_rank", "get_coordinate"):
            stack.enter_context(_swapped(DeviceMesh, name, watched(getattr(DeviceMesh, name))))
        yield seen


def default_store():
    """The default process group's key-value store (its rendezvous store)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


@contextlib.contextmanager
def stand_in_process_group(world: int):
    """A default process group of ``world`` ranks in this one process, this process rank 0,
    whose collectives move nothing (torch's testing ``fake`` backend): what a program is built
    against where there is no process group (``explain``). Destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def register_group_alias(name: str, group) -> bool:
    """Let the functional collectives find ``group`` under ``name`` too (c10d's registry of
    group names); True if ``name`` now names ``group``, False if it names another group."""
    from torch._C._distributed_c10d import _register_process_group

    try:
        return _resolve_process_group(name) is group
    except Exception:  # noqa: BLE001 - not registered yet
        pass
    try:
        _register_process_group(name, group)
    except RuntimeError:
        return False
    return _resolve_process_group(name) is group


def init_adam_state(opt: torch.optim.Optimizer, group: dict) -> None:
    """Adam's (and AdamW's) own lazy state initialisation (``Adam._init_group``) for the
    parameters of ``group`` that have a gradient, as its first ``step()`` makes it."""
    lists: list[list] = [[] for _ in range(6)]
    opt._init_group(group, *lists)


def mark_stepped(opt: torch.optim.Optimizer) -> None:
    """Leave ``opt`` as its ``step()`` does when an LR scheduler has wrapped it: the wrapper
    (torch/optim/lr_scheduler.py, ``LRScheduler.__init__``'s ``patch_track_step_called``) sets
    ``opt._opt_called``, which the scheduler's first ``step()`` reads to warn that it was called
    before ``optimizer.step()``."""
    opt._opt_called = True


@contextlib.contextmanager
def tag_regions(key: str, forward, backward, optimizer, stepped_key: str):
    """While recording: nodes recorded before and inside ``torch.autograd.backward`` (what
    ``loss.backward()`` calls) get ``meta[key]`` ``forward`` and ``backward``, and nodes recorded
    after a backward up to the end of an optimizer's ``step()`` get ``optimizer`` (where unset):
    a step with several backward calls (a GAN) has a region of each kind per backward. Nodes
    recorded up to the end of an optimizer's ``step()`` get ``meta[stepped_key] = True``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    original = torch.autograd.backward

    def tag(region, stepped=False):
        mode = get_proxy_mode()
        if mode is not None:
            for node in mode.tracer.graph.nodes:
                node.meta.setdefault(key, region)
                if stepped:
                    node.meta[stepped_key] = True

    def recorded_backward(*args, **kwargs):
        tag(forward)
        result = original(*args, **kwargs)
        tag(backward)
        return result

    handle = register_optimizer_step_post_hook(
        lambda *_: tag(optimizer, stepped=True))
    try:
        with _swapped(torch.autograd, "backward", recorded_backward):
            yield
    finally:
        handle.remove()


@contextlib.contextmanager
def refuse_reentrant_checkpoint(error: Callable[[str], Exception]):
    """While recording: reentrant activation checkpointing raises ``error(user's line)``."""
    from torch.utils import checkpoint

    def refuse(*args, **kwargs):
        raise error(user_line_here())

    with _swapped(checkpoint.CheckpointFunction, "apply", refuse):
        yield


@contextlib.contextmanager
def compiling_forward(module: torch.nn.Module):
    """Make ``torch.compiler.is_compiling()`` true while the model's forward is recorded, as
    torch's own make_fx-based (non-strict) export does: libraries then take their traceable code
    paths (Hugging Face avoids data-dependent checks and runs its grouped expert matmul as a custom
    op with a fake kernel). The loss code and the optimizer step run as written."""
    saved = {"depth": 0, "flag": False}

    def enter(*_):
        if saved["depth"] == 0:
            saved["flag"] = torch.compiler._is_compiling_flag
            torch.compiler._is_compiling_flag = True
        saved["depth"] += 1

    def leave(*_):
        saved["depth"] -= 1
        if saved["depth"] == 0:
            torch.compiler._is_compiling_flag = saved["flag"]

    hooks = [module.register_forward_pre_hook(enter),
             module.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        if saved["depth"]:  # the forward raised
            torch.compiler._is_compiling_flag = saved["flag"]


class StepTracer(PythonKeyTracer):
    """make_fx's tracer, plus the two annotations the compiler shows users, made cheaply:

    - ``node.stack_trace``: the frames of ``forward`` methods and of the step itself (as
      make_fx's ``record_stack_traces``), read from the live Python frames instead of a
      symbolized C++ traceback of the whole stack, and formatted once per distinct stack;
    - ``node.meta["nn_module_stack"]``: the model's submodules being called (as make_fx's
      ``record_module_stack``, without its proxies for every module attribute access).

    On a 24-block GPT-2 step this halves the trace (measurements in docs/benchmarks.md).
    """

    def __init__(self, root_module: torch.nn.Module, blocks=None):
        super().__init__()
        self.blocks = blocks  # spmd_compiler/trace/block_reuse.py: runs the calls of repeated blocks
        self._paths = {}
        for name, m in root_module.named_modules(remove_duplicate=False):
            self._paths.setdefault(id(m), name)
        self._calls: dict[str, int] = {}
        self._formatted: dict[tuple, str] = {}
        self._skip = uninteresting_files() | {os.path.join(os.path.dirname(__file__), "trace", "block_reuse.py")}
        self.code_seen: dict = {}  # code object on the stack of any recorded node -> its globals
        # the same for the frames above ``block_frame``, while block reuse records a block
        self.block_codes: dict | None = None
        self.block_frame = None

    def call_module(self, m, forward, args, kwargs):
        path = self._paths.get(id(m))
        if path is None:
            return forward(*args, **kwargs)
        calls = self._calls.get(path, 0)
        self._calls[path] = calls + 1
        key = f"{path}@{calls}" if calls else path
        self.module_stack[key] = (path, f"{type(m).__module__}.{type(m).__qualname__}")
        try:
            if self.blocks is not None:
                return self.blocks.call(m, forward, args, kwargs)
            return forward(*args, **kwargs)
        finally:
            self.module_stack.pop(key, None)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        if not node.stack_trace:
            node.stack_trace = self._stack_trace(sys._getframe(1))
        return node

    def _stack_trace(self, frame) -> str | None:
        frames = []
        seen, block = self.code_seen, self.block_codes
        while frame is not None:
            code = frame.f_code
            if code not in seen:
                seen[code] = frame.f_globals
            if frame is self.block_frame:
                block = None
            elif block is not None and code not in block:
                block[code] = frame.f_globals
            if (code.co_name == "forward" or (code.co_filename, code.co_name) in _STACK_TRACE_ANCHORS) \
                    and code.co_filename not in self._skip:
                frames.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        if not frames:
            return None
        key = tuple(frames)
        text = self._formatted.get(key)
        if text is None:
            text = self._formatted[key] = "".join(
                f'  File "{f}", line {n}, in {name}\n    {linecache.getline(f, n).strip()}\n'
                for f, n, name in reversed(frames)).strip()
        return text


class StepRecorder(_MakefxTracer):
    """make_fx (symbolic) recording with a ``StepTracer``."""

    def __init__(self, module: torch.nn.Module, blocks=None):
        super().__init__(None, "symbolic", False, False, False, False, True,
                         _disable_torch_fn_metadata_mode=True)
        self._module, self._blocks = module, blocks

    last_tracer: StepTracer | None = None

    def _construct_modes_with_fx_tracer(self, fx_tracer):
        self.fx_tracer = self.last_tracer = StepTracer(self._module, self._blocks)
        super()._construct_modes_with_fx_tracer(self.fx_tracer)


# ---------------------------------------------------------------------------------------------
# Block reuse (spmd_compiler/trace/block_reuse.py): a repeated block's nodes are copied into the
# recording instead of recorded again. Needs make_fx's proxy slots (which graph node a fake
# tensor or a symbolic size stands for), a way to run fake ops without recording them, and the
# tracer's graph swapped for a scratch graph while a block's backward is recorded once.

BLOCK_REUSE_OFF_ENV = "SPMD_NO_BLOCK_REUSE"
untraced = disable_proxy_modes_tracing  # fake ops run, nothing is recorded


def block_reuse_enabled() -> bool:
    """Is block reuse on? Off with ``SPMD_NO_BLOCK_REUSE=1`` (or ``SPMD_NO_TORCH_PATCHES=1``),
    on another torch, or when its probe fails: every block is then recorded as it runs."""
    return not os.environ.get(BLOCK_REUSE_OFF_ENV) and enabled("block_reuse")


def _probe_block_reuse() -> bool:
    from torch.utils._thunk import Thunk

    tracer = PythonKeyTracer()
    proxy_tensor._init_proxy_trackers(tracer)
    return (_params(proxy_tensor.track_tensor) == ["tensor", "proxy", "constant", "tracer"]
            and _params(get_proxy_slot)[:2] == ["obj", "tracer"]
            and isinstance(tracer.symnode_tracker, proxy_tensor._SymNodeDict)
            and hasattr(tracer.symnode_tracker, "sym_node_dict")
            and isinstance(tracer.sympy_expr_tracker, dict)
            and set(Thunk.__slots__) == {"f", "r"}
            and hasattr(torch.nn.modules.module, "_global_forward_hooks"))


def proxy_node(t, tracer) -> torch.fx.Node:
    """The graph node that fake tensor ``t`` stands for in ``tracer``'s recording."""
    return get_proxy_slot(t, tracer).proxy.node


def bind_proxy(t: torch.Tensor, tracer, node: torch.fx.Node, like: torch.Tensor | None = None,
               ) -> None:
    """Make fake tensor ``t`` stand for ``node`` in ``tracer``'s recording, as make_fx binds an
    op's result (its sizes get ``sym_size`` nodes of ``node`` when first used). With ``like`` (a
    tensor ``t`` aliases), ``t``'s symbolic sizes stand for what ``like``'s stand for."""
    if like is not None:
        pairs = zip((*t.shape, *t.stride(), t.numel(), t.storage_offset()),
                    (*like.shape, *like.stride(), like.numel(), like.storage_offset()))
        sym = tracer.symnode_tracker
        for a, b in pairs:
            if isinstance(a, torch.SymInt) and a not in sym and b in sym:
                sym[a] = sym[b]
    with disable_proxy_modes_tracing():  # as make_fx binds: size arithmetic not recorded
        proxy_tensor.track_tensor(t, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)


def sym_node(value, tracer) -> torch.fx.Node:
    """The graph node of a symbolic size (a ``sym_size`` node made now if not made yet)."""
    return get_proxy_slot(value, tracer).force().node


def module_hooks(m: torch.nn.Module) -> bool:
    """Has ``m`` (or every module, globally) a forward or backward hook?"""
    g = torch.nn.modules.module
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or g._global_forward_hooks
                or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)


@contextlib.contextmanager
def recording_into(tracer, scratch: torch.fx.Graph):
    """Nodes ``tracer`` records go to ``scratch`` instead of its graph. Symbolic sizes first
    given a node there (make_fx creates ``sym_size`` nodes lazily) are forgotten afterwards, so
    the real graph never uses a scratch node: they get their node in the real graph when next
    used, as if the scratch recording had not happened."""
    from torch.utils._thunk import Thunk

    graph = tracer.graph
    sym, exprs = tracer.symnode_tracker.sym_node_dict, tracer.sympy_expr_tracker
    known, known_exprs = set(sym), set(exprs)
    lazy = [(t, t.f) for t in sym.values() if isinstance(t, Thunk) and t.f is not None]
    lazy += [(v.proxy, v.proxy.f) for v in exprs.values()
             if isinstance(v.proxy, Thunk) and v.proxy.f is not None]
    tracer.graph = scratch
    try:
        yield
    finally:
        tracer.graph = graph
        for key in set(sym) - known:
            del sym[key]
        for key in set(exprs) - known_exprs:
            del exprs[key]
        for thunk, f in lazy:
            if thunk.f is None and getattr(thunk.r, "node", None) is not None \
                    and thunk.r.node.graph is scratch:
                thunk.f, thunk.r = f, None


class InputShapeEnv(ShapeEnv):
    """A ShapeEnv that remembers the user's source line that replaced an input symbol (by a
    constant: a specialization, or by another symbol)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.replaced_at: dict = {}

    def _set_replacement(self, a, tgt, msg):
        before = self.replacements.get(a)
        super()._set_replacement(a, tgt, msg)
        if self.replacements.get(a) is not before and a not in self.replaced_at:
            self.replaced_at[a] = user_line_here()

    def where_replaced(self, symbols) -> str:
        lines = [self.replaced_at[s] for s in sorted(symbols, key=str) if s in self.replaced_at]
        return lines[0] if lines else "<unknown location>"


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (spmd_compiler/features/tensor_parallel.py, halo_conv.py): DTensor's internals


def dtensor_from_spec(local: torch.Tensor, spec, requires_grad: bool = False) -> torch.Tensor:
    """The DTensor of ``spec`` (a DTensorSpec) around ``local``, without a collective or autograd
    node (``from_local`` is an autograd function)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=requires_grad)


def implicit_replication():
    """DTensor's ``implicit_replication``: a plain tensor meeting a DTensor counts as
    ``Replicate()`` (a position table the step makes, beside a sequence-sharded activation)."""
    from torch.distributed.tensor.experimental import implicit_replication as replicated

    return replicated()


@contextlib.contextmanager
def guarded_split_factors():
    """DTensor's view rules on a symbolic batch size ``b``, made to see its value, guarded (the
    batch stays a symbol for the placement analysis; another batch size recompiles):

    - flattening ``(b, t)`` with ``t`` sharded needs a ``_StridedShard`` split factor, which the
      rule refuses to take from a backed symbol: it takes the value, with ``Eq(b, value)``;
    - a batch of one is the rule's singleton dim (as a static size 1 is), with ``Eq(b, 1)``:
      else ``(1, t)`` flattens to a ``_StridedShard`` of split factor ``b``, laid out wrongly."""
    import torch.distributed.tensor._ops._view_ops as view_ops
    from torch._guards import ShapeGuard
    from torch.fx.experimental import symbolic_shapes

    own_hint, own_groups = view_ops._explicit_unbacked_hint, view_ops.view_groups

    def guarded(value) -> int | None:
        node = value.node
        env = getattr(node, "shape_env", None)
        if env is None or node.hint is None:
            return None
        equal = symbolic_shapes.sympy.Eq(node.expr, int(node.hint))  # (sympy, through torch)
        env.guards.append(ShapeGuard(equal, env._get_sloc(), False))
        return int(node.hint)

    def hint(value):
        found = own_hint(value)
        if found is not None or not isinstance(value, torch.SymInt):
            return found
        return guarded(value)

    def ones(sizes):
        return [1 if isinstance(s, torch.SymInt) and s.node.hint == 1 and guarded(s) == 1 else s
                for s in sizes]

    def view_groups(from_size, to_size):
        return own_groups(ones(from_size), ones(view_ops.normalize_sizes(to_size)))

    view_ops._explicit_unbacked_hint, view_ops.view_groups = hint, view_groups
    try:
        yield
    finally:
        view_ops._explicit_unbacked_hint, view_ops.view_groups = own_hint, own_groups


def strided_shard(dim: int, split_factor: int):
    """DTensor's ``_StridedShard``: a shard of a dim another mesh dim already split."""
    return _StridedShard(dim, split_factor=split_factor)


def is_dim_shard(p) -> bool:
    """``Shard`` or ``_StridedShard``."""
    from torch.distributed.tensor import Shard

    return isinstance(p, (Shard, _StridedShard))


def shards_of_dim(spec, dim: int) -> int:
    """Into how many pieces the mesh splits dim ``dim`` of a DTensorSpec's tensor."""
    return spec.num_shards_map[dim]


def concatenate_meshes(meshes: list):
    """One DeviceMesh of the dims of ``meshes`` (FSDP2's way to stack dp on a TP mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def dtensor_has_rule(op) -> bool:
    """Does DTensor's sharding propagator have a rule or strategy for ``op``?"""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    return any(op in table for table in (
        prop.op_strategy_funcs, prop.op_to_rules, prop.op_single_dim_strategy_funcs))


def tensor_hooks(t: torch.Tensor) -> list[Callable]:
    """The hooks ``t.register_hook`` registered on a leaf tensor."""
    return list((getattr(t, "_backward_hooks", None) or {}).values())


@contextlib.contextmanager
def dtensor_op_handlers(handlers: dict):
    """DTensor's dispatch of the ops in ``handlers`` (op -> ``fn(op, args, kwargs, torch_own)``)
    replaced inside the block; ``torch_own`` is DTensor's own handler of the op (its sharding
    propagation, for an op without a handler of its own)."""
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: table.get(op) for op in handlers}
    for op, fn in handlers.items():
        table[op] = functools.partial(_dispatch_to, fn, saved[op])
    try:
        yield
    finally:
        for op, own in saved.items():
            if own is None:
                table.pop(op, None)
            else:
                table[op] = own


def _dispatch_to(fn, own, op, args, kwargs):
    return fn(op, args, kwargs, own or _propagated)


def _propagated(op, args, kwargs):
    """``op`` dispatched by DTensor's sharding propagation, the handler in its place set aside."""
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher._custom_op_handlers
    handler = table.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        if handler is not None:
            table[op] = handler


# ---------------------------------------------------------------------------------------------
# direct_op_calls


class _DirectOps:
    """``torch`` as the generated code of an FX graph reads it, with ``torch.ops.<ns>.<op>.
    <overload>`` resolved once to the overload's C++ callable (``OpOverload.__call__`` only
    forwards to it). Every other attribute is torch's own; each is looked up once, then read
    from this object's ``__dict__``."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if isinstance(value, torch._ops.OpOverload):
            value = value._op
        elif isinstance(value, (torch._ops._Ops, torch._ops._OpNamespace,
                                torch._ops.OpOverloadPacket)):
            value = _DirectOps(value)
        object.__setattr__(self, name, value)
        return value


def direct_op_calls(run: Callable) -> Callable:
    """``run`` (a GraphModule, or ``functools.partial(forward, owner)`` of a program loaded from
    the disk cache) as a function of the same flat inputs whose ops are called directly
    (``_DirectOps``), skipping the module call machinery; ``run`` itself when the patch is off
    or ``run`` is something else."""
    if isinstance(run, torch.fx.GraphModule):
        _LazyGraphModule.force_recompile(run)
        fn, owner = type(run).forward, run
    elif isinstance(run, functools.partial) and len(run.args) == 1 and not run.keywords:
        fn, owner = run.func, run.args[0]
    else:
        return run
    if not (isinstance(fn, types.FunctionType) and fn.__globals__.get("torch") is torch
            and enabled("direct_op_calls")):
        return run
    namespace = dict(fn.__globals__, torch=_DirectOps(torch))
    fast = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    if enabled("below_autograd"):
        return functools.partial(_below_autograd, fast, owner)
    return functools.partial(fast, owner)


def _below_autograd(fn: Callable, *args):
    """``fn(*args)`` with autograd's dispatch keys excluded (the optional patch
    ``below_autograd``; the caller runs it under ``no_grad``)."""
    with torch._C._AutoDispatchBelowAutograd():
        return fn(*args)


def sympy_python(expr) -> str:
    """Python source of a size expression over plain symbols (torch's own printer: it knows
    ``FloatTrueDiv``, ``ToFloat`` and the other functions symbolic numbers make, which sympy's
    printer refuses; it may call ``torch.sym_float`` and the like, so evaluate with ``torch``
    and ``math`` in scope). Floats print as the doubles they are."""
    from torch.utils._sympy.printers import PythonPrinter

    return PythonPrinter().doprint(expr)


# ---------------------------------------------------------------------------------------------
# meta_kernel_values
#
# Fake mode computes an op's value by running its meta kernel on the fake tensors themselves
# (``in_kernel_invocation_manager``: the Meta key included, Python dispatch off) and wrapping the
# result as a fake tensor on the op's device; around that it validates the arguments, builds a
# cache key (per call, ~0.1 ms), tries constant propagation and checks the result. For the
# plain view, copy and collective ops a pass inserts on static shapes none of that changes the
# value: the meta kernel's result (views share their base's storage, as fake mode's do) is it.


def _probe_meta_kernel_values() -> bool:
    return (_params(in_kernel_invocation_manager) == ["fake_mode"]
            and _params(FakeTensor.__new__)[:4] == ["cls", "fake_mode_or_elem", "elem", "device"]
            and hasattr(FakeTensorMode, "in_kernel_invocation"))


def meta_kernel_value(fake_mode, op, args: tuple, kwargs: dict, device: torch.device):
    """``op(*args, **kwargs)`` on fake tensors of ``fake_mode``, as its meta kernel computes it
    inside fake mode (one tensor result, a fake tensor on ``device``); None where the patch is
    off (the caller runs the op in fake mode)."""
    if not enabled("meta_kernel_values"):
        return None
    with in_kernel_invocation_manager(fake_mode):
        out = op(*args, **kwargs)
    return FakeTensor(fake_mode, out, device) if type(out) is torch.Tensor else None


def new_fake(fake_mode, shape, stride, dtype: torch.dtype, device: torch.device):
    """A new fake tensor of ``fake_mode`` with these static metadata, as ``torch.empty_strided``
    in fake mode makes it (its own storage); None where the patch is off or ``fake_mode`` is
    None."""
    if fake_mode is None or not enabled("meta_kernel_values"):
        return None
    with unset_fake_temporarily():
        elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, elem, device)
