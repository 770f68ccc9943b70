"""Gradients a step would carry from one call into the next: refused, not silently dropped.

A compiled call starts from no gradient. An eager step that adds to a parameter's gradient
without resetting it first, and leaves it set at its end, adds the previous call's gradient at
the next call (nothing zeroes it in between). :class:`GradientResets` records, while the step
is recorded, when the step resets each gradient (``zero_grad()``, ``p.grad = None``) relative to
the backward calls that add to it (torch_internals.gradient_resets and the recording's
post-accumulate hooks), and :meth:`GradientResets.check` raises ``UnsupportedError`` for a
gradient an optimizer of the step holds that the step leaves set without resetting it before
its first backward. Accumulation across calls is what ``no_sync()`` is for (those recordings
are not checked).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError


class GradientResets:
    """When the step resets each parameter's gradient: the number of backward calls that had
    added to it by its first reset (``grad_nodes``: fqn -> one node per accumulation)."""

    def __init__(self, fqn_of_fake: dict[int, str], grad_nodes: dict[str, list]):
        self.fqn_of_fake, self.grad_nodes = fqn_of_fake, grad_nodes
        self.first: dict[str, int] = {}

    def reset(self, p: torch.Tensor) -> None:
        fqn = self.fqn_of_fake.get(id(p))
        if fqn is not None:
            self.first.setdefault(fqn, len(self.grad_nodes.get(fqn, ())))

    def check(self, params: list[tuple[str, torch.Tensor]], optimizers: list, where: str) -> None:
        """Raise for the optimizers' parameters whose gradient the step adds to before any reset
        and leaves set (``params``: (fqn, fake parameter) at the end of the step)."""
        held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        carried = [fqn for fqn, p in params
                   if id(p) in held and p.grad is not None and self.grad_nodes.get(fqn)
                   and self.first.get(fqn, 1) != 0]
        if carried:
            shown = ", ".join(carried[:4]) + (f" and {len(carried) - 4} more" if len(carried) > 4
                                              else "")
            raise UnsupportedError(
                f"the step {where} adds to the gradient of {shown} before resetting it and "
                f"leaves it set, so eager PyTorch would add this call's gradient to the next "
                f"call's; a compiled call starts from no gradient. Reset the gradients in the "
                f"step before its backward (optim.zero_grad(), or model.zero_grad() for a module "
                f"no optimizer zeroes), or accumulate across calls inside "
                f"`with train_step.no_sync():`.")
