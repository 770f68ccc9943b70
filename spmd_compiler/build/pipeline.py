"""The compiler's stages, in order, and the one runner that runs them.

``STAGES`` is the whole pipeline: each entry names a stage, says when it applies (style,
backend, options) and whether it is an optional optimization. ``build_program`` runs the ones
that apply, in order, on one graph:

- each stage's time goes into ``Program.seconds`` under its name;
- with a dump directory, each stage's graph is written (visualize.dump_stage), numbered in order;
- with ``SPMD_CHECK_STAGES=1`` (set by the test suite), ``graph.lint()`` and the meta contract
  (``passes/meta.check``) run after each stage;
- ``SPMD_DISABLE_PASSES=bucketing,overlap`` skips the named optional stages (for bisecting a
  wrong result or a crash to one pass);
- an exception raised in a stage carries a note naming that stage and the ones run before it.

Nothing here touches live state (parameters, optimizer state): that is the caller's, after every
rank has agreed on the program.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from spmd_compiler.passes import batch_dim, meta
from spmd_compiler.passes.bucketing import bucket_collectives
from spmd_compiler.passes.cleanup import eliminate_dead_code
from spmd_compiler.passes.dedup_collectives import deduplicate_collectives
from spmd_compiler.passes.expand import MeshDim, expand_data_parallel
from spmd_compiler.passes.fully_shard import ShardingError
from spmd_compiler.passes.gloo_collectives import all_reduce_scatters, broadcast_gathers
from spmd_compiler.passes.grad_outputs import output_gradients
from spmd_compiler.passes.inplace import (
    gather_into_preallocated,
    owned_temporary,
    produce_into_buckets,
    reduce_in_place,
)
from spmd_compiler.passes.memory_plan import out_variant, plan_static_memory
from spmd_compiler.passes.overlap import sink_waits
from spmd_compiler.passes.identity_views import skip_identity_views
from spmd_compiler.passes.rank_check import finish_rank_check, place_rank_check
from spmd_compiler.passes.recompute import recompute_activations
from spmd_compiler.passes.schedule import schedule_for_memory
from spmd_compiler.passes.split_optimizer import split_optimizer_by_bucket

from ..features.accumulation import ACCUMULATE
from ..errors import BatchDimError, UnsupportedError
from ..parallel_mode import SHARDED_STYLES, DataParallel, reduce_dtype_of
from ..features.subclass_params import ShardContext
from ..torch_internals import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from ..runtime.call_args import StepArgs
from ..runtime.signature import StepSignature, TracedStep
from ..trace.record import trace_step
from ..trace import guards

log = logging.getLogger("spmd_compiler")

CHECK_ENV = "SPMD_CHECK_STAGES"
DISABLE_ENV = "SPMD_DISABLE_PASSES"


def info(msg: str, *args) -> None:
    """Log at INFO on rank 0 (every rank when SPMD_LOG_ALL_RANKS is set)."""
    if os.environ.get("SPMD_LOG_ALL_RANKS") or not dist.is_initialized() or dist.get_rank() == 0:
        log.info(msg, *args)


@dataclass
class BuildOptions:
    """What decides which stages run and how."""

    mode: DataParallel
    backend: str = "eager"
    dims: list[tuple[str, int]] = field(default_factory=list)  # (group name, size), outermost first
    dynamic_dims: dict[int, tuple[int, ...]] | None = None  # None: the ones the user declared
    accumulation: str | None = None  # spmd_compiler/features/accumulation.py
    gm_transformation: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None
    # the per-call agreement the graph awaits: (check, carrier or None), passes/rank_check.py
    rank_check: tuple | None = None
    dump_dir: str | None = None
    lift: Any = None  # guards.LiftPolicy: the numbers the step reads to record as inputs
    # this rank's place on the shard dim (sharded styles), for FSDP2's all-gather extensions
    shard: ShardContext | None = None


@dataclass
class _Build:
    """What the stages of one build share besides the graph."""

    fn: Callable
    sa: StepArgs
    options: BuildOptions
    traced: TracedStep | None = None
    signature: StepSignature | None = None
    guard_code: str | None = None
    runnable: Callable | None = None


@dataclass(frozen=True)
class Stage:
    """One entry of the pipeline: ``run(gm, build) -> gm`` (the trace stage gets ``None``)."""

    name: str
    run: Callable[[Any, _Build], torch.fx.GraphModule]
    does: str  # one line, for docs/architecture.md
    applies: Callable[[BuildOptions], bool] = lambda options: True
    when: str = "always"  # ``applies`` in words, for docs/architecture.md
    optional: bool = False  # an optimization SPMD_DISABLE_PASSES may skip


@dataclass
class Program:
    """A built step: what the runtime runs and what the summary and the dumps describe."""

    traced: TracedStep  # as recorded; its graph is the one the first stages transformed
    gm: torch.fx.GraphModule  # the final graph (functional collectives, before lowering)
    signature: StepSignature
    guard_code: str | None  # the ShapeEnv's guards, a Python expression over the inputs
    runnable: Callable  # the lowered graph: flat inputs in signature order -> flat outputs
    seconds: dict[str, float]  # per stage that ran
    notes: dict[str, str]  # per pass, a choice it made (gm.meta[NOTES])

    @property
    def final_traced(self) -> TracedStep:
        """The traced step with the final graph and signature (what the runtime binds)."""
        return dataclasses.replace(self.traced, gm=self.gm, signature=self.signature)


# ---------------------------------------------------------------------------------------------
# The stages


def _trace(_, b: _Build) -> torch.fx.GraphModule:
    o = b.options
    b.traced = guards.record_lifting(o.lift, lambda lift: trace_step(
        b.fn, (), {}, step_args=b.sa, fuse_optimizer=o.mode.fuse_optimizer,
        dynamic_dims=b.sa.dynamic_dims if o.dynamic_dims is None else o.dynamic_dims,
        mp_policy=o.mode.mp_policy, accumulation=o.accumulation, lift=lift, shard=o.shard))
    b.signature = b.traced.signature
    _log_specializations(b.traced, b.sa)
    return b.traced.gm


def _log_specializations(traced: TracedStep, sa: StepArgs) -> None:
    """Say where the step made a dim traced as dynamic static again."""
    for i, d, size, where in traced.specialized_dims:
        info("spmd_compiler: %s dim %d was traced as a dynamic size, but the step specialized "
             "it to %d at %s; this graph serves only that size", sa.leaf_name(i), d, size, where)
    for i, d, where in traced.entangled:
        info("spmd_compiler: the step ties %s dim %d to the batch size at %s; traced as a "
             "static size (a dim holding the batch size's symbol would count as batch-sharded)",
             sa.leaf_name(i), d, where)


def _exact(b: _Build) -> bool:
    """A batch size the trace specialized to a constant leaves no batch symbol to propagate;
    that graph is guarded to the size, and its collectives come from the gradient roles."""
    return bool(b.traced.specialized)


def _analyze(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    if _exact(b):
        info("spmd_compiler: batch size specialized to %s: placements not analyzed",
             sorted({s for _, _, s in b.traced.specialized}))
        return gm
    return analyze(gm)


def analyze(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Placement propagation (passes/batch_dim.py), its failures raised as SPMDErrors."""
    try:
        return batch_dim.annotate_placements(gm)
    except batch_dim.PlacementError as e:
        raise BatchDimError(str(e)) from e


def _recompute(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    return recompute_activations(gm, budget=b.options.mode.activation_memory_budget)


def _expand(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    mode = b.options.mode
    # the parameters' layout on each mesh dim decides that dim's collectives
    layout = [MeshDim(name, size, placement)
              for (name, size), placement in zip(b.options.dims, mode.placements(len(b.options.dims)))]
    try:
        gm = expand_data_parallel(
            gm, layout, reshard_after_forward=mode.reshard_after_forward,
            broadcast_buffers=mode.broadcast_buffers, reduce_dtype=reduce_dtype_of(mode.mp_policy),
            divide_after_sum=mode.divide_gradients == "after",
            divide_factor=mode.gradient_divide_factor,
            sync_grads=b.options.accumulation != ACCUMULATE, reduce_unread=mode.keep_grads,
            accumulate_cap_bytes=int((mode.reduce_cap_mb or 0) * 2**20))
    except ShardingError as e:
        raise UnsupportedError(str(e)) from e
    b.signature = dataclasses.replace(b.signature, sharded_states=_sharded(b.options))
    if not _exact(b):
        gm = analyze(gm)  # derives only what the expansion changed (passes/batch_dim.py)
    gm.meta.pop(meta.PLACEMENT_INPUTS, None)  # no later stage reads it: the graph keeps no copy
    return gm


def _grad_outputs(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    gm = output_gradients(gm)
    b.signature = dataclasses.replace(b.signature, kept_grads=tuple(gm.meta[meta.KEPT_GRADS]))
    return gm


def _bucketing(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    mode = b.options.mode
    return bucket_collectives(gm, bucket_cap_mb=mode.bucket_cap_mb,
                              first_bucket_cap_mb=mode.first_bucket_cap_mb,
                              own_collective_mb=mode.own_collective_mb,
                              gather_cap_mb=mode.prefetch_cap_mb, scatter_cap_mb=mode.reduce_cap_mb)


def _schedule(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    """Under Inductor the fused optimizer kernels run outside the compiled regions, so each one
    splits the graph: fully_shard's updates then stay after the backward. A tensor-parallel
    plan's waits (which the schedule leaves where they were recorded) are then sunk to their
    first use, as replicate's overlap stage does."""
    mode = b.options.mode
    gm = schedule_for_memory(gm, prefetch_cap_mb=mode.prefetch_cap_mb,
                             reduce_cap_mb=mode.reduce_cap_mb, overlap=mode.overlap,
                             updates_in_backward=b.options.backend == "eager")
    # the schedule orders data parallelism's collectives; a tensor-parallel plan's wait where used
    return sink_waits(gm, only=lambda w: meta.MODEL_PARALLEL in w.meta) if mode.overlap else gm


def _lower(gm: torch.fx.GraphModule, b: _Build) -> torch.fx.GraphModule:
    b.guard_code = b.traced.shape_env.produce_guards_expression(b.traced.fake_inputs)
    b.runnable = lower(gm, b.options.backend, rank_check=b.options.rank_check)
    if isinstance(b.runnable, torch.fx.GraphModule):
        workspaces = tuple(tuple(w) for w in b.runnable.meta.get(meta.WORKSPACES, ()))
        b.signature = dataclasses.replace(b.signature, workspaces=workspaces)
    return gm


def _sharded(o: BuildOptions) -> bool:
    return o.mode.parallel_style in SHARDED_STYLES


STAGES: list[Stage] = [
    Stage("traced", _trace, "zero_grad + forward + backward + optimizer as one aten graph "
          "(spmd_compiler/trace/record.py)"),
    Stage("analyzed", _analyze, "a placement on every tensor (passes/batch_dim.py)"),
    Stage("recompute", _recompute, "activations recomputed in the backward (passes/recompute.py)",
          when="activation_memory_budget is set",
          applies=lambda o: o.mode.activation_memory_budget is not None),
    Stage("expanded", _expand, "functional collectives per mesh dim, then the placements of what "
          "they changed (passes/expand.py, replicate.py, fully_shard.py)"),
    Stage("grad_outputs", _grad_outputs, "averaged gradients returned for p.grad "
          "(passes/grad_outputs.py)", when="keep_grads", applies=lambda o: o.mode.keep_grads),
    Stage("dead_code", lambda gm, b: eliminate_dead_code(gm), "dead code removed "
          "(passes/cleanup.py)", optional=True),
    Stage("dedup", lambda gm, b: deduplicate_collectives(gm), "a value reduced twice on one "
          "group reduced once (passes/dedup_collectives.py)", optional=True),
    Stage("bucketing", _bucketing, "gradient collectives bucketed (passes/bucketing.py)",
          when="bucket_cap_mb", applies=lambda o: bool(o.mode.bucket_cap_mb), optional=True),
    Stage("split_optimizer", lambda gm, b: split_optimizer_by_bucket(gm), "the optimizer split "
          "by bucket (passes/split_optimizer.py)", when="split_optimizer",
          applies=lambda o: o.mode.split_optimizer, optional=True),
    Stage("schedule", _schedule, "one memory-aware order of the whole step, overlap included "
          "(passes/schedule.py)", when="fully_shard, hybrid_shard", applies=_sharded,
          optional=True),
    Stage("overlap", lambda gm, b: sink_waits(gm), "waits sunk to their first use "
          "(passes/overlap.py)", when="replicate with overlap",
          applies=lambda o: not _sharded(o) and o.mode.overlap, optional=True),
    Stage("gm_transformation", lambda gm, b: b.options.gm_transformation(gm),
          "the user's own GraphModule -> GraphModule", when="gm_transformation is given",
          applies=lambda o: o.gm_transformation is not None),
    Stage("lowered", _lower, "the runnable: the FX graph's Python (in-place buckets, gloo "
          "collectives, a planned workspace; passes/inplace.py, gloo_collectives.py, "
          "memory_plan.py, identity_views.py, rank_check.py) or Inductor (backend)"),
]


# ---------------------------------------------------------------------------------------------
# The runner


def build_program(fn: Callable, sa: StepArgs, options: BuildOptions) -> Program:
    """Run every stage of ``STAGES`` that applies to ``options`` on the step ``fn(*sa)``.

    Graph modules made meanwhile generate and compile their Python code only when it is read
    or run (torch.fx's lazy graph modules): each pass's ``recompile()`` only marks it.
    """
    build = _Build(fn, sa, options)
    with _use_lazy_graph_module(True):
        gm, seconds = run_stages(STAGES, build)
    return Program(traced=build.traced, gm=gm, signature=build.signature,
                   guard_code=build.guard_code, runnable=build.runnable, seconds=seconds,
                   notes=dict(gm.meta.get(meta.NOTES, {})))


DUMPS = "dumps written"  # seconds of a compile spent writing (and rendering) the stage dumps


def run_stages(stages: list[Stage], build: _Build) -> tuple[torch.fx.GraphModule, dict[str, float]]:
    """Run the stages that apply, in order (see the module docstring); the last graph and the
    seconds per stage."""
    disabled = disabled_passes()
    check = bool(os.environ.get(CHECK_ENV))
    gm, seconds, done = None, {}, []
    for stage in stages:
        if not stage.applies(build.options):
            continue
        if stage.optional and stage.name in disabled:
            log.warning("spmd_compiler: stage %s turned off by %s", stage.name, DISABLE_ENV)
            continue
        start = time.perf_counter()
        try:
            gm = stage.run(gm, build)
            if check:
                gm.graph.lint()
                meta.check(gm, stage.name)
        except Exception as e:
            e.add_note(f"spmd_compiler: raised in stage {stage.name!r}, after "
                       f"{', '.join(done) or 'no other stage'}")
            raise
        seconds[stage.name] = time.perf_counter() - start
        if build.options.dump_dir:
            from ..observe import visualize

            start = time.perf_counter()
            visualize.dump_stage(gm, stage.name, build.options.dump_dir, index=len(done))
            seconds[DUMPS] = seconds.get(DUMPS, 0.0) + time.perf_counter() - start
        done.append(stage.name)
    return gm, seconds


def disabled_passes() -> set[str]:
    """The optional stages named in SPMD_DISABLE_PASSES (comma-separated); a name that is not
    an optional stage is logged and ignored."""
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    optional = {s.name for s in STAGES if s.optional}
    for name in sorted(names - optional):
        log.warning("spmd_compiler: %s names %r, which is not an optional stage (those are: %s)",
                    DISABLE_ENV, name, ", ".join(sorted(optional)))
    return names & optional


_CLAIMED: set[str] = set()  # the step folders of this process's compiled steps


def step_dump_folder(dump_dir: str | None, name: str) -> str | None:
    """``<dump_dir>/<name>``: one compiled step's dumps, apart from every other step's that
    shares ``dump_dir`` (a second step of the same name gets ``<name>_2``, ...)."""
    if not dump_dir:
        return None
    base = os.path.join(dump_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "step")
    folder, n = base, 1
    while folder in _CLAIMED:
        n += 1
        folder = f"{base}_{n}"
    _CLAIMED.add(folder)
    return folder


def dump_dir_for_compile(dump_dir: str | None, index: int) -> str | None:
    """``<dump_dir>/compile_<n>`` (``dump_dir``: the step's folder) for the n-th compile, on rank 0 only (every rank with
    SPMD_LOG_ALL_RANKS, in ``rank_<r>`` subfolders)."""
    if not dump_dir:
        return None
    if not dist.is_initialized():
        return os.path.join(dump_dir, f"compile_{index}")
    if os.environ.get("SPMD_LOG_ALL_RANKS"):
        return os.path.join(dump_dir, f"rank_{dist.get_rank()}", f"compile_{index}")
    return os.path.join(dump_dir, f"compile_{index}") if dist.get_rank() == 0 else None


# ---------------------------------------------------------------------------------------------
# Lowering


def lower(gm: torch.fx.GraphModule, backend: str, rank_check: tuple | None = None) -> Callable:
    """The runnable for ``backend``; ``gm`` itself stays functional (it is what the dumps and
    the cross-rank check describe).

    ``"eager"`` runs the generated Python of a copy of ``gm`` whose bucket divisions and
    all_reduces work in place (passes/inplace.py) and that checks the per-call agreement
    (``rank_check``: the check and the carrier, passes/rank_check.py) in its first collective,
    or else just before its first collective or state update, so the agreement
    costs no collective of its own, or its message travels while the forward computes. ``"inductor"`` hands the whole step graph to
    ``torch.compile`` (Inductor functionalizes it, keeps the functional collectives, reuses
    buffers itself and compiles on the first run), all but the fused optimizer kernels, which
    run in place between the compiled regions.
    """
    if backend == "inductor":
        compiled = fused_kernels_outside_compile(gm)
        _LazyGraphModule.force_recompile(compiled)  # dynamo traces its generated forward
        # fallback_random: random ops (dropout) draw from torch's generator in graph order, the
        # numbers eager PyTorch (and DDP) draws, instead of Inductor's own random stream
        return torch.compile(compiled, backend="inductor", dynamic=True,
                             options={"fallback_random": True})
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    runnable = _make_graph_module(gm, graph)
    if rank_check:  # on the functional copy: its header rides in a collective before lowering
        runnable = place_rank_check(runnable, *rank_check)
    for lowering in (reduce_in_place, functools.partial(produce_into_buckets, out_variant=out_variant),
                     gather_into_preallocated, broadcast_gathers,
                     functools.partial(all_reduce_scatters, owned=owned_temporary),
                     plan_static_memory):
        runnable = lowering(runnable)
    runnable = skip_identity_views(runnable)
    return finish_rank_check(runnable) if rank_check else runnable


def fused_kernels_outside_compile(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose fused optimizer kernels (``_fused_adam_`` ...) are called through
    ``torch.compiler.disable``: torch.compile runs them as they are, in place, between the
    compiled regions (Inductor has no kernel of its own for them and would copy every updated
    tensor back)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.name.startswith("aten::_fused_"):
            node.target = _eager_kernel(node.target)
    return _make_graph_module(gm, graph)


@functools.cache
def _eager_kernel(op):
    @torch.compiler.disable(reason="fused optimizer kernel: runs in place, uncompiled")
    def run(*args, **kwargs):
        return op(*args, **kwargs)

    run.__name__ = f"eager_{op.__name__.replace('.', '_')}"
    return run
