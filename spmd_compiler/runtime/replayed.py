"""The step's Python statements that change Python state (spmd_compiler/trace/replay.py
chooses them while recording), run again after every call with that call's arguments, the
step's closure and its globals."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable

from ..torch_internals import pytree


def run_after(fn: Callable, statements: tuple[str, ...], sa) -> None:
    """Run the step's ``statements`` with its arguments of this call, closure and globals."""
    if not statements:
        return
    fn = getattr(fn, "__wrapped__", fn)  # the step under its decorator
    args, kwargs = pytree.tree_unflatten(sa.leaves, sa.spec)
    namespace = dict(_signature(fn).bind(*args, **kwargs).arguments)
    if isinstance(fn, types.MethodType):  # a bound-method step: its instance by its name
        namespace[fn.__code__.co_varnames[0]] = fn.__self__
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        namespace.setdefault(name, cell.cell_contents)
    for source in statements:
        exec(_compiled(source, fn.__code__.co_filename), fn.__globals__, namespace)  # noqa: S102


@functools.lru_cache(maxsize=256)
def _compiled(source: str, filename: str):
    return compile(source, filename, "exec")


@functools.lru_cache(maxsize=64)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)
