"""Record a whole training step (zero_grad, forward, loss, backward, optimizer step) as one
aten-level FX graph.

The module is reparametrized with fake parameters and buffers, the optimizer's ``param_groups``
and ``state`` are rebound to fake tensors, and ``make_fx`` records everything the step does,
including ``loss.backward()`` and ``optim.step()``. The batch dim of each input is symbolic, and
so are the other dims the caller names (``dynamic_dims``, e.g. a sequence length), so one graph
serves every size the ShapeEnv's guards allow.

Placeholders come in a fixed order: parameters (unique, tied weights once), buffers, optimizer
state tensors, lifted hyperparameters (``lr`` of each param group, as a SymFloat), batch leaves.
Outputs: the flat tensor leaves of the step's return value, then the optimizer state tensors the
step created (when the optimizer had none yet).
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import sympy
from sympy.printing.pycode import PythonCodePrinter
import torch
from torch.fx.experimental.proxy_tensor import get_proxy_slot
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from spmd_compiler.passes import meta
from spmd_compiler.passes.cleanup import remove_profiler_nodes
from spmd_compiler.passes.collectives import carries_gradient_on

from . import fake_kernels  # noqa: F401  (Meta kernels the fused optimizers lack)
from ..torch_internals import (
    ConstantSource,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    InputShapeEnv,
    StepRecorder,
    _get_fused_kernels_supported_devices,
    _register_stack_trace_anchor,
    _reparametrize_module,
    backed_size_oblivious,
    compiling_forward,
    symbolic_floats_unhashable,
    lstm_recorded_for_training,
    gradient_resets,
    faster_symbolic_recording,
    get_proxy_mode,
    pytree,
    refuse_reentrant_checkpoint,
    size_oblivious_reshape,
    tag_regions,
    user_line_here,
)
from ..errors import (
    BatchDimError,
    MissingGradientError,
    SideEffectError,
    SPMDError,
    StepSignatureError,
    TraceError,
    UnsupportedError,
)
from .trace_values import ReadConstantValues
from .side_effects import step_constants, warn_value_reads, watch as watch_side_effects
from . import guards, replay
from ..features.mixed_precision import cast_forward
from ..features import subclass_params as subclasses
from ..features.accumulation import ACCUMULATE, accumulating
from .carried_grads import GradientResets
from ..runtime.signature import StepSignature, TracedStep, split_inputs
from ..features import context_parallel
from ..features import tensor_parallel as tp
from ..features.halo_conv import halo_convolution
from ..runtime.call_args import (LIFTED_HPARAMS, StepArgs, group_input_values, group_inputs,
                                  split_step_args)
from ..runtime.step_modules import modules_of
from . import block_reuse
from .reads import Reads, watching as watch_reads

_log = logging.getLogger("spmd_compiler")


# Optimizers whose ``fused=True`` implementation computes the same update as their default and
# ``foreach`` ones (one kernel over all parameters instead of several passes per parameter).
FUSABLE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


# ---------------------------------------------------------------------------------------------
# Arguments


# ---------------------------------------------------------------------------------------------
# Tracing


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame in the user's code (not torch's, not ours)."""
    here = os.path.dirname(os.path.dirname(__file__))  # the package
    roots = (os.path.dirname(torch.__file__), here,
             os.path.join(os.path.dirname(here), "passes"), os.path.dirname(contextlib.__file__))
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(roots) and not f.filename.startswith("<")
    ]
    if not frames:
        return "<unknown location>"
    f = frames[-1]
    return f'File "{f.filename}", line {f.lineno}, in {f.name}: {f.line}'


def _reentrant_checkpoint_error(where: str) -> UnsupportedError:
    """Reentrant activation checkpointing runs a second, nested ``backward()`` on a recomputed
    graph, which the recording of the step cannot represent. Non-reentrant checkpointing
    (``use_reentrant=False``, ``CheckpointImpl.NO_REENTRANT``) records the recomputation in the
    backward and is what the compiled step runs."""
    return UnsupportedError(
        f"reentrant activation checkpointing at {where} cannot be compiled: its backward "
        f"runs a nested backward() on a recomputed graph. Use "
        f"torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
        f"checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT): the compiled "
        f"step recomputes the checkpointed forward in the backward the same way.")


def fusable(opt: torch.optim.Optimizer, group: dict) -> bool:
    """Can ``group`` of ``opt`` run the fused implementation instead of the one it names?

    SGD, Adam and AdamW (exactly these classes: a subclass may change the update) with floating
    parameters on a device with fused kernels, not ``differentiable`` nor ``capturable``; SGD with
    momentum only while its parameters all have a momentum buffer or none does (torch's fused SGD
    cannot start some buffers: a layer unfrozen after others trained).
    """
    if type(opt) not in FUSABLE_OPTIMIZERS or group.get("differentiable") or group.get("capturable"):
        return False
    if type(opt) is torch.optim.SGD and group.get("momentum") and len({
            "momentum_buffer" in opt.state.get(p, {}) for p in group["params"]}) > 1:
        return False
    if tp.refuses_fusing(opt, group["params"]):  # a tensor-parallel plan's parameters
        return False
    if group.get("fused"):
        return True
    devices = _get_fused_kernels_supported_devices()
    params = group["params"]
    return bool(params) and all(  # (a meta parameter will live on the step's device)
        (p.device.type in devices or p.is_meta) and torch.is_floating_point(p) and not p.is_sparse
        for p in params
    )


@contextlib.contextmanager
def _bind_optimizers(optimizers, fake_of, state_fakes, hparams, grad_nodes, fqn_of, fuse=False,
                     unfused=frozenset()):
    """Point the optimizers at fake params/states/lifted hparams; record each param's grad node.
    With ``fuse``, every param group that can runs its optimizer's fused implementation (not
    those that read a number per call besides the learning rate: ``_fused_here``)."""
    saved = []
    hooks = []
    hp = iter(hparams)
    for k, opt in enumerate(optimizers):
        groups = [dict(g) for g in opt.param_groups]
        saved.append((opt, groups, opt.state))
        inputs = [group_inputs(g) for g in opt.param_groups]
        for gi, g in enumerate(opt.param_groups):
            if fuse and fusable(opt, g) and _fused_here(k, gi, g, unfused):
                g["fused"], g["foreach"] = True, False
            elif g.get("fused") and ((k, gi) in unfused or tp.refuses_fusing(opt, g["params"])):
                # (asked for by the user, or by fuse_optimizer before; or a kernel DTensor has
                # no rule for, on a plan's parameters: the same update, unfused)
                g["fused"] = False
        new_state = defaultdict(dict)
        for p, st in opt.state.items():
            fp = fake_of[id(p)]
            new_state[fp] = {
                k: (state_fakes[(fqn_of[id(p)], k)] if isinstance(v, torch.Tensor) else v)
                for k, v in st.items()
            }
        for g, names in zip(opt.param_groups, inputs):
            g["params"] = [fake_of[id(p)] for p in g["params"]]
            for name in names:  # a tuple (``betas``): one input per entry
                g[name] = tuple(next(hp) for _ in g[name]) if isinstance(g[name], tuple) \
                    else next(hp)
        opt.state = new_state

    def on_grad(fqn):
        def hook(t):
            mode = get_proxy_mode()
            tp.grad_as_planned(t)
            node = get_proxy_slot(tp.local_of(subclasses.plain_grad(t)), mode.tracer).proxy.node
            grad_nodes.setdefault(fqn, []).append(node)

        return hook

    for pid, fp in fake_of.items():
        if fp.requires_grad:
            hooks.append(fp.register_post_accumulate_grad_hook(on_grad(fqn_of[pid])))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for opt, groups, state in saved:
            for g, old in zip(opt.param_groups, groups):
                g.clear()
                g.update(old)
            opt.state = state


def record(fn: Callable, module: torch.nn.Module, codes: dict | None = None,
           seen: "Reads | None" = None) -> Callable[..., torch.fx.GraphModule]:
    """``make_fx(fn, tracing_mode="symbolic")`` whose nodes carry the user's source lines and
    the path of the submodule of ``module`` they were recorded in. Adds to ``codes`` every code
    Python file with code on the stack of a recorded node."""
    blocks = block_reuse.for_recording(module, seen)
    recorder = StepRecorder(module, blocks)

    def run(*args):
        try:
            gm = recorder.trace(fn, *args)
        except Exception as e:
            if blocks is not None and blocks.watch.read is not None:
                raise blocks.mismatch() from e  # it failed on what a copy did not write
            raise
        finally:
            if codes is not None and recorder.last_tracer is not None:
                codes.update(recorder.last_tracer.code_seen)
            if blocks is not None:
                blocks.watch.stop()
        if blocks is not None:
            blocks.finish()
        return gm

    return run


def _global_meta(t: torch.Tensor, owner: torch.Tensor | None = None):
    """(shape, dtype, device) of a tensor (an optimizer state of parameter ``owner``) as the
    graph holds it: for a DTensor placed by data parallelism the global (logical) ones; for a
    tensor-parallel one its local shard's shape."""
    return tp.traced_shape(t, owner), t.dtype, t.device


def trace_step(
    fn: Callable, args: tuple, kwargs: dict | None = None, input_batch_dim: Any = 0,
    *, step_args: StepArgs | None = None, fuse_optimizer: bool = False,
    dynamic_dims: Mapping[int, Iterable[int]] | None = None, mp_policy=None,
    accumulation: str | None = None, lift: list[tuple] = (),
    shard: "subclasses.ShardContext | None" = None,
) -> TracedStep:
    """Record ``fn(*args, **kwargs)`` (a whole training step) as one FX graph.
    ``shard`` (sharded styles): parameters with FSDP2's all-gather extensions are unsharded in
    the recording as FSDP2 unshards them (spmd_compiler/features/subclass_params.py).

    With ``fuse_optimizer``, SGD/Adam/AdamW param groups are recorded with their fused
    implementation (one ``_fused_*_`` node per group and dtype) whatever ``foreach``/``fused``
    they name: the same update, in one pass over the parameters. With ``mp_policy`` (FSDP2's
    ``MixedPrecisionPolicy``) the module's forward is recorded with its parameters, inputs and
    outputs cast as the policy says (spmd_compiler/features/mixed_precision.py). ``accumulation``
    (``ACCUMULATE`` / ``APPLY``, spmd_compiler/features/accumulation.py) records a step whose gradients
    start from trailing gradient inputs (and, accumulating, end as trailing outputs). ``lift``:
    paths of Python numbers the step reads (spmd_compiler/trace/guards.py) recorded as symbolic
    numbers, lifted hyperparameters after the learning rates.

    The batch dim of every input is a symbolic size; so is every dim in ``dynamic_dims``
    (argument leaf index -> dims, e.g. a sequence length), each with its own symbol. A dynamic
    dim that the step ties to the batch size (the ShapeEnv replaced one by the other) is traced
    again as a static size, so that a dim holds the batch symbol only if it is batch-sharded.

    Reads live module/optimizer state only for shapes, dtypes and non-tensor settings; changes
    nothing. Writes node.meta ROLE, REGION, PARAM_FQN, STATE_KEY, INPUT_PATH, INPUT_BATCH_DIM,
    INPUT_DYNAMIC_DIMS.
    """
    kwargs = kwargs or {}
    sa = step_args or split_step_args(args, kwargs, input_batch_dim, fn=fn)
    dynamic = _dynamic_dims_to_trace(sa, dynamic_dims or {})
    entangled: list[tuple[int, int, str]] = []
    while True:
        try:
            traced = _record_step(fn, sa, fuse_optimizer, dynamic, mp_policy, accumulation,
                                  lift, shard)
        except block_reuse.BlockMismatch as e:  # a repeated block's copy does not fit: record all
            _log.info("spmd_compiler: block reuse: the step is recorded again without it: %s", e)
            with block_reuse.reuse_off():
                traced = _record_step(fn, sa, fuse_optimizer, dynamic, mp_policy, accumulation,
                                      lift, shard)
        tied = _dims_tied_to_batch(traced, sa)
        if not tied:
            traced.entangled = entangled
            return traced
        for i, d, where in tied:
            entangled.append((i, d, where))
            dynamic[i] = tuple(x for x in dynamic[i] if x != d)


def _dynamic_dims_to_trace(sa: StepArgs, dynamic_dims: Mapping[int, Iterable[int]]) -> dict[int, tuple[int, ...]]:
    """Per input leaf, the non-batch dims to trace as symbolic sizes (normalized, in range)."""
    out = {}
    for i, b in zip(sa.input_indices, sa.batch_dims):
        t = sa.leaves[i]
        dims = set()
        for d in dynamic_dims.get(i, ()):
            if not -t.dim() <= d < t.dim():
                raise BatchDimError(
                    f"dynamic dim {d} is out of range for an input of shape {tuple(t.shape)} "
                    f"(argument leaf {i})")
            dims.add(d % t.dim())
        out[i] = tuple(sorted(dims - {b}))
    return out


def _dims_tied_to_batch(traced: "TracedStep", sa: StepArgs) -> list[tuple[int, int, str]]:
    """(leaf, dim, user line) of dynamic dims whose size the trace tied to a batch size (their
    simplified sizes share a symbol): in the graph they would look batch-sharded."""
    env = traced.shape_env
    batch_syms, batch_made_with = set(), set()
    for fake, b in zip(traced.fake_inputs, sa.batch_dims):
        if b is not None:
            batch_syms |= _free_symbols(env, fake.shape[b])
            batch_made_with |= _free_symbols(env, fake.shape[b], simplify=False)
    tied = []
    for fake, i in zip(traced.fake_inputs, sa.input_indices):
        for d in traced.dynamic_dims.get(i, ()):
            if _free_symbols(env, fake.shape[d]) & batch_syms:
                own = _free_symbols(env, fake.shape[d], simplify=False)
                tied.append((i, d, env.where_replaced(own | batch_made_with)))
    return tied


def _free_symbols(env: ShapeEnv, size, simplify: bool = True) -> set:
    if not isinstance(size, torch.SymInt):
        return set()
    if not simplify:
        return set(size.node._expr.free_symbols)  # the symbol it was made with
    return set(env.simplify(size.node.expr).free_symbols)


@dataclass
class _ModuleState:
    """The step's module and optimizer state as the recording binds it: every parameter and
    buffer once (tied weights once, named by their first name) and every optimizer state tensor."""

    named_params: list[tuple[str, torch.Tensor]]  # every name, duplicates included
    named_buffers: list[tuple[str, torch.Tensor]]
    params: list[torch.Tensor]  # unique, placeholder order
    buffers: list[torch.Tensor]
    fqn_of: dict[int, str]  # id(parameter) -> its name
    buffer_fqn_of: dict[int, str]
    states: list[tuple[tuple[str, str], torch.Tensor]]  # ((param fqn, state name), tensor)
    _by_fqn: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def of(sa: StepArgs) -> "_ModuleState":
        module = sa.module
        named_params = list(module.named_parameters(remove_duplicate=False))
        named_buffers = list(module.named_buffers(remove_duplicate=False))
        fqn_of, buffer_fqn_of = {}, {}
        for name, p in named_params:
            fqn_of.setdefault(id(p), name)
        for name, b in named_buffers:
            buffer_fqn_of.setdefault(id(b), name)
        params = list({id(p): p for _, p in named_params}.values())
        buffers = list({id(b): b for _, b in named_buffers}.values())
        for k, opt in enumerate(sa.optimizers):
            stray = [p for g in opt.param_groups for p in g["params"] if id(p) not in fqn_of]
            if stray:
                raise StepSignatureError(
                    f"optimizer {k} ({type(opt).__name__}) holds a parameter of shape "
                    f"{tuple(stray[0].shape)} that belongs to no module passed to the step; pass "
                    f"every module whose parameters an optimizer updates as an argument of the "
                    f"step.")
        states = [((fqn_of[id(p)], k), v) for opt in sa.optimizers for p, st in opt.state.items()
                  for k, v in st.items() if isinstance(v, torch.Tensor)]
        return _ModuleState(named_params, named_buffers, params, buffers, fqn_of, buffer_fqn_of,
                            states)

    def owner(self, key: tuple[str, str]) -> torch.Tensor:
        """The parameter an optimizer state (``(param fqn, state name)``) belongs to."""
        if self._by_fqn is None:
            self._by_fqn = {}
            for p in self.params:
                self._by_fqn.setdefault(self.fqn_of[id(p)], p)
        return self._by_fqn[key[0]]


def _groups_with_lifted_entries(lift) -> set[tuple[int, int]]:
    """(optimizer, group) of the param groups one of whose entries (``weight_decay``, ``betas``)
    is a lifted number: they run the optimizer's own implementation, which reads it as a number
    (a fused kernel takes it as a constant)."""
    return {(p[0][1], p[1][1]) for p in lift
            if p[0][0] == "optimizer" and len(p) == 3 and p[1][0] == "group"}


def _fused_here(k: int, gi: int, group: dict, unfused: set) -> bool:
    """Does group ``gi`` of optimizer ``k`` keep the fused kernel this recording may give it:
    no number it reads per call but the learning rate."""
    return group_inputs(group) == LIFTED_HPARAMS and (k, gi) not in unfused


def _lift_hparams(sa: StepArgs, fake_mode, shape_env, fuse_optimizer: bool, lift: list = ()):
    """The lifted hyperparameters (``lr`` of each param group, and a momentum a scheduler cycles:
    ``call_args.group_inputs``) as graph inputs: (fake values,
    Python values, bound as a tensor?). A fused kernel takes its learning rate as a float64 0-d
    tensor (a float argument would bake the value into the graph); everything else reads a
    SymFloat."""
    for opt in sa.optimizers:
        for g in opt.param_groups:
            for name in LIFTED_HPARAMS:
                if isinstance(g.get(name), torch.Tensor):
                    raise UnsupportedError(
                        f"a tensor-valued {name!r} in the optimizer's param_groups is not "
                        f"supported; use a Python float (schedulers that change it work)."
                    )
    hparams, values, as_tensors = [], [], []
    unfused = _groups_with_lifted_entries(lift)  # (``lift``: the numbers lifted after these)
    for k, opt in enumerate(sa.optimizers):
        for gi, g in enumerate(opt.param_groups):
            as_tensor = fusable(opt, g) and (fuse_optimizer or bool(g.get("fused"))) and \
                _fused_here(k, gi, g, unfused)
            for j, value in enumerate(group_input_values(g)):
                name = "lr" if j == 0 else "momentum"
                values.append(value)
                as_tensors.append(as_tensor)
                if as_tensor:
                    with fake_mode:
                        hparams.append(torch.empty((), dtype=torch.float64))
                    continue
                src = ConstantSource(f"hparam_{len(hparams)}_{name}")
                sym = shape_env.create_unspecified_symbol(value, src, dynamic_dim=DimDynamic.DYNAMIC)
                hparams.append(shape_env.create_symfloatnode(sym, hint=value, source=src))
    return hparams, values, as_tensors


class _StatelessStep:
    """The step as a function of flat fake tensors (parameters, buffers, optimizer states,
    lifted hyperparameters, batch inputs, accumulated gradients), as make_fx records it; what
    the recording found out (gradient nodes, created state, the outputs' structure) is kept."""

    def __init__(self, fn: Callable, sa: StepArgs, st: _ModuleState, counts: list[int],
                 num_inputs: int, reads, fuse_optimizer: bool, mp_policy, accumulation,
                 lifted: tuple = ((), {}, 0)):
        self.fn, self.sa, self.st, self.counts, self.num_inputs = fn, sa, st, counts, num_inputs
        # (paths, roots, number of learning rates) of the numbers the step reads, lifted
        self.lifted = lifted
        # param groups recorded with their optimizer's own implementation
        self.unfused = _groups_with_lifted_entries(lifted[0])
        self.reads, self.fuse, self.mp_policy, self.accumulation = (
            reads, fuse_optimizer, mp_policy, accumulation)
        # parameter -> the node of its ``.grad`` after each backward that accumulated into it
        self.grad_nodes: dict[str, list[torch.fx.Node]] = {}
        self.created: list[tuple[str, str]] = []
        self.out_spec = None
        self.out_constants: dict[int, Any] = {}
        self.num_outputs = 0
        self.changed: list = []  # Python state the step's code changed (side_effects.py)
        self.subclasses: subclasses.Recording | None = None  # set by _record_step

    def __call__(self, *flat):
        sa, st = self.sa, self.st
        params, buffers, states, lifted, inputs = split_inputs(flat, self.counts)
        params, states = self.subclasses.rebuild(params, st.params, states)
        inputs, grads = inputs[:self.num_inputs], inputs[self.num_inputs:]
        # tensor-parallel parameters, states and inputs: DTensors around their local shards
        params = [tp.as_planned(fp, p) for fp, p in zip(params, st.params)]
        states = [tp.as_planned(fs, v, st.owner(key)) for fs, (key, v) in zip(states, st.states)]
        inputs = [tp.input_as_planned(fi, sa.leaves[i]) for fi, i in zip(inputs, sa.input_indices)]
        leaves = list(sa.leaves)
        for i, t in zip(sa.input_indices, inputs):
            leaves[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(leaves, sa.spec)
        fake_of = {id(p): fp for p, fp in zip(st.params, params)}
        by_name = {n: fake_of[id(p)] for n, p in _slots(sa.module, st.named_params)}
        buffer_of = {id(b): fb for b, fb in zip(st.buffers, buffers)}
        by_name.update({n: buffer_of[id(b)] for n, b in _slots(sa.module, st.named_buffers)})
        state_by_key = dict(zip([k for k, _ in st.states], states))
        trainable = [fp for fp in params if fp.requires_grad]
        fqn_of_fake = {id(fp): st.fqn_of[id(p)] for p, fp in zip(st.params, params)}
        resets = GradientResets(fqn_of_fake, self.grad_nodes)
        regions = tag_regions(meta.REGION, meta.Region.FORWARD, meta.Region.BACKWARD,
                              meta.Region.OPTIMIZER, meta.STEPPED)
        with _reparametrize_module(sa.module, by_name, strict=False), regions, \
                refuse_reentrant_checkpoint(_reentrant_checkpoint_error), _bind_optimizers(
            sa.optimizers, fake_of, state_by_key, lifted, self.grad_nodes, st.fqn_of, self.fuse,
            self.unfused), self.reads, _each_module(sa.module, compiling_forward,
                                                    lambda m: cast_forward(m, self.mp_policy)), \
                accumulating(sa.optimizers, sa.module, list(zip(trainable, grads)), self.accumulation), \
                guards.substituted(*self.lifted[:2], lifted[self.lifted[2]:]), \
                watch_side_effects(self.fn, sa.module, sa.optimizers, step_constants(sa),
                                   user_line_here, into=self.changed), \
                _each_module(sa.module, lambda m: subclasses.gathered_forward(
                    m, self.subclasses.hooked,
                    {st.fqn_of[id(p)]: fp for p, fp in zip(st.params, params)},
                    self.subclasses.shard, self.mp_policy, self.grad_nodes,
                    self.subclasses.described)):
            with gradient_resets(resets.reset), context_parallel.recording(inputs):
                out = self.fn(*call_args, **call_kwargs)
            if not self.accumulation:
                resets.check([(fqn_of_fake[id(fp)], fp) for fp in trainable], sa.optimizers,
                             _step_where(self.fn))
            grads_out = [fp.grad for fp in trainable] if self.accumulation == ACCUMULATE else []
            new_states = self._new_states(fqn_of_fake, state_by_key)
        out_leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_constants = {
            j: v for j, v in enumerate(out_leaves)
            if not isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
        }
        traced_out = [tp.local_of(context_parallel.output_value(v))
                      for j, v in enumerate(out_leaves) if j not in self.out_constants]
        self.num_outputs = len(traced_out)
        return self.subclasses.flatten(traced_out, new_states) + grads_out

    def _new_states(self, fqn_of_fake: dict, state_by_key: dict) -> list[torch.Tensor]:
        """The optimizer state the step created (recorded in ``created``)."""
        new_states = []
        for opt in self.sa.optimizers:
            for fp, st in opt.state.items():
                fqn = fqn_of_fake[id(fp)]
                for k, v in st.items():
                    if (fqn, k) in state_by_key:
                        continue
                    if not isinstance(v, torch.Tensor):
                        raise UnsupportedError(
                            f"the optimizer created a non-tensor state entry {k!r} for "
                            f"parameter {fqn!r}; only tensor optimizer state is supported."
                        )
                    self.created.append((fqn, k))
                    new_states.append(tp.local_of(v))
        return new_states


def _slots(root: torch.nn.Module,
           named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with one name per attribute slot: a submodule reachable by two paths (a layer
    shared by two of the step's modules) is swapped once, so it is restored once."""
    seen, out = set(), []
    for name, t in named:
        prefix, _, attr = name.rpartition(".")
        slot = (id(root.get_submodule(prefix)), attr)
        if slot not in seen:
            seen.add(slot)
            out.append((name, t))
    return out


@contextlib.contextmanager
def _each_module(root: torch.nn.Module, *contexts: Callable):
    """Each of ``contexts`` (a function of a module) entered for every module the step
    received (``root``'s, runtime/step_modules.py)."""
    with contextlib.ExitStack() as stack:
        for module in modules_of(root):
            for context in contexts:
                stack.enter_context(context(module))
        yield


def _watched_objects(roots: dict) -> list:
    """The objects whose attribute reads a recording watches (spmd_compiler/trace/reads.py): the
    model's modules and a bound-method step's instance."""
    return [*roots[("model",)].modules(), *([roots[("self",)]] if ("self",) in roots else [])]


def _make_fx(step: _StatelessStep, fake_mode, args: list, codes: dict,
             seen: "Reads | None" = None) -> torch.fx.GraphModule:
    """Record ``step(*args)``; every failure becomes a TraceError (an UnsupportedError when it
    is in the optimizer's code)."""
    fn, sa = step.fn, step.sa
    # Node stack traces keep frames of `forward` methods; anchor the step itself too, so nodes
    # recorded in the step's own lines (grad clipping, loss code) name them.
    _register_stack_trace_anchor(getattr(fn, "__wrapped__", fn))
    try:
        # Size-oblivious: shape checks on the batch symbol don't specialize on 0/1, so a local
        # batch of one runs the same graph and the guards stay the batch dims' equalities.
        with fake_mode, backed_size_oblivious(), \
                faster_symbolic_recording(), size_oblivious_reshape(), halo_convolution(), \
                symbolic_floats_unhashable(), lstm_recorded_for_training():
            return record(step, sa.module, codes, seen)(*args)
    except SPMDError:
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes a TraceError
        optimizer_frames = [f for f in traceback.extract_tb(e.__traceback__)
                            if os.sep + os.path.join("torch", "optim") + os.sep in f.filename]
        if optimizer_frames:
            names = ", ".join(sorted({type(o).__name__ for o in sa.optimizers}))
            f = optimizer_frames[-1]
            raise UnsupportedError(
                f"the optimizer's step ({names}) cannot be recorded as a graph: it failed at "
                f"{os.path.basename(f.filename)}:{f.lineno} ({f.line}) with "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}. "
                f"Supported and tested: SGD, Adam, AdamW (default, foreach, fused)."
            ) from e
        raise TraceError(_describe_trace_failure(e)) from e


def _record_step(fn: Callable, sa: StepArgs, fuse_optimizer: bool,
                 dynamic_dims: dict[int, tuple[int, ...]], mp_policy=None,
                 accumulation: str | None = None, lift: list[tuple] = (),
                 shard=None) -> TracedStep:
    """One make_fx recording of the step (see ``trace_step``)."""
    st = _ModuleState.of(sa)
    shape_env = InputShapeEnv(specialize_zero_one=False)
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    # A model built on the meta device is recorded on the device its state will live on.
    home = next((t.device for t in (*st.params, *st.buffers) if not t.is_meta),
                next((sa.leaves[i].device for i in sa.input_indices), torch.device("cpu")))

    def fake_static(t, owner=None):
        shape, dtype, device = _global_meta(t, owner)
        device = home if device.type == "meta" else device
        with fake_mode:
            return torch.empty(shape, dtype=dtype, device=device)

    # a tensor-parallel parameter's placeholder is its local shard; the DTensor around it is the
    # leaf that requires grad (tensor_parallel.as_planned)
    owners = {id(v): st.owner(key) for key, v in st.states}
    recording, fake_params, fake_states = subclasses.Recording.of(
        {st.fqn_of[id(p)]: p for p in st.params}, [v for _, v in st.states],
        lambda t: fake_static(t, owners.get(id(t))), shard,
        leaf=lambda p: p.requires_grad and tp.plan_of(p) is None)
    fake_buffers = [fake_static(b) for b in st.buffers]
    hparams, hparam_values, hparam_tensors = _lift_hparams(sa, fake_mode, shape_env, fuse_optimizer, lift)
    lifted = (list(lift), guards.step_roots(fn, sa), len(hparams))
    numbers = guards.lifted_numbers(lift, lifted[1])
    _lift_numbers(guards.flat_numbers(numbers), shape_env, hparams, hparam_values, hparam_tensors)
    fake_inputs = _fake_inputs(fake_mode, sa, dynamic_dims)
    counts = [len(fake_params), len(fake_buffers), len(fake_states), len(hparams)]
    trainable = [p for p in st.params if p.requires_grad] if accumulation else []
    unbatched = {k: sa.leaves[i].detach() for k, (i, d) in
                 enumerate(zip(sa.input_indices, sa.batch_dims)) if d is None}
    reads = ReadConstantValues({sum(counts) + k: t for k, t in unbatched.items()})
    step = _StatelessStep(fn, sa, st, counts, len(fake_inputs), reads, fuse_optimizer, mp_policy,
                          accumulation, lifted)
    step.subclasses = recording
    codes: dict = {}  # code objects on the stack of a recorded op -> their globals
    with watch_reads(_watched_objects(lifted[1])) as seen:
        gm = _make_fx(step, fake_mode, [*fake_params, *fake_buffers, *fake_states, *hparams,
                                        *fake_inputs, *[fake_static(p) for p in trainable]],
                      codes, seen)
    dropped, conditions = _guards_not_kept(fn, gm, shape_env, hparams, lifted, numbers)
    value_guards, source_files = guards.collect(fn, sa, codes, list(lift), seen, gm)
    accumulated = tuple(st.fqn_of[id(p)] for p in trainable)
    signature = StepSignature(
        params=tuple(st.fqn_of[id(p)] for p in st.params),
        buffers=tuple(st.buffer_fqn_of[id(b)] for b in st.buffers),
        states=tuple(k for k, _ in st.states), hparams=tuple(hparam_tensors),
        inputs=tuple(sa.input_indices), grads_in=accumulated, user_outputs=step.num_outputs,
        new_states=tuple(step.created), grads_out=accumulated if accumulation == ACCUMULATE else (),
        **recording.signature_fields(len(st.params)))
    _finish_graph(gm, signature, sa, step.grad_nodes, dynamic_dims)
    subclasses.mark_gathered(gm, recording.hooked, recording.described)
    warn_value_reads(reads.user_reads)
    after_call, assignments, deferred = _python_state(fn, step, gm, sa, hparams, lifted, dropped,
                                                      value_guards)
    return TracedStep(
        gm=gm,
        shape_env=shape_env,
        signature=signature,
        specialized_hparams=_specialized_hparams(shape_env, hparams, hparam_values),
        hparam_conditions=conditions,
        specialized_inputs=[(k, unbatched[k].clone()) for k in
                            sorted(p - sum(counts) for p in reads.used)],
        fake_inputs=fake_inputs,
        specialized=_specialized_batch_dims(shape_env, fake_inputs, sa.batch_dims),
        dynamic_dims=dynamic_dims,
        static_sizes=_static_sizes(fake_inputs, shape_env),
        specialized_dims=_specialized_dynamic_dims(shape_env, fake_inputs, sa, dynamic_dims),
        source_files=source_files,
        value_guards=value_guards,
        out_spec=step.out_spec,
        out_constants=step.out_constants,
        replay=after_call,
        assignments=assignments,
        deferred_error=deferred,
    )


def _guards_not_kept(fn: Callable, gm, shape_env, hparams: list, lifted: tuple,
                     numbers: list) -> tuple[set, tuple[str, ...]]:
    """Take out of ``shape_env`` the guards the program does not keep as shape guards: those
    the step made after its tensor work (their symbols returned) and those on the optimizers'
    numbers alone (returned as per-call conditions)."""
    dropped = replay.drop_guards_after_tensor_work(fn, gm, shape_env)
    lift, _, first = lifted
    return dropped, _hparam_conditions(shape_env, {
        i: hparams[i] for i in _optimizer_numbers(first, lift, numbers)})


def _optimizer_numbers(first: int, lift: list[tuple], numbers: list) -> list[int]:
    """Indices of the optimizers' numbers among the lifted hyperparameters: the ``first``
    (the param groups' inputs), then the lifted param-group entries (``numbers``: the lifted
    values at ``lift``, a tuple one input per entry)."""
    owners = [p for p, v in zip(lift, numbers) for _ in (v if isinstance(v, tuple) else (v,))]
    return list(range(first)) + [first + i for i, p in enumerate(owners) if p[0][0] == "optimizer"]


def _python_state(fn: Callable, step: _StatelessStep, gm, sa: StepArgs, hparams: list,
                  lifted: tuple, dropped: set, value_guards: list) -> tuple:
    """(statements to run again, lifted numbers to assign, a deferred SideEffectError) after
    each call for the Python state the recording changed (trace/replay.py). A change no
    statement repeats is deferred while a number the step writes is not yet an input: the
    recording with it lifted (guards.record_lifting) may explain it."""
    lift, roots, first = lifted
    symbols = {hparams[i].node._expr: i for i in range(first, len(hparams))
               if isinstance(hparams[i], (torch.SymInt, torch.SymFloat))}
    try:
        return (*replay.plan_with_assignments(
            fn, step.changed, gm, sa, user_line_here, [(p, guards.slot(p, roots)) for p in lift],
            symbols, dropped), None)
    except SideEffectError as e:
        if not any(g.written and not g.lifted for g in value_guards):
            raise
        return (), (), e  # recorded again with the numbers it writes as inputs


def _lift_numbers(values: list, shape_env, hparams: list, hparam_values: list,
                  hparam_tensors: list) -> None:
    """Append the numbers the step reads that are recorded as inputs (spmd_compiler/trace/guards.py)
    to the lifted hyperparameters: a symbolic float or int each, bound as a Python number."""
    for value in values:
        src = ConstantSource(f"hparam_{len(hparams)}_value")
        sym = shape_env.create_unspecified_symbol(value, src, dynamic_dim=DimDynamic.DYNAMIC)
        make = shape_env.create_symfloatnode if isinstance(value, float) else shape_env.create_symintnode
        hparams.append(make(sym, hint=value, source=src))
        hparam_values.append(value)
        hparam_tensors.append(False)


def _finish_graph(gm, signature: StepSignature, sa: StepArgs, grad_nodes, dynamic_dims) -> None:
    """Profiler nodes out, dtypes checked, the meta the passes read written; every parameter an
    optimizer updates must have got a gradient."""
    remove_profiler_nodes(gm)
    tp.mark_plan_collectives(gm, tp.plan_groups(sa))
    _check_matmul_dtypes(gm)
    _annotate(gm, signature, sa, grad_nodes, dynamic_dims)
    trainable = _trainable(sa)
    missing = [fqn for fqn in signature.params if fqn not in grad_nodes and fqn in trainable]
    unused_plans = tp.planned_names(sa.module, missing)  # left unchanged, as in eager DTensor
    missing = [fqn for fqn in missing if fqn not in unused_plans]
    if missing:
        raise MissingGradientError(
            f"parameter(s) {', '.join(missing)} got no gradient in the step: they are not used "
            f"by the loss. Set requires_grad=False on parameters that are frozen, or remove them."
        )


def _trainable(sa: StepArgs) -> set[str]:
    """Names of the parameters an optimizer updates from their gradients (a module nothing
    trains, an EMA copy that requires grad as timm's does, needs none)."""
    optimized = {id(p) for opt in sa.optimizers for g in opt.param_groups for p in g["params"]}
    return {n for n, p in sa.module.named_parameters(remove_duplicate=False)
            if p.requires_grad and id(p) in optimized}


def _hparam_conditions(shape_env, numbers: dict) -> tuple[str, ...]:
    """Take out of ``shape_env`` the guards on the optimizers' lifted numbers alone (SGD's
    ``if momentum != 0``; ``numbers``: index -> symbolic number) and return them as Python
    conditions over ``h<index>``, checked on every call: a scheduler's next momentum fits the
    program as long as the branch it took holds. Floats are written as the doubles they are
    (``repr``), so a value equal to the recorded one compares equal."""
    names = {h.node._expr: sympy.Symbol(f"h{i}") for i, h in numbers.items()
             if isinstance(h, (torch.SymFloat, torch.SymInt))}
    mine = [g for g in shape_env.guards if g.expr.free_symbols and g.expr.free_symbols <= names.keys()]
    shape_env.guards[:] = [g for g in shape_env.guards if g not in mine]
    return tuple(dict.fromkeys(_ExactFloats().doprint(g.expr.xreplace(names)) for g in mine))


class _ExactFloats(PythonCodePrinter):
    """Python source of a sympy expression whose floats round-trip exactly (sympy prints a
    double's 15 significant digits: 1/3 would not compare equal to itself)."""

    def _print_Float(self, expr) -> str:
        return repr(float(expr))


def _specialized_hparams(shape_env, hparams, values) -> list[tuple[int, float]]:
    """(index, value) of the lifted hyperparameters that the trace baked in as constants (an op
    that takes a plain float guarded on its value): the graph is valid only for those values."""
    index = {h.node._expr: i for i, h in enumerate(hparams)  # unreplaced
             if isinstance(h, (torch.SymFloat, torch.SymInt))}
    baked = {index[s] for g in shape_env.guards for s in g.expr.free_symbols if s in index}
    return [(i, values[i]) for i in sorted(baked)]


def _fake_inputs(fake_mode: FakeTensorMode, sa: StepArgs,
                 dynamic_dims: dict[int, tuple[int, ...]]) -> list[torch.Tensor]:
    """Fake batch leaves: the batch dim and the ``dynamic_dims`` of each get their own size
    symbol (``DimDynamic.DYNAMIC``: never shared with another dim of equal size, so a sequence
    length equal to the batch size is not taken for the batch); other dims are static."""
    out = []
    for i, b in zip(sa.input_indices, sa.batch_dims):
        t = tp.local_of(sa.leaves[i])
        dynamic = set(dynamic_dims.get(i, ())) | ({b} if b is not None else set())
        ctx = StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if j in dynamic else DimDynamic.STATIC for j in range(t.dim())])
        out.append(fake_mode.from_tensor(t, symbolic_context=ctx, source=ConstantSource(f"input_{i}")))
    return out


def _static_sizes(fake_inputs, shape_env) -> list[tuple[tuple[int, int], ...]]:
    """Per input, (dim, size) of every dim whose size the graph holds as a constant: static dims
    and dynamic ones the trace specialized. The ShapeEnv's guard expression does not check them."""
    out = []
    for fake in fake_inputs:
        sizes = []
        for d, size in enumerate(fake.shape):
            expr = shape_env.simplify(size.node.expr) if isinstance(size, torch.SymInt) else size
            if getattr(expr, "is_number", isinstance(expr, int)):
                sizes.append((d, int(expr)))
        out.append(tuple(sizes))
    return out


def _specialized_dynamic_dims(shape_env, fake_inputs, sa, dynamic_dims) -> list[tuple[int, int, int, str]]:
    """(leaf, dim, size, user line) of dims traced as dynamic that the step specialized to a
    constant: the graph serves only that size."""
    out = []
    for fake, i in zip(fake_inputs, sa.input_indices):
        for d in dynamic_dims.get(i, ()):
            size = fake.shape[d]
            if not isinstance(size, torch.SymInt):
                continue
            expr = shape_env.simplify(size.node.expr)
            if expr.is_number:
                out.append((i, d, int(expr), shape_env.where_replaced(size.node._expr.free_symbols)))
    return out


def _specialized_batch_dims(shape_env, fake_inputs, batch_dims) -> list[tuple[int, int, int]]:
    out = []
    for k, (fake, d) in enumerate(zip(fake_inputs, batch_dims)):
        if d is None:
            continue
        size = fake.shape[d]
        expr = shape_env.simplify(size.node.expr) if isinstance(size, torch.SymInt) else size
        if getattr(expr, "is_number", isinstance(expr, int)):
            out.append((k, d, int(expr)))
    return out


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default}


def _check_matmul_dtypes(gm: torch.fx.GraphModule) -> None:
    """Eager matmuls and convolutions reject operands of different dtypes; fake ones do not, so
    check here rather than fail on the first real run (after the live state was placed)."""
    for node in gm.graph.nodes:
        if node.target not in _MATMULS:
            continue
        dtypes = {a.meta["val"].dtype for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor)}
        if len(dtypes) > 1:
            where = node.meta.get("stack_trace") or "<unknown location>"
            raise TraceError(
                f"{node.target} mixes dtypes {sorted(map(str, dtypes))}: eager PyTorch raises "
                f"on this too. Cast the inputs to the model's dtype. User code:\n{where}"
            )


def _describe_trace_failure(e: Exception) -> str:
    where = _user_frame(e)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, (GuardOnDataDependentSymNode, DataDependentOutputException)):
        # torch's text (a condition on an unnamed symbol, "Eq(u0, 1)") helps only without a line
        detail = f" (torch: {first_line})" if where == "<unknown location>" else ""
        return (
            f"the step branches on or converts a tensor's value at {where}. The whole step is "
            f"recorded once as a graph, so Python control flow that depends on tensor data "
            f"(if/while on a tensor, .item(), .tolist(), bool(tensor)) cannot be compiled. Use "
            f"torch.where / tensor ops instead, or move it out of the step{detail}."
        )
    if isinstance(e, TypeError) and "FakeTensor" in str(e):
        return (
            f"the step uses a tensor's value as a Python number (a size, an index or a count) at "
            f"{where}. The whole step is recorded once as a graph, so a number that depends on "
            f"tensor data cannot shape it (e.g. nn.utils.rnn.pack_padded_sequence: its batch "
            f"sizes come from the lengths). Use padded tensors and masks instead. ({first_line})"
        )
    if isinstance(e, DynamicOutputShapeException):
        return (
            f"an op whose output shape depends on tensor values (e.g. nonzero, masked_select, "
            f"unique) at {where} cannot be compiled: {first_line}"
        )
    return f"recording the step failed at {where}: {type(e).__name__}: {first_line}"


def _step_where(fn: Callable) -> str:
    """``name (File "...", line N)`` of the step's function."""
    from .side_effects import unwrapped

    code = getattr(unwrapped(fn), "__code__", None)
    name = getattr(fn, "__name__", type(fn).__name__)
    return f'{name} (File "{code.co_filename}", line {code.co_firstlineno})' if code else name


def _gradients_read(gm, nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Of a parameter's ``.grad`` after each backward (in order), the ones the step reads: the
    last, and each earlier one that something other than the next backward's accumulation uses
    (an optimizer stepping between two backward calls). Micro-batches accumulated into one
    gradient are read once, at the end."""
    nodes = [n for n in dict.fromkeys(nodes) if n.graph is gm.graph]
    return [n for k, n in enumerate(nodes) if k == len(nodes) - 1
            or any(not carries_gradient_on(u, n) for u in n.users)]


def _annotate(gm, signature: StepSignature, sa: StepArgs, grad_nodes, dynamic_dims):
    """Write ROLE / PARAM_FQN / STATE_KEY / INPUT_* on placeholders (as the signature names
    them) and grads; REGION on all."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params, buffers, states, hparams, rest = split_inputs(placeholders, signature.input_groups)
    live = dict(sa.module.named_parameters(remove_duplicate=False))
    for n, fqn in zip(params, subclasses.per_placeholder(signature.params, signature.param_flats)):
        n.meta.update({meta.ROLE: meta.Role.PARAM, meta.PARAM_FQN: fqn})
        plan = tp.plan_of(live[fqn]) if fqn in live else None
        if plan is not None:
            names = plan.spec.mesh.mesh_dim_names or tuple(f"tp{d}" for d in range(plan.spec.mesh.ndim))
            n.meta[meta.PARAM_PLAN] = tuple(zip(names, map(repr, plan.spec.placements)))
    for n, fqn in zip(buffers, signature.buffers):
        n.meta.update({meta.ROLE: meta.Role.BUFFER, meta.PARAM_FQN: fqn})
    for n, (fqn, k) in zip(states, subclasses.per_placeholder(signature.states,
                                                              signature.state_flats)):
        n.meta.update({meta.ROLE: meta.Role.OPT_STATE, meta.PARAM_FQN: fqn, meta.STATE_KEY: k})
    for n in hparams:
        n.meta[meta.ROLE] = meta.Role.HPARAM
    for n, i, d in zip(rest, sa.input_indices, sa.batch_dims):
        n.meta[meta.ROLE] = meta.Role.INPUT
        n.meta[meta.INPUT_PATH] = f"leaf {i}"
        n.meta[meta.INPUT_BATCH_DIM] = d
        n.meta[meta.INPUT_DYNAMIC_DIMS] = dynamic_dims.get(i, ())
    for n, fqn in zip(rest[len(sa.input_indices):], signature.grads_in):
        # unbatched inputs: this rank's own gradients
        n.meta.update({meta.ROLE: meta.Role.INPUT, meta.INPUT_BATCH_DIM: None,
                       meta.INPUT_DYNAMIC_DIMS: (), meta.INPUT_PATH: f"accumulated grad of {fqn}"})
    for fqn, nodes in grad_nodes.items():
        for node in _gradients_read(gm, nodes):
            node.meta[meta.ROLE] = meta.Role.GRAD
            node.meta[meta.PARAM_FQN] = fqn
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta.setdefault(meta.REGION, meta.Region.FORWARD)
        else:
            n.meta.setdefault(meta.REGION, meta.Region.OPTIMIZER)
