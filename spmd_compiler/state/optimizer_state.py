"""The optimizer's state made before the first compile, so that the first call compiles the
steady program and the second call runs it (one compile, not two).

An optimizer makes its state lazily in its first ``step()``: recorded as it is, the first call's
program creates the state and the second call, whose optimizer now has state, compiles again.
For the optimizers whose first step is provably the steady step on zero state, the state is made
before recording, by the optimizer's own initialisation:

- ``Adam`` and ``AdamW`` (single-tensor, foreach and fused; amsgrad; capturable): their first step
  makes ``step`` = 0 and zero moments (``Adam._init_group``) and then runs the same update as
  every later step; the state is made by ``_init_group`` itself, so its dtypes and devices are
  the optimizer's own.

Every other optimizer keeps torch's behaviour (a state-creating program, then the steady one):
SGD with momentum clones the gradient into its first buffer (with dampening, not the steady
update on a zero buffer), others have first steps of their own.

Eager PyTorch makes state only for the parameters that have a gradient at the first step; the
state is made for every parameter that requires grad, which is the same set: a compiled step
refuses a parameter that requires grad and gets none (MissingGradientError). A compile that
fails removes the state it made: a failed compile changes nothing.
"""

from __future__ import annotations

import contextlib

import torch

from .. import torch_internals

_PROVEN = (torch.optim.Adam, torch.optim.AdamW)


def _eligible(opt) -> bool:
    """A proven optimizer without state whose parameters hold data: state made for a model
    still on the meta device would stay there (the first compiled call materializes the model
    after recording), so such a step keeps the state-creating program."""
    return type(opt) in _PROVEN and not opt.state and not any(
        g.get("differentiable") or any(p.is_meta for p in g["params"]) for g in opt.param_groups)


@contextlib.contextmanager
def made_before_recording(optimizers, accumulating: bool, sharded: bool = False):
    """Make the first-step state of each proven optimizer without state (not for a ``no_sync``
    call, which does not step); removed again if the block raises. ``sharded``: the state will
    live as dim-0 shards (fully_shard), so a state of the parameter's shape is made as a zero
    that holds no memory (an expanded 0-d zero) and placing it makes only this rank's shard;
    the recording reads only its shape and dtype."""
    made = []
    if not accumulating:
        for opt in filter(_eligible, optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        _init_one(opt, group, p, sharded)
            made.append(opt)
    try:
        yield
    except BaseException:
        for opt in made:
            opt.state.clear()
        raise


def _init_one(opt, group: dict, p: torch.Tensor, sharded: bool) -> None:
    """``p``'s state, made by the optimizer's own initialisation for a group of ``p`` alone (one
    parameter's worth of temporaries at a time); with ``sharded``, its full-size plain tensors
    replaced by expanded zeros (a tensor-subclass state, whose inner tensors the program takes
    one by one, is kept as the optimizer made it)."""
    with torch.no_grad(), _grads_present([p]):
        torch_internals.init_adam_state(opt, {**group, "params": [p]})
    state = opt.state[p]
    for k, v in state.items():
        if sharded and type(v) is torch.Tensor and v.dim() and v.shape == p.shape:
            state[k] = v = torch.zeros((), dtype=v.dtype, device=v.device).expand(v.shape)
        if isinstance(v, torch.Tensor):
            v._spmd_made_zero = True


def same_on_every_rank(v: torch.Tensor) -> bool:
    """Is ``v`` a state value made here (zero and step 0 on every rank alike), which placing
    the state need not broadcast? Placing makes new tensors, so a value no longer counts once
    placed, or once replaced (``load_state_dict``)."""
    return getattr(v, "_spmd_made_zero", False)


@contextlib.contextmanager
def _grads_present(params):
    """A zero gradient on every parameter without one (Adam makes state only where there is a
    gradient), taken away again after."""
    missing = [p for p in params if p.grad is None]
    for p in missing:
        p.grad = torch.zeros_like(p)
    try:
        yield
    finally:
        for p in missing:
            p.grad = None
