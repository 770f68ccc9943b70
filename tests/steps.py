"""The training steps the tests compile, written once.

Every step the tests compile has the seed's shape: ``optim.zero_grad()``, a loss of the model's
output, ``loss.backward()``, ``optim.step()``, return the loss. Steps differ only in their loss
(and sometimes in what runs between backward and the optimizer step, e.g. gradient clipping), so
a test names its loss and builds its step with :func:`step_with`::

    clip_step = step_with(diff_sum, between=lambda model: clip_grad_norm_(model.parameters(), 1.0))

Losses take ``(model, batch)``: ``batch`` is the step's third argument, a tensor or an ``(x, y)``
pair. The common steps are defined here (``train_step``, ``mse_step``, ``sum_step``, ...); a
test module's own loss (one that reads a global, a closure or a config value) stays in the test
module, where the value it reads lives.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def step_with(loss_of: Callable, *, between: Callable | None = None,
              name: str | None = None) -> Callable:
    """The step ``(model, optim, batch)``: zero_grad, ``loss = loss_of(model, batch)``,
    backward, then ``between(model)`` if given, then the optimizer step.

    Returns the loss, or ``(loss, between(model))`` when ``between`` returns a value. ``name`` (default:
    the loss's name with ``_step``) is the step's ``__name__`` (the compiler logs it)."""

    def step(model, optim, batch):
        optim.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        extra = between(model) if between is not None else None
        optim.step()
        return loss if extra is None else (loss, extra)

    step.__name__ = step.__qualname__ = name or f"{loss_of.__name__}_step"
    step.__doc__ = loss_of.__doc__
    return step


# --------------------------------------------------------------------------------------------------
# Losses of (model, batch)
# --------------------------------------------------------------------------------------------------


def diff_sum(model, batch):
    """The seed's loss: the sum of ``model(x) - y``."""
    x, y = batch
    return (model(x) - y).sum()


def square_sum(model, batch):
    """The sum of squared errors."""
    x, y = batch
    return ((model(x) - y) ** 2).sum()


def square_mean(model, batch):
    """The mean of squared errors (a loss that averages over the local batch)."""
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def mse(model, batch):
    """``F.mse_loss`` (a loss that averages over the local batch, as DDP users write it)."""
    x, y = batch
    return F.mse_loss(model(x), y)


def output_sum(model, x):
    """The sum of the model's output (an unlabelled batch)."""
    return model(x).sum()


def token_cross_entropy(model, batch):
    """Next-token cross-entropy over every position; ``batch = (tokens, targets)``."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def flexible(model, batch):
    """Accepts a ``(x, y)`` tuple or a ``{"x": ..., "y": ...}`` dict; computes in float32 whatever
    the batch's dtype (so a float64 batch is a new input signature for an unchanged model)."""
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    out = model(x.to(torch.float32))
    return ((out - y.to(torch.float32)) ** 2).sum()


def self_labelled(model, ids):
    """A Hugging Face causal LM's own loss on ``ids`` (``labels=ids``)."""
    return model(ids, labels=ids).loss


def clip_norm(max_norm: float, returned: bool = True, **kwargs) -> Callable:
    """``between``: ``clip_grad_norm_(model.parameters(), max_norm, **kwargs)``; the step returns
    the total norm beside the loss when ``returned``."""

    def clip(model):
        total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, **kwargs)
        return total_norm if returned else None

    return clip


def weighted_mse_step(model, optim, batch, weight):
    """The step of ``mse(model, batch) * weight``, for a step that reads its weight from
    somewhere (a global, a closure, an attribute) and passes it on, so that the read stays in
    that step's own line::

        def weighted_step(model, optim, batch):
            return weighted_mse_step(model, optim, batch, LOSS_WEIGHT)
    """
    optim.zero_grad()
    loss = mse(model, batch) * weight
    loss.backward()
    optim.step()
    return loss


# --------------------------------------------------------------------------------------------------
# The common steps
# --------------------------------------------------------------------------------------------------

train_step = step_with(diff_sum, name="train_step")  # the seed's training step
mse_step = step_with(mse)
sum_step = step_with(output_sum, name="sum_step")
square_sum_step = step_with(square_sum)
square_mean_step = step_with(square_mean)
lm_step = step_with(token_cross_entropy, name="lm_step")
flexible_step = step_with(flexible)
