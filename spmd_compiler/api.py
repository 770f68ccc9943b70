"""The user-facing decorator: compile a training step once, run it many times.

    @spmd_compile(DataParallel("replicate"))
    def train_step(model, optim, batch): ...

The seed spelling ``compile(parallel_mode=...)(train_step)`` is the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module

from spmd_compiler.passes import batch_dim, meta
from spmd_compiler.passes.bucketing import bucket_collectives
from spmd_compiler.passes.cleanup import eliminate_dead_code
from spmd_compiler.passes.overlap import sink_waits
from spmd_compiler.passes.gloo_collectives import all_reduce_scatters, broadcast_gathers
from spmd_compiler.passes.inplace import gather_into_preallocated, owned_temporary, reduce_in_place
from spmd_compiler.passes.memory_plan import plan_static_memory
from spmd_compiler.passes.rank_check import place_rank_check
from spmd_compiler.passes.recompute import recompute_activations
from spmd_compiler.passes.schedule import schedule_for_memory
from spmd_compiler.passes.split_optimizer import split_optimizer_by_bucket
from spmd_compiler.passes.expand import MeshDim, expand_data_parallel
from spmd_compiler.passes.fully_shard import ShardingError
from spmd_compiler.passes.grad_outputs import output_gradients

from . import cache
from .cache import cache_dir_from, program_key
from .errors import BatchDimError, NoProcessGroupError, SPMDError, UnsupportedError
from .parallel_mode import SHARDED_STYLES, DataParallel, check_mesh, mesh_dims
from .tensor_parallel import data_parallel_mesh, graph_inputs
from .mixed_precision import check_policy, reduce_dtype_of
from .accumulation import ACCUMULATE, APPLY
from .eager import attach as attach_eager_use, refuse_bound
from .consistency import (
    CACHED,
    COMPILE,
    COMPILE_FAILED,
    Redispatch,
    agree_on_call,
    agree_on_program,
    agreement_in_flight,
    await_agreement,
    describe_graph,
    describe_program,
    exchange_objects,
    start_agreement,
)
from .runtime import (
    CompiledGraph,
    communication_failures,
    default_mesh,
    lifted_hparams,
    mesh_group,
    module_device,
    place_state,
    retain_host_memory,
)
from .tracing import LIFTED_HPARAMS, StepArgs, TracedStep, split_step_args, trace_step

log = logging.getLogger("spmd_compiler")

BACKENDS = ("eager", "inductor")


def _info(msg: str, *args) -> None:
    """Log at INFO on rank 0 (every rank when SPMD_LOG_ALL_RANKS is set)."""
    if os.environ.get("SPMD_LOG_ALL_RANKS") or not dist.is_initialized() or dist.get_rank() == 0:
        log.info(msg, *args)


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
                 cache_dir: str | None = None, mesh=None):
        # without DataParallel, a tensor-parallel plan over the whole mesh runs alone
        self.data_parallel_given = parallel_mode is not None
        parallel_mode = parallel_mode or DataParallel("replicate")
        if not isinstance(parallel_mode, DataParallel):
            raise SPMDError(
                f"parallel_mode must be a DataParallel(...), got {type(parallel_mode).__name__}"
            )
        if backend not in BACKENDS:
            raise SPMDError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.parallel_mode = parallel_mode
        self.backend = backend
        self.dump_dir = dump_dir or os.environ.get("SPMD_DUMP_DIR") or None
        self.gm_transformation = gm_transformation
        self.check_ranks = check_ranks
        self.retain_host_memory = retain_host_memory
        self.cache_dir = cache_dir
        if mesh is not None:
            check_mesh(parallel_mode, mesh)
        self.mesh = mesh  # None: the 1-D mesh over the default process group
        # Every program compiled so far, in compile order. Every rank compiles together, so
        # program k exists on every rank and communicates the same on all of them (the per-call
        # agreement relies on it).
        self._programs: list[CompiledGraph] = []
        # per (input structure, leaf): the shape at the last compile, and the dims traced dynamic
        self._seen_shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        self._dynamic: dict[tuple[str, int], set[int]] = {}
        self._last_key: tuple | None = None
        self.compile_count = 0  # programs made ready: compiled, or loaded from the disk cache
        self.cache_hits = 0  # of those, loaded from the disk cache
        self.last_compile_seconds: float | None = None
        self.last_compiled: CompiledGraph | None = None
        self._no_sync = False  # inside no_sync(): calls only accumulate gradients
        self._accumulated: dict[str, torch.Tensor] = {}  # parameter -> this rank's gradient
        self._data_meshes: dict[tuple[int, int], Any] = {}  # (mesh, module) -> data-parallel dims

    # -- gradient accumulation across calls -----------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Calls of the step inside this block run its forward and backward only: gradients
        accumulate on each rank (kept by the step, not in ``p.grad``), with no communication and
        no optimizer update; the step's ``zero_grad`` does nothing. The next call outside the
        block adds its own gradients to them, syncs once and updates (DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``). See spmd_compiler/accumulation.py."""
        outer, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = outer

    def _accumulation(self) -> str | None:
        if self._no_sync:
            return ACCUMULATE
        return APPLY if self._accumulated else None

    def _step_key(self, sa: StepArgs) -> tuple:
        return step_key(sa) + (("gradient accumulation", self._accumulation()),)

    # -- calling ------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not (dist.is_available() and dist.is_initialized()):
            raise NoProcessGroupError(
                "spmd_compile needs an initialized default process group: call "
                "torch.distributed.init_process_group(...) first (e.g. launch with torchrun, "
                "backend 'gloo' on CPU or 'nccl' on CUDA)."
            )
        mode = self.parallel_mode
        try:
            sa = split_step_args(args, kwargs, mode.input_batch_dim, mode.dynamic_dims)
        except SPMDError as e:
            if self.check_ranks:  # the other ranks must not wait for this one in a collective
                group = mesh_group(self._mesh(_device_of(args, kwargs)))
                agree_on_call(COMPILE_FAILED, 0, group, [], len(self._programs), e)
            raise
        mesh = self._mesh(module_device(sa.module, [sa.leaves[i] for i in sa.input_indices]))
        key = self._step_key(sa)
        inputs = graph_inputs([sa.leaves[i] for i in sa.input_indices])
        dp_mesh = self._data_mesh(mesh, sa)
        hparams = lifted_hparams(sa)
        fits = [k for k, e in enumerate(self._programs)
                if e.static_key == key and e.guards_hold(inputs, hparams)]
        choice = fits[-1] if fits else None  # the newest program that fits, as dynamo's cache
        if self.check_ranks:
            batch = next((sa.leaves[i].shape[d] for i, d in zip(sa.input_indices, sa.batch_dims)
                          if d is not None), 0)
            group = mesh_group(mesh)
            if choice is not None and self._programs[choice].checks_ranks_inside:
                # Run it while the agreement travels; the graph awaits it before its first
                # collective or state update, and stops there if the ranks chose otherwise.
                with communication_failures("the per-call agreement between ranks"):
                    pending = start_agreement(CACHED, batch, group, fits, len(self._programs),
                                              running=choice)
                try:
                    with torch.no_grad(), agreement_in_flight(pending):
                        return self._programs[choice](sa, dp_mesh, hparams, self._accumulated)
                except Redispatch as r:
                    choice = r.choice
            else:
                with communication_failures("the per-call agreement between ranks"):
                    choice = agree_on_call(CACHED if fits else COMPILE, batch, group, fits,
                                           len(self._programs))
        entry = self._programs[choice] if choice is not None else self._compile(sa, mesh, key)
        with torch.no_grad():
            return entry(sa, dp_mesh, hparams, self._accumulated)

    def _data_mesh(self, mesh, sa: StepArgs):
        """The dims of ``mesh`` left to data parallelism once a tensor-parallel plan's are taken
        out (None: the plan uses them all); spmd_compiler/tensor_parallel.py. Raises before any
        state changes when the plan does not fit the mesh."""
        key = (id(mesh), id(sa.module))
        if key not in self._data_meshes:
            dp_mesh = data_parallel_mesh(mesh, sa.module, [sa.leaves[i] for i in sa.input_indices],
                                         self.data_parallel_given)
            if dp_mesh is not None and dp_mesh is not mesh:
                check_mesh(self.parallel_mode, dp_mesh)
            self._data_meshes[key] = dp_mesh
        return self._data_meshes[key]

    def _mesh(self, device: torch.device):
        """The step's mesh: the one given, else the 1-D mesh over the default group."""
        if self.mesh is None:
            return default_mesh(device)
        if self.mesh.get_coordinate() is None:
            raise SPMDError(
                f"rank {dist.get_rank()} is not in the mesh the step was compiled for "
                f"({self.mesh}); call the compiled step only on the mesh's ranks")
        return self.mesh

    # -- compiling ----------------------------------------------------------------------------

    def _compile(self, sa: StepArgs, mesh, key: tuple) -> CompiledGraph:
        """Build the graph (or load it from the disk cache), check that every rank has the same,
        then place the live state."""
        group = mesh_group(mesh)
        check_policy(self.parallel_mode.mp_policy, dist.get_backend(group))
        with communication_failures("the compile-time agreement between ranks"):
            dynamic, why = self._dims_to_trace_dynamic(sa, group)
            disk_key, stored = self._load_program(sa, dynamic, group)
        summary = None
        try:
            refuse_bound(sa.module)
            if stored is not None:
                traced, runnable, guard_code, seconds, graph, num_nodes = self._unpack(stored)
                summary = stored.summary
            else:
                dp_mesh = self._data_mesh(mesh, sa)
                gm, traced, guard_code, seconds, runnable = self._build(
                    sa, mesh_dims(dp_mesh) if dp_mesh is not None else [], key, dynamic, why)
                graph, num_nodes = describe_graph(gm), len(gm.graph.nodes)
            description = describe_program(sa, graph, traced.dynamic_dims)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
            description = e
        if self.check_ranks:
            with communication_failures("the compile-time agreement between ranks"):
                agree_on_program(description, group)
        elif isinstance(description, Exception):
            raise description
        if self.retain_host_memory:
            retain_host_memory()
        start = time.perf_counter()
        # Only now, with a graph in hand, touch live state: a failed compile changes nothing.
        dp_mesh = self._data_mesh(mesh, sa)
        if dp_mesh is not None:  # tensor parallelism alone: the plan placed everything
            place_state(sa.module, sa.optimizers, dp_mesh,
                        self.parallel_mode.parallel_style in SHARDED_STYLES,
                        self.parallel_mode.param_init_fn, torch.device(mesh.device_type))
            if dp_mesh is mesh:  # model(x), generate(), load_state_dict outside the step
                attach_eager_use(sa.module, mesh)
        key = self._step_key(sa)
        entry = CompiledGraph(traced, runnable, guard_code, key, seconds,
                              checks_ranks_inside=self.check_ranks and self.backend == "eager",
                              summary=summary)
        self._programs.append(entry)
        self._remember_input_shapes(sa, traced)
        self._last_key = key
        self.compile_count += 1
        seconds["placed state"] = time.perf_counter() - start
        self.last_compile_seconds = sum(seconds.values())
        self.last_compiled = entry
        dump_dir = self._dump_dir_for_compile(self.compile_count - 1)
        if dump_dir:
            from .visualize import write_summary

            write_summary(entry_summary(entry), dump_dir)
            write_summary(entry_summary(entry), self.dump_dir)  # the latest, at the top level
        _info(
            "spmd_compiler: %s %s (%s, %d nodes) in %.2fs",
            "loaded" if stored is not None else "compiled", self.__name__,
            self.parallel_mode.parallel_style, num_nodes, self.last_compile_seconds,
        )
        if stored is not None:
            self.cache_hits += 1
        elif disk_key is not None:
            self._store_program(disk_key, sa, entry, runnable, graph, num_nodes)
        return entry

    # -- the disk cache -----------------------------------------------------------------------

    def _disk_cache(self) -> str | None:
        """The program cache directory, if the cache applies to this step (eager backend, no
        per-stage dumps, which need a real compile)."""
        if self.backend != "eager" or self.dump_dir or self._accumulation():
            return None
        return cache_dir_from(self.cache_dir)

    def _load_program(self, sa: StepArgs, dynamic: dict[int, tuple[int, ...]], group):
        """(key, stored program) from the disk cache: (None, None) without a cache; (key, None)
        unless every rank found the program (all compile then, so none waits for another)."""
        cache_dir = self._disk_cache()
        if cache_dir is None:
            return None, None
        try:
            disk_key = program_key(
                fn=self.fn, sa=sa, dynamic_dims=dynamic, rank=dist.get_rank(group),
                world_size=dist.get_world_size(group), group_name=group.group_name, options=dict(
                    mode=self.parallel_mode, backend=self.backend, check_ranks=self.check_ranks,
                    gm_transformation=self.gm_transformation, mesh=None if self.mesh is None
                    else (tuple(self.mesh.shape), self.mesh.mesh_dim_names)))
            stored = cache.load(cache_dir, disk_key)
        except Exception as e:  # noqa: BLE001 - the cache never stops a compile
            log.info("spmd_compiler: program cache lookup failed (%s); compiling", e)
            disk_key, stored = None, None
        if self.check_ranks and dist.get_world_size(group) > 1:
            found = torch.tensor([stored is not None], dtype=torch.int64)
            dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
            if not found.item():
                stored = None
        return disk_key, stored

    @staticmethod
    def _unpack(stored):
        start = time.perf_counter()
        traced, runnable = cache.unpack(stored)
        seconds = {"loaded from cache": time.perf_counter() - start}
        return traced, runnable, stored.guard_code, seconds, stored.graph_description, stored.num_nodes

    def _store_program(self, disk_key: str, sa: StepArgs, entry: CompiledGraph, runnable,
                       graph: dict, num_nodes: int) -> None:
        if self.backend != "eager":
            return
        try:
            program = cache.pack(disk_key, entry.traced, runnable, entry.guard_code, graph,
                                 num_nodes, entry.stage_seconds, entry_summary(entry), cache.class_files(sa)
                                 + [inspect.getsourcefile(self.fn) or ""])
            if program is not None:
                cache.store(self._disk_cache(), program)
        except Exception as e:  # noqa: BLE001 - the cache never stops a step
            log.info("spmd_compiler: program not cached (%s)", e)

    # -- dynamic sizes ------------------------------------------------------------------------

    def _dims_to_trace_dynamic(self, sa: StepArgs, group) -> tuple[dict[int, tuple[int, ...]], list[str]]:
        """Per input leaf, the non-batch dims to trace as symbolic sizes, and why (for the log).

        A dim is dynamic when the user declared it (``DataParallel(dynamic_dims=...)``,
        ``torch._dynamo.mark_dynamic``), when it was dynamic in an earlier compile of this step,
        when its size changed since the last compile (``automatic_dynamic``, as dynamo's
        automatic dynamic shapes), or when it differs across ranks in this call. The ranks
        exchange their view, so all of them trace the same dims as dynamic.
        """
        structure = str(sa.spec)
        rank = f" on rank {dist.get_rank(group)}" if dist.get_world_size(group) > 1 else ""
        mine: dict[int, tuple[tuple[int, ...], list[int], list[str]]] = {}
        for i, b in zip(sa.input_indices, sa.batch_dims):
            shape = tuple(sa.leaves[i].shape)
            declared = set(sa.dynamic_dims.get(i, ()))
            dims = declared | self._dynamic.get((structure, i), set())
            why = [f"{sa.leaf_name(i)} dim {d}: declared dynamic" for d in sorted(declared)]
            seen = self._seen_shapes.get((structure, i))
            if self.parallel_mode.automatic_dynamic and seen is not None and len(seen) == len(shape):
                for d, (before, now) in enumerate(zip(seen, shape)):
                    if before != now and d != b and d not in dims:
                        dims.add(d)
                        why.append(f"{sa.leaf_name(i)} dim {d}: size changed {before} -> {now}"
                                   f"{rank}")
            mine[i] = (shape, sorted(dims - {b}), why)
        everyone = [mine]
        if self.check_ranks and dist.get_world_size(group) > 1:
            everyone = exchange_objects(mine, group)
        dynamic, why = {}, []
        for i, b in zip(sa.input_indices, sa.batch_dims):
            views = [r[i] for r in everyone if i in r]
            dims = set().union(*(set(v[1]) for v in views))
            why += [w for w in dict.fromkeys(w for v in views for w in v[2]) if w not in why]
            shapes = [v[0] for v in views]
            if len({len(s) for s in shapes}) == 1:
                differ = {d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1}
                differ -= dims | {b}
                why += [f"{sa.leaf_name(i)} dim {d}: sizes differ across ranks "
                        f"({', '.join(str(s[d]) for s in shapes)})" for d in sorted(differ)]
                dims |= differ
            dynamic[i] = tuple(sorted(dims - {b}))
        return dynamic, why

    def _remember_input_shapes(self, sa: StepArgs, traced: TracedStep) -> None:
        """Record this compile's input shapes and dynamic dims, for the next compile's
        automatic dynamic dims."""
        structure = str(sa.spec)
        for i in sa.input_indices:
            self._seen_shapes[(structure, i)] = tuple(sa.leaves[i].shape)
            self._dynamic.setdefault((structure, i), set()).update(traced.dynamic_dims.get(i, ()))

    def _dump_dir_for_compile(self, index: int | None = None) -> str | None:
        """``<dump_dir>/compile_<n>`` for the n-th compile, on rank 0 only (every rank with
        SPMD_LOG_ALL_RANKS, in ``rank_<r>`` subfolders)."""
        if not self.dump_dir:
            return None
        index = self.compile_count if index is None else index
        if not dist.is_initialized():
            return os.path.join(self.dump_dir, f"compile_{index}")
        if os.environ.get("SPMD_LOG_ALL_RANKS"):
            return os.path.join(self.dump_dir, f"rank_{dist.get_rank()}", f"compile_{index}")
        return os.path.join(self.dump_dir, f"compile_{index}") if dist.get_rank() == 0 else None

    def _build(self, sa: StepArgs, dims: list[tuple[str, int]], key: tuple | None,
               dynamic: dict[int, tuple[int, ...]] | None = None, why: list[str] = ()):
        """Trace, analyze, expand, optimize and lower the step; touches no live state.
        ``dims``: (process group name, size) of each mesh dim, outermost first.

        Graph modules made meanwhile generate and compile their Python code only when it is
        read or run (torch.fx's lazy graph modules): each pass's ``recompile()`` only marks it.
        """
        with _use_lazy_graph_module(True):
            return self._build_stages(sa, dims, key, dynamic, why)

    def _build_stages(self, sa: StepArgs, dims: list[tuple[str, int]], key: tuple | None,
                      dynamic: dict[int, tuple[int, ...]] | None, why: list[str]):
        """Trace, analyze, expand, optimize and lower the step; touches no live state."""
        if self._last_key is not None and key is not None:
            _info("spmd_compiler: recompiling %s: %s", self.__name__, _why(self._last_key, key))
        if why:
            _info("spmd_compiler: tracing as dynamic sizes: %s", "; ".join(why))
        fully_shard = self.parallel_mode.parallel_style in SHARDED_STYLES
        seconds: dict[str, float] = {}
        dump_index = [0]
        dump_dir = self._dump_dir_for_compile()

        def stage(name: str, gm: torch.fx.GraphModule, started: float) -> None:
            seconds[name] = time.perf_counter() - started
            if dump_dir:
                from .visualize import dump_stage

                dump_stage(gm, name, dump_dir, index=dump_index[0])
                dump_index[0] += 1

        t = time.perf_counter()
        traced = trace_step(self.fn, (), {}, step_args=sa,
                            fuse_optimizer=self.parallel_mode.fuse_optimizer,
                            dynamic_dims=sa.dynamic_dims if dynamic is None else dynamic,
                            mp_policy=self.parallel_mode.mp_policy,
                            accumulation=self._accumulation())
        _log_specializations(traced, sa)
        stage("traced", traced.gm, t)

        t = time.perf_counter()
        # A batch size the trace specialized to a constant leaves no batch symbol to propagate;
        # that graph is guarded to the size, and its collectives come from the gradient roles.
        exact = bool(traced.specialized)
        if exact:
            _info("spmd_compiler: batch size specialized to %s: placements not analyzed",
                  sorted({s for _, _, s in traced.specialized}))
        else:
            analyze(traced.gm)
        stage("analyzed", traced.gm, t)

        mode = self.parallel_mode
        if mode.activation_memory_budget is not None:
            t = time.perf_counter()
            traced.gm = recompute_activations(traced.gm, budget=mode.activation_memory_budget)
            stage("recompute", traced.gm, t)

        t = time.perf_counter()
        # the parameters' layout on each mesh dim decides that dim's collectives
        layout = [MeshDim(name, size, placement)
                  for (name, size), placement in zip(dims, mode.placements(len(dims)))]
        try:
            gm = expand_data_parallel(
                traced.gm, layout, reshard_after_forward=mode.reshard_after_forward,
                broadcast_buffers=mode.broadcast_buffers,
                reduce_dtype=reduce_dtype_of(mode.mp_policy),
                divide_after_sum=mode.divide_gradients == "after",
                sync_grads=self._accumulation() != ACCUMULATE,
                accumulate_cap_bytes=int((mode.reduce_cap_mb or 0) * 2**20))
        except ShardingError as e:
            raise UnsupportedError(str(e)) from e
        if mode.keep_grads:
            gm = output_gradients(gm)
        if not exact:
            analyze(gm)
        stage("expanded", gm, t)

        for name, run in optimization_passes(mode, self.backend):
            t = time.perf_counter()
            gm = run(gm)
            stage(name, gm, t)
        if self.gm_transformation is not None:
            t = time.perf_counter()
            gm = self.gm_transformation(gm)
            stage("gm_transformation", gm, t)

        t = time.perf_counter()
        guard_code = traced.shape_env.produce_guards_expression(traced.fake_inputs)
        traced.gm = gm
        traced.sharded_states = fully_shard
        traced.kept_grads = list(gm.meta.get(meta.KEPT_GRADS, ()))
        runnable = lower(gm, self.backend, rank_check=await_agreement if self.check_ranks else None)
        stage("lowered", gm, t)
        return gm, traced, guard_code, seconds, runnable


def _log_specializations(traced: TracedStep, sa: StepArgs) -> None:
    """Say where the step made a dim traced as dynamic static again."""
    for i, d, size, where in traced.specialized_dims:
        _info("spmd_compiler: %s dim %d was traced as a dynamic size, but the step specialized "
              "it to %d at %s; this graph serves only that size", sa.leaf_name(i), d, size, where)
    for i, d, where in traced.entangled:
        _info("spmd_compiler: the step ties %s dim %d to the batch size at %s; traced as a "
              "static size (a dim holding the batch size's symbol would count as batch-sharded)",
              sa.leaf_name(i), d, where)


def explain(train_step: Callable, *args, parallel_mode: DataParallel | None = None,
            world_size: int | tuple[int, int] | None = None, dump_dir: str | None = None, **kwargs):
    """Compile ``train_step(*args, **kwargs)`` without running it or touching the model and
    optimizer; return the summary (``visualize.Summary``; ``.to_text()`` for the tables).

    Under an initialized process group the world size is the group's (the step's mesh, if it
    was given one); otherwise give ``world_size`` (default 2) to see what the step would do at
    that size; for hybrid_shard a (replicate, shard) mesh shape (an int n: ``(n // 2, 2)``).
    """
    from .visualize import summarize, write_summary

    step = train_step if isinstance(train_step, CompiledStep) else CompiledStep(
        train_step, parallel_mode or DataParallel("replicate"), dump_dir=dump_dir)
    if dist.is_available() and dist.is_initialized():
        dims = mesh_dims(step._mesh(torch.device("cpu")))
    elif step.parallel_mode.parallel_style == "hybrid_shard":
        shape = world_size if isinstance(world_size, tuple) else (max(1, (world_size or 4) // 2), 2)
        dims = [("explain_replicate", shape[0]), ("explain_shard", shape[1])]
    else:
        dims = [("explain", world_size or 2)]
    sa = split_step_args(args, kwargs, step.parallel_mode.input_batch_dim,
                         step.parallel_mode.dynamic_dims)
    gm, _, _, seconds, runnable = step._build(sa, dims, None)
    summary = summarize(gm, compile_times=seconds,
                        lowered=runnable if isinstance(runnable, torch.fx.GraphModule) else None)
    if step.dump_dir:
        write_summary(summary, step.dump_dir)
    return summary


def lower(gm: torch.fx.GraphModule, backend: str, rank_check: Callable[[], None] | None = None) -> Callable:
    """The runnable for ``backend``; ``gm`` itself stays functional (it is what the dumps and
    the cross-rank check describe).

    ``"eager"`` runs the generated Python of a copy of ``gm`` whose bucket divisions and
    all_reduces work in place (passes/inplace.py) and that calls ``rank_check`` (the per-call
    agreement) just before its first collective or state update (passes/rank_check.py), so the
    agreement's message travels while the forward computes. ``"inductor"`` hands the whole step graph to
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
    for lowering in (reduce_in_place, gather_into_preallocated, broadcast_gathers,
                     functools.partial(all_reduce_scatters, owned=owned_temporary),
                     plan_static_memory):
        runnable = lowering(runnable)
    return place_rank_check(runnable, rank_check) if rank_check else runnable


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


def optimization_passes(mode: DataParallel, backend: str = "eager") -> list[tuple[str, Callable]]:
    """The optimization passes ``mode`` turns on for ``backend``, in order, as (stage name,
    pass). Under Inductor the fused optimizer kernels run outside the compiled regions, so
    each one splits the graph: fully_shard's updates then stay after the backward."""
    passes: list[tuple[str, Callable]] = [("dead_code", eliminate_dead_code)]
    if mode.bucket_cap_mb:
        passes.append(("bucketing", functools.partial(
            bucket_collectives, bucket_cap_mb=mode.bucket_cap_mb,
            first_bucket_cap_mb=mode.first_bucket_cap_mb, own_collective_mb=mode.own_collective_mb)))
    if mode.split_optimizer:
        passes.append(("split_optimizer", split_optimizer_by_bucket))
    if mode.parallel_style in SHARDED_STYLES:  # orders everything, overlap included
        passes.append(("schedule", functools.partial(
            schedule_for_memory, prefetch_cap_mb=mode.prefetch_cap_mb,
            reduce_cap_mb=mode.reduce_cap_mb, overlap=mode.overlap,
            updates_in_backward=backend == "eager")))
    elif mode.overlap:
        passes.append(("overlap", sink_waits))
    return passes


def analyze(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Placement propagation (passes/batch_dim.py), its failures raised as SPMDErrors."""
    try:
        return batch_dim.annotate_placements(gm)
    except batch_dim.BatchDimError as e:
        raise BatchDimError(str(e)) from e


def entry_summary(entry: CompiledGraph):
    """The visualize.Summary of a compiled graph (of a program loaded from the disk cache: the
    one made when it was compiled)."""
    from .visualize import summarize

    if entry.traced.gm is None:
        return entry.summary
    lowered = entry.run if isinstance(entry.run, torch.fx.GraphModule) else None
    return summarize(entry.traced.gm, compile_times=entry.stage_seconds, lowered=lowered)


def summary_text(step: CompiledStep) -> str | None:
    """The summary table of the step's last compiled graph (None before its first call)."""
    if step.last_compiled is None:
        return None
    return entry_summary(step.last_compiled).to_text()


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device of the first module or tensor among the arguments (for the error path)."""
    import torch.utils._pytree as pytree

    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.nn.Module):
            return module_device(leaf)
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", id(x))


def step_key(sa: StepArgs) -> tuple:
    """Everything a compiled graph depends on besides the input sizes (which its guards check).

    Named components, so a recompile can say what changed.
    """
    module = sa.module
    params = tuple(
        (id(p), tuple(p.shape), p.dtype, p.requires_grad) for p in module.parameters()
    )
    buffers = tuple((id(b), tuple(b.shape), b.dtype) for b in module.buffers())
    training = tuple(m.training for m in module.modules())
    optim = []
    for opt in sa.optimizers:
        groups = tuple(
            tuple(sorted((k, _hashable(v)) for k, v in g.items() if k != "params" and k not in LIFTED_HPARAMS))
            + (tuple(id(p) for p in g["params"]),)
            for g in opt.param_groups
        )
        state = tuple(
            (id(p), tuple(sorted(k for k, v in st.items() if isinstance(v, torch.Tensor))))
            for p, st in opt.state.items()
        )
        optim.append((type(opt), id(opt), groups, state))
    # Sizes are left to each program's guards (a dim may be static in one program and a
    # symbol in a later one); the rank and everything else that makes another program is here.
    inputs = []
    for i, d in zip(sa.input_indices, sa.batch_dims):
        t = sa.leaves[i]
        inputs.append((t.dim(), d, t.dtype, t.device, t.requires_grad))
    constants = tuple(
        _hashable(x) for j, x in enumerate(sa.leaves)
        if j not in sa.input_indices and j != sa.module_index and j not in sa.optimizer_indices
    )
    return (
        ("module", id(module)), ("parameters", params), ("buffers", buffers),
        ("train/eval mode", training), ("optimizer", tuple(optim)),
        ("input structure", str(sa.spec)), ("inputs", tuple(inputs)), ("constants", constants),
    )


def _why(old: tuple, new: tuple) -> str:
    changed = [name for (name, a), (_, b) in zip(old, new) if a != b]
    return "changed " + ", ".join(changed) if changed else (
        "input shapes, a baked-in learning rate or an unbatched input's value outside the guards")


def spmd_compile(parallel_mode: DataParallel | None = None, *, backend: str = "eager",
                 dump_dir: str | None = None, gm_transformation=None, check_ranks: bool = True,
                 retain_host_memory: bool = True, cache_dir: str | None = None, mesh=None):
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
            all ranks agree on when to recompile (one small all_reduce per call, awaited by the
            eager graph just before its first collective or state update). Turn off only
            when inputs are known to agree across ranks; a disagreement then hangs or diverges.
        retain_host_memory: keep the host memory a step frees for the next one instead of
            returning it to the OS (glibc malloc settings, process-wide, set at the first
            compile; see ``runtime.retain_host_memory``). Saves re-faulting every step's
            activations and buckets; resident memory stays at the step's peak.
        cache_dir: keep compiled programs in this directory (also ``SPMD_CACHE_DIR``), so a
            restarted job or a second run loads them instead of compiling (eager backend;
            ignored with ``dump_dir``). Keyed by everything the program depends on and checked
            against the source files it was recorded from; see spmd_compiler/cache.py and
            docs/user_guide.md.
        mesh: the ``DeviceMesh`` to train over. replicate and fully_shard take a 1-D mesh (a
            sub-group, or one dim of a larger mesh: ``mesh["dp"]``); hybrid_shard a 2-D mesh,
            ``(replicate, shard)`` (``mesh_dim_names`` required): parameters are sharded over the
            inner dim and replicated over the outer. Only the mesh's ranks call the step.
            Default: a 1-D mesh over the whole default process group.
    """
    if mesh is not None:
        check_mesh(parallel_mode or DataParallel("replicate"), mesh)

    def decorate(fn: Callable) -> CompiledStep:
        return CompiledStep(fn, parallel_mode, backend=backend, dump_dir=dump_dir,
                            gm_transformation=gm_transformation, check_ranks=check_ranks,
                            retain_host_memory=retain_host_memory, cache_dir=cache_dir, mesh=mesh)

    return decorate


def compile(module_override=None, gm_transformation=None, parallel_mode: DataParallel | None = None):
    """The ``torch.distributed._spmd.api.compile`` spelling of :func:`spmd_compile`."""
    if module_override is not None:
        raise SPMDError("compile(module_override=...) is not supported; pass module=None")
    return spmd_compile(parallel_mode, gm_transformation=gm_transformation)
