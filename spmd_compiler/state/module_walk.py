"""One walk over a module tree: its submodules, parameters and buffers, with their names, in the
order and with the deduplication of ``named_modules()``, ``named_parameters()`` and
``named_buffers()``, without their nested generators (a cached call reads them every call)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ModuleWalk(NamedTuple):
    modules: list[torch.nn.Module]  # pre-order, each module once
    params: list[tuple[str, torch.Tensor]]  # each parameter once, first name
    buffers: list[tuple[str, torch.Tensor]]  # each buffer once, first name


def walk(module: torch.nn.Module) -> ModuleWalk:
    """``module``'s tree as ``named_modules()`` and ``named_parameters()`` /
    ``named_buffers()`` (remove_duplicate=True) list it."""
    modules, params, buffers = [], [], []
    seen_modules, seen_params, seen_buffers = set(), set(), set()
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        modules.append(m)
        dot = prefix + "." if prefix else ""
        for out, seen, members in ((params, seen_params, m._parameters),
                                   (buffers, seen_buffers, m._buffers)):
            for name, t in members.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((dot + name, t))
        children = [(dot + name, c) for name, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))
    return ModuleWalk(modules, params, buffers)


def tensors(module: torch.nn.Module, kind: str = "_parameters"):
    """``module.parameters()`` (``kind="_buffers"``: ``buffers()``) in the same order, generated
    lazily without nested generators (its first few are read on every call)."""
    seen_modules, seen = set(), set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen_modules:
            continue
        seen_modules.add(id(m))
        for t in getattr(m, kind).values():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield t
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
