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
import re
import sys

import torch
import torch.distributed as dist

log = logging.getLogger("spmd_compiler")

NOTICE_SECONDS = 1.0
_DEFAULT = logging.StreamHandler(sys.stderr)  # the long-compile line's, when logging is not set up


def _first_rank() -> bool:
    return bool(os.environ.get("SPMD_LOG_ALL_RANKS")) or not dist.is_initialized() or \
        dist.get_rank() == 0


def reason(old: tuple | None, new: tuple) -> str | None:
    """Why a step with static key ``new`` compiles again after ``old`` (runtime/dispatch.step_key's named
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


def guard_miss(programs: list, key: tuple, sa) -> str | None:
    """Why the newest of ``programs`` (runtime.program.CompiledGraph) compiled for the static ``key``
    does not serve the call with arguments ``sa``, in plain words: the input, its dim and size
    (or the value) and what the program was compiled for; None if no program has that key."""
    from ..runtime.call_args import lifted_hparams
    from ..features.tensor_parallel import graph_inputs

    entry = next((e for e in reversed(programs) if e.static_key == key), None)
    if entry is None:
        return None
    inputs, traced = graph_inputs(sa), entry.traced
    names = [sa.leaf_name(i) for i in sa.input_indices]
    hparams = entry.with_lifted(lifted_hparams(sa)) if entry.values is not None else \
        lifted_hparams(sa)
    for i, value in traced.specialized_hparams:
        if hparams[i] != value:
            return (f"a learning rate (or a number the step reads), {hparams[i]!r}, differs from "
                    f"the constant {value!r} the program was compiled with")
    for name, t, sizes in zip(names, inputs, traced.static_sizes):
        for d, size in sizes:
            if t.shape[d] != size:
                return (f"{name} has size {t.shape[d]} in dim {d}; the program was compiled for "
                        f"size {size} there (a constant in it)")
    for k, value in traced.specialized_inputs:
        if not torch.equal(inputs[k], value):
            return (f"{names[k]} (an unbatched input whose values the recording read) has other "
                    f"values than the program was compiled for")
    return _failed_shape_guard(entry.guard_code, inputs, names)


def _failed_shape_guard(code: str | None, inputs: list, names: list[str]) -> str | None:
    """The first of the ShapeEnv's guards (``code``: ``a and b and ...`` over ``L['t<i>']``)
    that the inputs fail, with the inputs named as the user passed them."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    scope = {"L": {f"t{i}": t for i, t in enumerate(inputs)}}
    for part in _conjuncts(code or ""):
        try:
            holds = bool(eval(part, SYMPY_INTERP, scope))
        except Exception:  # noqa: BLE001 - a part that cannot be judged alone
            continue
        if not holds:
            used = sorted({int(i) for i in re.findall(r"L\['t(\d+)'\]", part)})
            readable = re.sub(r"L\['t(\d+)'\]\.size\(\)\[(\d+)\]",
                              lambda m: f"{names[int(m[1])]}.shape[{m[2]}]", part)
            shapes = ", ".join(f"{names[i]} has shape {tuple(inputs[i].shape)}" for i in used)
            return (f"the program was compiled for sizes with {readable}, and {shapes}" if shapes
                    else f"the program's guard {readable} fails")
    return None


def _conjuncts(code: str) -> list[str]:
    """``a and b and c`` split at its top-level ``and``s."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(code):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and code.startswith(" and ", i):
            parts.append(code[start:i])
            start = i + 5
    return parts + [code[start:]] if code else parts
