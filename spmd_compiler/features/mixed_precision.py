"""Mixed precision with FSDP2's policy class (``torch.distributed.fsdp.MixedPrecisionPolicy``).

The parameters and the optimizer state keep their own dtype (fp32 master weights). While the
step is recorded, the root module's forward sees every floating-point parameter cast to
``param_dtype`` (one cast per parameter and forward call, tied parameters cast once), its
floating-point inputs cast to ``param_dtype`` (``cast_forward_inputs``) and its floating-point
outputs cast to ``output_dtype``, as FSDP2's pre- and post-forward hooks do. Autograd records
the casts' backward, so each gradient is computed in ``param_dtype`` and arrives in the
parameter's dtype; the expansion then reduces it in ``parallel_mode.reduce_dtype_of`` the policy and the
optimizer updates the fp32 parameters. fully_shard gathers a parameter whose every use is such a
cast in the cast dtype (passes/fully_shard.py casts the shard before the gather, as FSDP2 does).
"""

from __future__ import annotations

import contextlib

import torch

from ..torch_internals import pytree
from .per_call_parameters import parameters_replaced_per_call


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
