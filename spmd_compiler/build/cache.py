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

**Values.** A stored program keeps its value guards (spmd_compiler/trace/guards.py: every Python
value the recording read, by its path from the step's model, optimizers and function and by
value). A program whose guards fail on the current objects is not loaded: a setting changed at
run time (argparse, the environment, an edited config module) compiles again.

**Staleness**, a second check. Each file also lists the Python source files of the code the
recording ran (on the stack of a recorded operation, or reachable by name from it), and the
files of the model's and optimizer's classes, each with its content hash. A file whose sources
changed since is stale: it is ignored, and the recompile overwrites it.

**Ranks.** Whether to use the cache, and whether every rank found a usable program, is decided by
every rank together (one exchange of small objects), before any rank loads or compiles: a rank
with the cache off (another ``SPMD_CACHE_DIR``/``cache_dir``, ``SPMD_DUMP_DIR``, an unsafe
directory) turns it off on every rank, with a warning naming the setting. Files are written
atomically (a temporary file renamed over the target).

**Trust.** A file holds generated Python and pickled data: loading it runs code. The directory
must be owned by the user and not writable by group or others (else the cache is off, with a
warning); it is created with mode 0700. Every file carries an HMAC-SHA256 of its content under a
per-user key (``.spmd-key`` in the directory, 32 random bytes, mode 0600, owned by the user),
checked before anything in the file is unpickled or run: a file planted or edited by anyone
without the key is refused.

**Bad files.** A file that cannot be read, fails its HMAC, was written by another format or
key, or does not describe a usable program (its code does not compile, its fields or guards do
not fit) is ignored with a log line on every rank; all ranks compile, and the compile rewrites it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import importlib
import inspect
import logging
import os
import pickle
import platform
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from ..torch_internals import pytree
from ..runtime.call_args import StepArgs
from ..runtime.signature import TracedStep

log = logging.getLogger("spmd_compiler")


def _info(msg: str, *args) -> None:
    """Log at INFO on rank 0 (every rank when SPMD_LOG_ALL_RANKS is set), as the compiler does."""
    import torch.distributed as dist

    if os.environ.get("SPMD_LOG_ALL_RANKS") or not dist.is_initialized() or dist.get_rank() == 0:
        log.info(msg, *args)

FORMAT = 5  # 3: HMAC-SHA256 under the user's key, value guards; 4: the Python statements replayed;
# 5: conditions on the optimizers' lifted numbers
_MAGIC = b"spmd-compiler-program\n"
_KEY_FILE = ".spmd-key"


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
    graph_description: dict[str, Any]  # program_check.describe_graph of the program
    num_nodes: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    summary: Any = None  # visualize.Summary of the program, when it was made


# Fields of TracedStep a stored program keeps (the graph itself and its ShapeEnv are not kept).
_TRACED_FIELDS = ("signature", "specialized", "specialized_hparams", "hparam_conditions", "out_constants",
                  "dynamic_dims", "static_sizes", "specialized_dims", "entangled", "source_files",
                  "specialized_inputs", "value_guards", "replay", "assignments")


def cache_dir_from(option: str | None) -> str | None:
    """The cache directory: the ``cache_dir`` option, else ``SPMD_CACHE_DIR``, else none."""
    path = option or os.environ.get("SPMD_CACHE_DIR") or None
    return os.path.expanduser(path) if path else None


def setting(option: str | None, dump_dir: str | None, backend: str,
            accumulating: bool) -> tuple[str | None, str]:
    """The cache directory this rank would use for a compile (None: no cache), and the setting
    that decided it, for the message when ranks differ. A directory that cannot be trusted
    (``unsafe``) turns the cache off with a warning."""
    if backend != "eager":
        return None, f"backend={backend!r}"
    if dump_dir:
        return None, f"dump_dir / SPMD_DUMP_DIR={dump_dir!r} (dumps need a real compile)"
    if accumulating:
        return None, "gradient accumulation (no_sync)"
    path = cache_dir_from(option)
    if path is None:
        return None, "cache_dir / SPMD_CACHE_DIR unset"
    why = unsafe(path)
    if why is not None:
        logging.getLogger("spmd_compiler").warning(
            "spmd_compiler: program cache off: %s cannot be trusted: %s", path, why)
        return None, f"cache_dir / SPMD_CACHE_DIR={path!r} refused ({why})"
    return path, f"cache_dir / SPMD_CACHE_DIR={path!r}"


def agree(on: bool, described: str, found: bool, group) -> tuple[bool, bool]:
    """(use the cache, load the programs found) as every rank of ``group`` decides together:
    the cache only if it is on for every rank (else off everywhere, with a warning naming each
    rank's setting), loading only if every rank found a usable program (else all compile)."""
    from ..runtime.agreement import exchange_objects

    views = exchange_objects((on, described, found), group)
    if any(v[0] for v in views) and not all(v[0] for v in views):
        logging.getLogger("spmd_compiler").warning(
            "spmd_compiler: program cache off on every rank: the ranks' settings differ (%s); "
            "set cache_dir / SPMD_CACHE_DIR (and SPMD_DUMP_DIR) alike on every rank",
            "; ".join(f"rank {r}: {v[1]}" for r, v in enumerate(views)))
        return False, False
    return on, all(v[2] for v in views)


@dataclass
class Loaded:
    """A stored program made ready to run."""

    traced: TracedStep
    runnable: Callable
    guard_code: str | None
    seconds: dict[str, float]
    graph: dict[str, Any]
    num_nodes: int
    summary: Any


def usable(program: StoredProgram | None, fn: Callable, sa: StepArgs,
           agreement: bool = True) -> Loaded | None:
    """``program`` unpacked, if it can serve this call: its code compiles and takes the inputs
    the runtime passes (``agreement``: the per-call agreement last), its fields describe a
    program for these arguments and its value guards hold on the current objects; else None,
    logged (the compile that follows rewrites the file)."""
    from ..trace import guards
    from .program_check import describe_program

    if program is None:
        return None
    try:
        start = time.perf_counter()
        traced, runnable = unpack(program)
        _check_inputs(runnable, traced.signature, agreement)
        seconds = {"loaded from cache": time.perf_counter() - start}
        if program.guard_code:
            compile(program.guard_code, "<shape guards>", "eval")
        describe_program(sa, program.graph_description, traced.dynamic_dims)
        roots = guards.step_roots(fn, sa)
        guards.lifted_numbers([g.path for g in traced.value_guards if g.lifted], roots)
        changes = guards.ValueGuards(traced.value_guards, roots).changed()
    except Exception as e:  # noqa: BLE001 - any unusable file is ignored, and rewritten
        _info("spmd_compiler: cached program %s ignored (%s: %s); compiling", program.key[:12],
              type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    if changes:
        _info("spmd_compiler: cached program %s not used: %s; compiling", program.key[:12],
              guards.describe_changes(changes))
        return None
    return Loaded(traced, runnable, program.guard_code, seconds, program.graph_description,
                  program.num_nodes, program.summary)


def _check_inputs(runnable: functools.partial, sig, agreement: bool) -> None:
    """Raise a TypeError unless the stored code's ``forward`` takes exactly the inputs the
    runtime passes for ``sig`` (runtime.CompiledGraph: params, buffers, states, hparams, batch
    inputs, accumulated gradients, workspaces, then the agreement when the ranks are checked):
    a program that would fail at its first call is not used."""
    names = list(inspect.signature(runnable.func).parameters)[1:]  # after ``self``
    expected = (sum(sig.input_groups) + len(sig.inputs) + len(sig.grads_in)
                + len(sig.workspaces) + agreement)
    if len(names) != expected or (agreement and names[-1] != "agreement"):
        raise TypeError(f"its forward takes {len(names)} inputs ({', '.join(names[-2:])} last); "
                        f"the runtime passes {expected}"
                        + (" with the per-call agreement last" if agreement else ""))


def unsafe(path: str) -> str | None:
    """Why the cache directory ``path`` (made, mode 0700, if missing) cannot be trusted, or None:
    it must be a directory owned by this user that neither group nor others can write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        return f"it cannot be made or read ({e})"
    if not os.path.isdir(path):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return (f"group or others can write it (mode {st.st_mode & 0o777:o}); "
                f"chmod go-w {path}, or use a private directory")
    return None


def _key(cache_dir: str) -> bytes:
    """The user's HMAC key for ``cache_dir``: made once (32 random bytes, mode 0600, linked into
    place atomically, so concurrent ranks agree on one); refused unless owned by this user and
    readable by nobody else."""
    path = os.path.join(cache_dir, _KEY_FILE)
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-key-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank made it first
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} must be owned by this user and readable by nobody else")
        key = f.read()
    if len(key) < 32:
        raise ValueError(f"{path} is not a key")
    return key


def _mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


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
                      if j not in sa.input_indices and j not in sa.module_indices
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
    from ..state import eager

    return [v for v in hooks.values() if getattr(v, "__module__", None) != eager.__name__]


def _optimizer_structure(opt: torch.optim.Optimizer, module: torch.nn.Module, fp: _Fingerprint):
    from ..runtime.call_args import group_inputs

    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    groups = [(sorted((k, fp.value(v)) for k, v in g.items()
                      if k != "params" and k not in group_inputs(g)),
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
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    passes = os.path.dirname(os.path.abspath(importlib.import_module("spmd_compiler.passes").__file__))
    h = hashlib.sha256()
    for folder in (here, passes):
        for name in _python_files(folder):
            h.update(name.encode())
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _python_files(folder: str) -> list[str]:
    """The .py files under ``folder`` (subpackages too), as sorted relative paths."""
    return sorted(os.path.relpath(os.path.join(d, name), folder)
                  for d, _, names in os.walk(folder) for name in names if name.endswith(".py"))


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


def lookup(cache: tuple[str | None, str], sa: StepArgs, dynamic_dims: dict[int, tuple[int, ...]],
           group, check_ranks: bool, *, fn: Callable, options: dict[str, Any]):
    """((cache directory, key), Loaded program) from the disk cache; (None, None) without a
    cache; ((dir, key), None) unless every rank found a usable program. ``cache`` is this rank's
    ``setting``; with ``check_ranks`` every rank decides together (``agree``) before any loads
    or compiles, so none waits for another."""
    import torch.distributed as dist

    cache_dir, described = cache
    key, found = None, None
    if cache_dir is not None:
        try:
            key = program_key(fn=fn, sa=sa, dynamic_dims=dynamic_dims, rank=dist.get_rank(group),
                              world_size=dist.get_world_size(group), group_name=group.group_name,
                              options=options)
            found = usable(load(cache_dir, key), fn, sa, agreement=check_ranks)
        except Exception as e:  # noqa: BLE001 - the cache never stops a compile
            log.info("spmd_compiler: program cache lookup failed (%s); compiling", e)
    on, everyone_found = cache_dir is not None, found is not None
    if check_ranks and dist.get_world_size(group) > 1:
        on, everyone_found = agree(on, described, found is not None, group)
    if not on or key is None:
        return None, None
    return (cache_dir, key), found if everyone_found else None


def save(cache_dir: str, key: str, sa: StepArgs, fn: Callable, entry, ready, summary) -> None:
    """Store a compiled eager program (``entry``, a runtime.program.CompiledGraph, built as ``ready``);
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
        if not hmac.compare_digest(_mac(_key(cache_dir), payload), digest):
            raise ValueError("not signed with this user's key: refused without reading it")
        program = pickle.loads(payload)  # only what this user's compiles wrote
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
    try:
        header = _MAGIC + f"{FORMAT} {_mac(_key(cache_dir), payload)}\n".encode()
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-", suffix=".program")
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path_for(cache_dir, program.key))
    except (OSError, ValueError) as e:
        _info("spmd_compiler: could not write the program cache in %s (%s)", cache_dir, e)
