"""Every Python read a recording depends on, seen while the step's Python runs: the one record
that value guards (spmd_compiler/trace/guards.py), block reuse (spmd_compiler/trace/block_reuse.py) and the
shared compile (spmd_compiler/build/shared_compile.py) prove their shortcuts with.

While :func:`watching` is active (around one recording of a step) it keeps:

- ``attrs``: every attribute read (``obj.x``, ``getattr(obj, name)`` with any name, a lookup
  that reaches the type and its MRO, a miss that falls back to a default) and write on the
  watched objects (the model's modules, a bound-method step's instance): their classes'
  ``__getattribute__``/``__setattr__`` are wrapped for the recording;
- ``environ``: the environment variables the user's code read (``os.environ[...]``,
  ``os.getenv``, iterating it), as ``os._Environ`` sees them;
- ``ranks``: the user's lines that asked for the rank (torch_internals.rank_queries).

Reads by torch's own code are not the user's values, with one exception: attribute reads on the
model's modules count whoever makes them (a ``Dropout`` reads its ``p`` in torch's code).

The code that ran (whose globals and closures are read) is the code on the stack of every
recorded op (torch_internals.StepTracer), the code that read a watched attribute, and what that
code reaches by name (:func:`expanded`: functions it names as globals, code nested in it). A
``sys.settrace`` hook would see every call, but it made recording a GPT-2 step 2.3 times as
slow (cProfile's C hook 1.8 times): a function that records no op, reads no watched attribute
and is reached by no name (one fetched from a container by a computed key) is not seen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import types
from dataclasses import dataclass, field

import torch

from ..torch_internals import rank_queries


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    paths = sysconfig.get_paths()
    return tuple(os.path.join(d, "") for d in (os.path.dirname(torch.__file__), here,
                                                paths["stdlib"], paths["platstdlib"]))


def is_user_file(filename: str) -> bool:
    """Code outside torch, this package and the standard library."""
    return not filename.startswith("<") and not filename.startswith(_library_dirs())


ABSENT_READ = "<absent>"  # the value logged for a name an object and its type do not have
_SKIPPED = frozenset({"__dict__", "__class__", "_parameters", "_buffers", "_modules",
                      "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                      "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                      "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                      "_forward_hooks_always_called", "_is_full_backward_hook",
                      "_non_persistent_buffers_set", "_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks", "_compiled_call_impl", "__setstate__"})


@dataclass
class AttrRead:
    """One attribute read or write on a watched object."""

    obj: object
    name: str
    value: object  # as read (ABSENT_READ: not found); None for a write
    write: bool = False
    where: tuple | None = None  # (code, line) of the reader; None when it is this package
    globals: dict | None = None  # the reader's globals


_HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")


def _read(obj, name: str, value, frame) -> AttrRead:
    code = frame.f_code
    if code.co_filename.startswith(_HERE):
        return AttrRead(obj, name, value)
    return AttrRead(obj, name, value, where=(code, frame.f_lineno), globals=frame.f_globals)


@dataclass
class Reads:
    """What one recording read (see the module docstring)."""

    watched: dict = field(default_factory=dict)  # id -> object whose attributes are watched
    attrs: list[AttrRead] = field(default_factory=list)
    environ: dict = field(default_factory=dict)  # name -> value (ABSENT_READ: unset)
    environ_listed: bool = False  # the user's code iterated the environment
    ranks: list[str] = field(default_factory=list)

    def mark(self) -> int:
        """A point in ``attrs`` to read what came after (:meth:`since`)."""
        return len(self.attrs)

    def since(self, mark: int) -> list[AttrRead]:
        return self.attrs[mark:]

    def readers(self, since: int = 0) -> dict:
        """code -> globals of the code that read the watched attributes (after ``since``)."""
        return {r.where[0]: r.globals for r in self.attrs[since:] if r.where is not None}


@contextlib.contextmanager
def watching(objects):
    """Record (into the yielded :class:`Reads`) every read described in the module docstring,
    with the attributes of ``objects`` watched."""
    reads = Reads({id(o): o for o in objects})
    with _attributes_watched(reads), _environ_watched(reads), rank_queries() as ranks:
        reads.ranks = ranks
        yield reads


@contextlib.contextmanager
def _attributes_watched(reads: Reads):
    watched, log = reads.watched, reads.attrs
    patched = []
    for cls in {type(o) for o in watched.values()}:
        own = {k: cls.__dict__.get(k) for k in ("__getattribute__", "__setattr__")}
        get, put = cls.__getattribute__, cls.__setattr__

        def read(self, name, _get=get):
            try:
                value = _get(self, name)
            except AttributeError:
                if id(self) in watched and name not in _SKIPPED:
                    log.append(_read(self, name, ABSENT_READ, sys._getframe(1)))
                raise
            if id(self) in watched and name not in _SKIPPED:
                log.append(_read(self, name, value, sys._getframe(1)))
            return value

        def write(self, name, value, _put=put):
            if id(self) in watched:
                log.append(AttrRead(self, name, None, write=True))
            _put(self, name, value)

        try:
            cls.__getattribute__, cls.__setattr__ = read, write
        except TypeError:  # a built-in (immutable) class: its instances' attributes are not
            continue       # watched; guards.py follows the names the code uses instead
        patched.append((cls, own))
    try:
        yield
    finally:
        for cls, own in patched:
            for k, v in own.items():
                if v is None:
                    delattr(cls, k)
                else:
                    setattr(cls, k, v)


_ENVIRON_SKIPPED = (os.path.dirname(os.__file__), os.path.join("torch", "distributed", ""))


def users_frame(frame) -> bool:
    """Is the first frame from ``frame`` outwards that is not the standard library's nor
    torch.distributed's (which reads the environment and the rank for the user) user code?"""
    while frame is not None:
        name = frame.f_code.co_filename  # (os and _collections_abc run frozen: "<frozen os>")
        if not (name.startswith((_ENVIRON_SKIPPED[0], "<frozen ")) or _ENVIRON_SKIPPED[1] in name):
            return is_user_file(name)
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _environ_watched(reads: Reads):
    cls = type(os.environ)
    get, listed = cls.__getitem__, cls.__iter__

    def read(self, key):
        try:
            value = get(self, key)
        except KeyError:
            if self is os.environ and users_frame(sys._getframe(1)):
                reads.environ.setdefault(key, ABSENT_READ)
            raise
        if self is os.environ and users_frame(sys._getframe(1)):
            reads.environ.setdefault(key, value)
        return value

    def iterate(self):
        if self is os.environ and users_frame(sys._getframe(1)):
            reads.environ_listed = True
        return listed(self)

    cls.__getitem__, cls.__iter__ = read, iterate
    try:
        yield
    finally:
        cls.__getitem__, cls.__iter__ = get, listed


# ---------------------------------------------------------------------------------------------
# Where a name resolves, and what a value is, for comparing two executions


def resolve(obj, name: str) -> tuple:
    """Where ``getattr(obj, name)`` finds its value, read without running anything:
    ``("structure",)`` (a parameter, buffer or submodule of a module), ``("instance", value)``,
    ``("class", k, raw)`` (in ``type(obj).__mro__[k]``'s own dict), or ``("absent",)``."""
    own = object.__getattribute__(obj, "__dict__") if hasattr(type(obj), "__dict__") or \
        isinstance(getattr(obj, "__dict__", None), dict) else {}
    for table in ("_parameters", "_buffers", "_modules"):
        if name in own.get(table, ()):
            return ("structure",)
    for k, cls in enumerate(type(obj).__mro__):
        if name in vars(cls) and _is_data_descriptor(vars(cls)[name]):
            return ("class", k, vars(cls)[name])
    if name in own:
        return ("instance", own[name])
    for k, cls in enumerate(type(obj).__mro__):
        if name in vars(cls):
            return ("class", k, vars(cls)[name])
    return ("absent",)


def _is_data_descriptor(v) -> bool:
    return hasattr(type(v), "__set__") or hasattr(type(v), "__delete__")


_PLAIN = (type(None), bool, int, float, complex, str, bytes)
UNSURE = "<unsure>"  # a fingerprint part that never compares equal (see fingerprint)


def fingerprint(v, inside: dict | None = None, depth: int = 4):
    """A value that compares equal for two Python values a recording cannot tell apart: plain
    values by value, containers and plain objects by their contents (``depth`` levels), tensors
    by identity and version, functions by identity and their closures' contents, and an object
    of ``inside`` (id -> a path relative to a block) by that path. Anything else, or deeper,
    holds a fresh ``object()``: equal to nothing (the caller then takes no shortcut)."""
    import enum
    import types

    import torch

    if id(v) in (inside or {}):
        return ("inside", inside[id(v)])
    if type(v) in _PLAIN or isinstance(v, enum.Enum):
        return (type(v), v) if v == v else (type(v), "nan")
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(v), str(v))
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v), v._version)
    if isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType, torch.nn.Module)):
        return ("id", id(v))
    if depth <= 0:
        return (UNSURE, object())
    if isinstance(v, types.MethodType):
        return ("method", fingerprint(v.__func__, inside, depth - 1),
                fingerprint(v.__self__, inside, depth - 1))
    if isinstance(v, types.FunctionType):  # (a function in its cells by identity: it runs)
        cells = tuple(("id", id(x)) if isinstance(x, types.FunctionType) else
                      fingerprint(x, inside, depth - 1) for x in map(_cell, v.__closure__ or ()))
        return ("function", id(v), cells)
    if type(v) in (list, tuple, set, frozenset, dict) and len(v) > 1024:
        return (UNSURE, object())
    if type(v) in (list, tuple, set, frozenset):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return (type(v), tuple(fingerprint(x, inside, depth - 1) for x in items))
    if type(v) is dict:
        return (dict, tuple((fingerprint(k, inside, 1), fingerprint(x, inside, depth - 1))
                            for k, x in v.items()))
    if not _user_type(type(v)):  # a library's object (a logger, a signature): by identity
        return ("id", id(v))
    attrs = getattr(v, "__dict__", None)
    if not isinstance(attrs, dict) or len(attrs) > 256:
        return (UNSURE, object())
    return (type(v), tuple((k, fingerprint(x, inside, depth - 1)) for k, x in attrs.items()))


def _user_type(cls: type) -> bool:
    return is_user_file(getattr(sys.modules.get(cls.__module__), "__file__", None) or "<")


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return ABSENT_READ


def functions_of(codes: list) -> list[types.FunctionType]:
    """The live functions made from any of ``codes``."""
    import gc

    if not codes:
        return []
    wanted = set(codes)
    return [f for f in gc.get_referrers(*codes) if isinstance(f, types.FunctionType)
            and f.__code__ in wanted]


def expanded(codes: dict) -> dict:
    """``codes`` (code -> globals) with, for the user's code among them, the code nested in it
    and the user functions it names as globals, transitively."""
    out, todo = dict(codes), list(codes)
    while todo:
        code = todo.pop()
        g = out[code]
        if not is_user_file(code.co_filename):
            continue
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and const not in out:
                out[const] = g
                todo.append(const)
        for n in code.co_names:
            f = g.get(n)
            if isinstance(f, types.FunctionType) and f.__code__ not in out:
                out[f.__code__] = f.__globals__
                todo.append(f.__code__)
    return out
