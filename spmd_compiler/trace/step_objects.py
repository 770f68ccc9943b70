"""Objects a step makes and passes through its repeated blocks (Hugging Face's ``DynamicCache``:
every layer calls ``cache.update(k, v, self.layer_idx)``), for block reuse
(spmd_compiler/trace/block_reuse.py).

A copied block runs no Python, so it neither reads nor writes such an object. A copy is made
only where that cannot show:

- what a block can read of the object is the same for every block: at the template's call,
  every list in the object's reachable state holds equal elements (the per-layer entries of an
  empty cache), its dicts are empty, and at a copy's call the state is the one the template
  left (no other code wrote it since);
- a block reads only tensors it was passed (the template check already refuses a block whose
  nodes use a tensor from before it: a pre-filled cache's keys);
- the block's own integer attributes that differ between blocks (``layer_idx``) are used by the
  object's own methods only: while the template records, each is a :class:`TrackedInt` that
  notes any use by other Python (arithmetic, comparison, hashing, formatting); torch reads an
  int's value in C without such a use (``x * self.layer_idx``), so the next block, with
  another value, is recorded too and copies are made only if it recorded the same nodes
  (block_reuse._verify);
- nothing reads the object once a block was copied (:class:`Watch`: every attribute read on
  its reachable objects is noted), and the object is gone after the step (a weak reference):
  the entries a copy did not write are never seen. Otherwise the step is recorded again
  without reuse.

Not seen: a Python-only entry of the object (no tensor) that one block writes and a later block
reads by another index than its own.
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref

import torch

from .reads import fingerprint

_LIMIT = 10_000  # objects walked in one state
_SKIPPED_TYPES = (type, types.FunctionType, types.MethodType, types.ModuleType,
                  torch.nn.Module, torch.Tensor)


def is_step_object(x) -> bool:
    """An object a block may get as an argument: a plain Python object (not a module, tensor,
    type or function) with attributes, that a weak reference can follow."""
    if isinstance(x, _SKIPPED_TYPES) or not isinstance(getattr(x, "__dict__", None), dict):
        return False
    try:
        weakref.ref(x)
    except TypeError:
        return False
    return True


def reachable(roots) -> list:
    """The objects with attributes reachable from ``roots`` through attributes, lists, tuples
    and dict values (roots first, each once)."""
    seen, out, todo = set(), [], list(roots)
    while todo and len(out) < _LIMIT:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (list, tuple)):
            todo.extend(reversed(o))
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif is_step_object(o):
            out.append(o)
            todo.extend(vars(o).values())
    return out


def uniform(objects, written: set) -> str | None:
    """Why a block's reads of ``objects``' state could depend on which block reads it (a list
    of unequal entries, a non-empty dict), or None. Entries ``written`` by the blocks recorded
    before (their ids, or (id of the list, index)) are left out: each block has its own."""
    for o in objects:
        for name, v in vars(o).items():
            if isinstance(v, dict) and v:
                return f"{type(o).__name__}.{name} is a non-empty dict"
            if isinstance(v, (list, tuple)) and len({
                    repr(contents(x)) for i, x in enumerate(v)
                    if id(x) not in written and (id(v), i) not in written}) > 1:
                return f"the entries of {type(o).__name__}.{name} differ"
    return None


def entries(objects) -> dict:
    """What :func:`written` compares: each object's contents, each list's entries."""
    out = {}
    for o in objects:
        out[id(o)] = repr(contents(vars(o), 2))
        for v in vars(o).values():
            if isinstance(v, list):
                out[id(v)] = [id(x) for x in v]
    return out


def written(before: dict, after: dict) -> set:
    """The objects (ids) whose contents changed between two :func:`entries`, and the list
    entries ((id of the list, index)) replaced."""
    out = set()
    for k, v in before.items():
        if isinstance(v, list):
            now = after.get(k, [])
            out |= {(k, i) for i in range(max(len(v), len(now)))
                    if i >= len(v) or i >= len(now) or v[i] != now[i]}
        elif after.get(k) != v:
            out.add(k)
    return out


def state(objects) -> tuple:
    """What ``objects`` hold now (their attributes, tensors by identity and version)."""
    return tuple((id(o), repr(contents(vars(o), 2))) for o in objects)


def contents(v, depth: int = 4):
    """A value equal for two step objects holding the same: objects with attributes, lists,
    tuples and dicts by their contents (``depth`` levels), anything else as
    ``reads.fingerprint`` has it (tensors by identity and version)."""
    if depth > 0 and is_step_object(v):
        return (type(v), tuple((k, contents(x, depth - 1)) for k, x in vars(v).items()))
    if depth > 0 and type(v) in (list, tuple):
        return (type(v), tuple(contents(x, depth - 1) for x in v))
    if depth > 0 and type(v) is dict:
        return (dict, tuple((repr(k), contents(x, depth - 1)) for k, x in v.items()))
    return fingerprint(v, depth=0) if isinstance(v, (list, tuple, dict)) else fingerprint(v)


def method_codes(objects) -> frozenset:
    """The code of the methods of ``objects``' classes (and the code nested in it)."""
    codes, todo = set(), []
    for cls in {type(o) for o in objects}:
        for klass in cls.__mro__[:-1]:
            for v in vars(klass).values():
                f = getattr(v, "__func__", v)
                while hasattr(f, "__wrapped__"):
                    f = f.__wrapped__
                if isinstance(f, types.FunctionType):
                    todo.append(f.__code__)
    while todo:
        code = todo.pop()
        if code not in codes:
            codes.add(code)
            todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(codes)


class TrackedInt(int):
    """An integer attribute of a block while its template records: notes whether Python other
    than the step objects' methods (``owners``) used it."""

    owners: frozenset = frozenset()
    used_outside = False


def _noted(name):
    plain = getattr(int, name)

    def method(self, *args):
        if sys._getframe(1).f_code not in self.owners:
            self.used_outside = True
        return plain(int.__int__(self), *args)

    method.__name__ = name
    return method


for _name in ("__index__", "__int__", "__float__", "__bool__", "__hash__", "__eq__", "__ne__",
              "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__sub__",
              "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__", "__truediv__",
              "__rtruediv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__",
              "__abs__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__",
              "__lshift__", "__rshift__", "__invert__", "__repr__", "__str__", "__format__",
              "__round__", "__trunc__", "__floor__", "__ceil__", "__divmod__", "__rdivmod__"):
    setattr(TrackedInt, _name, _noted(_name))


@contextlib.contextmanager
def tracked_ints(m: torch.nn.Module, owners: frozenset):
    """While active, every int attribute of ``m``'s modules is a :class:`TrackedInt`; yields
    {(submodule path, name): TrackedInt}."""
    tracked = {}
    for path, s in m.named_modules(remove_duplicate=False):
        own = vars(s)
        for name, v in list(own.items()):
            if type(v) is int:
                t = own[name] = TrackedInt(v)
                t.owners = owners
                tracked[(path, name)] = t
    try:
        yield tracked
    finally:
        for (path, name), t in tracked.items():
            vars(m.get_submodule(path))[name] = int.__int__(t)


class Watch:
    """Notes every attribute read on the objects of ``objects``' classes from when it starts
    until it stops (reads by this package's own walks excepted)."""

    def __init__(self):
        self.read: str | None = None  # the first read seen
        self.ids: set = set()
        self._patched: list = []
        self.paused = False

    def add(self, objects) -> None:
        self.ids |= {id(o) for o in objects}
        for cls in {type(o) for o in objects} - {c for c, _ in self._patched}:
            self._patch(cls)

    def _patch(self, cls) -> None:
        own, get = cls.__dict__.get("__getattribute__"), cls.__getattribute__
        watch = self

        def read(obj, name, _get=get):
            if (watch.read is None and not watch.paused and id(obj) in watch.ids
                    and not name.startswith("__")):
                watch.read = f"{type(obj).__name__}.{name}"
            return _get(obj, name)

        cls.__getattribute__ = read
        self._patched.append((cls, own))

    def stop(self) -> None:
        for cls, own in reversed(self._patched):
            if own is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own
        self._patched = []

    @contextlib.contextmanager
    def pause(self):
        saved, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = saved
