"""Parallel modes: what kind of parallelism to compile the step for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from .errors import MixedPrecisionError, SPMDError
from .torch_internals import pytree

_STYLES = ("replicate", "fully_shard", "hybrid_shard")
SHARDED_STYLES = ("fully_shard", "hybrid_shard")  # parameters sharded on the mesh's inner dim


@dataclass(frozen=True)
class DataParallel:
    """Data parallelism over every rank of the default process group (or of the mesh given to
    ``spmd_compile(..., mesh=...)``).

    Args:
        parallel_style: ``"replicate"`` (DDP-like: every rank holds the full parameters and
            optimizer state; gradients are all-reduced), ``"fully_shard"`` (ZeRO-3/FSDP-like:
            parameters, gradients and optimizer state are dim-0 shards; parameters are all-gathered
            just in time, gradients reduce-scattered) or ``"hybrid_shard"`` (HSDP, on a 2-D mesh
            ``(replicate, shard)``: fully_shard within each row of the shard dim, the shards
            replicated over the replicate dim; gradients are reduce-scattered over the shard dim,
            then all-reduced over the replicate dim). ``fully_shard``'s options apply to it.
        input_batch_dim: the batch dim of every tensor in the step's non-module, non-optimizer
            arguments. An int applies to every tensor leaf; a pytree matching the batch (ints, or
            ``None`` for an input that is not batched) sets it per leaf.
        reshard_after_forward: fully_shard only. ``True`` gathers parameters again for the
            backward so the forward copy is freed after its last forward use; ``False`` keeps one
            gathered copy from forward through backward.
        broadcast_buffers: like DDP's option: buffers (e.g. BatchNorm running stats) are
            broadcast from rank 0 at the start of every step, in one collective.
        bucket_cap_mb: merge per-parameter gradient collectives into flat buckets, assigned as
            DDP's reducer does: in production order, a bucket closes once it holds this many
            MiB (DDP's default 25; the first once it holds ``first_bucket_cap_mb``, so
            communication starts early). fully_shard's gathers and reduce-scatters are bucketed
            under ``prefetch_cap_mb`` and ``reduce_cap_mb`` instead (a bucket is alive as a
            whole), or this cap when those are 0. ``None`` or ``0`` turns bucketing off.
        own_collective_mb: a parameter or gradient of at least this many MiB keeps its own
            collective instead of joining a bucket when that adds no collective to the step
            (largest first): merging would copy its bytes into the bucket (and out again for
            gathers), which costs more than one collective's latency. The default is this
            machine's figure (``python -m benchmarks.bucket_costs``: gloo's latency about
            0.15 ms, copies about 6-9 GiB/s, so the copy costs more from about 1 MiB).
            ``None`` buckets every tensor.
        prefetch_cap_mb: fully_shard only. Issue parameter all-gathers ahead of their use so
            they transfer while earlier layers compute, holding at most this many MiB of
            gathered parameters ahead of use, and always the next one (FSDP2 prefetches one
            module ahead). ``None`` or ``0`` gathers each parameter (bucket) just before its use.
        reduce_cap_mb: fully_shard only. At most this many MiB of full-size gradients whose
            reduce-scatter is issued but not yet waited on; the oldest is waited on (and its
            parameters updated) before a new one would pass the cap. ``None`` or ``0`` waits on
            each right after issuing it. Also the memory rule for gradients accumulated over
            micro-batches inside the step: summed unsharded and reduce-scattered once while all
            of them fit in this cap, else each micro-batch's reduce-scattered (the summary's
            "passes" table says which).
        fuse_optimizer: record SGD, Adam and AdamW with their fused implementation (one kernel
            over the parameters, not several passes per parameter) whatever ``foreach``/``fused``
            the optimizer names. The update is the same up to float round-off.
        split_optimizer: order the optimizer's updates by gradient bucket, so a bucket's
            parameters update while later buckets are still communicating (a fused or
            ``foreach`` update over all parameters is split into one per bucket).
        overlap: move each collective's wait to the first use of its result, so communication
            runs while the rest of the step computes. ``False`` waits right after issuing.
        keep_grads: after each step leave in ``p.grad`` what DDP leaves there: the gradient
            averaged over ranks (after any in-place change the step made, e.g. clipping), as a
            DTensor placed like the parameter (``Shard(0)`` under fully_shard, as FSDP2). Costs
            one gradient-sized tensor per parameter (1/world of it sharded) held between steps;
            ``False`` (default) frees the gradients inside the step.
        param_init_fn: for a model built under ``torch.device("meta")``: ``fn(module)``
            initializes, in place, the parameters and buffers that ``module`` itself holds
            (called once per such module, children before parents, each with only its own
            tensors materialized at full size); default ``module.reset_parameters()``. Each
            rank keeps only what it holds (its shards), so the whole model never exists on
            one rank. See docs/fully_shard.md, "Meta-device initialization".
        activation_memory_budget: keep at most this fraction (0 to 1) of the bytes of the
            activations the backward reads; the compiler recomputes the others in the backward
            (cheapest per byte first), as activation checkpointing does. ``None`` (default)
            keeps what autograd saves (checkpointed modules in the model are recomputed
            either way).
        dynamic_dims: non-batch dims to compile as symbolic sizes from the first call on (a
            sequence length), so one program serves every size: an int for every batched input,
            or a pytree shaped like the batch of ints/None (one dim per input; for several, or
            instead, ``torch._dynamo.mark_dynamic(tensor, dims)`` on the input). Ranks may pass
            different sizes in these dims, as in the batch dim.
        automatic_dynamic: like torch.compile's automatic dynamic shapes: a dim whose size
            changed since the last compile is compiled as a symbolic size on the recompile, so
            a new length compiles once more and then never again. A dim that differs across
            ranks is always compiled as a symbolic size on every rank.
        mp_policy: mixed precision, FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``:
            the forward and backward compute with the parameters cast to ``param_dtype``
            (fully_shard gathers them in it), gradients are reduced in ``reduce_dtype`` (default
            ``param_dtype``), inputs and outputs of the model are cast as the policy says; the
            parameters and optimizer state keep their dtype. ``reduce_dtype`` alone reduces
            gradients in that dtype. See docs/training_features.md.
        divide_gradients: ``"before"`` (DDP's order, default): each rank divides its gradient
            by the world size and the ranks sum the quotients; ``"after"`` (FSDP2's order for
            float32/bfloat16 reductions, ``ReduceOp.AVG``): the ranks sum their gradients and the
            sum is divided. Same average up to round-off; "before" cannot overflow a float16
            sum, "after" rounds once.
        gradient_divide_factor: what each gradient's sum over the ranks is divided by, instead
            of the number of ranks (FSDP2's ``set_gradient_divide_factor``): e.g. the number of
            tokens or samples across ranks when the loss is a per-rank sum. ``None``: average.
        input_seq_dim: context parallelism: the sequence dim of every input (an int, or a
            pytree shaped like the batch of ints and ``None`` for inputs without one), sharded
            over the step mesh's dim named ``"cp"`` (``mesh_dim_names=("dp", "cp")``). Every rank
            of a cp group passes the same full-length rows; the result is one device's on them.
            See docs/context_parallel.md.
    """

    parallel_style: str = "replicate"
    input_batch_dim: Any = 0
    reshard_after_forward: bool = True
    broadcast_buffers: bool = True
    bucket_cap_mb: float | None = 25.0
    first_bucket_cap_mb: float = 1.0
    own_collective_mb: float | None = 1.0
    prefetch_cap_mb: float | None = 16.0
    reduce_cap_mb: float | None = 16.0
    fuse_optimizer: bool = True
    split_optimizer: bool = True
    overlap: bool = True
    keep_grads: bool = False
    param_init_fn: Callable[[Any], None] | None = None
    activation_memory_budget: float | None = None
    dynamic_dims: Any = None
    automatic_dynamic: bool = True
    mp_policy: Any = None
    divide_gradients: str = "before"
    gradient_divide_factor: float | None = None
    input_seq_dim: Any = None

    def __post_init__(self):
        _check_types(self)
        budget = self.activation_memory_budget
        if budget is not None and not (isinstance(budget, (int, float)) and 0 <= budget <= 1):
            raise SPMDError(
                f"DataParallel: activation_memory_budget must be a fraction between 0 and 1 "
                f"(or None), got {budget!r}")
        check_policy(self.mp_policy)
        if self.divide_gradients not in ("before", "after"):
            raise SPMDError(f"DataParallel: divide_gradients must be 'before' or 'after', got "
                            f"{self.divide_gradients!r}")
        factor = self.gradient_divide_factor
        if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
            raise SPMDError(f"DataParallel: gradient_divide_factor must be a positive number (or "
                            f"None), got {factor!r}")
        if self.parallel_style not in _STYLES:
            raise SPMDError(
                f"DataParallel: unknown parallel_style {self.parallel_style!r}; "
                f"use one of {', '.join(map(repr, _STYLES))}"
            )

    def placements(self, mesh_ndim: int) -> tuple[Placement, ...]:
        """The parameters' placement on each dim of a mesh with ``mesh_ndim`` dims."""
        inner = Shard(0) if self.parallel_style in SHARDED_STYLES else Replicate()
        return (Replicate(),) * (mesh_ndim - 1) + (inner,)


_FLAGS = ("reshard_after_forward", "broadcast_buffers", "fuse_optimizer", "split_optimizer",
          "overlap", "keep_grads", "automatic_dynamic")
_SIZES_MB = ("bucket_cap_mb", "own_collective_mb", "prefetch_cap_mb", "reduce_cap_mb")


def _check_types(mode: DataParallel) -> None:
    """Raise an SPMDError naming the first argument of ``mode`` of the wrong type or range."""
    if not isinstance(mode.parallel_style, str):
        raise SPMDError(f"DataParallel: parallel_style must be a str, got "
                        f"{type(mode.parallel_style).__name__}")
    for name in _FLAGS:
        if not isinstance(getattr(mode, name), bool):
            raise SPMDError(f"DataParallel: {name} must be True or False, got {getattr(mode, name)!r}")
    for name in _SIZES_MB + ("first_bucket_cap_mb",):
        v = getattr(mode, name)
        if v is None and name != "first_bucket_cap_mb":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise SPMDError(f"DataParallel: {name} must be a number of MiB >= 0"
                            f"{'' if name == 'first_bucket_cap_mb' else ' (or None)'}, got {v!r}")
    for name in ("input_batch_dim", "dynamic_dims", "input_seq_dim"):
        v = getattr(mode, name)
        leaves = pytree.tree_leaves(v)
        bad = [x for x in leaves if x is not None and (isinstance(x, bool) or not isinstance(x, int))]
        if bad:
            raise SPMDError(
                f"DataParallel: {name} must be an int, None, or a pytree shaped like the batch "
                f"of ints and None; got {v!r} (holding {bad[0]!r}, a {type(bad[0]).__name__})")
    if mode.param_init_fn is not None and not callable(mode.param_init_fn):
        raise SPMDError(f"DataParallel: param_init_fn must be a callable fn(module) or None, got "
                        f"{type(mode.param_init_fn).__name__}")


def check_mesh(mode: DataParallel, mesh: Any) -> None:
    """Raise an SPMDError unless ``mesh`` is a DeviceMesh of the shape ``mode`` needs."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise SPMDError(f"spmd_compile(mesh=...) takes a torch.distributed.device_mesh.DeviceMesh, "
                        f"got {type(mesh).__name__}")
    style = mode.parallel_style
    want = 2 if style == "hybrid_shard" else 1
    # a larger mesh with named dims may hold tensor-parallel dims: the dims left to data
    # parallelism are checked again at the first call (spmd_compiler/features/tensor_parallel.py)
    if mesh.ndim != want and not (mesh.ndim > want and mesh.mesh_dim_names):
        hint = ("a 2-D mesh (replicate, shard), e.g. init_device_mesh('cpu', (nodes, per_node), "
                "mesh_dim_names=('replicate', 'shard'))" if want == 2 else
                "a 1-D mesh; pass one dim of a larger mesh, e.g. mesh['dp']")
        raise SPMDError(f"DataParallel({style!r}) needs {hint}; got a {mesh.ndim}-D mesh {mesh}")
    if want == 2 and not mesh.mesh_dim_names:
        raise SPMDError("DataParallel('hybrid_shard') needs a mesh with mesh_dim_names (e.g. "
                        "('replicate', 'shard')): the step agrees across all its ranks over the "
                        "mesh flattened by name")


def mesh_dims(mesh: Any) -> list[tuple[str, int]]:
    """(process group name, size) of each dim of ``mesh``, outermost first."""
    return [(mesh.get_group(d).group_name, mesh.size(d)) for d in range(mesh.ndim)]


ParallelMode = DataParallel


# Dtypes the backends reduce and gather (gloo raises "Invalid scalar type" on float8 types).
_COLLECTIVE_DTYPES = {
    "gloo": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "nccl": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}


def check_policy(policy, backend: str | None = None) -> None:
    """Raise a MixedPrecisionError for anything but a ``MixedPrecisionPolicy`` whose dtypes are
    floating point and, under ``backend`` (at the first call), dtypes the forward can compute in
    and the backend can gather (``param_dtype``) and reduce (the reduce dtype)."""
    if policy is None:
        return
    if not isinstance(policy, MixedPrecisionPolicy):
        raise MixedPrecisionError(
            f"DataParallel(mp_policy=...) takes a torch.distributed.fsdp.MixedPrecisionPolicy, "
            f"got {type(policy).__name__}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise MixedPrecisionError(
                f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype, got {dtype!r}")
    if not backend:
        return
    supported = _COLLECTIVE_DTYPES.get(str(backend).lower())
    for field, dtype, what in (("param_dtype", policy.param_dtype, "all-gather"),
                               ("reduce_dtype", reduce_dtype_of(policy), "reduce")):
        if supported is not None and dtype is not None and dtype not in supported:
            raise MixedPrecisionError(
                f"MixedPrecisionPolicy.{field}={dtype}: the {backend} backend cannot {what} "
                f"{dtype} tensors (it supports {', '.join(map(str, supported))}); choose one of "
                f"those")
    _check_computable(policy)


def _check_computable(policy) -> None:
    """Raise a MixedPrecisionError for a ``param_dtype`` or ``output_dtype`` that the forward
    and the loss cannot compute in: one with no type promotion (the float8 types: "Promotion
    for Float8 Types is not supported")."""
    for field in ("param_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is None:
            continue
        try:
            torch.promote_types(dtype, torch.float32)
        except RuntimeError as e:
            raise MixedPrecisionError(
                f"MixedPrecisionPolicy.{field}={dtype}: the model's outputs and the loss cannot "
                f"be computed in {dtype} ({e}); use torch.bfloat16, torch.float16 or "
                f"torch.float32 (float8 training goes through torchao's Float8Linear, whose "
                f"weights the compiled step gathers in float8)") from None


def reduce_dtype_of(policy) -> torch.dtype | None:
    """The dtype gradients are reduced in (FSDP2: ``reduce_dtype``, else ``param_dtype``);
    None: the gradient's own dtype."""
    if policy is None:
        return None
    return policy.reduce_dtype or policy.param_dtype
