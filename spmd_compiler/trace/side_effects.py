"""Python state a step changes, and tensor values it reads, while it is recorded.

The compiled step records the step's tensor operations once; its Python code runs only while it
is recorded, on the recording's stand-ins (fake tensors, size and learning-rate symbols). A
change to Python-visible state made there would happen once, with those stand-ins, and never
again: a scheduler's ``step()`` inside the step would leave the learning rate at its first value
(and a fake tensor in the scheduler), a counter would stop counting. :func:`watch` therefore
snapshots, before the step's code runs, the Python state the step can change:

- the values of every optimizer's ``param_groups`` (``lr``, ``betas``, ``weight_decay``, ...;
  the learning rates bound to the recording's symbols);
- the attributes of the model's modules (``training`` aside: ``model.train()`` in the step does
  the same on every call);
- plain Python objects the step reaches (an LR scheduler, a user's own objects) and lists, dicts
  and sets: its non-tensor arguments, its closure variables, the globals its code names, and the
  plain objects among their attributes (a trainer's scheduler); containers are compared one
  level deep (a list appended to);
- the globals the step's code and its modules' ``forward`` methods assign (``global step_count``).

After the step's code has run it compares, and puts the state back as it was (a change made with
the recording's stand-ins must not stay). The changes go to spmd_compiler/trace/replay.py, which runs
the statements that made them again after every call, or raises a :class:`SideEffectError` that
names what changed, the user's line and why it cannot (a failed compile changes nothing). One
exception: a module that changed an attribute holding tensors is caching something made from its
inputs or parameters (a rotary embedding's cos/sin table and its length, an RNN's flat weights):
its attributes are put back silently and are not a change, and the model, eager or compiled,
recomputes the cache (a traced tensor must not stay on the model).

Reading a tensor's value (``loss.item()``, ``float(t)``) in the step to print or log it shows a
symbol, once. :func:`value_read_line` finds where such a read happens in the user's code (reads
in torch's own code, as foreach Adam's ``step.item()``, are not the user's), and
:func:`warn_value_reads` warns once per line that it runs only while compiling.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import SideEffectError


_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_SKIPPED_ATTRS = {"training", "_parameters", "_buffers", "_modules", "params"}
_MAX_OBJECTS = 256  # plain objects watched at most (the step's reach, two levels)


class ValueReadWarning(UserWarning):
    """The step reads a tensor's value in Python (``.item()``) while it is recorded: the code
    using it runs only while compiling."""


@dataclass
class Change:
    """One change of Python state: what, and the user's line that made it (text, and where)."""

    what: str
    line: str | None = None
    # (attribute dict or globals, name, value after the step's code ran) of what changed
    slots: tuple = ()
    # a learning-rate schedule's change (an optimizer's param_groups, an LRScheduler's state):
    # the graph reads it only through its learning-rate inputs
    schedule: bool = False
    # what changed, one item per attribute or key: (owner, name)
    parts: tuple = ()

    @property
    def where(self) -> tuple[str, int] | None:
        """(file, line number) of ``line``."""
        m = re.match(r'File "(.*)", line (\d+)', self.line or "")
        return (m.group(1), int(m.group(2))) if m else None


@dataclass
class _Snapshot:
    """The watched state before the step's code ran."""

    groups: list[tuple[int, list[dict]]] = field(default_factory=list)  # (optimizer, groups)
    # (label, variable name, object, its attributes, the only ones watched or None)
    objects: list[tuple[str, str | None, Any, dict, frozenset | None]] = field(default_factory=list)
    modules: list[tuple[str, torch.nn.Module, dict]] = field(default_factory=list)
    # (function, assigned global, its line, value or _MISSING) of the step and modules' forwards
    globals: list[tuple[Callable, str, int, Any]] = field(default_factory=list)


_MISSING = object()


@dataclass(frozen=True)
class _Written:
    """A tensor and its version counter (an in-place write, e.g. a scheduler's ``fill_`` of a
    tensor learning rate, changes the version)."""

    tensor: torch.Tensor
    version: int


def _copy(v: Any) -> Any:
    """``v``, with a container shallow-copied (so a list appended to compares unequal) and a
    tensor paired with its version."""
    if type(v) in (list, dict, set):
        return type(v)(v)
    if isinstance(v, torch.Tensor):
        return _Written(v, v._version)
    return v


def _same(a: Any, b: Any, depth: int = 1) -> bool:
    """Equal as Python state: the same object, equal plain scalars (a symbol or fake tensor never
    equals anything else), or containers of such, one level deep."""
    if a is b:
        return True
    if isinstance(a, _Written) and isinstance(b, _Written):
        return a.tensor is b.tensor and a.version == b.version
    if type(a) is not type(b):
        return False
    if isinstance(a, _SCALARS):
        return a == b or (a != a and b != b)  # nan
    if depth and isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth - 1) for x, y in zip(a, b))
    if depth and isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth - 1) for k in a)
    if depth and isinstance(a, set):
        return a == b
    return False


def _plain_object(obj: Any) -> bool:
    """Is ``obj`` a Python object whose attributes the step may change: a user's object or an LR
    scheduler (not a module, optimizer, tensor, function, class, library object or this
    package's own)?"""
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, type,
                        types.ModuleType, types.FunctionType, types.MethodType,
                        types.BuiltinFunctionType, *_SCALARS)):
        return False
    if not isinstance(getattr(obj, "__dict__", None), dict):
        return False
    module = type(obj).__module__ or ""
    if module.split(".")[0] == __package__.split(".")[0]:
        return False  # this package's own bookkeeping on the model (eager use, saving)
    if module.startswith("torch."):
        return module == "torch.optim.lr_scheduler"
    return module.split(".")[0] not in sys.stdlib_module_names


def step_constants(sa) -> list[tuple[str, Any]]:
    """(name, value) of the step's arguments that are neither tensors nor its module and
    optimizers (``sa``: runtime.call_args.StepArgs)."""
    return [(sa.leaf_name(j), x) for j, x in enumerate(sa.leaves) if j not in sa.input_indices
            and j not in sa.module_indices and j not in sa.optimizer_indices]


def unwrapped(fn: Callable) -> Callable:
    """The function a step runs: through ``functools.partial`` and ``functools.wraps``."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__") and not isinstance(fn, types.MethodType):
            fn = fn.__wrapped__
        else:
            return fn


def _code_objects(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def _stores(fn: Callable, opname: str) -> dict[str, int]:
    """name -> first line of ``fn``'s code (nested functions too) doing ``opname`` with it."""
    code = getattr(fn, "__code__", None)
    out: dict[str, int] = {}
    if code is None:
        return out
    for c in _code_objects(code):
        for ins in dis.get_instructions(c):
            if ins.opname == opname and ins.positions and ins.positions.lineno:
                out.setdefault(ins.argval, ins.positions.lineno)
    return out


def _reach(fn: Callable, constants: list[tuple[str, Any]]) -> list[tuple[str, str | None, Any]]:
    """(label, variable name, object) of the plain objects the step reaches: its non-tensor
    arguments, the instance of a bound-method step (``self``), closure variables and named
    globals, then the plain objects among their attributes."""
    roots: list[tuple[str, str | None, Any]] = [(label, None, x) for label, x in constants]
    code = getattr(fn, "__code__", None)
    if code is not None:
        params = code.co_varnames[:code.co_argcount]
        shift = 1 if isinstance(fn, types.MethodType) else 0  # arguments after ``self``
        roots = [(label, params[int(label[9:]) + shift] if label.startswith("argument ") and
                  label[9:].isdigit() and int(label[9:]) + shift < len(params) else None, x)
                 for label, _, x in roots]
        if shift and params:
            roots.insert(0, (params[0], params[0], fn.__self__))
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                roots.append((f"closure variable {name!r}", name, cell.cell_contents))
        names = {n for c in _code_objects(code) for n in c.co_names}
        roots += [(f"global {n!r}", n, fn.__globals__[n]) for n in sorted(names)
                  if n in fn.__globals__]
    out, seen = [], set()
    for label, var, obj in roots:
        if not (_plain_object(obj) or type(obj) in _CONTAINERS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        out.append((label, var, obj))
        for attr, value in list(_attrs(obj).items()):
            if _plain_object(value) and id(value) not in seen and len(out) < _MAX_OBJECTS:
                seen.add(id(value))
                out.append((f"{label}.{attr}", var, value))
    return out[:_MAX_OBJECTS]


def _counters(module: torch.nn.Module | None) -> list[tuple[str, Any, frozenset]]:
    """(label, object, attribute names) of the plain objects the model's modules hold whose
    number attributes a module's ``forward`` or the object's own methods assign (a call counter
    on a stats object, ``self.stats.update()``): only those attributes are watched. (A forward also fills in a config's string once, as Hugging
    Face models set ``config.problem_type``: that stays as the recording left it, as after an
    eager call.)"""
    if module is None:
        return []
    modules = list(module.named_modules())
    stored = set().union(*(_stores(f, "STORE_ATTR") for f in {type(m).forward for _, m in modules}
                           if isinstance(f, types.FunctionType)))
    out, seen = [], set()
    for name, m in modules:
        for a, v in vars(m).items():
            if not _plain_object(v) or id(v) in seen:
                continue
            mine = stored | _method_stores(type(v))  # (``self.stats.update()`` counts in there)
            attrs = frozenset(k for k, x in vars(v).items() if k in mine and _is_number(x))
            if attrs:
                seen.add(id(v))
                out.append((f"attribute {a!r} of module {name or '<root>'!r}", v, attrs))
    return out


@functools.lru_cache(maxsize=1024)
def _method_stores(cls: type) -> frozenset:
    """The attribute names the methods of ``cls``'s own (Python) classes assign to."""
    out = set()
    for klass in cls.__mro__:
        for f in vars(klass).values():
            f = f.__func__ if isinstance(f, (staticmethod, classmethod)) else f
            if isinstance(f, types.FunctionType):
                out |= _stores(f, "STORE_ATTR").keys()
    return frozenset(out)


def _is_number(v: Any) -> bool:
    """A number, or the symbolic one a recording reads in its place (trace/guards.substituted)."""
    return isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool)


_CONTAINERS = (list, dict, set)
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _attrs(obj: Any) -> dict:
    """What is compared of a watched object: its attributes; a list's, dict's or set's contents."""
    return {"contents": obj} if type(obj) in _CONTAINERS else vars(obj)


def _use_line(fn: Callable, var: str | None) -> int | None:
    """The first line of ``fn`` that calls a method of (or reads an attribute of) ``var``."""
    code = getattr(fn, "__code__", None)
    if code is None or var is None:
        return None
    for c in _code_objects(code):
        ins = list(dis.get_instructions(c))
        for a, b in zip(ins, ins[1:]):
            if a.opname.startswith("LOAD_") and a.argval == var and b.opname in (
                    "LOAD_METHOD", "LOAD_ATTR") and a.positions and a.positions.lineno:
                return a.positions.lineno
    return None


def _state(d: dict) -> dict:
    """Attribute -> (value, shallow copy of it) (the copy is what a later state is compared
    with; the value and its former contents are what ``_put_back`` restores)."""
    return {k: (v, _copy(v)) for k, v in d.items() if k not in _SKIPPED_ATTRS}


def _put_back(d: dict, before: dict) -> None:
    for k in [k for k in d if k not in before and k not in _SKIPPED_ATTRS]:
        del d[k]
    for k, (value, contents) in before.items():
        if type(value) in (list, dict, set):  # a container: its former contents too
            value.clear()
            value.update(contents) if isinstance(value, (dict, set)) else value.extend(contents)
        d[k] = value


class _RecordingGroup(dict):
    """An optimizer param group that remembers the user's line of each write."""

    def __init__(self, *args, where):
        super().__init__(*args)
        self.where = where
        self.lines: dict[Any, str] = {}

    def __setitem__(self, key, value):
        self.lines[key] = self.where()
        super().__setitem__(key, value)


@contextlib.contextmanager
def watch(fn: Callable, module: torch.nn.Module, optimizers: list, constants: list[Any],
          where: Callable[[], str], into: list[Change] | None = None):
    """Run the step's code inside this block; if it changed Python state (see the module
    docstring), put the state back and raise SideEffectError, or, given ``into``, append the
    changes to it. ``constants``: (name, value) of the step's non-tensor, non-state arguments;
    ``where()``: the user's line now (for writes to param groups)."""
    fn = unwrapped(fn)
    snap = _Snapshot()
    originals = []
    for k, opt in enumerate(optimizers):
        originals.append(list(opt.param_groups))
        opt.param_groups[:] = [_RecordingGroup(g, where=where) for g in opt.param_groups]
        snap.groups.append((k, [_state(g) for g in opt.param_groups]))
    snap.modules = [(name, m, _state(m.__dict__)) for name, m in module.named_modules()]
    snap.objects = [(label, var, obj, _state(_attrs(obj)), None)
                    for label, var, obj in _reach(fn, constants)]
    reached = {id(obj) for *_, obj, _, _ in snap.objects}
    snap.objects += [(label, None, obj, _state({k: vars(obj)[k] for k in attrs}), attrs)
                     for label, obj, attrs in _counters(module) if id(obj) not in reached]
    snap.globals = [(f, n, line, f.__globals__.get(n, _MISSING))
                    for f, n, line in _global_stores(fn, module)]
    changes: list[Change] = []
    try:
        yield
        changes = _changes(snap, fn, optimizers)
    except BaseException:
        _restore(snap)
        raise
    finally:
        for opt, groups, (_, before) in zip(optimizers, originals, snap.groups):
            for old, new, state in zip(groups, opt.param_groups, before):
                if old is not new:
                    old.clear()
                    old.update(new)
                if changes or sys.exc_info()[0] is not None:
                    _put_back(old, state)
            opt.param_groups[:] = groups + opt.param_groups[len(groups):]
    if changes:
        _restore(snap)
        if into is None:
            raise SideEffectError(message(fn, changes))
        into.extend(changes)


def _holds_tensor(v: Any) -> bool:
    """A tensor, or a list, tuple or dict with one (an RNN's ``_flat_weights``)."""
    if isinstance(v, dict):
        v = list(v.values())
    return isinstance(v, torch.Tensor) or (
        isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v))


def _diff(before: dict, now: dict) -> list[str]:
    keys = [k for k in now if k not in _SKIPPED_ATTRS]
    changed = [k for k in keys if k not in before or not _same(before[k][1], _copy(now[k]))]
    return changed + [k for k in before if k not in now]


def _global_stores(fn: Callable, module: torch.nn.Module | None) -> list[tuple[Callable, str, int]]:
    """(function, name, line) of the globals the step and its modules' ``forward`` methods
    assign (``global step_count``), each global once."""
    forwards = {} if module is None else {
        f.__code__: f for f in (getattr(type(m), "forward", None) for m in module.modules())
        if isinstance(f, types.FunctionType)}
    out, seen = [], set()
    for f in (fn, *forwards.values()):
        for n, line in _stores(f, "STORE_GLOBAL").items():
            if (id(f.__globals__), n) not in seen:
                seen.add((id(f.__globals__), n))
                out.append((f, n, line))
    return out


def _changes(snap: _Snapshot, fn: Callable, optimizers: list) -> list[Change]:
    out = []
    for k, groups in snap.groups:
        now = optimizers[k].param_groups
        if len(now) != len(groups):
            out.append(Change(f"optimizer {k}: param groups added or removed",
                              parts=((f"optimizer {k}", "param_groups"),)))
        for i, (before, group) in enumerate(zip(groups, now)):
            for key in _diff(before, group):
                out.append(Change(f"optimizer {k} param_groups[{i}][{key!r}]",
                                   getattr(group, "lines", {}).get(key), schedule=True,
                                   parts=((f"optimizer {k} param_groups[{i}]", key),)))
    stores = _stores(fn, "STORE_ATTR")
    for name, m, before in snap.modules:
        changed = _diff(before, m.__dict__)
        if any(_holds_tensor(m.__dict__.get(a)) for a in changed):
            _put_back(m.__dict__, before)  # a cache of tensors made from the inputs
            continue
        forward = _stores(type(m).forward, "STORE_ATTR")
        out += [Change(f"attribute {a!r} of module {name or '<root>'!r} ({type(m).__name__})",
                        _line(type(m).forward, forward[a]) if a in forward else
                        _line(fn, stores.get(a)), ((m.__dict__, a, m.__dict__.get(a)),),
                        parts=((f"module {name}", a),))
                for a in changed]
    for label, var, obj, before, only in snap.objects:
        changed = _diff(before, _attrs(obj) if only is None else
                        {k: v for k, v in vars(obj).items() if k in only})
        if changed:
            line = next((stores[a] for a in changed if a in stores), _use_line(fn, var))
            what = f"the contents of a {type(obj).__name__} ({label})" if type(obj) in _CONTAINERS \
                else f"{type(obj).__name__} object ({label}): attribute(s) {', '.join(map(str, changed))}"
            attrs = _attrs(obj)
            slots = () if type(obj) in _CONTAINERS else tuple((attrs, a, attrs.get(a)) for a in changed)
            out.append(Change(what, _line(fn, line) if line is not None else
                              _forward_line(snap.modules, changed), slots,
                              schedule=isinstance(obj, _SCHEDULERS),
                              parts=tuple((label, a) for a in changed)))
    for f, n, line, before in snap.globals:
        if not _same(before, f.__globals__.get(n, _MISSING)):
            out.append(Change(f"global {n!r}", _line(f, line), ((f.__globals__, n, f.__globals__.get(n)),),
                              parts=((f"globals of {f.__module__}", n),)))
    return out


def _forward_line(modules: list, attrs: list[str]) -> str | None:
    """The line of a watched module's ``forward`` assigning one of ``attrs`` (a forward
    counting its calls on a plain object it holds)."""
    for _, m, _ in modules:
        stores = _stores(type(m).forward, "STORE_ATTR")
        line = next((stores[a] for a in attrs if a in stores), None)
        if line is not None:
            return _line(type(m).forward, line)
    return None


def _line(fn: Callable, lineno: int | None) -> str | None:
    code = getattr(fn, "__code__", None)
    if code is None or lineno is None:
        return None
    import linecache

    return (f'File "{code.co_filename}", line {lineno}: '
            f"{linecache.getline(code.co_filename, lineno).strip()}")


def _restore(snap: _Snapshot) -> None:
    """Put the watched modules, objects and assigned globals back as they were."""
    for *_, obj, before in snap.modules:
        _put_back(obj.__dict__, before)
    for *_, obj, before, only in snap.objects:
        if only is None:
            _put_back(_attrs(obj) if type(obj) in _CONTAINERS else obj.__dict__, before)
        else:  # the watched numbers only
            obj.__dict__.update({k: value for k, (value, _) in before.items()})
    for f, n, _, value in snap.globals:
        if value is _MISSING:
            f.__globals__.pop(n, None)
        else:
            f.__globals__[n] = value


def message(fn: Callable, changes: list[Change], why: str = "") -> str:
    code = getattr(fn, "__code__", None)
    step = (f"{fn.__name__} (File \"{code.co_filename}\", line {code.co_firstlineno})"
            if code is not None else getattr(fn, "__name__", "the step"))
    items = "; ".join(c.what + (f" at {c.line}" if c.line else "") for c in changes)
    return (
        f"the step {step} changes Python state while it is recorded: {items}. {why}The compiled step "
        f"runs the recorded tensor operations on every call, but the step's Python code only "
        f"once, while recording, so this change would happen once (with the recording's "
        f"stand-in values) and never again. Do it outside the compiled step, after each call "
        f"(e.g. `loss = train_step(...); scheduler.step()`), or in a top-level statement at the "
        f"end of the step that uses only the step's arguments, closure variables and globals "
        f"(such statements run again after every call); a learning rate set in the optimizer's "
        f"param_groups between calls takes effect. The state was left as it was before the call.")


# ---------------------------------------------------------------------------------------------
# Tensor values read in Python while recording

_TORCH = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.dirname(__file__))  # the package
_DISPATCH = tuple(os.path.join(_TORCH, p) for p in (
    "_ops.py", "utils", "_tensor.py", "fx", "_subclasses", "overrides.py", "_decomp", "_refs",
    "_prims", "_higher_order_ops", "_library", "_dynamo", "_compile.py"))


def value_read_line() -> str | None:
    """The user's line reading a tensor's value now (``.item()``, ``float(t)``), or None when
    torch's own code reads it (foreach Adam's ``step.item()``)."""
    frame = sys._getframe(1)
    while frame is not None:
        f = frame.f_code.co_filename
        if not (f.startswith(_HERE) or f.startswith(_DISPATCH) or f.startswith("<")
                or f == contextlib.__file__):
            if f.startswith(_TORCH):
                return None
            import linecache

            return (f'File "{f}", line {frame.f_lineno}, in {frame.f_code.co_name}: '
                    f"{linecache.getline(f, frame.f_lineno).strip()}")
        frame = frame.f_back
    return None


def warn_value_reads(lines: list[str]) -> None:
    """Warn once per line that reads a tensor's value while the step is recorded (rank 0; every
    rank with SPMD_LOG_ALL_RANKS set)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0 and not os.environ.get("SPMD_LOG_ALL_RANKS"):
        return
    for line in dict.fromkeys(lines):
        warning = ValueReadWarning(
            f"spmd_compiler: the step reads a tensor's value in Python at {line}. This runs "
            f"only while the step is compiled (a print or log there shows a symbol such as "
            f"'zuf0', once); the compiled step does not run it on later calls. Return the tensor "
            f"from the step and read it after the call: `loss = train_step(...); "
            f"print(loss.item())`.")
        where = Change("", line).where  # shown at the user's line, as a warning of their code
        warnings.warn_explicit(warning, ValueReadWarning, *(where or ("<unknown>", 0)))


def may_change_python_state(fn: Callable, constants: list[tuple[str, Any]],
                            module: torch.nn.Module | None = None) -> bool:
    """Could the step change Python state its recording must change on every rank: does it
    assign a global, or reach a plain object (a scheduler, a counter, a list, a bound-method
    step's instance) through its arguments, instance, closure, globals or the model's modules?
    The objects ``watch`` snapshots, known before recording."""
    fn = unwrapped(fn)
    return bool(_global_stores(fn, module) or _reach(fn, constants) or _counters(module))
