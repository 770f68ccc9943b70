"""On-disk cache of compiled programs: a restarted job, or a second run of the same script, runs
its first step without tracing or compiling.

Opt-in, as torch.compile's own whole-program cache: ``spmd_compile(..., cache_dir=...)`` or the
``SPMD_CACHE_DIR`` environment variable. Eager backend only (Inductor keeps its own caches).

**Key.** A program is stored under the sha256 of everything that decides what the compiler
builds (``program_key``): this package's source and format, torch's and Python's versions, the
world size, process group and device, the parallel mode with all its options, the backend and
rank checks, the rank (each rank records the step at its own sizes); the step function's code (with its defaults, closure and the globals it reads); the
model's structure (every submodule's class and non-tensor attributes, every parameter's and
buffer's name, shape, dtype, requires_grad and placement, tied weights, train/eval); the
optimizers (class, hyperparameters but the lifted learning rate, parameter groups, state
structure); the batch's structure, dtypes, batch dims, the dims traced as symbolic sizes and the
sizes of the others; non-tensor arguments; torch's default dtype and grad/autocast mode.

**Staleness.** Each file also lists the Python source files that were on the stack when the
compiler recorded the step, and the files of the model's and optimizer's classes, each with its
content hash. A file whose sources changed since is stale: it is ignored, and the recompile
overwrites it. Code that ran during the recording but was never on the stack of a recorded
operation (a function that only returns a Python value) is covered only through the files that
called it.

**Ranks.** Every rank looks its own program up; unless every rank found its program, every rank
compiles (one all_reduce), so ranks never differ in whether they compiled. Files are written
atomically (a temporary file renamed over the target).

**Bad files.** A file that cannot be read, fails its checksum, was written by another format or
key, or does not describe a usable program is ignored with a log line; the step compiles.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import platform
import sys
import tempfile
import types
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from .torch_internals import pytree
from .tracing import StepArgs, TracedStep

log = logging.getLogger("spmd_compiler")


def _info(msg: str, *args) -> None:
    """Log at INFO on rank 0 (every rank when SPMD_LOG_ALL_RANKS is set), as the compiler does."""
    import torch.distributed as dist

    if os.environ.get("SPMD_LOG_ALL_RANKS") or not dist.is_initialized() or dist.get_rank() == 0:
        log.info(msg, *args)

FORMAT = 2
_MAGIC = b"spmd-compiler-program\n"


@dataclass
class StoredProgram:
    """What a cache file holds: the lowered program's Python source and what binds it."""

    key: str
    dependencies: list[tuple[str, str]]  # (source file, sha256 of its content)
    code: str  # the eager runnable's generated Python (``def forward(self, ...)``)
    globals: dict[str, tuple]  # name -> how to get the object back (see ``_global_ref``)
    constants: dict[str, torch.Tensor]  # attributes the code reads from ``self``
    traced: dict[str, Any]  # the TracedStep fields the runtime reads
    guard_code: str | None
    graph_description: dict[str, Any]  # consistency.describe_graph of the program
    num_nodes: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    summary: Any = None  # visualize.Summary of the program, when it was made


# Fields of TracedStep a stored program keeps (the graph itself and its ShapeEnv are not kept).
_TRACED_FIELDS = ("signature", "specialized", "specialized_hparams", "out_constants",
                  "dynamic_dims", "static_sizes", "specialized_dims", "entangled", "source_files",
                  "specialized_inputs")


def cache_dir_from(option: str | None) -> str | None:
    """The cache directory: the ``cache_dir`` option, else ``SPMD_CACHE_DIR``, else none."""
    path = option or os.environ.get("SPMD_CACHE_DIR") or None
    return os.path.expanduser(path) if path else None


# ---------------------------------------------------------------------------------------------
# Key


def program_key(*, fn: Callable, sa: StepArgs, dynamic_dims: dict[int, tuple[int, ...]],
                options: dict[str, Any], rank: int, world_size: int, group_name: str) -> str:
    """The sha256 (hex) of everything the compiled program depends on (see the module doc)."""
    fp = _Fingerprint()
    parts = {
        "format": (FORMAT, _package_hash()),
        "versions": (torch.__version__, torch.version.git_version, sys.version, platform.machine()),
        # a rank's program is recorded at its own sizes: it may differ from another rank's
        "world": (rank, world_size, group_name),
        "options": fp.value(options),
        "global state": (str(torch.get_default_dtype()), torch.is_grad_enabled(),
                         torch.is_autocast_enabled("cpu"),
                         torch.are_deterministic_algorithms_enabled()),
        "step function": fp.value(fn),
        "module": _module_structure(sa.module, fp),
        "optimizers": [_optimizer_structure(opt, sa.module, fp) for opt in sa.optimizers],
        "input structure": str(sa.spec),
        "inputs": [_input_structure(sa, i, b, dynamic_dims.get(i, ()))
                   for i, b in zip(sa.input_indices, sa.batch_dims)],
        "constants": [fp.value(x) for j, x in enumerate(sa.leaves)
                      if j not in sa.input_indices and j != sa.module_index
                      and j not in sa.optimizer_indices],
    }
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def class_files(sa: StepArgs) -> list[str]:
    """Source files of the model's submodule classes and of the optimizers' classes."""
    classes = {type(m) for m in sa.module.modules()} | {type(o) for o in sa.optimizers}
    files = set()
    for cls in classes:
        for base in cls.__mro__:
            f = getattr(sys.modules.get(base.__module__), "__file__", None)
            if f:
                files.add(f)
    return sorted(files)


def _input_structure(sa: StepArgs, i: int, batch_dim: int | None, dynamic: tuple[int, ...]):
    t = sa.leaves[i]
    symbolic = set(dynamic) | ({batch_dim} if batch_dim is not None else set())
    sizes = tuple(None if d in symbolic else s for d, s in enumerate(t.shape))
    strides = tuple(t.stride()) if not symbolic else t.is_contiguous()
    return (sizes, batch_dim, tuple(dynamic), str(t.dtype), t.device.type, t.requires_grad,
            strides, t.storage_offset() == 0)


def _module_structure(module: torch.nn.Module, fp: _Fingerprint) -> list:
    first_name: dict[int, str] = {}
    out = []
    for name, m in module.named_modules(remove_duplicate=False):
        attrs = {k: fp.value(_hooks(v) if "hook" in k and isinstance(v, dict) else v)
                 for k, v in vars(m).items()
                 if k not in ("_parameters", "_buffers", "_modules", "_spmd_eager")}
        out.append((name, _qualname(type(m)), attrs))
    for kind, named in (("param", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        for name, t in named:
            tied = first_name.setdefault(id(t), name)
            placement = tuple(map(str, getattr(t, "placements", ())))
            out.append((kind, name, tied, tuple(t.shape), str(t.dtype), t.device.type,
                        t.requires_grad, placement))
    return out


def _hooks(hooks: dict) -> list:
    """A module's hooks in order, without their handle ids (a process-wide counter) and without
    the hooks that let the placed model run outside the compiled step (spmd_compiler.eager)."""
    from . import eager

    return [v for v in hooks.values() if getattr(v, "__module__", None) != eager.__name__]


def _optimizer_structure(opt: torch.optim.Optimizer, module: torch.nn.Module, fp: _Fingerprint):
    from .tracing import LIFTED_HPARAMS

    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    groups = [(sorted((k, fp.value(v)) for k, v in g.items()
                      if k != "params" and k not in LIFTED_HPARAMS),
               [names.get(id(p)) for p in g["params"]]) for g in opt.param_groups]
    state = sorted(
        (names.get(id(p), "?"), sorted((k, (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                                        else fp.value(v)) for k, v in st.items()))
        for p, st in opt.state.items())
    hooks = {k: fp.value(_hooks(v) if isinstance(v, dict) else v)
             for k, v in vars(opt).items() if "hook" in k}
    return (_qualname(type(opt)), fp.value(opt.defaults), groups, state, hooks)


class _Fingerprint:
    """A deterministic text for a value the compiled program may depend on (memoized by id
    within one key)."""

    def __init__(self):
        self._memo: dict[int, Any] = {}
        self._alive: list[Any] = []  # keeps every memoized object alive: ids stay unique

    def value(self, v: Any, depth: int = 0) -> Any:
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype,
                                       torch.device, torch.Size, torch.memory_format,
                                       torch.layout, enum.Enum)):
            return repr(v)
        key = id(v)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = "<cycle>"
        self._alive.append(v)
        out = self._compute(v, depth)
        self._memo[key] = out
        return out

    def _compute(self, v: Any, depth: int) -> Any:
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, [self.value(x, depth) for x in v])
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, sorted(repr(self.value(x, depth)) for x in v))
        if isinstance(v, dict):
            return (type(v).__name__, sorted((repr(self.value(k, depth)), self.value(x, depth))
                                             for k, x in v.items() if not _process_specific(k, x)))
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), str(v.dtype), _tensor_digest(v))
        if isinstance(v, torch.nn.Module):  # the step's model itself is described on its own
            attrs = {k: x for k, x in vars(v).items() if k not in ("_parameters", "_buffers")}
            return ("module", _qualname(type(v)), self.value(attrs, depth + 1) if depth < 4 else "")
        if isinstance(v, types.ModuleType):
            return ("python module", v.__name__)
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func, depth), self.value(v.args, depth),
                    self.value(v.keywords, depth))
        if isinstance(v, (types.FunctionType, types.MethodType)):
            return self._function(v, depth)
        if isinstance(v, type) or callable(v) and not hasattr(v, "__dict__"):
            return ("callable", _qualname(v))
        if depth < 4 and hasattr(v, "__dict__"):
            return (_qualname(type(v)), self.value(vars(v), depth + 1))
        return ("object", _qualname(type(v)))

    def _function(self, f, depth: int):
        if isinstance(f, types.MethodType):
            return ("method", self._function(f.__func__, depth), _qualname(type(f.__self__)))
        f = getattr(f, "__wrapped__", f)
        if not isinstance(f, types.FunctionType):
            return ("callable", _qualname(f))
        code = _code_digest(f.__code__)
        if depth >= 2:
            return ("function", _qualname(f), code)
        names = f.__code__.co_names
        reads = {n: self.value(f.__globals__[n], depth + 1) for n in names if n in f.__globals__}
        closure = [self.value(c.cell_contents, depth + 1) if _cell_set(c) else "<empty>"
                   for c in f.__closure__ or ()]
        return ("function", _qualname(f), code, self.value(f.__defaults__, depth + 1),
                self.value(f.__kwdefaults__, depth + 1), closure, reads)


def _process_specific(name, value) -> bool:
    """An attribute holding a Python ``hash()`` (different in every process, e.g. Hugging Face's
    ``_original_object_hash``): left out of the key."""
    return isinstance(name, str) and "hash" in name and isinstance(value, int)


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()

    def add(c):
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_filename, c.co_name)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                add(const)
            else:
                h.update(repr(const).encode())

    add(code)
    return h.hexdigest()


def _tensor_digest(t: torch.Tensor) -> str:
    if t.is_meta or type(t) not in (torch.Tensor, torch.nn.Parameter):  # fake, DTensor, ...
        return "unreadable"
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(bytes(data.tolist())).hexdigest()


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


@functools.cache
def _package_hash() -> str:
    """sha256 over this package's own source files (a development edit invalidates the cache)."""
    here = os.path.dirname(os.path.abspath(__file__))
    passes = os.path.dirname(os.path.abspath(importlib.import_module("spmd_compiler.passes").__file__))
    h = hashlib.sha256()
    for folder in (here, passes):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                h.update(name.encode())
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def file_hash(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def dependencies(files: list[str]) -> list[tuple[str, str]]:
    """(file, content hash) of the source files a program depends on, torch's own left out
    (the key holds torch's version)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    out = []
    for f in sorted(set(files)):
        if f.startswith(torch_dir) or not os.path.isfile(f):
            continue
        digest = file_hash(f)
        if digest is not None:
            out.append((f, digest))
    return out


# ---------------------------------------------------------------------------------------------
# Looking a program up and saving it


def lookup(cache_dir: str | None, sa: StepArgs, dynamic_dims: dict[int, tuple[int, ...]], group,
           agree: bool, *, fn: Callable, options: dict[str, Any]):
    """(key, stored program) from the disk cache: (None, None) without a cache; (key, None)
    unless every rank found the program (with ``agree``: all compile then, so none waits for
    another)."""
    import torch.distributed as dist

    if cache_dir is None:
        return None, None
    try:
        key = program_key(fn=fn, sa=sa, dynamic_dims=dynamic_dims, rank=dist.get_rank(group),
                          world_size=dist.get_world_size(group), group_name=group.group_name,
                          options=options)
        stored = load(cache_dir, key)
    except Exception as e:  # noqa: BLE001 - the cache never stops a compile
        log.info("spmd_compiler: program cache lookup failed (%s); compiling", e)
        key, stored = None, None
    if agree and dist.get_world_size(group) > 1:
        found = torch.tensor([stored is not None], dtype=torch.int64)
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
        if not found.item():
            stored = None
    return key, stored


def save(cache_dir: str, key: str, sa: StepArgs, fn: Callable, entry, ready, summary) -> None:
    """Store a compiled eager program (``entry``, a runtime.CompiledGraph, built as ``ready``);
    a program that cannot be stored is logged, never raised."""
    try:
        program = pack(key, entry.traced, ready.runnable, entry.guard_code, ready.graph,
                       ready.num_nodes, entry.stage_seconds, summary,
                       class_files(sa) + [inspect.getsourcefile(fn) or ""])
        if program is not None:
            store(cache_dir, program)
    except Exception as e:  # noqa: BLE001 - the cache never stops a step
        log.info("spmd_compiler: program not cached (%s)", e)


# ---------------------------------------------------------------------------------------------
# Packing a compiled program and getting it back


def pack(key: str, traced: TracedStep, runnable: torch.fx.GraphModule, guard_code: str | None,
         graph_description: dict[str, Any], num_nodes: int, stage_seconds: dict[str, float],
         summary: Any, extra_files: list[str]) -> StoredProgram | None:
    """A StoredProgram of a compiled eager program; None if part of it cannot be stored (a
    global of the generated code that is not importable by name, an unserializable output
    structure), which is logged."""
    code = runnable.graph.python_code(root_module="self")
    refs = {}
    for name, obj in code.globals.items():
        ref = _global_ref(obj)
        if ref is None:
            _info("spmd_compiler: program not cached: %s (%r) in its code cannot be stored",
                     name, obj)
            return None
        refs[name] = ref
    constants = {}
    for node in runnable.graph.nodes:
        if node.op == "get_attr":
            value = getattr(runnable, node.target)
            if not isinstance(value, torch.Tensor):
                _info("spmd_compiler: program not cached: attribute %s is a %s",
                         node.target, type(value).__name__)
                return None
            constants[node.target] = value.detach().clone()
        elif node.op == "call_module":
            _info("spmd_compiler: program not cached: it calls submodule %s", node.target)
            return None
    state = {name: getattr(traced, name) for name in _TRACED_FIELDS}
    try:
        state["out_spec"] = pytree.treespec_dumps(traced.out_spec)
        pickle.dumps(state)
    except Exception as e:  # noqa: BLE001 - not cacheable, compile as usual
        _info("spmd_compiler: program not cached: its outputs cannot be stored (%s)", e)
        return None
    return StoredProgram(
        key=key, dependencies=dependencies(traced.source_files + extra_files), code=code.src,
        globals=refs, constants=constants, traced=state, guard_code=guard_code,
        graph_description=graph_description, num_nodes=num_nodes,
        stage_seconds=dict(stage_seconds), summary=summary)


def unpack(program: StoredProgram) -> tuple[TracedStep, Callable]:
    """The TracedStep (without graph or ShapeEnv) and the runnable of a stored program."""
    namespace = {name: _resolve(ref) for name, ref in program.globals.items()}
    exec(compile(program.code, f"<spmd_compiler cached program {program.key[:12]}>", "exec"),
         namespace)
    owner = types.SimpleNamespace(**program.constants)
    runnable = functools.partial(namespace["forward"], owner)
    state = dict(program.traced)
    state["out_spec"] = pytree.treespec_loads(state["out_spec"])
    traced = TracedStep(gm=None, shape_env=None, fake_inputs=[], **state)
    return traced, runnable


def _global_ref(obj) -> tuple | None:
    """How to get ``obj`` back in another process: ("module", name), ("attr", module, qualname),
    ("value", picklable); None if there is no way."""
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname and "<locals>" not in qualname:
        try:
            if _resolve(("attr", module, qualname)) is obj:
                return ("attr", module, qualname)
        except Exception:  # noqa: BLE001 - not importable by name; try by value
            pass
    if obj is type(None):
        return ("attr", "types", "NoneType")
    try:
        if pickle.loads(pickle.dumps(obj)) == obj or obj != obj:  # nan
            return ("value", obj)
    except Exception:  # noqa: BLE001
        pass
    return None


def _resolve(ref: tuple):
    kind = ref[0]
    if kind == "module":
        return importlib.import_module(ref[1])
    if kind == "attr":
        obj = importlib.import_module(ref[1])
        for part in ref[2].split("."):
            obj = getattr(obj, part)
        return obj
    return ref[1]


# ---------------------------------------------------------------------------------------------
# Files


def path_for(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"{key}.program")


def load(cache_dir: str, key: str) -> StoredProgram | None:
    """The program stored under ``key``, or None (missing, unreadable, corrupt, stale)."""
    path = path_for(cache_dir, key)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        _info("spmd_compiler: cache file %s unreadable (%s); compiling", path, e)
        return None
    try:
        if not blob.startswith(_MAGIC):
            raise ValueError("not a program file")
        header_end = blob.index(b"\n", len(_MAGIC))
        fmt, digest = blob[len(_MAGIC):header_end].decode().split()
        payload = blob[header_end + 1:]
        if int(fmt) != FORMAT:
            raise ValueError(f"format {fmt}, expected {FORMAT}")
        if hashlib.sha256(payload).hexdigest() != digest:
            raise ValueError("checksum mismatch")
        program = pickle.loads(payload)
        if not isinstance(program, StoredProgram) or program.key != key:
            raise ValueError("another key")
        if {f.name for f in fields(StoredProgram)} - set(vars(program)):
            raise ValueError("missing fields")
    except Exception as e:  # noqa: BLE001 - any bad file is ignored
        _info("spmd_compiler: cache file %s ignored (%s); compiling", path, e)
        return None
    stale = [f for f, digest in program.dependencies if file_hash(f) != digest]
    if stale:
        _info("spmd_compiler: cached program %s is stale (%s changed); compiling",
                 key[:12], ", ".join(stale[:3]))
        return None
    return program


def store(cache_dir: str, program: StoredProgram) -> None:
    """Write ``program`` atomically (a temporary file renamed over the target)."""
    payload = pickle.dumps(program, protocol=pickle.HIGHEST_PROTOCOL)
    header = _MAGIC + f"{FORMAT} {hashlib.sha256(payload).hexdigest()}\n".encode()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-", suffix=".program")
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path_for(cache_dir, program.key))
    except OSError as e:
        _info("spmd_compiler: could not write the program cache in %s (%s)", cache_dir, e)
