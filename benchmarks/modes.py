"""The ways a benchmark step can be run: eager references, compiled modes and lower-bound parts.

A mode turns a ``ModelSpec`` into a ``Runner`` on every rank. To add a mode, add a ``Mode`` to
``all_modes`` (``spmd_modes`` adds one per spmd_compiler parallel style and backend, each followed
by its ablation modes: the same mode with one optimization switched off, see ``ABLATIONS``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .models import Batch, ModelSpec, make_train_step


class NotAvailable(Exception):
    """The mode cannot run here (implementation missing or unsupported); reported as n/a."""


@dataclass
class Runner:
    """One rank's prepared step.

    ``module``/``optim`` are None for modes that hold no training state (``comm``).
    ``compile_seconds``/``compiles`` return the compiler's own figures (time of the latest
    compile, number of compiles so far), ``collectives`` the collectives in its compiled graph,
    when it reports them.
    """

    step: Callable[[Batch], Any]
    module: nn.Module | None = None
    optim: torch.optim.Optimizer | None = None
    compile_seconds: Callable[[], float | None] = lambda: None
    compiles: Callable[[], int | None] = lambda: None
    collectives: Callable[[], dict | None] = lambda: None
    estimated_peak: Callable[[], int | None] = lambda: None


@dataclass(frozen=True)
class Mode:
    """A named way to run the step.

    ``comm`` describes the collectives of one step as ``{kind: payload_bytes}`` given the model
    (``kind`` is all_reduce, all_gather or reduce_scatter; payload = full tensor bytes).
    ``reference`` modes form the lower bound and have no parity figure. spmd modes have a
    ``style``; an ablation mode names its ``ablation`` and the mode it ablates (``ablation_of``).
    """

    name: str
    prepare: Callable[[ModelSpec, int], Runner]
    comm: Callable[[ModelSpec, nn.Module], dict[str, int]]
    description: str
    reference: bool = False
    sharded: bool = False
    style: str | None = None
    ablation: str | None = None
    ablation_of: str | None = None
    variant: str | None = None  # a setting of VARIANTS applied to the spmd mode ``ablation_of``


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _unsharded_root_bytes(spec: ModelSpec, model: nn.Module) -> int:
    """Bytes of parameters outside every FSDP2 block (kept gathered from forward to backward)."""
    in_blocks = {
        id(p) for m in model.modules() if spec.is_block(m) for p in m.parameters()
    }
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if p.requires_grad and id(p) not in in_blocks
    )


def _replicate_comm(spec: ModelSpec, model: nn.Module) -> dict[str, int]:
    return {"all_reduce": param_bytes(model)}


def _fsdp2_comm(spec: ModelSpec, model: nn.Module) -> dict[str, int]:
    # Blocks gather for forward and again for backward (reshard_after_forward=True); FSDP2 keeps
    # the root's own parameters gathered after forward, so those are gathered once.
    p = param_bytes(model)
    return {"all_gather": 2 * p - _unsharded_root_bytes(spec, model), "reduce_scatter": p}


def _fully_shard_comm(spec: ModelSpec, model: nn.Module) -> dict[str, int]:
    p = param_bytes(model)
    return {"all_gather": 2 * p, "reduce_scatter": p}


def _no_comm(spec: ModelSpec, model: nn.Module) -> dict[str, int]:
    return {}


# --- eager references -------------------------------------------------------------------------


def _prepare_ddp(spec: ModelSpec, world_size: int) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(spec.build())
    optim = spec.optim.build(ddp.parameters())
    train_step = make_train_step(spec.loss_fn)
    return Runner(lambda batch: train_step(ddp, optim, batch), ddp.module, optim)


def _prepare_ddp_tuned(spec: ModelSpec, world_size: int) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        from spmd_compiler.runtime.program import retain_host_memory
    except ImportError as e:
        raise NotAvailable(f"spmd_compiler not importable: {e}") from e
    retain_host_memory()
    ddp = DDP(spec.build())
    optim = dataclasses.replace(spec.optim, impl="fused").build(ddp.parameters())
    train_step = make_train_step(spec.loss_fn)
    return Runner(lambda batch: train_step(ddp, optim, batch), ddp.module, optim)


def _prepare_fsdp2(spec: ModelSpec, world_size: int) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = spec.build()
    for block in [m for m in model.modules() if spec.is_block(m) and m is not model]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = spec.optim.build(model.parameters())
    train_step = make_train_step(spec.loss_fn)
    return Runner(lambda batch: train_step(model, optim, batch), model, optim)


def _prepare_ddp_compile(spec: ModelSpec, world_size: int) -> Runner:
    """``torch.compile(DDP(model))`` as users write it: Dynamo compiles the forward (and
    AOTAutograd its backward) with Inductor, split at DDP's bucket boundaries (DDP's optimizer
    for Dynamo) so each bucket's all_reduce still overlaps the backward; the optimizer step runs
    eagerly. The first call and the warm-up steps compile (tens of seconds cold on CPU)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(spec.build())
    compiled = torch.compile(ddp)
    optim = spec.optim.build(ddp.parameters())
    train_step = make_train_step(spec.loss_fn)
    return Runner(lambda batch: train_step(compiled, optim, batch), ddp.module, optim,
                  *_dynamo_compiles())


def _prepare_fsdp2_compile(spec: ModelSpec, world_size: int) -> Runner:
    """FSDP2 as ``fsdp2`` (each block, then the root), then ``torch.compile`` of the root
    module's forward, as users write it: Dynamo traces through FSDP2's hooks (graph breaks where
    it cannot) and Inductor compiles the pieces; the optimizer step runs eagerly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = spec.build()
    for block in [m for m in model.modules() if spec.is_block(m) and m is not model]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model)
    optim = spec.optim.build(model.parameters())
    train_step = make_train_step(spec.loss_fn)
    return Runner(lambda batch: train_step(compiled, optim, batch), model, optim,
                  *_dynamo_compiles())


def _dynamo_compiles() -> tuple[Callable[[], float | None], Callable[[], int | None]]:
    """``Runner.compile_seconds`` and ``Runner.compiles`` of a torch.compile mode: the frames
    Dynamo compiled in this process, and the seconds of those compiles not yet reported (each
    frame's compile, then its backward's, which AOTAutograd compiles at the first backward)."""
    from torch._dynamo.utils import compilation_time_metrics

    reported = 0.0

    def total() -> float:
        return sum(sum(compilation_time_metrics.get(k, ()))
                   for k in ("_compile.compile_inner", "backward._backward_impl"))

    def seconds() -> float:
        nonlocal reported
        new, reported = total() - reported, total()
        return new

    return seconds, lambda: len(compilation_time_metrics.get("_compile.compile_inner", ()))


def _prepare_compute(spec: ModelSpec, world_size: int) -> Runner:
    """One rank's step alone, with the fused optimizer and the host-memory setting of ddp_tuned
    and spmd: the fastest single-device step, the bound every data-parallel mode is held to."""
    try:
        from spmd_compiler.runtime.program import retain_host_memory
    except ImportError as e:
        raise NotAvailable(f"spmd_compiler not importable: {e}") from e
    retain_host_memory()
    model = spec.build()
    optim = dataclasses.replace(spec.optim, impl="fused").build(model.parameters())
    train_step = make_train_step(spec.loss_fn)
    return Runner(lambda batch: train_step(model, optim, batch), model, optim)


def _prepare_comm(spec: ModelSpec, world_size: int) -> Runner:
    numel = sum(p.numel() for p in spec.build().parameters() if p.requires_grad)
    flat = torch.zeros(numel)
    return Runner(lambda batch: dist.all_reduce(flat))


# --- spmd_compiler ----------------------------------------------------------------------------

STYLES = ("replicate", "fully_shard")


@dataclass(frozen=True)
class Ablation:
    """One optimization switched off: overrides of DataParallel fields and spmd_compile keywords.

    ``styles`` are the parallel styles where the switched-off pass has work to do; ``--ablation``
    runs only those pairs (the others stay selectable by name).
    """

    description: str
    parallel: dict[str, Any] = field(default_factory=dict)
    compile: dict[str, Any] = field(default_factory=dict)
    styles: tuple[str, ...] = STYLES
    meta_init: bool = False  # build the model under torch.device("meta")

    def overrides(self) -> str:
        """The settings changed, e.g. ``DataParallel(bucket_cap_mb=0)``."""
        calls = (("DataParallel", self.parallel), ("spmd_compile", self.compile))
        parts = [
            f"{call}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
            for call, kwargs in calls
            if kwargs
        ]
        if self.meta_init:
            parts.append('model built under torch.device("meta")')
        return " ".join(parts)


ALL_PASSES_ON = Ablation("every pass on")

# The ablation modes: each optimization switched off in turn. One whose override the installed
# spmd_compiler lacks is left out (see available_ablations).
ABLATIONS = {
    "no_bucketing": Ablation(
        "bucketing off: one collective per parameter instead of flat buckets",
        parallel={"bucket_cap_mb": 0},
    ),
    "bucket_all": Ablation(
        "large tensors bucketed too (own_collective_mb=None): every collective joins a bucket",
        parallel={"own_collective_mb": None},
    ),
    "no_overlap": Ablation(
        "overlap off: each collective is waited on right after it is issued, not at its first use",
        parallel={"overlap": False},
    ),
    "no_prefetch": Ablation(
        "prefetch off: parameter all-gathers are issued just before their use, not ahead",
        parallel={"prefetch_cap_mb": 0},
        styles=("fully_shard",),
    ),
    "no_fuse_optimizer": Ablation(
        "optimizer fusion off: the optimizer runs the implementation it names (CPU default: "
        "several passes per parameter), not its fused kernel",
        parallel={"fuse_optimizer": False},
    ),
    "no_split_optimizer": Ablation(
        "optimizer split off: updates run in the recorded (model) order, not by gradient bucket",
        parallel={"split_optimizer": False},
    ),
    "no_retain_host_memory": Ablation(
        "host memory returned to the OS between steps (glibc's default), not kept for the next step",
        compile={"retain_host_memory": False},
    ),
    "no_check_ranks": Ablation(
        "rank checks off: no per-call agreement all_reduce, no per-compile program exchange",
        compile={"check_ranks": False},
    ),
}


# Settings that change what a step holds rather than switching a pass off; not run by default
# (``python -m benchmarks.memory`` runs them).
VARIANTS = {
    "meta_init": Ablation(
        "model built on the meta device: each rank materializes (reset_parameters) only what it "
        "holds, one module at a time",
        meta_init=True,
    ),
    "activation_budget": Ablation(
        "the compiler recomputes forward activations in the backward so that at most half of "
        "the activation bytes the backward reads are kept",
        parallel={"activation_memory_budget": 0.5},
    ),
}


def available_ablations() -> dict[str, Ablation]:
    """The ablations whose DataParallel fields and spmd_compile keywords all exist here."""
    try:
        from spmd_compiler import DataParallel, spmd_compile
    except ImportError:
        return {}
    fields = {f.name for f in dataclasses.fields(DataParallel)}
    keywords = set(inspect.signature(spmd_compile).parameters)
    return {
        name: a
        for name, a in ABLATIONS.items()
        if a.parallel.keys() <= fields and a.compile.keys() <= keywords
    }


def _spmd_call(style: str, backend: str, ablation: Ablation) -> str:
    """The spmd_compile call of a mode, as text."""
    parallel = [repr(style), *(f"{k}={v!r}" for k, v in ablation.parallel.items())]
    keywords = {"backend": backend, **ablation.compile}
    return (
        f"spmd_compile(DataParallel({', '.join(parallel)}), "
        f"{', '.join(f'{k}={v!r}' for k, v in keywords.items())})"
        + ('; model built under torch.device("meta")' if ablation.meta_init else "")
    )


def _spmd_prepare(
    style: str, backend: str, ablation: Ablation
) -> Callable[[ModelSpec, int], Runner]:
    def prepare(spec: ModelSpec, world_size: int) -> Runner:
        try:
            from spmd_compiler import DataParallel, spmd_compile
        except ImportError as e:
            raise NotAvailable(f"spmd_compiler not importable: {e}") from e
        if ablation.meta_init:
            with torch.device("meta"):
                model = spec.build()
        else:
            model = spec.build()
        optim = spec.optim.build(model.parameters())
        kwargs = {} if backend == "eager" else {"backend": backend}
        mode = DataParallel(style, **ablation.parallel)
        step = spmd_compile(mode, **kwargs, **ablation.compile)(make_train_step(spec.loss_fn))
        return Runner(
            lambda batch: step(model, optim, batch),
            model,
            optim,
            lambda: _compile_seconds(step),
            lambda: getattr(step, "compile_count", None),
            lambda: _graph_collectives(step),
            lambda: _estimated_peak(step),
        )

    return prepare


def _compile_seconds(step) -> float | None:
    for attr in ("compile_seconds", "last_compile_seconds"):
        value = getattr(step, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _graph_collectives(step) -> dict[str, dict[str, int]] | None:
    """Collectives one call of the latest compiled graph issues: {kind: {count, bytes}}."""
    try:
        from spmd_compiler.observe.visualize import (
            collective_bytes,
            collective_kind,
            collective_nodes,
        )

        gm = step.last_compiled.traced.gm
    except (ImportError, AttributeError):
        return None
    if gm is None:  # a program received from the rank that built it (shared_compile.py)
        return None
    out: dict[str, dict[str, int]] = {}
    for node in collective_nodes(gm):
        entry = out.setdefault(collective_kind(node), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += collective_bytes(node)[0]
    return out


def _estimated_peak(step) -> int | None:
    """The liveness estimate of the latest compiled graph's peak (bytes), when reported."""
    try:
        from spmd_compiler.api import entry_summary

        return entry_summary(step.last_compiled).peak_bytes
    except (ImportError, AttributeError):
        return None


def spmd_backends() -> tuple[str, ...]:
    """Backends spmd_compiler offers (``BACKENDS`` in spmd_compiler.api), else just eager."""
    try:
        from spmd_compiler import api
    except ImportError:
        return ("eager",)
    return tuple(getattr(api, "BACKENDS", ("eager",)))


def _spmd_mode(style: str, backend: str, ablation: str | None = None,
               variant: str | None = None) -> Mode:
    """The spmd mode of a style and backend, with one of ``ABLATIONS`` or ``VARIANTS``
    applied when given."""
    base = f"spmd_{style}" + ("" if backend == "eager" else f"_{backend}")
    overrides = (ABLATIONS[ablation] if ablation else VARIANTS[variant] if variant
                 else ALL_PASSES_ON)
    suffix = ablation or variant
    return Mode(
        f"{base}-{suffix}" if suffix else base,
        _spmd_prepare(style, backend, overrides),
        {"replicate": _replicate_comm, "fully_shard": _fully_shard_comm}[style],
        _spmd_call(style, backend, overrides),
        sharded=style == "fully_shard",
        style=style,
        ablation=ablation,
        ablation_of=base if suffix else None,
        variant=variant,
    )


def spmd_modes() -> list[Mode]:
    """One mode per parallel style and backend, each followed by its available ablation modes
    and its variants (eager backend only)."""
    ablations = [None, *available_ablations()]
    return [
        _spmd_mode(style, backend, ablation)
        for style in STYLES
        for backend in spmd_backends()
        for ablation in ablations
    ] + [
        _spmd_mode(style, "eager", variant=variant)
        for style in STYLES
        for variant in available_variants()
    ]


def available_variants() -> list[str]:
    """The variants whose DataParallel fields exist in the installed spmd_compiler."""
    try:
        from spmd_compiler import DataParallel
    except ImportError:
        return []
    fields = {f.name for f in dataclasses.fields(DataParallel)}
    return [name for name, v in VARIANTS.items() if v.parallel.keys() <= fields]


def ablation_run(base_modes: list[str], modes: dict[str, Mode]) -> list[str]:
    """For each of ``base_modes``: its ablation modes whose pass has work to do in its style."""
    return [
        m.name
        for m in modes.values()
        if m.ablation and m.ablation_of in base_modes and m.style in ABLATIONS[m.ablation].styles
    ]


def all_modes(spmd: list[Mode] | None = None) -> dict[str, Mode]:
    """Every mode, references first (DDP is the parity and ratio baseline), ablation modes included.

    ``spmd`` defaults to ``spmd_modes()``, which imports spmd_compiler to list its backends.
    """
    modes = [
        Mode("ddp", _prepare_ddp, _replicate_comm, "eager DistributedDataParallel"),
        Mode(
            "ddp_tuned",
            _prepare_ddp_tuned,
            _replicate_comm,
            "eager DDP tuned by hand as spmd_compiler does by default: the optimizer's "
            "fused=True kernel and retain_host_memory()",
        ),
        Mode(
            "fsdp2",
            _prepare_fsdp2,
            _fsdp2_comm,
            "eager fully_shard per block, then root",
            sharded=True,
        ),
        Mode(
            "ddp_compile",
            _prepare_ddp_compile,
            _replicate_comm,
            "torch.compile(DDP(model)): the forward and backward through Inductor, split at "
            "DDP's buckets; the optimizer eager",
        ),
        Mode(
            "fsdp2_compile",
            _prepare_fsdp2_compile,
            _fsdp2_comm,
            "fsdp2, then torch.compile(model): the forward and backward through Inductor; the "
            "optimizer eager",
            sharded=True,
        ),
        *(spmd_modes() if spmd is None else spmd),
        Mode(
            "compute",
            _prepare_compute,
            _no_comm,
            "single-device step on the local batch, no communication",
            reference=True,
        ),
        Mode(
            "comm",
            _prepare_comm,
            _replicate_comm,
            "one all_reduce of all gradient bytes as a single flat buffer",
            reference=True,
        ),
    ]
    return {m.name: m for m in modes}


def get_mode(name: str) -> Mode:
    """The mode called ``name``, importing spmd_compiler only for spmd modes."""
    modes = all_modes(spmd=[])
    return modes[name] if name in modes else {m.name: m for m in spmd_modes()}[name]


# --- per-rank figures -------------------------------------------------------------------------


def _bytes(tensors) -> int:
    """Bytes of the distinct tensors' local data (each counted once)."""
    distinct = {id(t): t for t in tensors}.values()  # ids of the caller's live tensors
    return sum(_local(t).numel() * _local(t).element_size() for t in distinct)


def persistent_bytes(runner: Runner) -> dict[str, int] | None:
    """Bytes this rank holds for params, grads and optimizer state (local shards of DTensors)."""
    if runner.module is None:
        return None
    params = list(runner.module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [
        v for s in runner.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    out = {"params": _bytes(params), "grads": _bytes(grads), "optim": _bytes(states)}
    out["total"] = sum(out.values())
    return out


def full_params(runner: Runner) -> dict[str, torch.Tensor] | None:
    """Full parameters by name (a collective for sharded DTensors: every rank must call)."""
    if runner.module is None:
        return None
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in runner.module.named_parameters()
    }
