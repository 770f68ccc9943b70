"""``spmd_compile(..., verify=N)``: the compiled step checked against the step run eagerly with
DDP's semantics, the oracle.

A checked call first runs the user's step eagerly on plain copies of the state it trains — every
parameter and buffer of the step's modules as one full tensor, the optimizers' state keyed by
those copies — with DDP's semantics: buffers broadcast from rank 0 before the step, and every
parameter gradient averaged over the data-parallel ranks as autograd stores it (a hook after
each accumulation, so any number of modules, optimizers, backward calls, gradient penalties
and forwards reused after a step need no special case). The Python state the step changes
(schedulers, counters, the optimizers' param groups) is put back after it
(trace/side_effects.watch), the random generator is forked so both runs draw alike, and the
tensors the step is given are copied. Then the compiled call runs as always, and every
parameter, buffer, optimizer state and returned value is compared at ``verify_tolerance``.
On a difference every rank raises ``DivergenceError`` naming the first differing values,
whether the program ran was compiled at an earlier call (a Python value the step reads may have
changed unseen since), and how to narrow it down.

Costs per checked call: one eager run of the step, and three full copies of the parameters,
buffers and optimizer state on every rank (under fully_shard gathered: the model's whole size).
Calls inside ``no_sync()`` and the call that syncs them, calls under a mixed-precision policy and
steps with a tensor-parallel plan are not checked (logged once).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .errors import DivergenceError, SPMDError
from .torch_internals import pytree

log = logging.getLogger("spmd_compiler")

DEFAULT_TOLERANCE = (1e-4, 1e-5)  # (rtol, atol)


@dataclass
class Verification:
    """Which calls are checked: the first ``first``, then every ``every``-th (0: none)."""

    first: int
    every: int
    rtol: float
    atol: float
    calls: int = 0
    checked: int = 0
    skipped_why: str | None = None

    def due(self) -> bool:
        """Count a call; is it one to check?"""
        self.calls += 1
        k = self.calls
        return k <= self.first or (self.every > 0 and (k - self.first) % self.every == 0)


def verification(verify: int | None, verify_every: int | None,
                 tolerance: tuple[float, float] | None) -> Verification | None:
    """The checks asked for by the arguments, else by ``SPMD_VERIFY`` / ``SPMD_VERIFY_EVERY``."""
    first = verify if verify is not None else _env_int("SPMD_VERIFY")
    every = verify_every if verify_every is not None else _env_int("SPMD_VERIFY_EVERY")
    if first < 0 or every < 0:
        raise SPMDError(f"verify and verify_every count calls: got {first} and {every}")
    rtol, atol = tolerance or DEFAULT_TOLERANCE
    return Verification(first, every, rtol, atol) if first or every else None


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise SPMDError(f"{name}={raw!r} is not a number of calls") from None


@dataclass
class Variants:
    """How to compile the step again for the diagnosis: ``make(**DataParallel options)`` gives
    a new compiled step; ``transformed``: the step has a ``gm_transformation``."""

    make: Callable[..., Callable]
    transformed: bool
    optional_stages: tuple[str, ...]


def checked_call(fn: Callable, sa, group, why_not: str | None, compiled_call: Callable,
                 check: Verification, fresh: Callable[[], bool], broadcast_buffers: bool = True,
                 variants: Variants | None = None):
    """Run ``compiled_call()`` checked against the eager reference of ``fn`` on ``sa``'s
    state (runtime.call_args.StepArgs); ``group``: the data-parallel ranks; ``why_not``: why
    this call cannot be checked (then it only runs); ``fresh()``: was the program that ran
    compiled by this call? ``broadcast_buffers``: as DDP's option of that name; ``variants``:
    for the diagnosis of a difference (:func:`_diagnosis`)."""
    if why_not is not None:
        if check.skipped_why != why_not:
            log.info("spmd_compiler: verify skips calls of %s: %s", _name(fn), why_not)
            check.skipped_why = why_not
        return compiled_call()
    modules = _modules(sa)
    rng = torch.get_rng_state()
    before = _state(modules, sa.optimizers)
    if check.checked == 0:
        size = sum(v.numel() * v.element_size() for v in before.values()
                   if isinstance(v, torch.Tensor))
        log.info("spmd_compiler: verify: each checked call of %s runs it eagerly once and holds "
                 "3 full copies of its state on every rank (%.1f MiB each)", _name(fn),
                 size / 2**20)
    expected, ref_out = _reference(fn, sa, modules, group, broadcast_buffers)
    torch.set_rng_state(rng)
    out = compiled_call()
    got = _state(modules, sa.optimizers)
    problems = _differences(expected, got, check)
    problems += _differences(_outputs(ref_out), _outputs(out), check, what="returned value")
    check.checked += 1
    if _any_rank(bool(problems), group):
        was_fresh = fresh()
        diagnosis = _diagnosis(fn, sa, modules, group, before, expected, rng, check, was_fresh,
                               variants) if variants is not None else ""
        _write(modules, sa.optimizers, got)  # the compiled call's result, as it left it
        _raise_on_every_rank(problems, group, fn, check, was_fresh, diagnosis)
    return out


def _any_rank(flag: bool, group) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _diagnosis(fn, sa, modules, group, before, expected, rng, check: Verification,
               fresh: bool, variants: Variants) -> str:
    """Where the difference comes from: the call run again from the state before it, compiled
    afresh (a stale program then agrees); then with every shortcut and optional stage off at
    once, and if that agrees with one at a time; then without the user's ``gm_transformation``.
    The first variant that agrees with the reference on every rank is named."""
    every = ",".join(variants.optional_stages)
    alone = [("with block reuse off (SPMD_NO_BLOCK_REUSE=1)", {"SPMD_NO_BLOCK_REUSE": "1"}, {}),
             ("with the optimizer recorded as written (DataParallel(fuse_optimizer=False))", {},
              {"fuse_optimizer": False})]
    alone += [(f"with stage {name!r} off (SPMD_DISABLE_PASSES={name})",
               {"SPMD_DISABLE_PASSES": name}, {}) for name in variants.optional_stages]
    plan = [] if fresh else [("compiled afresh from the Python values the step reads now", {}, {})]
    plan.append(("with every shortcut and optional stage off", {
        "SPMD_NO_BLOCK_REUSE": "1", "SPMD_DISABLE_PASSES": every}, {"fuse_optimizer": False}))
    for label, env, options in plan:
        agrees = _agrees(fn, sa, modules, group, before, expected, rng, check, variants, env,
                         options)
        if isinstance(agrees, str):
            return f" The diagnosis could not run ({label}: {agrees})."
        if agrees and label.startswith("compiled afresh"):
            return (" Compiled afresh from the Python values the step reads now, the call "
                    "agrees: the program that ran was stale (a Python value it read changed "
                    "unseen since it was compiled).")
        if agrees:
            for one, env1, options1 in alone:
                if _agrees(fn, sa, modules, group, before, expected, rng, check, variants, env1,
                           options1) is True:
                    return f" The call agrees {one}: the difference comes from there."
            return (" The call agrees with every shortcut and optional stage off, but with no "
                    "single one off: several of them together make the difference.")
    if variants.transformed and _agrees(fn, sa, modules, group, before, expected, rng, check,
                                        variants, {}, {"_no_transformation": True}) is True:
        return " The call agrees without the gm_transformation: the difference comes from there."
    return (" With every shortcut and optional stage off it still differs: the recording "
            "itself does.")


def _agrees(fn, sa, modules, group, before, expected, rng, check: Verification,
            variants: Variants, env: dict, options: dict) -> bool | str:
    """Run the call again from ``before``, compiled with ``env`` set and ``options``: does every
    rank agree with ``expected``? (A string: why it could not run.)"""
    from .trace.side_effects import step_constants, watch
    from .torch_internals import user_line_here

    args, kwargs = pytree.tree_unflatten(sa.leaves, sa.spec)
    failure = None
    try:
        _write(modules, sa.optimizers, before)
        torch.set_rng_state(rng)
        with _environment({**env, "SPMD_CACHE_DIR": None}), watch(
                fn, sa.module, sa.optimizers, step_constants(sa), user_line_here, into=[]):
            variants.make(**options)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a diagnosis that cannot run says so
        failure = f"{type(e).__name__}: {e}"
    if _any_rank(failure is not None, group):  # every rank stops trying together
        return failure or "it failed on another rank"
    return not _any_rank(bool(_differences(expected, _state(modules, sa.optimizers), check)),
                         group)


@contextlib.contextmanager
def _environment(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _live(modules, optimizers) -> dict[str, Any]:
    """The live tensors (or (state dict, key) of a non-tensor state entry) under :func:`_state`'s
    names."""
    out: dict[str, Any] = {}
    names: dict[int, str] = {}
    for label, m in modules:
        for n, p in m.named_parameters():
            names.setdefault(id(p), f"{label}.{n}")
            out[f"parameter {label}.{n}"] = p
        for n, b in m.named_buffers():
            out[f"buffer {label}.{n}"] = b
    for k, opt in enumerate(optimizers):
        for gi, g in enumerate(opt.param_groups):
            for j, p in enumerate(g["params"]):
                who = names.get(id(p), f"group {gi} parameter {j}")
                st = opt.state.get(p, {})
                for key in st:
                    out[f"optimizer {k} state {key} of {who}"] = (st, key)
    return out


def _write(modules, optimizers, values: dict[str, Any]) -> None:
    """Write ``values`` (full tensors by :func:`_state`'s names) into the live state in place."""
    from torch.distributed.tensor import distribute_tensor

    from .torch_internals import local_tensor

    for name, live in _live(modules, optimizers).items():
        if isinstance(live, tuple):  # an optimizer state entry: made by the call, or written
            state, key = live
            if name not in values:
                del state[key]
                continue
            if not isinstance(state[key], torch.Tensor):
                state[key] = values[name]
                continue
            live = state[key]
        if name not in values:
            continue
        value = values[name]
        if isinstance(live, DTensor):
            local = distribute_tensor(value.to(live.dtype), live.device_mesh, live.placements)
            with torch.no_grad():
                local_tensor(live).copy_(local_tensor(local))
        else:
            with torch.no_grad():
                live.copy_(value)
    for opt in optimizers:  # parameters whose state the call made
        for p in [p for p, st in opt.state.items() if not st]:
            del opt.state[p]


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


def _modules(sa) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module the step trains or reads, as the step's arguments name them."""
    from .runtime.step_modules import modules_of

    mods = modules_of(sa.module)
    if len(mods) == 1:
        return [("model", mods[0])]
    return [(f"module {k}", m) for k, m in enumerate(mods)]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _state(modules, optimizers) -> dict[str, Any]:
    """Full copies of every parameter, buffer and optimizer state entry, by a readable name."""
    out: dict[str, Any] = {}
    names: dict[int, str] = {}
    for label, m in modules:
        for n, p in m.named_parameters():
            names.setdefault(id(p), f"{label}.{n}")
            out[f"parameter {label}.{n}"] = _full(p).detach().clone()
        for n, b in m.named_buffers():
            out[f"buffer {label}.{n}"] = _full(b).detach().clone()
    for k, opt in enumerate(optimizers):
        for gi, g in enumerate(opt.param_groups):
            for j, p in enumerate(g["params"]):
                who = names.get(id(p), f"group {gi} parameter {j}")
                for key, v in opt.state.get(p, {}).items():
                    out[f"optimizer {k} state {key} of {who}"] = (
                        _full(v).detach().clone() if isinstance(v, torch.Tensor) else v)
    return out


def _reference(fn: Callable, sa, modules, group, broadcast_buffers: bool
               ) -> tuple[dict[str, Any], Any]:
    """(the state after the step ran eagerly with DDP's semantics, its returned value); the
    real modules, optimizers and Python state are left as they were."""
    from .trace.side_effects import step_constants, watch
    from .torch_internals import user_line_here

    with _twins_in(modules, sa.optimizers, group, broadcast_buffers) as twins:
        args, kwargs = pytree.tree_map(_copied_input, pytree.tree_unflatten(sa.leaves, sa.spec))
        with watch(fn, sa.module, sa.optimizers, step_constants(sa), user_line_here, into=[]):
            out = fn(*args, **kwargs)
        expected = _state(modules, sa.optimizers)
        del twins
    return expected, pytree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, out)


def _copied_input(x):
    """An input as one device reads it: a copy (a sequence-sharded input whole)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter):
        return _full(x).detach().clone().requires_grad_(x.requires_grad)
    return x


@contextlib.contextmanager
def _twins_in(modules, optimizers, group, broadcast_buffers: bool):
    """Plain full copies bound in the modules' parameter and buffer slots and the optimizers'
    param groups and state for the duration; gradients averaged over ``group`` as DDP does."""
    twins: dict[int, torch.nn.Parameter] = {}
    slots: list[tuple[dict, str, Any]] = []
    world = dist.get_world_size(group)

    def average(p):
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world)

    hooks = []
    for _, root in modules:
        for mod in root.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                twin = twins.get(id(p))
                if twin is None:
                    twin = twins[id(p)] = torch.nn.Parameter(
                        _full(p).detach().clone(), requires_grad=p.requires_grad)
                    if twin.requires_grad:
                        hooks.append(twin.register_post_accumulate_grad_hook(average))
                slots.append((mod._parameters, name, p))
                mod._parameters[name] = twin
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                slots.append((mod._buffers, name, b))
                plain = _full(b).detach().clone()
                if world > 1 and broadcast_buffers:
                    dist.broadcast(plain, src=dist.get_global_rank(group, 0), group=group)
                mod._buffers[name] = plain
    saved = []
    for opt in optimizers:
        groups = [dict(g) for g in opt.param_groups]
        saved.append((opt, groups, opt.state))
        state = defaultdict(dict)
        for p, st in opt.state.items():
            state[twins.get(id(p), p)] = {k: _full(v).detach().clone() if isinstance(
                v, torch.Tensor) else copy.copy(v) for k, v in st.items()}
        for g in opt.param_groups:
            g["params"] = [twins.get(id(p), p) for p in g["params"]]
        opt.state = state
    try:
        yield twins
    finally:
        for h in hooks:
            h.remove()
        for mapping, name, value in reversed(slots):
            mapping[name] = value
        for opt, groups, state in saved:
            for g, old in zip(opt.param_groups, groups):
                g.clear()
                g.update(old)
            opt.state = state


def _outputs(out) -> dict[str, Any]:
    leaves = pytree.tree_leaves(out)
    return {f"output {k}": _full(v).detach() if isinstance(v, torch.Tensor) else v
            for k, v in enumerate(leaves)}


def _differences(expected: dict, got: dict, check: Verification,
                 what: str | None = None) -> list[tuple[float, str]]:
    """(size, text) of each entry of ``got`` that differs from ``expected``, in order."""
    out = []
    for name in list(expected) + [k for k in got if k not in expected]:
        label = name if what is None else f"{what} {name.split()[-1]}"
        if name not in got or name not in expected:
            out.append((float("inf"), f"{label}: present only in the "
                        f"{'reference' if name in expected else 'compiled step'}"))
            continue
        a, b = got[name], expected[name]
        if not isinstance(b, torch.Tensor):
            if isinstance(a, torch.Tensor) or a != b:
                out.append((float("inf"), f"{label}: {a!r}, expected {b!r}"))
            continue
        a = a.to(b.dtype) if isinstance(a, torch.Tensor) else torch.as_tensor(a, dtype=b.dtype)
        if a.shape != b.shape:
            out.append((float("inf"), f"{label}: shape {tuple(a.shape)}, expected {tuple(b.shape)}"))
            continue
        if not b.is_floating_point():
            if not torch.equal(a, b):
                out.append((float("inf"), f"{label}: differs"))
            continue
        diff = (a.double() - b.double()).abs()
        bound = check.atol + check.rtol * b.double().abs()
        bad = ~(diff <= bound) & ~(a.isnan() & b.isnan())
        if bad.any():
            worst = diff.nan_to_num(float("inf")).max().item()
            out.append((worst, f"{label}: max abs difference {worst:.3g} "
                               f"({int(bad.sum())} of {b.numel()} elements beyond "
                               f"rtol={check.rtol:g}, atol={check.atol:g})"))
    return out


def _raise_on_every_rank(problems: list, group, fn: Callable, check: Verification,
                         fresh: bool, diagnosis: str) -> None:
    """Every rank raises, naming the differences of a rank that found some."""
    texts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, [t for _, t in problems[:5]], group=group)
    rank = dist.get_rank(group)
    mine = texts[rank] or []
    found = sorted(r for r, t in enumerate(texts) if t)
    first = mine[0] if mine else texts[found[0]][0]
    shown = "\n".join(f"  - {t}" for t in (mine or texts[found[0]]))
    stale = "" if fresh else " The program that ran was compiled at an earlier call."
    raise DivergenceError(
        f"verify: call {check.calls} of {_name(fn)} differs from the step run eagerly with DDP's "
        f"semantics (on rank(s) {found}): {first}.{stale}{diagnosis}\nDifferences on rank "
        f"{rank if mine else found[0]}:\n{shown}\nThe model and optimizer hold the compiled "
        f"call's result (docs/user_guide.md, 'When a result looks wrong').")
