"""Gradient accumulation across calls of a compiled step (DDP's ``no_sync``).

``with step.no_sync(): step(model, optim, batch)`` runs the step's forward and backward only:
no gradient collective, no optimizer update. The gradients (each rank's own, unsharded, in the
parameters' dtype) are kept with the model between calls (``accumulated_grads``: one set per
model object, so two models trained through one step never mix theirs). The next call outside
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
import weakref

import torch

ACCUMULATE = "accumulate"
APPLY = "apply"

_GRADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]]" = (
    weakref.WeakKeyDictionary())


def accumulated_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients that calls inside ``no_sync`` accumulated for ``module``'s
    parameters, by parameter name (empty when none): the model's, whatever step ran them; the
    runtime adds to and clears this dict in place."""
    grads = _GRADS.get(module)
    if grads is None:
        grads = _GRADS[module] = {}
    return grads


@contextlib.contextmanager
def accumulating(optimizers, module: torch.nn.Module,
                 grads_in: list[tuple[torch.Tensor, torch.Tensor]], mode: str | None):
    """While recording the step in ``mode`` (``ACCUMULATE`` / ``APPLY``; None: nothing): each
    (parameter, gradient) of ``grads_in`` starts with that gradient, ``zero_grad`` of the
    optimizers and of the module does nothing, and accumulating neither does ``step``.
    Restores the patched methods afterwards, an instance's own too (an LR scheduler's wrapper
    of ``optimizer.step``)."""
    if mode is None:
        yield
        return
    for param, grad in grads_in:
        param.grad = grad
    patched = [(opt, "zero_grad") for opt in optimizers] + [(module, "zero_grad")]
    if mode == ACCUMULATE:
        patched += [(opt, "step") for opt in optimizers]
    own = [(obj, name, obj.__dict__[name]) for obj, name in patched if name in obj.__dict__]
    for obj, name in patched:
        setattr(obj, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for obj, name in patched:
            obj.__dict__.pop(name, None)
        for obj, name, method in own:
            obj.__dict__[name] = method


class KeptGradients:
    """A compiled step's accumulation state: inside ``no_sync`` or not, and the gradients that
    ``module`` (the model of the current call, set by the step) accumulated on this rank so far
    (``accumulated_grads``: the model's, updated in place by the runtime)."""

    def __init__(self):
        self.inside_no_sync = False
        self.module: torch.nn.Module | None = None

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        return accumulated_grads(self.module) if self.module is not None else {}

    @contextlib.contextmanager
    def no_sync(self):
        outer, self.inside_no_sync = self.inside_no_sync, True
        try:
            yield
        finally:
            self.inside_no_sync = outer

    def mode_for(self, module: torch.nn.Module) -> str | None:
        """``mode`` for a call with ``module``, whose accumulated gradients the call then uses."""
        self.module = module
        return self.mode

    @property
    def mode(self) -> str | None:
        """The program this call needs: ``ACCUMULATE``, ``APPLY`` or None (no accumulation)."""
        return ACCUMULATE if self.inside_no_sync else APPLY if self.grads else None
