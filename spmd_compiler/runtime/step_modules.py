"""Several modules among a step's arguments (a generator and a discriminator, a model and its
EMA copy, a student and a frozen teacher) as one module tree the compiler places and records.

The modules become children of one :class:`StepModules` root, each named by the argument it was
passed as (``G``, ``D``, ``ema``; ``nets.G`` for ``nets={"G": ...}``, ``models.0`` for a list,
``cfg.teacher`` for a field of a dataclass argument),
so every parameter has one name (``G.0.weight``) in the graph, the summaries and the errors. The
root is made once per set of modules and reused on every call (its identity keys the compiled
programs); the user's modules stay the objects the step and the user call. A parameter shared by
two modules is one parameter, named after its first module. A module passed with one argument
alone is its own root, as before.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch

from ..errors import StepSignatureError
from ..torch_internals import pytree

_ROOTS: dict[tuple, "StepModules"] = {}  # ((name, id(module)), ...) -> its root
_LIMIT = 64  # roots kept before the cache starts over


class StepModules(torch.nn.Module):
    """The step's modules as children named by their arguments; never called itself."""

    def forward(self, *args, **kwargs):
        raise StepSignatureError(
            "the modules a compiled step receives are called one by one, never as a group")


def argument_names(fn: Callable | None, args: tuple, kwargs: dict) -> list[str]:
    """The name of every leaf of ``(args, kwargs)`` (pytree order) as the step's signature
    calls it: ``G``, ``nets.G``, ``models.0``; ``arg2`` where ``fn`` names none."""
    params = _positional_names(fn, len(args))
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head = params[path[1].idx] if path[0].idx == 0 else _key(path[1])
        names.append(".".join([head] + [_key(k) for k in path[2:]]))
    return names


def _positional_names(fn: Callable | None, count: int) -> list[str]:
    """Names of the first ``count`` positional parameters of ``fn`` (``arg<i>`` past them)."""
    names: list[str] = []
    try:
        sig = inspect.signature(fn) if fn is not None else None
    except (TypeError, ValueError):
        sig = None
    for p in (sig.parameters.values() if sig is not None else ()):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            break
    return names[:count] + [f"arg{i}" for i in range(len(names), count)]


def _key(k: Any) -> str:
    """One part of a leaf's name (a dot in a dict key becomes ``_``: dots separate parts)."""
    for attr in ("idx", "key", "name"):
        if hasattr(k, attr) and not isinstance(k, (str, int)):
            return str(getattr(k, attr)).replace(".", "_") or "_"
    return str(k).replace(".", "_") or "_"


def held_state(leaves: list) -> tuple[list[tuple[int, str, Any]], list[int]]:
    """The modules and optimizers inside dataclass leaves (which pytree does not flatten):
    (leaf, path inside it as ``field.0.key``, object) each, and the leaves holding any."""
    found: list[tuple[int, str, Any]] = []
    for j, leaf in enumerate(leaves):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += [(j, path, x) for path, x in _walk(leaf, "")]
    return found, sorted({j for j, _, _ in found})


def _walk(x: Any, path: str):
    """(path, object) of the modules and optimizers in ``x`` (dataclass fields, lists, tuples,
    dicts), depth first."""
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        yield path, x
        return
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    elif isinstance(x, (list, tuple)):
        items = list(enumerate(x))
    elif isinstance(x, dict):
        items = list(x.items())
    else:
        return
    for key, value in items:
        yield from _walk(value, f"{path}.{_key(key)}" if path else _key(key))


def step_root(named: list[tuple[str, torch.nn.Module]]) -> torch.nn.Module:
    """The root the compiler places and records for the step's modules (``named``: argument
    name and module, in argument order): the module itself when there is one, else the
    :class:`StepModules` holding each under its argument name (the same object for the same
    modules under the same names)."""
    seen: dict[int, str] = {}
    for name, m in named:
        if id(m) in seen:
            raise StepSignatureError(
                f"the same module ({type(m).__name__}) is passed to the step twice, as "
                f"{seen[id(m)]!r} and {name!r}; pass it once.")
        seen[id(m)] = name
    if len(named) == 1:
        return named[0][1]
    key = tuple((name, id(m)) for name, m in named)
    root = _ROOTS.get(key)
    if root is not None and all(_child(root, name) is m for name, m in named):
        return root
    if len(_ROOTS) >= _LIMIT:
        _ROOTS.clear()
    root = _ROOTS[key] = StepModules()
    for name, m in named:
        _add_child(root, name, m)
    return root


def modules_of(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The user's modules under ``root`` that no other of them contains (a module passed
    together with one of its own submodules counts once): each gets its own use outside the
    step."""
    if not isinstance(root, StepModules):
        return [root]
    leaves = [m for m in _passed(root)]
    inner = {id(sub) for m in leaves for sub in list(m.modules())[1:]}
    return [m for m in leaves if id(m) not in inner]


def _passed(root: torch.nn.Module) -> list[torch.nn.Module]:
    out = []
    for child in root.children():
        if type(child) is _Group:
            out += _passed(child)
        else:
            out.append(child)
    return out


class _Group(torch.nn.Module):
    """The modules of one container argument (a list, dict or tuple of modules)."""

    def forward(self, *args, **kwargs):
        raise StepSignatureError("a group of the step's modules is never called itself")


def _add_child(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parts = name.split(".")
    parent = root
    for part in parts[:-1]:
        if part not in parent._modules:
            parent.add_module(part, _Group())
        parent = parent._modules[part]
    parent.add_module(parts[-1], module)


def _child(root: torch.nn.Module, name: str) -> torch.nn.Module | None:
    m = root
    for part in name.split("."):
        m = m._modules.get(part) if m is not None else None
    return m
