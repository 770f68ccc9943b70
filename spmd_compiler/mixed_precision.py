"""Mixed precision with FSDP2's policy class (``torch.distributed.fsdp.MixedPrecisionPolicy``).

The parameters and the optimizer state keep their own dtype (fp32 master weights). While the
step is recorded, the root module's forward sees every floating-point parameter cast to
``param_dtype`` (one cast per parameter and forward call, tied parameters cast once), its
floating-point inputs cast to ``param_dtype`` (``cast_forward_inputs``) and its floating-point
outputs cast to ``output_dtype``, as FSDP2's pre- and post-forward hooks do. Autograd records
the casts' backward, so each gradient is computed in ``param_dtype`` and arrives in the
parameter's dtype; the expansion then reduces it in :func:`reduce_dtype_of` the policy and the
optimizer updates the fp32 parameters. fully_shard gathers a parameter whose every use is such a
cast in the cast dtype (passes/fully_shard.py casts the shard before the gather, as FSDP2 does).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from .torch_internals import pytree
from .errors import MixedPrecisionError
from .per_call_parameters import parameters_replaced_per_call


# Dtypes the backends reduce and gather (gloo raises "Invalid scalar type" on float8 types).
_COLLECTIVE_DTYPES = {
    "gloo": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "nccl": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}


def check_policy(policy, backend: str | None = None) -> None:
    """Raise a MixedPrecisionError for anything but a ``MixedPrecisionPolicy`` whose dtypes are
    floating point and, under ``backend``, dtypes the backend can gather (``param_dtype``) and
    reduce (the reduce dtype)."""
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
    if backend:
        _check_computable(policy)
    supported = _COLLECTIVE_DTYPES.get(str(backend).lower()) if backend else None
    if supported is None:
        return
    for field, dtype, what in (("param_dtype", policy.param_dtype, "all-gather"),
                               ("reduce_dtype", reduce_dtype_of(policy), "reduce")):
        if dtype is not None and dtype not in supported:
            raise MixedPrecisionError(
                f"MixedPrecisionPolicy.{field}={dtype}: the {backend} backend cannot {what} "
                f"{dtype} tensors (it supports {', '.join(map(str, supported))}); choose one of "
                f"those")


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


def _cast(dtype: torch.dtype | None, tree):
    if dtype is None:
        return tree
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


@contextlib.contextmanager
def cast_forward(module: torch.nn.Module, policy):
    """While active, each outermost call of ``module`` runs with its floating-point parameters
    cast to ``policy.param_dtype`` (the parameter slots hold the casts during the call and the
    originals again after it, also when it raises), its inputs and outputs cast as the policy
    says. For recording the step: the casts become graph nodes whose backward autograd records."""
    if policy is None or (policy.param_dtype is None and policy.output_dtype is None):
        yield
        return
    dtype = policy.param_dtype

    def cast(owner, p):
        if dtype is None or not p.is_floating_point() or p.dtype == dtype or (
                getattr(p, "_spmd_unsharded", False)):  # an all-gather extension's own
            return None
        return p.to(dtype)

    cast_inputs = dtype is not None and policy.cast_forward_inputs
    with parameters_replaced_per_call(
            module, cast, inputs=(lambda args, kwargs: _cast(dtype, (args, kwargs))) if cast_inputs
            else None, output=lambda out: _cast(policy.output_dtype, out)):
        yield
