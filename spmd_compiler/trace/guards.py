"""Guards on the Python values a recorded step read: a compiled program holds every plain Python
value the recording read (a submodule's ``Dropout.p``, a temperature attribute, a global loss
weight, a closure variable, an attribute of a bound-method step's instance, an optimizer's
``momentum``) as a constant, so it is valid only while those values are unchanged.

**What is guarded.** What the recording read (spmd_compiler/trace/reads.py):

- every attribute read on the model's modules and on a bound-method step's instance (``self``),
  however it was asked for (``getattr`` with any name) and wherever Python found it: an instance
  value; a class attribute (guarded in the class of the MRO that holds it, and guarded absent in
  the instance and the user's classes before it); a name found nowhere (a ``getattr`` default:
  guarded absent);
- the code that ran (on a recorded op's stack, or reading a watched attribute) and what it
  reaches by name: the globals of the user's code (not torch's, not the standard library's; the
  launched script's own globals, ``__main__``/``__mp_main__``, by the step's own globals dict),
  the closure cells of the step and of the functions it reaches, and, among the objects and
  Python modules reached so, the attributes that code names (``co_names`` and its constant
  strings), through the type too;
- every item (any key) and the length of a list, tuple or dict reached so;
- the environment variables the user's code read;
- every entry of the optimizers' ``param_groups`` but ``params`` and the lifted learning rate,

- the step's object arguments (a dataclass passed on every call), and the closures of the
  gradient hooks on the model's parameters;
- the functions of ``torch.nn.functional`` that any code that ran names (a user may patch them);

the plain values (but names the code that ran assigns: state the step writes, which
spmd_compiler/trace/side_effects.py replays): numbers, strings, bools, None, enum members and
tuples of them, DTensor placements, dtypes and devices; functions by which function they are
(``callable_id``: library functions, built-ins and partials too); plain tensors by their values
(``tensor_digest``, hashed again only when the version counter moves). Each is a ``ValueGuard``: its name as the user would write it, a path from the
step's roots to it (valid in another process: the disk cache and the shared compile check
programs with the same guards on the rank that runs them), the value at recording and the line
that read it. Objects and modules along the way are followed three levels deep; each object a
path passes through is checked by identity first, and one replaced since (a global rebound to a
new config, a member reassigned) re-resolves the paths on the new objects before the values are
compared. A user class reached by name (``Weights.mse``) is followed like an object, through its
MRO; a function by its code (``code_id``: another function put in a dict, a module or a class
is noticed); a method the recording ran on a watched object by its code in its class and its
absence from the instance (``model.lin.forward = ...`` and ``Net.forward = ...`` both
recompile). A step that is a ``functools.partial`` has its bound arguments guarded as containers.
User code that asks for attributes by computed names (``getattr``, ``vars``) has every plain
attribute of the user-class objects it reaches guarded, not only the names it spells. A read no path reaches (a closure cell holding data in a function
no root reaches, globals that are not their module's) becomes a guard that never holds, logged
once: the program serves the call it was recorded for, and is neither shared nor cached.

**Checked** on every call with the program's other guards (``runtime.program.CompiledGraph.guards_hold``):
a dict lookup and an equality per guard. A change recompiles (logged on the ``spmd_compiler``
logger with the name, the old and new value and the reading line) and, when the value is a
number, the recompile records it as a program input instead (a symbolic number, passed on every
call, as the learning rate): a counter compiles twice, never once per call. A number the step
uses where it must be a constant (a size, a branch) is kept as a constant and guarded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import dis
import functools
import logging
import math
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..runtime.call_args import group_inputs
from ..runtime.dispatch import is_plain
from ..torch_internals import tensor_hooks
from .reads import expanded, functions_of, is_user_file, resolve


class _Absent:
    """The value of a guard on a name that is not there (an attribute a class default stands
    for, a ``getattr`` default, an unset environment variable); the same object after pickling."""

    def __repr__(self):
        return "<absent>"

    def __reduce__(self):
        return "ABSENT"


ABSENT = _Absent()
_MISSING = ABSENT


class _Unguardable:
    """The value of a guard on a read that cannot be guarded: it never holds, so the program is
    used for the one call it was recorded for (and neither shared nor loaded from the cache)."""

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__

    def __repr__(self):
        return "<not guardable>"
_MAX_DEPTH = 3
_BASE_CLASSES = (torch.nn.Module, object)
_COMPUTED_NAMES = frozenset({"getattr", "hasattr", "vars", "__dict__", "attrgetter"})
# module attributes that are structure (in the step's static key) or bookkeeping, not values
_SKIPPED_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "training", "_spmd_eager"})
_NUMBERS = (int, float)
# objects that are only their attributes (``getattr(args, f"{k}_weight")`` reads any of them)
_ATTRIBUTE_BAGS = (argparse.Namespace, types.SimpleNamespace)
# torch's public namespaces whose functions users patch (``F.gelu = ...``): the functions the
# code that ran names in them are guarded by identity, torch's own code's calls included
_PATCHED_MODULES = ("torch.nn.functional",)


@dataclass(frozen=True)
class ValueGuard:
    """One Python value a program depends on (see the module docstring)."""

    name: str  # as the user writes it: "model.drop.p", "train.LOSS_WEIGHT"
    path: tuple  # root and steps to the value (``slot``); picklable, process-independent
    value: Any  # at recording
    where: str  # the line that read it
    lifted: bool = False  # a program input: its value is passed on every call, not compared
    written: bool = False  # the step also assigns it (replayed after each call): lift it


# ---------------------------------------------------------------------------------------------
# Paths: ("model",) / ("self",) / ("fn",) / ("optimizer", k) / ("global", module name) /
# ("environ",) / ("unguardable",) roots, then steps ("sub", submodule path), ("attr", name),
# ("item", key), ("group", index), ("cell", free variable name), ("type", index in the MRO),
# ("len", None), ("mro", index in a class's own MRO).


class _Attrs:
    """A class's own attributes, or a list's or tuple's items, or a container's length, as a
    mapping (the guards read every value with ``get``; a lifted number is written with
    ``[key] = ``)."""

    __slots__ = ("obj", "kind")

    def __init__(self, obj, kind: str):
        self.obj, self.kind = obj, kind

    def get(self, key, default=_MISSING):
        if self.kind == "len":
            return len(self.obj)
        if self.kind == "class":
            return vars(self.obj).get(key, default)
        return self.obj[key] if -len(self.obj) <= key < len(self.obj) else default

    def __setitem__(self, key, value):
        if self.kind == "class":
            setattr(self.obj, key, value)
        elif self.kind == "seq" and isinstance(self.obj, list):
            self.obj[key] = value
        else:
            raise LookupError(f"{self.kind} {key!r} cannot be written")


class _TypeOf:
    """An object's class as a one-entry mapping (a path through the class checks it is the same
    class)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def get(self, _key, default=_MISSING):
        return type(self.obj)


def code_id(code: types.CodeType) -> tuple:
    """Which code a function runs, comparable in another process."""
    return (code.co_filename, code.co_firstlineno, code.co_qualname)


class _CodeOf:
    """A function's code (``code_id``) as a one-entry mapping."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def get(self, _key, default=_MISSING):
        fn = _function_of(self.fn)
        return default if fn is None else code_id(fn.__code__)


class _Hooks:
    """The hooks ``register_hook`` put on a module's own parameter, as a mapping from their
    position (a parameter replaced since, or its hooks, re-resolve the paths through them)."""

    __slots__ = ("module", "name")

    def __init__(self, module, name: str):
        self.module, self.name = module, name

    def get(self, k, default=_MISSING):
        hooks = tensor_hooks(self.module._parameters.get(self.name))
        return hooks[k] if k < len(hooks) else default


class _DigestOf:
    """A plain tensor's values (``tensor_digest``) as a one-entry mapping, recomputed only when
    its version counter moved (an in-place change)."""

    __slots__ = ("t", "version", "digest")

    def __init__(self, t: torch.Tensor):
        self.t, self.version, self.digest = t, None, None

    def get(self, _key, default=_MISSING):
        version = self.t._version
        if version != self.version:
            self.version, self.digest = version, tensor_digest(self.t)
        return self.digest


def tensor_digest(t: torch.Tensor) -> tuple:
    """(dtype, shape, a hash of the bytes) of a plain tensor: equal in another process for the
    same values."""
    import hashlib

    data = t.detach().contiguous().cpu().reshape(-1)
    raw = data.view(torch.uint8) if data.numel() else data
    return (str(t.dtype), tuple(t.shape), hashlib.blake2b(raw.numpy().tobytes(), digest_size=16)
            .hexdigest())


def callable_id(fn) -> tuple:
    """Which function ``fn`` is, comparable in another process: a Python function by its code,
    a built-in by its module and name, a ``functools.partial`` by its function and plain
    arguments (others by identity, which no other process matches)."""
    if isinstance(fn, types.FunctionType):
        return code_id(fn.__code__)
    if isinstance(fn, functools.partial):
        plain = lambda x: x if is_plain(x) or _by_value(x) else ("object", id(x))  # noqa: E731
        return ("partial", callable_id(fn.func), tuple(map(plain, fn.args)),
                tuple(sorted((k, plain(v)) for k, v in fn.keywords.items())))
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = getattr(fn, "__self__", None)
        owner = owner.__name__ if isinstance(owner, types.ModuleType) else type(owner).__qualname__
        return ("builtin", getattr(fn, "__module__", None), owner, fn.__qualname__)
    return ("object", id(fn))


class _CallableOf:
    """The function at a path (``callable_id``) as a one-entry mapping."""

    __slots__ = ("holder", "key", "fn", "id")

    def __init__(self, holder, key):
        self.holder, self.key, self.fn, self.id = holder, key, _MISSING, None

    def get(self, _key, default=_MISSING):
        fn = self.holder.get(self.key, _MISSING)
        if fn is not self.fn:  # (the same function as last time: its id is known)
            self.fn, self.id = fn, default if fn is _MISSING else callable_id(fn)
        return self.id


class _Cell:
    """A closure cell as a one-entry mapping (the guards read every value with ``get``)."""

    __slots__ = ("cell",)

    def __init__(self, cell):
        self.cell = cell

    def get(self, _key, default=_MISSING):
        try:
            return self.cell.cell_contents
        except ValueError:
            return default

    def __setitem__(self, _key, value):
        self.cell.cell_contents = value


def step_roots(fn: Callable, sa) -> dict:
    """The objects guard paths start from: the model, the optimizers, the step function and its
    instance (a bound-method step)."""
    fn = _unwrap(fn)
    roots = {}
    while isinstance(fn, functools.partial):  # its arguments are the step's too
        roots.setdefault(("partial", "args"), fn.args)
        roots.setdefault(("partial", "keywords"), fn.keywords)
        fn = _unwrap(fn.func)
    roots.update({("model",): sa.module, ("fn",): getattr(fn, "__func__", fn)})
    if isinstance(fn, types.MethodType):
        roots[("self",)] = fn.__self__
    elif not isinstance(fn, types.FunctionType) and hasattr(fn, "__dict__"):
        roots[("self",)] = fn  # a callable object: its __call__ reads its attributes
    for k, opt in enumerate(sa.optimizers):
        roots[("optimizer", k)] = opt
    skip = {*sa.input_indices, *sa.module_indices, *sa.optimizer_indices}
    for j, leaf in enumerate(sa.leaves):  # a config argument: a dataclass, a namespace, an
        # object of the user's class (a library's object, as a scheduler, is read as its own)
        if j not in skip and not isinstance(leaf, type) and hasattr(leaf, "__dict__") and (
                dataclasses.is_dataclass(leaf) or type(leaf) in _ATTRIBUTE_BAGS
                or _user_class(type(leaf))):
            roots[("arg", j)] = leaf
    roots[("environ",)] = os.environ
    module = getattr(fn, "__globals__", {}).get("__name__")
    if isinstance(module, str):  # (the launched script's globals may not be its module's dict)
        roots[("global", module)] = fn.__globals__
    return roots


def _unwrap(fn: Callable) -> Callable:
    while hasattr(fn, "__wrapped__") and not isinstance(fn, types.MethodType):
        fn = fn.__wrapped__
    return fn


class _TorchDefaults:
    """torch's global defaults a recording depends on, as a mapping (``torch.set_default_dtype``
    between calls makes ``torch.tensor(0.5)`` another dtype)."""

    _READ = {"default_dtype": torch.get_default_dtype}

    def get(self, key, default=_MISSING):
        return self._READ[key]()


def _root(head: tuple, roots: dict):
    if head in roots:
        return roots[head]
    if head == ("torch",):
        return _TorchDefaults()
    if head[0] == "unguardable":
        raise LookupError("a read that cannot be guarded")
    if head[0] == "global":
        module = sys.modules.get(head[1])
        if module is None:
            raise LookupError(f"module {head[1]} is not imported")
        return vars(module)
    return roots[head]


def _step(obj, step: tuple):
    kind, arg = step
    if kind == "sub":
        return obj.get_submodule(arg)
    if kind == "group":
        return obj.param_groups[arg]
    if kind == "cell":
        return _Cell(obj.__closure__[obj.__code__.co_freevars.index(arg)])
    if kind == "type":
        return type(obj).__mro__[arg]
    if kind == "mro":
        return obj.__mro__[arg]
    raise LookupError(f"unknown step {step}")


def slot(path: tuple, roots: dict, along: list | None = None):
    """(mapping, key) holding the value at ``path``: ``mapping.get(key)`` reads it. ``along``,
    when given, receives a (mapping, key, object) per object the path passes through by an
    attribute, item or closure cell: the object ``mapping.get(key)`` must still be for the
    (mapping, key) to be the one the path names (a global rebound to another object is not)."""
    head, steps = path[0], path[1:]
    obj = _root(head, roots)
    for step in steps[:-1]:
        if step[0] in ("attr", "item"):
            holder = obj if step[0] == "item" or isinstance(obj, dict) else vars(obj)
            obj = holder[step[1]]
            if along is not None:  # (read with ``get``: a list's or tuple's items too)
                along.append((_Attrs(holder, "seq") if isinstance(holder, (list, tuple))
                              else holder, step[1], obj))
        elif step[0] == "hook":
            hooks = _Hooks(obj, step[1][0])
            obj = hooks.get(step[1][1])
            if obj is _MISSING:
                raise LookupError(f"no hook {step[1]}")
            if along is not None:
                along.append((hooks, step[1][1], obj))
        elif step[0] == "cell":
            cell = _step(obj, step)
            obj = cell.get(None)
            if obj is _MISSING:
                raise LookupError(f"empty closure cell {step[1]}")
            if along is not None:
                along.append((cell, None, obj))
        elif step[0] == "type" and along is not None:
            along.append((_TypeOf(obj), None, type(obj)))  # (``obj.__class__ = Other``)
            obj = _step(obj, step)
        else:
            obj = _step(obj, step)
    last = steps[-1]
    if last[0] == "callable":
        return _CallableOf(*slot(path[:-1], roots)), None
    if last[0] == "code":
        return _CodeOf(obj), None
    if last[0] == "digest":
        if type(obj) is not torch.Tensor:
            raise LookupError("no longer a plain tensor")
        return _DigestOf(obj), None
    if last[0] == "cell":
        return _step(obj, last), None
    if last[0] == "len":
        return _Attrs(obj, "len"), None
    if last[0] == "type":
        raise LookupError("a path ends at a class")
    if isinstance(obj, (list, tuple)):
        return _Attrs(obj, "seq"), last[1]
    if isinstance(obj, _TorchDefaults):
        return obj, last[1]
    if last[0] == "item" or isinstance(obj, dict) or obj is os.environ:
        return obj, last[1]
    if isinstance(obj, type):
        return _Attrs(obj, "class"), last[1]
    return vars(obj), last[1]


# ---------------------------------------------------------------------------------------------
# Checking


class ValueGuards:
    """A program's guards bound to the live objects of the step they were recorded for."""

    def __init__(self, guards: Iterable[ValueGuard], roots: dict):
        self.guards = list(guards)
        self._roots = roots
        self.has_lifted = any(g.lifted for g in self.guards)
        self._checked, self._lifted, self._place = [], [], []
        self._objects: list[list] = []  # [mapping, key, object] per object a path passes through
        self._deps: list[list[int]] = []  # per guard: the indices of the objects its path passes
        index: dict = {}
        for g in self.guards:
            mapping, key, along = self._resolve(g)
            if g.lifted:
                self._place.append(("lifted", len(self._lifted)))
                self._lifted.append((mapping, key))
            else:
                self._place.append(("checked", len(self._checked)))
                self._checked.append((mapping, key, g.value))
            deps = []
            for holder, k, obj in along:
                j = index.setdefault((type(holder), id(getattr(holder, "obj", holder)), k),
                                     len(self._objects))
                if j == len(self._objects):
                    self._objects.append([holder, k, obj])
                deps.append(j)
            self._deps.append(deps)
        self._getters = [m.get for m, _, _ in self._checked]
        self._keys = [k for _, k, _ in self._checked]
        self._values_hold = _checker(self._checked, self._getters, self._keys)
        self._same_objects = _identity_checker(self._objects)

    def _resolve(self, g: ValueGuard) -> tuple:
        """(mapping, key, objects along the path) of ``g`` on the live objects (``slot``)."""
        along: list = []
        try:
            mapping, key = slot(g.path, self._roots, along)
        except (LookupError, AttributeError, TypeError, ValueError, IndexError):
            return {}, None, []  # gone: the guard fails (a lifted value reads None)
        return mapping, key, along

    def _rebind(self) -> None:
        """Re-resolve the paths that pass through an object replaced since (a global rebound to
        a new config), in place: the generated checks read the new (mapping, key) pairs."""
        stale = {j for j, (holder, k, obj) in enumerate(self._objects)
                 if holder.get(k, _MISSING) is not obj}
        for i, g in enumerate(self.guards):
            if stale.isdisjoint(self._deps[i]):
                continue
            mapping, key, along = self._resolve(g)
            kind, at = self._place[i]
            if kind == "lifted":
                self._lifted[at] = (mapping, key)
            else:
                self._checked[at] = (mapping, key, g.value)
                self._getters[at], self._keys[at] = mapping.get, key
            for j, entry in zip(self._deps[i], along):
                self._objects[j][:] = entry

    def hold(self) -> bool:
        """Does every value the program holds as a constant read as it did at recording? An
        object along a path replaced since the last call (a global rebound to a new config)
        re-resolves the paths through it first, so its values are the ones compared and the
        lifted values are read from it."""
        if not self._same_objects():
            self._rebind()
        return self._values_hold()

    def lifted_values(self) -> list:
        """The current values of the program's lifted inputs, in placeholder order (a tuple's
        entries one by one)."""
        return flat_numbers([mapping.get(key) for mapping, key in self._lifted])

    def assign(self, assignments: tuple, numbers: list) -> None:
        """Set each lifted value ``assignments`` names ((path, Python expression over
        ``h<index>``), runtime.signature.TracedStep) to the expression's value for this call's
        ``numbers`` (the program's lifted inputs)."""
        slots = dict(zip([g.path for g in self.guards if g.lifted], self._lifted))
        h = {f"h{i}": v for i, v in enumerate(numbers)}
        for path, code in assignments:
            mapping, key = slots[path]
            mapping[key] = eval(_compiled(code), {"math": math, "torch": torch}, h)  # noqa: S307

    def changed(self) -> list[tuple[ValueGuard, Any]]:
        """(guard, current value) of every guard that fails."""
        if not self._same_objects():
            self._rebind()
        out = []
        for g, (mapping, key, value) in zip([g for g in self.guards if not g.lifted], self._checked):
            now = mapping.get(key, _MISSING)
            if now is not value and (now != value or type(now) is not type(value)):
                out.append((g, now))
        return out


def _checker(checked: list[tuple], getters: list, keys: list) -> Callable[[], bool]:
    """``hold()``: is every value the program holds as a constant unchanged? One generated
    expression (a lookup, an identity test and, only when that fails, a type and equality test
    per guard): about half the time of a loop over the guards. It reads each value through
    ``getters[i](keys[i])``, lists ``ValueGuards._rebind`` updates in place."""
    if not checked:
        return lambda: True
    namespace: dict[str, Any] = {"_M": _MISSING, "G": getters, "K": keys}
    terms = []
    for i, (_, _, value) in enumerate(checked):
        namespace.update({f"v{i}": value, f"t{i}": type(value)})
        terms.append(f"((x := G[{i}](K[{i}], _M)) is v{i} or (type(x) is t{i} and x == v{i}))")
    exec(compile("def hold():\n    return bool(" + "\n        and ".join(terms) + ")",
                 "<spmd_compiler value guards>", "exec"), namespace)
    return namespace["hold"]


def _identity_checker(objects: list[list]) -> Callable[[], bool]:
    """``same()``: is each object the guards' paths pass through still the one they were
    resolved on (``mapping.get(key) is obj`` for each [mapping, key, obj] of ``objects``, read
    as they are when it runs)?"""
    if not objects:
        return lambda: True
    namespace = {"_M": _MISSING, "O": objects}
    terms = [f"O[{j}][0].get(O[{j}][1], _M) is O[{j}][2]" for j in range(len(objects))]
    exec(compile("def same():\n    return (" + "\n        and ".join(terms) + ")",
                 "<spmd_compiler guarded paths>", "exec"), namespace)
    return namespace["same"]


@functools.lru_cache(maxsize=256)
def _compiled(code: str):
    return compile(code, "<spmd_compiler lifted assignment>", "eval")


def describe_changes(changes: list[tuple[ValueGuard, Any]]) -> str:
    return "; ".join(f"{g.name} changed {g.value!r} -> {now!r} (read at {g.where})"
                     for g, now in changes)


def _is_number(v) -> bool:
    return isinstance(v, _NUMBERS) and not isinstance(v, bool)


def _liftable(v) -> bool:
    """A number, or a short tuple of numbers (an optimizer's ``betas``)."""
    return _is_number(v) or (type(v) is tuple and 0 < len(v) <= 4 and all(map(_is_number, v)))


def flat_numbers(values: Iterable) -> list:
    """``values`` with each tuple replaced by its entries (one program input each)."""
    return [x for v in values for x in (v if isinstance(v, tuple) else (v,))]


class LiftPolicy:
    """Which numbers a step's next recording takes as program inputs: those whose guard failed
    (a value that changed once may change again; a tuple of numbers, as ``betas``, entry by
    entry), unless a recording had to keep them constant; and why each of the step's programs
    was compiled, at most ``limit`` of them (``within_limit``)."""

    def __init__(self, recompile_limit: int | None = None):
        self.lift: list[tuple] = []
        self.constant: set[tuple] = set()
        if recompile_limit is None:
            recompile_limit = int(os.environ.get("SPMD_RECOMPILE_LIMIT", RECOMPILE_LIMIT))
        if recompile_limit < 1:
            raise ValueError(f"recompile_limit must be at least 1, not {recompile_limit}")
        self.limit, self.reasons = recompile_limit, []

    def recompiled_for(self, changes: list[tuple[ValueGuard, Any]]) -> None:
        for g, now in changes:
            if g.path[-1][0] not in ("attr", "item", "cell"):
                continue  # a length, an environment variable: compared, never an input
            same_kind = _liftable(g.value) and _liftable(now) and (
                type(g.value) is not tuple or (type(now) is tuple and len(now) == len(g.value)))
            if same_kind and g.path not in self.constant and g.path not in self.lift:
                self.lift.append(g.path)

    def keep_constant(self, paths: Iterable[tuple]) -> None:
        for p in paths:
            self.constant.add(p)
            if p in self.lift:
                self.lift.remove(p)


def lifted_numbers(paths: Iterable[tuple], roots: dict) -> list:
    """The current values at ``paths``; LookupError unless each is an int, a float or a short
    tuple of them."""
    out = []
    for p in paths:
        mapping, key = slot(p, roots)
        v = mapping.get(key, _MISSING)
        if not _liftable(v):
            raise LookupError(f"{_name_of(p)} is no longer a number")
        out.append(v)
    return out


def specialized_lifts(traced) -> list[tuple]:
    """Paths of the lifted numbers that the recording used as constants after all (it guarded
    their symbol: a size, a branch, a float argument): the program compares them instead."""
    owner = [g.path for g in traced.value_guards if g.lifted
             for _ in (g.value if isinstance(g.value, tuple) else (g.value,))]
    first = traced.num_hparams - len(owner)
    return list(dict.fromkeys(owner[i - first] for i, _ in traced.specialized_hparams if i >= first))


@contextlib.contextmanager
def substituted(paths: list[tuple], roots: dict, values: list):
    """While recording: the value at each of ``paths`` is the symbolic number in ``values`` (a
    tuple: as many of them as it has entries)."""
    slots = [slot(p, roots) for p in paths]
    saved = [mapping.get(key, _MISSING) for mapping, key in slots]
    try:
        rest = iter(values)
        for (mapping, key), old in zip(slots, saved):
            mapping[key] = tuple(next(rest) for _ in old) if isinstance(old, tuple) else next(rest)
        yield
    finally:
        for (mapping, key), v in zip(slots, saved):
            if v is not _MISSING:
                mapping[key] = v


# ---------------------------------------------------------------------------------------------
# Collecting


def collect(fn: Callable, sa, codes: dict, lifted: list[tuple] = (),
            reads=None, gm=None) -> tuple[list[ValueGuard], list[str]]:
    """The guards of a recording of ``fn`` on ``sa`` whose stacks held ``codes`` (code object
    -> its globals) and which read ``reads`` (spmd_compiler/trace/reads.py: the attributes of
    the model's modules and of the step's instance, the code that read them, the environment), the
    ``lifted`` paths first (in order, as program inputs); and the source files of every code it
    considered. A plain tensor the recording ``gm`` holds as a constant (a ``get_attr`` node)
    that no guard's path reaches makes the program serve one call."""
    roots = step_roots(fn, sa)
    outer, frame = set(), sys._getframe(1)
    while frame is not None:  # the caller's code, on every recorded stack, read nothing inside
        outer.add(frame.f_code)
        frame = frame.f_back
    ran = {**codes, **(reads.readers() if reads is not None else {})}
    c = _Collector({code: g for code, g in ran.items() if code not in outer}, roots, reads)
    for _ in range(3):  # methods and functions found in values name more code
        before = len(c.codes)
        c.expand()
        c.walk(sa, lifted)
        if len(c.codes) == before:
            break
    c.unreached_closures(set(ran) - outer)
    if gm is not None:
        c.unreached_tensors(gm)
    out = []
    for p in lifted:
        mapping, key = slot(p, roots)
        g = c.guards.get(p)
        out.append(ValueGuard(g.name if g else _name_of(p), p, mapping.get(key), g.where if g else "?",
                              lifted=True))
    out += [g for p, g in c.guards.items() if p not in lifted]
    return out, sorted({code.co_filename for code in c.codes if not code.co_filename.startswith("<")})


def _name_of(path: tuple) -> str:
    return ".".join(str(s[-1]) for s in path)


_log = logging.getLogger("spmd_compiler")
_UNGUARDABLE_LOGGED: set = set()


class _Collector:
    def __init__(self, codes: dict, roots: dict, reads=None):
        self.codes = dict(codes)
        self.roots = roots
        self.reads = reads
        self._reads_index: dict | None = None  # (_read_names)
        self.guards: dict[tuple, ValueGuard] = {}
        self.names: set[str] = set()
        self.stored: set[str] = set()
        self.user_stored: set[str] = set()  # of those, assigned by the user's code
        self._seen_objects: set[int] = set()
        self._reached: set = set()  # code objects whose closure cells are guarded by a path
        self._model_modules = {id(m) for m in roots[("model",)].modules()}
        # tensors that are the step's state or inputs, not constants (set by ``walk``)
        self._state: set[int] = set()
        self._constants: set[int] = set()  # plain tensors guarded by their values
        fn = roots[("fn",)]
        if not isinstance(fn, types.FunctionType):
            fn = getattr(type(fn), "__call__", None)
        if isinstance(fn, types.FunctionType):
            self.codes.setdefault(fn.__code__, fn.__globals__)
        self.keys: set[str] = set()  # string constants of the user's code: names it reads
        self.computed_names = False
        self._methods: set = set()  # (class, name) of the methods guarded by their code

    def expand(self) -> None:
        """Add nested code and the user functions that user code can call by a global name."""
        self.codes = expanded(self.codes)
        user = [c for c in self.codes if is_user_file(c.co_filename)]
        self.keys = {k for c in user for k in c.co_consts if isinstance(k, str)}
        # what user code names: attribute and global names, and the constant strings it may
        # pass to getattr or use as keys
        self.names = set().union(*(c.co_names for c in self.codes)) | self.keys
        self.user_names = set().union(*(c.co_names for c in user)) | self.keys
        # user code that asks for attributes by a computed name: every attribute of the objects
        # it reaches counts, not only the names it spells
        self.computed_names = bool(_COMPUTED_NAMES.intersection(self.user_names))
        # names the code that ran assigns (self.n += 1, global n): state the step writes, which
        # spmd_compiler/trace/side_effects.py replays after each call; not a constant to guard
        self.stored = set().union(*(_stored_names(c) for c in self.codes))
        self.user_stored = set().union(*(_stored_names(c) for c in user))
        if self.reads is not None:
            self.stored |= {r.name for r in self.reads.attrs if r.write}

    def walk(self, sa, lifted) -> None:
        self._seen_objects.clear()
        model = sa.module
        self._state = {id(t) for t in (*model.parameters(), *model.buffers(), *sa.leaves,
                                       *(v for opt in sa.optimizers for st in opt.state.values()
                                         for v in st.values()))}
        for path, m in sa.module.named_modules(remove_duplicate=False):
            head = (("model",), ("sub", path)) if path else (("model",),)
            self._object(m, "model" + (f".{path}" if path else ""), head, 1, module=True)
            self._hooks(m, "model" + (f".{path}" if path else ""), head)
        if ("self",) in self.roots:
            self._object(self.roots[("self",)], "self", (("self",),), 1)
        fn = self.roots[("fn",)]
        if isinstance(fn, types.FunctionType):
            self._closure(fn, fn.__qualname__, (("fn",),), 1)
        for head, obj in self.roots.items():
            if head[0] == "arg":
                self._value(obj, sa.leaf_name(head[1]), (head,), 1, str(head[1]))
        for head in (("partial", "args"), ("partial", "keywords")):
            if head in self.roots:
                self._container(self.roots[head], f"the step's partial {head[1]}", (head,), 1)
        for k, opt in enumerate(sa.optimizers):
            for gi, group in enumerate(opt.param_groups):
                inputs = group_inputs(group)
                for key, v in group.items():
                    if key != "params" and key not in inputs and is_plain(v):
                        self._add(f"optimizer {k} param_groups[{gi}][{key!r}]",
                                  (("optimizer", k), ("group", gi), ("item", key)), v, key,
                                  where=f"{type(opt).__qualname__}.step()")
        for code, g in list(self.codes.items()):
            if is_user_file(code.co_filename):
                self._globals(code, g)
        self._patchable()
        self._environment()
        self._add("torch.get_default_dtype()", (("torch",), ("item", "default_dtype")),
                  torch.get_default_dtype(), "default_dtype", where="torch's default dtype")

    def _patchable(self) -> None:
        """The functions of ``_PATCHED_MODULES`` that any code that ran names, by identity."""
        for module_name in _PATCHED_MODULES:
            module = sys.modules.get(module_name)
            if module is None:
                continue
            attrs = vars(module)
            names = {n for c in self.codes for n in c.co_names if n in attrs}
            for n in sorted(names):
                v = attrs[n]
                if callable(v) and not isinstance(v, (type, types.ModuleType)):
                    self._add(f"{module_name}.{n}",
                              (("global", module_name), ("item", n), ("callable", None)),
                              callable_id(v), n, where=f"the step calls {module_name}.{n}")

    def _hooks(self, m: torch.nn.Module, name: str, path: tuple) -> None:
        """The closures of the gradient hooks on ``m``'s own parameters (seed 000's
        ``grad.redistribute(placements=dist_spec)``), which run in the recorded backward."""
        for pname, p in m._parameters.items():
            for k, hook in enumerate(tensor_hooks(p) if p is not None else ()):
                if isinstance(hook, types.FunctionType):
                    self._closure(hook, f"{name}.{pname}.<hook {k}>",
                                  path + (("hook", (pname, k)),), 2)

    def _globals(self, code, g: dict) -> None:
        module = g.get("__name__")
        names = [n for n in code.co_names if n in g]
        if not names:
            return
        head = ("global", module) if isinstance(module, str) else ("unguardable",)
        try:
            same = _root(head, self.roots) is g
        except LookupError:
            same = False
        if not same:  # code run with globals no path reaches (exec'd into a private dict)
            self._unguardable(f"the globals {', '.join(names[:3])} of {code.co_name}",
                              f'File "{code.co_filename}", line {code.co_firstlineno}')
            return
        for n in names:
            self._value(g[n], f"{module}.{n}", (head, ("item", n)), 1, n)

    def _environment(self) -> None:
        if self.reads is None:
            return
        env = dict(self.reads.environ)
        if self.reads.environ_listed:
            env.update({k: os.environ.get(k) for k in os.environ})
            self._add("len(os.environ)", (("environ",), ("len", None)), len(os.environ), "environ",
                      where="the step lists the environment")
        for k, v in env.items():
            value = ABSENT if v == "<absent>" else v
            self._add(f"os.environ[{k!r}]", (("environ",), ("item", k)), value, k)

    def _value(self, v, name: str, path: tuple, depth: int, attr: str) -> None:
        if is_plain(v) or _by_value(v):
            self._add(name, path, v, attr)
        elif type(v) is torch.Tensor:  # a constant of the program: guarded by its values
            if id(v) not in self._state and not v.is_meta and not v.requires_grad:
                self._constants.add(id(v))
                self._add(f"{name} (its values)", path + (("digest", None),), tensor_digest(v),
                          attr)
        elif isinstance(v, type) and depth < _MAX_DEPTH and _user_class(v):
            self._class(v, name, path, depth + 1)
        elif depth < _MAX_DEPTH and not isinstance(v, (torch.Tensor, type)):
            if isinstance(v, types.FunctionType):  # which function: by its code
                self._add(f"{name}.__code__", path + (("code", None),), code_id(v.__code__), attr)
                self._closure(v, name, path, depth + 1)
            elif isinstance(v, (functools.partial, types.BuiltinFunctionType)):
                self._add(name, path + (("callable", None),), callable_id(v), attr)
            elif isinstance(v, types.ModuleType):
                if is_user_file(getattr(v, "__file__", None) or "<"):
                    self._object(v, name, path, depth + 1)
            elif isinstance(v, torch.nn.Module) and id(v) in self._model_modules:
                pass  # walked as part of the model
            elif type(v) in (list, tuple, dict) and len(v) <= 256:
                self._container(v, name, path, depth)
            elif hasattr(v, "__dict__") and not isinstance(v, (torch.optim.Optimizer, types.MethodType)) \
                    and not type(v).__module__.startswith(__package__):  # (a compiled step)
                self._object(v, name, path, depth + 1, module=isinstance(v, torch.nn.Module))

    def _container(self, v, name: str, path: tuple, depth: int) -> None:
        """A list, tuple or dict the step reaches: its length and every item (any key)."""
        if type(v) is not tuple:
            self._add(f"len({name})", path + (("len", None),), len(v), "len")
        items = v.items() if type(v) is dict else enumerate(v)
        for k, x in items:
            if is_plain(k):
                self._value(x, f"{name}[{k!r}]", path + (("item", k),), depth + 1, str(k))

    def _object(self, obj, name: str, path: tuple, depth: int, module: bool = False) -> None:
        if id(obj) in self._seen_objects:
            return
        self._seen_objects.add(id(obj))
        if self.reads is not None and id(obj) in self.reads.watched:
            self._watched(obj, name, path, depth)
        else:
            self._named(obj, name, path, depth, module)
        if not isinstance(obj, types.ModuleType):
            for f in _user_methods(type(obj), self.names):
                self.codes.setdefault(f.__code__, f.__globals__)

    def _class(self, cls: type, name: str, path: tuple, depth: int) -> None:
        """A user class the step reaches (``Model.k``, ``Config.scale``): each name user code
        uses, where its MRO finds it (absent in the classes before that one, which a subclass
        attribute set later would shadow)."""
        if id(cls) in self._seen_objects:
            return
        self._seen_objects.add(id(cls))
        for f in _user_methods(cls, self.names):
            self.codes.setdefault(f.__code__, f.__globals__)
        mro = cls.__mro__
        for n in sorted(self.user_names):
            if not n.isidentifier() or n.startswith("__") or n in self.stored:
                continue
            owner = next((k for k, klass in enumerate(mro) if n in vars(klass)), None)
            if owner is None or not _user_class(mro[owner]):
                continue
            for k in range(owner):
                if _user_class(mro[k]):
                    self._add(f"{mro[k].__qualname__}.{n}", path + (("mro", k), ("attr", n)),
                              ABSENT, n)
            self._value(vars(mro[owner])[n], f"{mro[owner].__qualname__}.{n}",
                        path + (("mro", owner), ("attr", n)), depth, n)

    def _named(self, obj, name: str, path: tuple, depth: int, module: bool) -> None:
        """An object whose attribute reads were not watched: the attributes user code names,
        through the type and its MRO (user classes), absent ones included."""
        attrs = vars(obj)
        every = self.computed_names and len(attrs) <= 256 and (
            _user_class(type(obj)) or type(obj) in _ATTRIBUTE_BAGS)
        named = attrs.keys() if every else self.names
        for n in named & attrs.keys():
            if n in _SKIPPED_ATTRS or (module and "hook" in n):
                continue
            self._value(attrs[n], f"{name}.{n}", path + (("attr", n),), depth, n)
        if isinstance(obj, types.ModuleType):
            return
        for n in self.user_names.difference(attrs):
            if n.isidentifier() and not n.startswith("__"):
                self._through_type(obj, n, name, path, depth, user_only=True)

    def _watched(self, obj, name: str, path: tuple, depth: int) -> None:
        """An object whose attribute reads were watched: every name read, wherever it was found."""
        for n in self._read_names().get(id(obj), ()):
            if n in _SKIPPED_ATTRS or n.startswith(("__", "_spmd")) or "hook" in n:
                continue  # (this package's own marks on a module are not the step's values)
            if n in vars(obj):
                self._value(vars(obj)[n], f"{name}.{n}", path + (("attr", n),), depth, n)
            else:
                self._through_type(obj, n, name, path, depth, user_only=False)

    def _read_names(self) -> dict[int, dict[str, Any]]:
        """id(object) -> the names read from it (not written; in order), and under ``None``
        the first place each name was read (made once: the reads are many, the objects too)."""
        if self._reads_index is None:
            self._reads_index = {None: {}}
            for r in self.reads.attrs:
                if not r.write and r.where is not None:
                    self._reads_index.setdefault(id(r.obj), {}).setdefault(r.name, None)
                    self._reads_index[None].setdefault(r.name, r.where)
        return self._reads_index

    def _through_type(self, obj, n: str, name: str, path: tuple, depth: int, user_only: bool):
        """A name not in ``obj``'s own dict: guarded absent there (and in the classes before
        the one holding it), and the class's plain value."""
        where = resolve(obj, n)
        if where[0] == "structure" or n in self.stored:
            return
        mro = type(obj).__mro__
        owner = where[1] if where[0] == "class" else len(mro)
        if user_only and not any(_user_class(k) for k in mro[:owner + 1] if k is not object):
            return
        method = None
        if owner < len(mro) and not is_plain(where[2]) and type(where[2]) not in (list, tuple, dict):
            method = _function_of(where[2])
            if method is None or mro[owner] in _BASE_CLASSES:
                return  # a property or other descriptor: its code's reads are its own; (and
                # nn.Module's own machinery, which every module runs, is not the model's)
        self._add(f"{name}.{n}", path + (("attr", n),), ABSENT, n)
        for k in range(min(owner, len(mro))):
            if _user_class(mro[k]):
                self._add(f"{mro[k].__qualname__}.{n}", path + (("type", k), ("attr", n)), ABSENT, n)
        if method is not None:  # a method the recording ran: by its code (another one
            # assigned to the class, or to the instance or a subclass above, is noticed), once
            # per class however many instances ran it
            if (mro[owner], n) in self._methods:
                return
            self._methods.add((mro[owner], n))
            self._add(f"{mro[owner].__qualname__}.{n}.__code__",
                      path + (("type", owner), ("attr", n), ("code", None)),
                      code_id(method.__code__), n)
        elif owner < len(mro):
            self._value(where[2], f"{mro[owner].__qualname__}.{n}",
                        path + (("type", owner), ("attr", n)), depth, n)

    def _closure(self, f: types.FunctionType, name: str, path: tuple, depth: int) -> None:
        if not is_user_file(f.__code__.co_filename):
            return
        self.codes.setdefault(f.__code__, f.__globals__)
        self._reached.add(f.__code__)
        for var, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            value = _Cell(cell).get(None)
            if value is not _MISSING:
                self._value(value, f"{name}.<closure {var}>", path + (("cell", var),), depth, var)

    def unreached_closures(self, ran) -> None:
        """Free variables of user code that ran, held by a function no path reaches (a
        decorator's wrapper, a closure made elsewhere): code (functions, classes, modules) is
        fine, its reads are its own when it runs; anything else cannot be guarded."""
        cells = {v for c in ran for v in c.co_cellvars}
        free = {code: set(code.co_freevars) - cells - {"__class__"} for code in ran
                if code not in self._reached and is_user_file(code.co_filename)}
        free = {code: names for code, names in free.items() if names}
        for f in functions_of(list(free)):
            code = f.__code__
            for var, cell in zip(code.co_freevars, f.__closure__ or ()):
                if var in free[code] and not _is_code(_Cell(cell).get(None)):
                    self._unguardable(f"closure variable {var!r} of {code.co_qualname}",
                                      f'File "{code.co_filename}", line {code.co_firstlineno}')
                    return

    def unreached_tensors(self, gm) -> None:
        """A tensor the step read as a constant (one it did not make: ``lift_fresh_copy`` marks
        those) that no path reaches: cannot be guarded."""
        for node in gm.graph.nodes:
            if node.op != "get_attr" or all(
                    u.target is torch.ops.aten.lift_fresh_copy.default for u in node.users):
                continue
            value = getattr(gm, node.target, None)
            if type(value) is torch.Tensor and id(value) not in self._constants:
                where = next((u.meta.get("stack_trace") for u in node.users
                              if u.meta.get("stack_trace")), None)
                line = where.strip().splitlines()[-2].strip() if where else "<unknown location>"
                self._unguardable(f"a tensor of shape {tuple(value.shape)} that is not a "
                                  "parameter, buffer or argument (pass it as an argument, or "
                                  "register it as a buffer)", line)

    def _unguardable(self, what: str, where: str) -> None:
        path = (("unguardable",), ("item", what))
        if path not in self.guards:
            self.guards[path] = ValueGuard(what, path, _Unguardable(), where)
        if (what, where) not in _UNGUARDABLE_LOGGED:
            _UNGUARDABLE_LOGGED.add((what, where))
            _log.warning("spmd_compiler: the step reads %s (%s), which cannot be guarded: its "
                         "program serves one call (recompiled on every call, neither shared "
                         "between ranks nor cached)", what, where)

    def _add(self, name: str, path: tuple, value, attr: str, where: str | None = None) -> None:
        written = path[0][0] not in ("optimizer", "environ") and attr in self.stored
        if written and (attr not in self.user_stored or not isinstance(value, _NUMBERS)
                        or isinstance(value, bool)):
            return  # state the step (or a library it calls) writes, replayed only
        if path not in self.guards:
            self.guards[path] = ValueGuard(name, path, value, where or self._where(attr, path),
                                           written=written)

    def _where(self, attr: str, path: tuple = ()) -> str:
        if self.reads is not None and (where := self._read_names()[None].get(attr)) is not None:
            code, line = where
            return f'File "{code.co_filename}", line {line}, in {code.co_name}'
        readers = [c for c in self.codes
                   if attr in c.co_names or attr in c.co_freevars or attr in c.co_consts]
        readers.sort(key=lambda c: not is_user_file(c.co_filename))
        for code in readers[:1]:
            line = _line_reading(code, attr)
            return f'File "{code.co_filename}", line {line}, in {code.co_name}'
        return "<unknown location>"


def _by_value(v) -> bool:
    """Immutable torch values a guard compares by equality: a dtype, a device, a DTensor
    placement (a closure over ``[Replicate()]``)."""
    from torch.distributed.tensor import Placement

    return isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format, Placement))


def _function_of(v) -> types.FunctionType | None:
    """The Python function a class attribute runs (a plain, static or class method)."""
    v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
    return v if isinstance(v, types.FunctionType) else None


def _user_class(cls: type) -> bool:
    return is_user_file(getattr(sys.modules.get(cls.__module__), "__file__", None) or "<")


def _is_code(v) -> bool:
    return v is _MISSING or isinstance(v, (types.FunctionType, types.BuiltinFunctionType,
                                           types.MethodType, type, types.ModuleType,
                                           functools.partial))


def _user_methods(cls: type, names: set[str]) -> list[types.FunctionType]:
    """The functions of ``cls``'s own (user-written) classes named in ``names``."""
    out = []
    for klass in cls.__mro__:
        if not is_user_file(getattr(sys.modules.get(klass.__module__), "__file__", None) or "<"):
            continue
        for n in names.intersection(vars(klass)):
            f = vars(klass)[n]
            f = f.__func__ if isinstance(f, (staticmethod, classmethod)) else f
            if isinstance(f, types.FunctionType):
                out.append(f)
    return out


@functools.lru_cache(maxsize=16384)
def _stored_names(code: types.CodeType) -> frozenset:
    """The attribute, global and closure names ``code`` assigns."""
    return frozenset(ins.argval for ins in dis.get_instructions(code)
                     if ins.opname in ("STORE_ATTR", "STORE_GLOBAL", "STORE_DEREF"))


@functools.lru_cache(maxsize=4096)
def _line_reading(code: types.CodeType, name: str) -> int:
    line = code.co_firstlineno
    for ins in dis.get_instructions(code):
        if ins.positions and ins.positions.lineno:
            line = ins.positions.lineno
        if ins.argval == name and ins.opname.startswith(("LOAD", "STORE_ATTR")):
            return line
    return code.co_firstlineno


def describe_paths(paths: Iterable[tuple]) -> list[str]:
    return [_name_of(p) for p in paths]


def record_lifting(policy: LiftPolicy | None, record: Callable[[list], Any]):
    """``record(lift)`` with the numbers ``policy`` lifts as inputs; if that recording fails,
    again with them as constants (kept so by the policy from then on). A lifted number the
    recording guarded on (a size, a branch, a float argument) is recorded again as a constant
    too: the graph's guard expression cannot name a lifted input."""
    from ..errors import SPMDError

    lift = list(policy.lift) if policy is not None else []
    try:
        traced = record(lift)
    except (SPMDError, LookupError) as e:
        if not lift:
            raise
        logging.getLogger("spmd_compiler").info(
            "spmd_compiler: recording with %s as inputs failed (%s); recording them as constants",
            ", ".join(describe_paths(lift)), str(e).splitlines()[0] if str(e) else type(e).__name__)
        policy.keep_constant(lift)
        return _settled(record([]))
    constant = specialized_lifts(traced) if lift else []
    if constant:
        policy.keep_constant(constant)
        return _settled(record(list(policy.lift)))
    written = [g.path for g in traced.value_guards if g.written and not g.lifted
               and g.path not in policy.constant] if policy is not None else []
    if written:  # a number the step writes and reads: an input from the first program on
        policy.lift += written
        return record_lifting(policy, record)
    return _settled(traced)


def _settled(traced):
    """``traced``, unless the Python state it changes cannot be repeated (raised now)."""
    if traced.deferred_error is not None:
        raise traced.deferred_error
    return traced


def bind(traced, fn: Callable, sa) -> ValueGuards:
    """The value guards of a recording (``traced.value_guards``) bound to the live objects of
    the call ``fn`` was compiled for."""
    return ValueGuards(traced.value_guards, step_roots(fn, sa))


RECOMPILE_LIMIT = 8  # programs per compiled step, as torch.compile's ``recompile_limit``


def within_limit(name: str, policy: "LiftPolicy", programs: int, why: str | None) -> str | None:
    """``why`` a step that holds ``programs`` programs compiles one more, kept in ``policy``;
    RecompileLimitError when that one would pass the step's limit (``policy.limit``). Every
    rank holds the same number of programs, so every rank raises on the same call."""
    policy.reasons[programs:] = [why or "the first call"]
    if programs < policy.limit:
        return why
    from ..errors import RecompileLimitError

    lines = [f"  program {k + 1}: {r}" for k, r in enumerate(policy.reasons[:programs])]
    raise RecompileLimitError(
        f"{name} would compile a program {programs + 1}, past its recompile limit of "
        f"{policy.limit} (spmd_compile(recompile_limit=...) or SPMD_RECOMPILE_LIMIT). Why each "
        "was compiled:\n" + "\n".join(lines) + f"\n  now: {why or 'no reason found'}\n"
        "A value that changes on every call should reach the step as a tensor argument (or "
        "a number the step reads, which becomes an input of the program); a read that cannot "
        "be guarded (logged as a warning) makes every program serve one call.")


def recompile_reason(programs: list, key: tuple, policy: LiftPolicy) -> str | None:
    """Which Python values read by the newest of ``programs`` (runtime.program.CompiledGraph) for the
    static ``key`` changed, for the log; the numbers among them are lifted by ``policy`` from
    the next recording on."""
    for entry in reversed(programs):
        if entry.static_key == key and entry.values is not None:
            changes = entry.values.changed()
            if changes:
                policy.recompiled_for(changes)
                return describe_changes(changes)
    return None
