"""Meta kernels for the fused optimizer ops that torch 2.13 ships without one.

Recording a step runs every op on fake tensors. An op with no Meta kernel makes fake tensor
mode fall back to the real CPU kernel on real zero-filled copies of every input: for
``_fused_adam_.tensor_lr`` (what the tracer records for Adam) that is the parameters,
gradients and both moment buffers of the whole model, allocated and computed on during
compilation (the first compile's resident memory peaked at about four times the model's
parameter bytes). These ops update their inputs in place and return nothing, so a kernel that
does nothing is exact for them.
"""

from __future__ import annotations

import torch

from ..torch_internals import has_kernel

_FUSED_OPTIMIZERS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
_LIBRARY = torch.library.Library("aten", "IMPL")  # kept alive: the registrations live with it


def _updates_in_place(*args, **kwargs) -> None:
    return None


def _register() -> list[str]:
    registered = []
    for name in _FUSED_OPTIMIZERS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            qualified = name if overload == "default" else f"{name}.{overload}"
            schema = getattr(packet, overload)._schema
            if schema.returns or has_kernel(f"aten::{qualified}", "Meta"):
                continue
            _LIBRARY.impl(qualified, _updates_in_place, "Meta")
            registered.append(qualified)
    return registered


REGISTERED = _register()
