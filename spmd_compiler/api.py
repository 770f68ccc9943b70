"""The user-facing decorator: compile a training step once, run it many times.

    @spmd_compile(DataParallel("replicate"))
    def train_step(model, optim, batch): ...

The seed spelling ``compile(parallel_mode=...)(train_step)`` is the same thing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time
import types
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .build import cache, shared_compile
from .build.pipeline import (STAGES, BuildOptions, build_program, dump_dir_for_compile, info,
                             step_dump_folder)
from .build.program_check import agree_on_program, describe_graph, describe_program
from .errors import NoProcessGroupError, SPMDError
from .features.accumulation import KeptGradients
from .features.subclass_params import shard_context
from .features import context_parallel
from .features.tensor_parallel import DataParallelDims, graph_inputs, has_plan
from .observe import compile_log
from .parallel_mode import SHARDED_STYLES, DataParallel, check_mesh, check_policy
from .runtime.agreement import CARRIER, RankCheck, await_agreement, dim_group_names, mesh_group
from .runtime.call_args import StepArgs, lifted_hparams, split_step_args
from .runtime.dispatch import (
    DONE,
    Call,
    agree_and_run,
    call_mesh,
    module_device,
    refuse_call,
    run,
    step_key,
)
from .runtime.program import CompiledGraph, retain_host_memory
from .runtime.signature import TracedStep
from .runtime.step_modules import modules_of
from .state import optimizer_state, saving
from .state.eager import attach as attach_eager_use, refuse_bound
from .state.placement import communication_failures, place_state
from .trace import guards
from .trace.dynamic_dims import InputShapeHistory
from .verify import Variants, checked_call, verification as checks_asked

log = logging.getLogger("spmd_compiler")

BACKENDS = ("eager", "inductor")


class CompiledStep:
    """A training step compiled for a parallel mode. Call it like the original step.

    The first call (and any call whose model, optimizer, input structure, dtypes or shapes fall
    outside what an earlier compile covered) records and compiles the step; later calls bind the
    live parameters, optimizer state and batch to the compiled graph and run it.
    """

    def __init__(self, fn: Callable, parallel_mode: DataParallel, *, backend: str = "eager",
                 dump_dir: str | None = None,
                 gm_transformation: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None,
                 check_ranks: bool = True, retain_host_memory: bool = True,
                 cache_dir: str | None = None, mesh=None, verification=None, recompile_limit=None):
        self._data_mesh = DataParallelDims(parallel_mode)  # (mesh, step args) -> dims left to dp
        parallel_mode = self._data_mesh.mode  # none given: replicate, or a plan over every dim alone
        _check_options(parallel_mode, backend, mesh)
        functools.update_wrapper(self, fn)
        if not hasattr(self, "__name__"):  # a functools.partial, a callable object
            self.__name__ = getattr(getattr(fn, "func", type(fn)), "__name__", type(fn).__name__)
        self.fn, self.parallel_mode, self.backend = fn, parallel_mode, backend
        self.dump_dir = step_dump_folder(dump_dir or os.environ.get("SPMD_DUMP_DIR"), self.__name__)
        self.gm_transformation = gm_transformation
        self.check_ranks, self.retain_host_memory = check_ranks, retain_host_memory
        self.cache_dir = cache_dir
        self.mesh = mesh  # None: the 1-D mesh over the default process group
        # Every program so far, in compile order: program k exists and communicates alike on
        # every rank (compiled together, or shared: shared_compile.py; the agreement relies on it)
        self._programs: list[CompiledGraph] = []
        self._shapes = InputShapeHistory(parallel_mode.automatic_dynamic, check_ranks)
        self._last_key: tuple | None = None
        self._carrier = None  # the all_reduces every program's check rides in (runtime/agreement.py)
        self.compile_count = 0  # programs made ready: compiled, or loaded from the disk cache
        self.cache_hits = 0  # of those, loaded from the disk cache
        self.last_compile_seconds: float | None = None
        self.last_compiled: CompiledGraph | None = None
        self._kept, self._lifts = KeptGradients(), guards.LiftPolicy(recompile_limit)  # no_sync
        self.verification = verification or checks_asked(None, None, None)

    def no_sync(self):
        """Calls inside this block run forward and backward only, gradients accumulating with the
        model; the next call outside syncs once and updates (DDP's ``no_sync``): accumulation.py."""
        return self._kept.no_sync()

    def _step_key(self, sa: StepArgs) -> tuple:
        return step_key(sa, self._kept.mode_for(sa.module))

    def __call__(self, *args, **kwargs):
        _require_process_group()
        sa = self._arguments(args, kwargs)
        inputs = [sa.leaves[i] for i in sa.input_indices]
        mesh = call_mesh(self.mesh, module_device(sa.module, inputs))
        sa = _sequence_sharded(sa, mesh, self.parallel_mode)
        if self.verification is not None and self.verification.due():
            return _checked(self, sa, mesh)
        return self._run(sa, mesh)

    def _run(self, sa: StepArgs, mesh):
        """The call on the newest program that fits, compiled first if none does."""
        call = Call.of(sa, self._data_mesh(mesh, sa), self._kept.mode_for(sa.module))
        choice = call.newest_fit(self._programs)  # the newest program that fits, as dynamo's
        if self.check_ranks:
            choice, out = agree_and_run(self._programs, self._carrier, call, mesh_group(mesh),
                                        choice, self._kept.grads, self.fn)
            if choice is DONE:
                return out
        entry = self._programs[choice] if choice is not None else _compile(self, sa, mesh, call.key)
        return run(entry, call, self._kept.grads, self.fn)

    def _arguments(self, args: tuple, kwargs: dict) -> StepArgs:
        """The call's arguments split; a rejection is told to the other ranks, then raised."""
        mode = self.parallel_mode
        try:
            return split_step_args(args, kwargs, mode.input_batch_dim, mode.dynamic_dims, self.fn,
                                   mode.input_seq_dim)
        except SPMDError as e:
            if self.check_ranks:  # the other ranks must not wait for this one in a collective
                refuse_call(self._carrier, self.mesh, args, kwargs, len(self._programs), e)
            raise

    def _compile(self, sa: StepArgs, mesh, key: tuple) -> CompiledGraph:
        """Build the program (or load it from the disk cache), check that every rank has the
        same, then place the live state: a failed compile changes nothing."""
        group = mesh_group(mesh)
        why_again = _why_within_limit(self, key, sa)
        check_policy(self.parallel_mode.mp_policy, dist.get_backend(group))
        with communication_failures("the compile-time agreement between ranks"):
            dynamic, why = self._shapes.dims_to_trace(sa, group)
            options = _cache_options(self, self._data_dims(mesh, sa))
            disk, stored = cache.lookup(_disk_cache(self), sa, dynamic, group, self.check_ranks,
                                        fn=self.fn, options=options)
        received = None
        try:
            ready, received = _obtain(self, sa, mesh, group, stored,
                                      lambda: self._build(sa, mesh, key, dynamic, why), dynamic,
                                      options)
            description = describe_program(sa, ready.graph, ready.traced.dynamic_dims)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
            description = e
        if self.check_ranks:
            with communication_failures("the compile-time agreement between ranks"):
                agree_on_program(description, group)
        elif isinstance(description, Exception):
            raise description
        entry = self._install(sa, mesh, ready)
        compile_log.announce(self.__name__, self.parallel_mode.parallel_style, ready.num_nodes,
                             ready.seconds, stored is not None, why_again)
        self.cache_hits += stored is not None
        if stored is None and disk is not None:
            _save(self, disk, received, sa, entry, ready)
        return entry

    def _install(self, sa: StepArgs, mesh, ready: "_Ready") -> CompiledGraph:
        """Place the live state for the program and keep it as the newest."""
        start = time.perf_counter()
        _place_live_state(sa, self._data_mesh(mesh, sa), self.parallel_mode, self.retain_host_memory)
        self._last_key = key = self._step_key(sa)
        entry = CompiledGraph(ready.traced, ready.runnable, ready.guard_code, key, ready.seconds,
                              checks_ranks_inside=self.check_ranks and self.backend == "eager",
                              summary=ready.summary, values=guards.bind(ready.traced, self.fn, sa),
                              carrier=ready.graph.get(CARRIER))
        self._programs.append(entry)
        self._carrier = entry.carrier if all(p.carrier == entry.carrier for p in self._programs) \
            else None
        self._shapes.remember(sa, ready.traced)
        self.compile_count += 1
        ready.seconds["placed state"] = time.perf_counter() - start
        self.last_compile_seconds = sum(ready.seconds.values())
        self.last_compiled = entry
        _write_summaries(entry, self.dump_dir, self.compile_count - 1)
        return entry

    def _data_dims(self, mesh, sa: StepArgs) -> list[tuple[str, int]]:
        """(group name, size) of each data-parallel dim; a multi-dim mesh all data-parallel
        names its groups alike on every rank (agreement.dim_group_names): its programs are
        then the same on every rank, and one rank may build them for all."""
        dims = self._data_mesh.dims(mesh, sa)
        if mesh.ndim > 1 and self._data_mesh(mesh, sa) is mesh:
            return list(zip(dim_group_names(mesh), (size for _, size in dims)))
        return dims

    def _build(self, sa: StepArgs, mesh, key, dynamic, why) -> "_Ready":
        if self._last_key is not None:
            info("spmd_compiler: recompiling %s: %s", self.__name__, _why_again(self, key, sa, _why))
        if why:
            info("spmd_compiler: tracing as dynamic sizes: %s", "; ".join(why))
        program = build_program(self.fn, sa, build_options(
            self, self._data_dims(mesh, sa), dynamic, self._data_mesh(mesh, sa),
            mesh_group(mesh).group_name))
        return _Ready(program.final_traced, program.runnable, program.guard_code, program.seconds,
                      describe_graph(program.gm, program.runnable), len(program.gm.graph.nodes))


def _checked(step: CompiledStep, sa: StepArgs, mesh):
    """The call checked against the step run eagerly with DDP's semantics (verify.py)."""
    compiled = step.compile_count
    return checked_call(step.fn, sa, mesh_group(mesh), _unverifiable(step, sa),
                        lambda: step._run(sa, mesh), step.verification,
                        lambda: step.compile_count != compiled, step.parallel_mode.broadcast_buffers,
                        _variants(step))


def _variants(step: CompiledStep) -> Variants:
    """The step compiled again with other options, for verify's diagnosis."""
    def make(_no_transformation: bool = False, **options) -> CompiledStep:
        return CompiledStep(step.fn, dataclasses.replace(step.parallel_mode, **options),
                            backend=step.backend, check_ranks=step.check_ranks, mesh=step.mesh,
                            gm_transformation=None if _no_transformation else step.gm_transformation,
                            retain_host_memory=step.retain_host_memory)

    applies = types.SimpleNamespace(mode=step.parallel_mode)
    return Variants(make, step.gm_transformation is not None,
                    tuple(s.name for s in STAGES if s.optional and s.applies(applies)))


def _sequence_sharded(sa: StepArgs, mesh, mode: DataParallel) -> StepArgs:
    """The call under context parallelism: the parameters replicated over the cp dim (once),
    the inputs cut to this rank's piece of the sequence (features/context_parallel.py); ``sa``
    itself without context parallelism."""
    if not sa.seq_dims and context_parallel.cp_mesh(mesh) is None:
        return sa
    context_parallel.check(mode, mesh)
    leaves = context_parallel.shard_inputs(sa.leaves, sa.input_indices, sa.seq_dims, mesh)
    context_parallel.place_parameters(sa.module, sa.optimizers, mesh)  # (after the checks)
    return dataclasses.replace(sa, leaves=leaves)


def _unverifiable(step: CompiledStep, sa: StepArgs) -> str | None:
    """Why this call cannot be checked against the eager reference (None: it can)."""
    if has_plan(sa.module) and not sa.seq_dims:  # (context parallelism's own plan is checked)
        return "the step has a tensor-parallel plan"
    if step.parallel_mode.mp_policy is not None:
        return "the step runs under a mixed-precision policy"
    if step._kept.mode_for(sa.module) or step._kept.grads:
        return "calls inside no_sync() and the call that syncs them carry gradients"
    return None


def _compile(step: CompiledStep, sa: StepArgs, mesh, key: tuple) -> CompiledGraph:
    """Compile a new program; Adam's and AdamW's first-step state made first, so that their
    first call compiles the steady program (optimizer_state.py): one compile, not two."""
    sharded = step.parallel_mode.parallel_style in SHARDED_STYLES and not has_plan(sa.module)
    with optimizer_state.made_before_recording(sa.optimizers, bool(step._kept.mode), sharded):
        return step._compile(sa, mesh, key)


def _obtain(step: CompiledStep, sa: StepArgs, mesh, group, stored, build: Callable, dynamic,
            options: dict):
    """(the program: loaded from the disk cache, built here or received from the rank that
    built it, the StoredProgram received or None); see shared_compile.py. ``options``: the
    step's options its programs depend on (``_cache_options``)."""
    if stored is None and step.check_ranks and dist.get_world_size(group) > 1:
        return shared_compile.build_jointly(step, sa, mesh, group, dynamic, options=options,
                                            check=lambda: _refuse_bound(sa), build=build,
                                            fits=lambda ready: _fits(step, ready, sa))
    _refuse_bound(sa)
    return (stored if stored is not None else build()), None


def _refuse_bound(sa: StepArgs) -> None:
    for module in modules_of(sa.module):
        refuse_bound(module)


def _save(step: CompiledStep, disk: tuple[str, str], received, sa: StepArgs, entry, ready) -> None:
    """Store a program built here, or received from the rank that built it, on disk."""
    if received is not None:
        shared_compile.save(disk, received)
    else:
        cache.save(*disk, sa, step.fn, entry, ready, entry_summary(entry))


def _fits(step: CompiledStep, ready: "_Ready", sa: StepArgs) -> bool:
    """Does a program built on another rank serve this rank's inputs?"""
    probe = CompiledGraph(ready.traced, ready.runnable, ready.guard_code, None, {},
                          values=guards.bind(ready.traced, step.fn, sa))
    return probe.guards_hold(graph_inputs(sa), lifted_hparams(sa))


def _why_again(step: CompiledStep, key: tuple, sa: StepArgs,
               static=compile_log.reason) -> str | None:
    """Why ``step`` compiles again for the static ``key``: a Python value its newest program for
    ``key`` read changed (guards.py; numbers among them become inputs), a guard of that program
    the call's inputs fail (compile_log.guard_miss), or what changed in the static key
    (``static(old key, key)``)."""
    return (guards.recompile_reason(step._programs, key, step._lifts)
            or compile_log.guard_miss(step._programs, key, sa)
            or static(step._last_key, key))


def _why_within_limit(step: CompiledStep, key: tuple, sa: StepArgs) -> str | None:
    """``_why_again``, or RecompileLimitError where one more program passes the step's
    recompile limit (guards.within_limit)."""
    return guards.within_limit(step.__name__, step._lifts, len(step._programs),
                               _why_again(step, key, sa))


def _why(old: tuple, new: tuple) -> str:
    changed = [name for (name, a), (_, b) in zip(old, new) if a != b]
    return "changed " + ", ".join(changed) if changed else (
        "input shapes, a baked-in learning rate or an unbatched input's value outside the guards")


def build_options(step: CompiledStep, dims: list[tuple[str, int]], dynamic=None,
                  mesh=None, group: str | None = None) -> BuildOptions:
    """The pipeline's options for a compile of ``step`` on mesh ``dims`` ((group name, size)
    per dim, outermost first); ``mesh``: the DeviceMesh itself, when there is one; ``group``:
    the name of the group over every rank of the step (the per-call agreement's)."""
    check = (await_agreement, RankCheck(group) if group else None) if step.check_ranks else None
    return BuildOptions(step.parallel_mode, step.backend, dims, dynamic, step._kept.mode,
                        step.gm_transformation, check,
                        dump_dir_for_compile(step.dump_dir, step.compile_count), step._lifts,
                        shard=shard_context(step.parallel_mode, mesh, dims))


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise NoProcessGroupError(
            "spmd_compile needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first (e.g. launch with torchrun, "
            "backend 'gloo' on CPU or 'nccl' on CUDA)."
        )


def _check_options(parallel_mode, backend: str, mesh) -> None:
    if not isinstance(parallel_mode, DataParallel):
        raise SPMDError(
            f"parallel_mode must be a DataParallel(...), got {type(parallel_mode).__name__}"
        )
    if backend not in BACKENDS:
        raise SPMDError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if mesh is not None:
        check_mesh(parallel_mode, mesh)
        context_parallel.check(parallel_mode, mesh)


def _place_live_state(sa: StepArgs, mesh, mode: DataParallel, retain: bool) -> None:
    """Parameters, buffers and optimizer state placed on ``mesh`` (the data-parallel dims) for
    the program's style; with a tensor-parallel plan over every dim (``mesh`` None) the plan
    placed everything."""
    if retain:
        retain_host_memory()
    if mesh is None:
        return
    place_state(sa.module, sa.optimizers, mesh, mode.parallel_style in SHARDED_STYLES,
                mode.param_init_fn, torch.device(mesh.device_type))
    for module in modules_of(sa.module):  # model(x), generate(), load_state_dict outside the step
        attach_eager_use(module, mesh)
    if not has_plan(sa.module):  # a plan's state dicts keep DTensors, as eager TP's do
        saving.attach(sa.module, sa.optimizers, mode.parallel_style in SHARDED_STYLES)


def _write_summaries(entry: CompiledGraph, dump_dir: str | None, index: int) -> None:
    """The summary of compile ``index`` in its dump folder, and at the top level (the latest)."""
    folder = dump_dir_for_compile(dump_dir, index)
    if folder:
        from .observe.visualize import write_summary

        write_summary(entry_summary(entry), folder)
        write_summary(entry_summary(entry), dump_dir)
        _write_timeline(entry.run, folder)


def _write_timeline(run, folder: str) -> None:
    """The timeline of one step of the program ``run`` (an eager one) in ``folder``."""
    if isinstance(run, torch.fx.GraphModule):
        from .observe.timeline import write_timeline

        write_timeline(run, folder, f"{os.path.basename(os.path.dirname(folder))}, {os.path.basename(folder)}")


def _disk_cache(step: CompiledStep) -> tuple[str | None, str]:
    """The program cache directory, if the cache applies to the step (eager backend, no
    per-stage dumps, which need a real compile, no gradient accumulation, a trusted directory),
    and the setting that decided it (cache.setting)."""
    return cache.setting(step.cache_dir, step.dump_dir, step.backend, bool(step._kept.mode))


def _cache_options(step: CompiledStep, dims: list[tuple[str, int]]) -> dict:
    """The step's options that its programs depend on (part of the cache key), with the names
    and sizes of the data-parallel dims' groups the programs hold (``dims``)."""
    return dict(mode=step.parallel_mode, backend=step.backend, check_ranks=step.check_ranks,
                gm_transformation=step.gm_transformation, mesh=None if step.mesh is None
                else (tuple(step.mesh.shape), step.mesh.mesh_dim_names), dims=dims)


class _Ready(NamedTuple):
    """A program ready to install: built now or loaded from the disk cache."""

    traced: TracedStep
    runnable: Callable
    guard_code: str | None
    seconds: dict[str, float]
    graph: dict  # program_check.describe_graph of the final graph
    num_nodes: int
    summary: Any = None  # the stored summary of a loaded program


def explain(train_step: Callable, *args, parallel_mode: DataParallel | None = None,
            world_size: int | tuple[int, int] | None = None, dump_dir: str | None = None, **kwargs):
    """Compile ``train_step(*args, **kwargs)`` as its first call would, without running it or
    changing the model and optimizer; return the summary (``visualize.Summary``; ``.to_text()``
    for the tables), the one a real run's first compile prints.

    Under an initialized process group the world size is the group's (the step's mesh, if it
    was given one); otherwise the program is built on a stand-in group of ``world_size`` ranks
    (default 2; for hybrid_shard a (replicate, shard) mesh shape, an int n: ``(n // 2, 2)``) in
    this process, as rank 0 of a gloo run on CPU builds it: the gloo lowering and the per-call
    agreement included. Adam's and AdamW's state is made first as the compiled step makes it,
    then taken away again.
    """
    step = train_step if isinstance(train_step, CompiledStep) else CompiledStep(
        train_step, parallel_mode or DataParallel("replicate"), dump_dir=dump_dir)
    context = step.parallel_mode.input_seq_dim is not None
    if context:  # the sequence's layout replaces the parameters: explain a copy
        args, kwargs = copy.deepcopy((args, kwargs))
    if dist.is_available() and dist.is_initialized():
        sa = _explained_args(step, args, kwargs)
        mesh = call_mesh(step.mesh, module_device(sa.module, [sa.leaves[i] for i in sa.input_indices]))
        return _explain(step, _sequence_sharded(sa, mesh, step.parallel_mode) if context else sa, mesh, stand_in=False)
    hybrid = step.parallel_mode.parallel_style == "hybrid_shard"
    names = ("replicate", "shard") if hybrid else ("dp", "cp") if context else None
    if context:
        shape = world_size if isinstance(world_size, tuple) else (1, world_size or 2)
    elif hybrid:
        shape = world_size if isinstance(world_size, tuple) else (max(1, (world_size or 4) // 2), 2)
    else:
        shape = (world_size or 2,)
    from torch.distributed.device_mesh import init_device_mesh

    from .torch_internals import stand_in_process_group

    with stand_in_process_group(int(torch.tensor(shape).prod())):
        sa = _explained_args(step, args, kwargs)
        device = module_device(sa.module, [sa.leaves[i] for i in sa.input_indices])
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        return _explain(step, _sequence_sharded(sa, mesh, step.parallel_mode) if context else sa, mesh, stand_in=True)


def _explained_args(step: CompiledStep, args: tuple, kwargs: dict) -> StepArgs:
    mode = step.parallel_mode
    return split_step_args(args, kwargs, mode.input_batch_dim, mode.dynamic_dims, step.fn,
                           mode.input_seq_dim)


def _explain(step: CompiledStep, sa: StepArgs, mesh, stand_in: bool):
    """The summary of the program ``step``'s first compile on ``mesh`` builds (compile's own
    options: the data-parallel dims, the agreement's group, Adam's state made before recording);
    the optimizers' state made here is taken away again."""
    from .observe.visualize import summarize, world_notes, write_summary

    fresh = [opt for opt in sa.optimizers if not opt.state]
    sharded = step.parallel_mode.parallel_style in SHARDED_STYLES and not has_plan(sa.module)
    data_mesh = step._data_mesh(mesh, sa)
    group = mesh_group(mesh)
    try:
        with optimizer_state.made_before_recording(sa.optimizers, bool(step._kept.mode), sharded):
            program = build_program(step.fn, sa, build_options(
                step, step._data_dims(mesh, sa), None, data_mesh, group.group_name))
    finally:
        for opt in fresh:
            opt.state.clear()
    runnable = program.runnable
    summary = summarize(program.gm, compile_times=program.seconds,
                        lowered=runnable if isinstance(runnable, torch.fx.GraphModule) else None)
    created = sorted({k for _, k in program.final_traced.new_state_keys})
    if created:  # a real run's second compile holds it
        summary.notes["optimizer state"] = (
            f"0 B in this first program: the optimizer creates its state ({', '.join(created)}) "
            f"on its first step and the step compiles again with it (Adam's and AdamW's are made "
            f"before recording: one compile)")
    if stand_in:
        summary.at_other_sizes = world_notes(summary, step.parallel_mode.parallel_style)
    if step.dump_dir:
        write_summary(summary, step.dump_dir)
        _write_timeline(runnable, dump_dir_for_compile(step.dump_dir, step.compile_count))
    return summary


def entry_summary(entry: CompiledGraph):
    """The visualize.Summary of a compiled graph (of a program loaded from the disk cache: the
    one made when it was compiled)."""
    from .observe.visualize import summarize

    if entry.traced.gm is None:
        return entry.summary
    lowered = entry.run if isinstance(entry.run, torch.fx.GraphModule) else None
    return summarize(entry.traced.gm, compile_times=entry.stage_seconds, lowered=lowered)


def summary_text(step: CompiledStep) -> str | None:
    """The summary table of the step's last compiled graph (None before its first call)."""
    if step.last_compiled is None:
        return None
    return entry_summary(step.last_compiled).to_text()


def spmd_compile(parallel_mode: DataParallel | None = None, *, backend: str = "eager",
                 dump_dir: str | None = None, gm_transformation=None, check_ranks: bool = True,
                 retain_host_memory: bool = True, cache_dir: str | None = None, mesh=None,
                 verify: int | None = None, verify_every: int | None = None,
                 verify_tolerance: tuple[float, float] | None = None,
                 recompile_limit: int | None = None):
    """Decorator: compile a single-device training step for data parallelism.

    Args:
        parallel_mode: ``DataParallel("replicate")`` (default), ``DataParallel("fully_shard")``
            or ``DataParallel("hybrid_shard")``.
        backend: how the compiled graph runs: ``"eager"`` runs the FX graph's Python;
            ``"inductor"`` compiles the whole step graph with Inductor on its first run (tens of
            seconds on CPU, per compiled graph).
        dump_dir: write every stage's graph (and a summary) here; also ``SPMD_DUMP_DIR``.
        gm_transformation: an extra ``GraphModule -> GraphModule`` applied after the built-in passes.
        check_ranks: verify that every rank compiles the same program (at compile time) and that
            all ranks agree on when to recompile (per call, a header in the eager graph's first
            gradient bucket, else one small all_reduce awaited just before its first collective
            or state update; see spmd_compiler/runtime/agreement.py). Turn off only
            when inputs are known to agree across ranks; a disagreement then hangs or diverges.
        retain_host_memory: keep the host memory a step frees for the next one instead of
            returning it to the OS (glibc malloc settings, process-wide, set at the first
            compile; see ``runtime.program.retain_host_memory``). Saves re-faulting every step's
            activations and buckets; resident memory stays at the step's peak.
        cache_dir: keep compiled programs in this directory (also ``SPMD_CACHE_DIR``), so a
            restarted job or a second run loads them instead of compiling (eager backend;
            ignored with ``dump_dir``). Keyed by everything the program depends on and checked
            against the source files it was recorded from; see spmd_compiler/build/cache.py and
            docs/user_guide.md.
        mesh: the ``DeviceMesh`` to train over. replicate and fully_shard take a 1-D mesh (a
            sub-group, or one dim of a larger mesh: ``mesh["dp"]``); hybrid_shard a 2-D mesh,
            ``(replicate, shard)`` (``mesh_dim_names`` required): parameters are sharded over the
            inner dim and replicated over the outer. Only the mesh's ranks call the step.
            Default: a 1-D mesh over the whole default process group. With a tensor-parallel
            plan (``parallelize_module`` over ``mesh["tp"]``) data parallelism runs over the
            dims the plan leaves; without ``parallel_mode`` a plan over the whole mesh runs
            alone (docs/tensor_parallel.md).
        verify: check the first ``verify`` calls against the step run eagerly with DDP's
            semantics on copies of its state (also ``SPMD_VERIFY``); a difference raises
            ``DivergenceError`` on every rank (spmd_compiler/verify.py, docs/user_guide.md).
        verify_every: after those, check every ``verify_every``-th call (``SPMD_VERIFY_EVERY``).
        verify_tolerance: ``(rtol, atol)`` of the comparison, default ``(1e-4, 1e-5)``.
        recompile_limit: the most programs the step may compile (also ``SPMD_RECOMPILE_LIMIT``;
            default 8, as torch.compile's): one more raises ``RecompileLimitError`` on every
            rank, naming why each program was compiled.
    """
    if mesh is not None:
        check_mesh(parallel_mode or DataParallel("replicate"), mesh)
    checks = checks_asked(verify, verify_every, verify_tolerance)

    def decorate(fn: Callable) -> CompiledStep:
        return CompiledStep(fn, parallel_mode, backend=backend, dump_dir=dump_dir,
                            gm_transformation=gm_transformation, check_ranks=check_ranks,
                            retain_host_memory=retain_host_memory, cache_dir=cache_dir, mesh=mesh,
                            verification=checks, recompile_limit=recompile_limit)

    return decorate


def compile(module_override=None, gm_transformation=None, parallel_mode: DataParallel | None = None):
    """The ``torch.distributed._spmd.api.compile`` spelling of :func:`spmd_compile`."""
    if module_override is not None:
        raise SPMDError("compile(module_override=...) is not supported; pass module=None")
    return spmd_compile(parallel_mode, gm_transformation=gm_transformation)
