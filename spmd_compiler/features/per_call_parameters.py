"""Parameters replaced for the duration of each outermost call of a module.

Mixed precision (the casts of ``param_dtype``) and FSDP2's all-gather extensions (the weight the
post hook rebuilds) both record the forward with other tensors in the parameter slots and put
the parameters back after the call, also when it raises.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


@contextlib.contextmanager
def parameters_replaced_per_call(
        module: torch.nn.Module,
        replacement: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor | None],
        inputs: Callable[[tuple, dict], Any] | None = None,
        output: Callable[[Any], Any] | None = None):
    """While active, each outermost call of ``module`` runs with every parameter slot holding
    ``replacement(owner, p)`` for its parameter ``p`` (asked once per parameter, at its first
    slot: tied slots share it; None leaves the slot alone). ``inputs(args, kwargs)`` and
    ``output(out)`` may replace the call's inputs and output, as forward hooks do."""
    depth = [0]
    saved: list[tuple[torch.nn.Module, str, torch.Tensor]] = []

    def restore():
        while saved:
            sub, name, p = saved.pop()
            sub._parameters[name] = p

    def enter(mod, args, kwargs):
        depth[0] += 1
        if depth[0] > 1:
            return None
        made: dict[int, torch.Tensor | None] = {}
        for sub in mod.modules():
            for name, p in sub._parameters.items():
                if p is None:
                    continue
                if id(p) not in made:
                    made[id(p)] = replacement(sub, p)
                if made[id(p)] is not None:
                    saved.append((sub, name, p))
                    sub._parameters[name] = made[id(p)]
        return inputs(args, kwargs) if inputs is not None else None

    def leave(mod, args, kwargs, out):
        depth[0] -= 1
        if depth[0]:
            return None
        restore()
        return output(out) if output is not None else None

    handles = [module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
               module.register_forward_hook(leave, with_kwargs=True, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        restore()
