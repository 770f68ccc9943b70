"""What a compile says: one line per compile, shown by default when it is long, and why a step
compiled again, in plain words.

A compile shorter than ``NOTICE_SECONDS`` logs its line at INFO on the ``spmd_compiler`` logger
(shown when logging is configured to show it). A longer one is shown by default, on rank 0 (every
rank with ``SPMD_LOG_ALL_RANKS``): to stderr while nobody has set the ``spmd_compiler`` logger's
level, through the logger's handlers when INFO is enabled. Quiet with logging's usual switch:
``logging.getLogger("spmd_compiler").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

log = logging.getLogger("spmd_compiler")

NOTICE_SECONDS = 1.0
_DEFAULT = logging.StreamHandler(sys.stderr)  # the long-compile line's, when logging is not set up


def _first_rank() -> bool:
    return bool(os.environ.get("SPMD_LOG_ALL_RANKS")) or not dist.is_initialized() or \
        dist.get_rank() == 0


def reason(old: tuple | None, new: tuple) -> str | None:
    """Why a step with static key ``new`` compiles again after ``old`` (api.step_key's named
    components), in plain words; None for a first compile."""
    if old is None:
        return None
    before, now = dict(old), dict(new)
    changed = [name for name in now if before.get(name) != now[name]]
    words = []
    for name in changed:
        if name == "optimizer" and _created_state(before[name], now[name]):
            words.append("the optimizer created its state on the first call (a second compile, "
                         "once)")
        else:
            words.append(_WORDS.get(name, f"the step's {name} changed"))
    return "; ".join(words) or ("an input size, a baked-in learning rate or an unbatched input's "
                                "value is outside what the compiled graphs serve")


_WORDS = {
    "module": "the step got another model",
    "parameters": "the model's parameters changed (new tensors, shapes, dtypes or requires_grad)",
    "buffers": "the model's buffers changed",
    "train/eval mode": "the model switched between train() and eval()",
    "optimizer": "the optimizer changed (its param_groups' settings or its state)",
    "input structure": "the batch's structure changed",
    "inputs": "the batch's dtypes, devices or dimensions changed",
    "constants": "a non-tensor argument changed",
    "gradient accumulation": "the step entered or left no_sync()",
}


def _created_state(old: tuple, new: tuple) -> bool:
    """Did only the optimizers' state change, from none to some (the first optimizer step)?"""
    if len(old) != len(new):
        return False
    return all(o[:3] == n[:3] and not any(keys for _, keys in o[3]) for o, n in zip(old, new)) \
        and old != new


def announce(name: str, style: str, nodes: int, seconds: dict[str, float], loaded: bool,
             why: str | None) -> None:
    """The one line of a compile: what, how big, how long per stage, and why it compiled again."""
    if not _first_rank():
        return
    total = sum(seconds.values())
    stages = ", ".join(f"{stage} {s:.2f}" for stage, s in seconds.items() if s >= 0.01)
    msg = (f"spmd_compiler: {'loaded' if loaded else 'compiled'} {name} ({style}, {nodes} nodes) "
           f"in {total:.2f}s" + (f" [{stages} s]" if stages else "")
           + (f"; compiled again because {why}" if why else ""))
    if log.isEnabledFor(logging.INFO) or total < NOTICE_SECONDS:
        log.info(msg)
    elif log.level == logging.NOTSET:
        _DEFAULT.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, msg, None, None))
