"""Gradient accumulation across calls of a compiled step (DDP's ``no_sync``).

``with step.no_sync(): step(model, optim, batch)`` runs the step's forward and backward only:
no gradient collective, no optimizer update. The gradients (each rank's own, unsharded, in the
parameters' dtype) are kept by the compiled step between calls. The next call outside
``no_sync`` runs the whole step, its backward adding to the kept gradients, then syncs them
once and updates the parameters, as DDP does after ``no_sync`` and FSDP2 after
``set_requires_gradient_sync(False)``; the kept gradients are then dropped.

Inside these calls the step's ``zero_grad`` does nothing (it would discard what was
accumulated): the gradients start from the kept ones, or from zero at the first ``no_sync``
call. Each mode is its own program (recorded once, with the mode in the cache key):

- ``ACCUMULATE``: gradients in, forward + backward, gradients out; ``optim.step()`` and
  ``zero_grad`` are no-ops, the expansion inserts no gradient collective.
- ``APPLY``: gradients in, the whole step.
"""

from __future__ import annotations

import contextlib

import torch

ACCUMULATE = "accumulate"
APPLY = "apply"


@contextlib.contextmanager
def accumulating(optimizers, module: torch.nn.Module,
                 grads_in: list[tuple[torch.Tensor, torch.Tensor]], mode: str | None):
    """While recording the step in ``mode`` (``ACCUMULATE`` / ``APPLY``; None: nothing): each
    (parameter, gradient) of ``grads_in`` starts with that gradient, ``zero_grad`` of the
    optimizers and of the module does nothing, and accumulating neither does ``step``.
    Restores the patched methods afterwards."""
    if mode is None:
        yield
        return
    for param, grad in grads_in:
        param.grad = grad
    patched = [(opt, "zero_grad") for opt in optimizers] + [(module, "zero_grad")]
    if mode == ACCUMULATE:
        patched += [(opt, "step") for opt in optimizers]
    for obj, name in patched:
        setattr(obj, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for obj, name in patched:
            obj.__dict__.pop(name, None)


class KeptGradients:
    """A compiled step's accumulation state: inside ``no_sync`` or not, and each parameter's
    gradient accumulated on this rank so far (updated in place by the runtime)."""

    def __init__(self):
        self.inside_no_sync = False
        self.grads: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def no_sync(self):
        outer, self.inside_no_sync = self.inside_no_sync, True
        try:
            yield
        finally:
            self.inside_no_sync = outer

    @property
    def mode(self) -> str | None:
        """The program this call needs: ``ACCUMULATE``, ``APPLY`` or None (no accumulation)."""
        return ACCUMULATE if self.inside_no_sync else APPLY if self.grads else None
