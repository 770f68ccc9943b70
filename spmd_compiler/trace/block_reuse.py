"""Repeated blocks recorded once: the layers of a deep model are identical, so the recording of
the step copies the first layer's nodes for the others instead of running the same Python,
autograd and fake-tensor propagation again for each.

A *block* is a submodule whose class and structure (its submodules' names and classes, its
parameters' and buffers' names, shapes, dtypes and ``requires_grad``) occur at least twice in
the model, outermost such (the layers of a ``ModuleList``). While the step is recorded, a call
of a block runs through an autograd function (``_BlockCall``) keyed by everything the recording
of the block can depend on: the block's structure, the ``training`` flag of each of its modules,
grad state, the default dtype, the arguments' structure and non-tensor values, and each
tensor's dtype, device, ``requires_grad``, symbolic sizes, strides and which arguments are the
same tensor (under autocast, on any device type, a block is recorded as it runs). Sizes are
compared as the ShapeEnv's replacements have them: a label's batch size that the loss proved
equal to the input's is the same size, whichever symbol each was made with.

- The first call with a key records the block as usual (its forward nodes land in the step's
  graph), then its backward once into a scratch graph (``torch.autograd.grad`` of its outputs,
  with gradients shaped like them): the key's *template*. What the recording read
  (spmd_compiler/trace/reads.py) is kept with it: every attribute of the block's modules as
  Python resolved it (an instance value, a class default, an absent name, a ``forward``
  replaced on the instance), the attributes of other watched objects, the globals and closure
  cells of the user code that ran inside, the environment: each as a ``reads.fingerprint``
  (by value: a shared config object changed between blocks differs).
- A later call with the key copies the template's forward nodes into the graph with its own
  inputs, provided all of that reads the same on this block (its own modules by their path in
  it); otherwise the block is recorded as the first one was. A block that sets an attribute,
  or whose code assigns an attribute or a global, is never copied.
- When autograd reaches a block's backward (every block, the first included) the template's
  backward nodes are copied with that block's forward nodes and incoming gradients; autograd
  then accumulates the returned parameter gradients as it would.

The copies share the template's fake values (same shapes, dtypes and symbols) and carry the
block's own module path in ``nn_module_stack``; the graph is the one a plain recording makes,
block for block (tests/test_block_reuse.py compares them). Nothing is guessed: a block with
hooks, non-plain tensors (DTensor, subclasses), outputs that are not fresh tensors, an in-place
update of an input or a use of a tensor it was not passed is recorded plainly. An object the
step makes and passes through the blocks (a ``DynamicCache``) is handled by
spmd_compiler/trace/step_objects.py. A backward whose incoming gradients differ from the
template's (a missing or strided one), a backward through a block that is itself differentiated
(``create_graph=True``: a gradient penalty), or a step object read after a copy skipped its Python,
abandons reuse and the whole step is recorded again without it (``BlockMismatch``). Every
block recorded plainly and every abandoned recording is logged (INFO, ``spmd_compiler``
logger) with the reason. ``SPMD_NO_BLOCK_REUSE=1`` turns it off.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import logging
import os
import sys
import types
import weakref
from dataclasses import dataclass, field

import sympy
import torch

from ..errors import SPMDError
from ..torch_internals import (
    _reparametrize_module,
    bind_proxy,
    block_reuse_enabled,
    get_proxy_mode,
    module_hooks,
    proxy_node,
    pytree,
    recording_into,
    sym_node,
    untraced,
)
from . import step_objects
from .reads import ABSENT_READ, expanded, fingerprint, functions_of, is_user_file, resolve

log = logging.getLogger("spmd_compiler")

_PRIMITIVES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout)
_switched_off = False
_TENSOR = object()  # a tensor's place among a block's output leaves
_aten = torch.ops.aten
_SIZE_OF = (_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
            _aten.sym_storage_offset.default)


class BlockMismatch(SPMDError):
    """A reused block's backward met gradients unlike its template's: record without reuse."""


@contextlib.contextmanager
def reuse_off():
    """Record every block as it runs (after a ``BlockMismatch``)."""
    global _switched_off
    saved, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = saved


def for_recording(root: torch.nn.Module, reads=None) -> "BlockReuse | None":
    """The block reuse of one recording of a step on ``root`` whose Python reads are watched
    (``reads``, spmd_compiler/trace/reads.py), or None when it is off or nothing watches them."""
    if _switched_off or not block_reuse_enabled() or reads is None:
        return None
    reuse = BlockReuse(root, reads)
    return reuse if reuse.paths else None


def _structure(m: torch.nn.Module) -> tuple:
    return (type(m),
            tuple((n, type(s)) for n, s in m.named_modules(remove_duplicate=False)),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in m.named_parameters(remove_duplicate=False)),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(remove_duplicate=False)))


def _size(s):
    return s.node.expr if isinstance(s, torch.SymInt) else s


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.dtype, t.device, t.requires_grad, tuple(map(_size, t.shape)),
            tuple(map(_size, t.stride())), _size(t.storage_offset()))


def _replaced(key, shape_env):
    """``key`` with every symbolic expression in it rewritten by the ShapeEnv's current
    replacements: sizes the ShapeEnv has proven equal (a label's batch size and the input's)
    become the same expression, whichever symbol each was made with."""
    if isinstance(key, sympy.Basic):
        return shape_env.replace(key) if shape_env is not None else key
    if type(key) is tuple:
        return tuple(_replaced(k, shape_env) for k in key)
    return key


def _specialized(key, shape_env) -> bool:
    """Has the ShapeEnv replaced a symbolic size in ``key`` by a number since (a template
    recorded with it would use a size node where a recording now uses the number)?"""
    if isinstance(key, sympy.Basic):
        return shape_env is not None and not key.is_number and \
            shape_env.replace(key).is_number
    return type(key) is tuple and any(_specialized(k, shape_env) for k in key)


def _shape_env_of(tensors):
    """The ShapeEnv of the first symbolic size among ``tensors``' sizes, or None."""
    for t in tensors:
        for s in (*t.shape, *t.stride(), t.storage_offset()):
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


def _plain(t) -> bool:
    return type(t).__name__ == "FakeTensor" and not t.is_sparse


@dataclass
class _Template:
    """One recorded block: its forward nodes (in the step's graph) and backward (scratch)."""

    path: str  # module path of the block it was recorded on
    caller_trace: str  # the stack trace of its call (its nodes' stack traces start with it)
    input_nodes: list  # per flat input
    fwd_nodes: list
    shared: set  # nodes reading a size of a tensor from before the block: not copied
    out_nodes: list  # per tensor output
    out_spec: object = None
    out_leaves: list = field(default_factory=list)  # non-tensor output leaves (_TENSOR for tensors)
    differentiable: list = field(default_factory=list)  # per tensor output
    reads: "_BlockReads" = None  # what its recording read
    grad_keys: list = field(default_factory=list)  # per differentiable output
    grad_nodes: list = field(default_factory=list)  # scratch placeholders, same order
    bwd_nodes: list = field(default_factory=list)
    results: list = field(default_factory=list)  # per flat input: node of its gradient or None
    reusable: bool = True
    why_not: str | None = None  # why it is not reusable
    dead: set = field(default_factory=set)  # size arithmetic no copy uses: not copied
    # a copy's inputs in the order autograd accumulates their gradients (``accumulation_order``)
    order: list | None = None
    object_state: tuple = ()  # step_objects.state of the objects it was passed, after it ran
    verified: bool = True  # False: it read an int any block may differ in (see _recorded_alike)


class BlockReuse:
    """The blocks of ``root`` and their templates, for one recording."""

    def __init__(self, root: torch.nn.Module, reads):
        self.reads = reads
        groups: dict = {}
        for path, m in root.named_modules():
            if path and any(True for _ in m.parameters()):
                groups.setdefault(_structure(m), []).append(path)
        repeated = sorted(p for paths in groups.values() if len(paths) > 1 for p in paths)
        self.paths: dict[int, str] = {}
        for path in repeated:
            if not any(path.startswith(outer + ".") for outer in self.paths.values()):
                self.paths[id(root.get_submodule(path))] = path
        self.templates: dict[tuple, _Template] = {}
        self.inside = False
        self.fallbacks: dict[str, list[str]] = {}  # why -> blocks recorded as they ran
        self.objects: list = []  # weak references to the step objects copies were passed
        self.watch = step_objects.Watch()
        self.copied_with_objects: str | None = None  # the first such copy
        self.written: set = set()  # step_objects.written by the blocks recorded as they ran
        self.held = {id(v) for m in root.modules() for v in vars(m).values()}  # by the model

    def call(self, m, forward, args, kwargs):
        """Run the module call ``forward(*args, **kwargs)`` of ``m``, through a template when
        ``m`` is a block (the recorder's hook on every module call)."""
        path = self.paths.get(id(m))
        if path is None or self.inside or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        key, flat, names, spec, objects = self._key(m, args, kwargs)
        if key is None:
            self.fell_back(path, flat)
            return forward(*args, **kwargs)
        template, check_of = self._template(key, flat), None
        if template is not None:
            why = template.why_not or template.reads.differs(m) or (
                "the objects it is passed changed since block " + template.path
                if objects and self._objects_state(objects) != template.object_state else None)
            if why:
                self.fell_back(path, why)
                template = None  # recorded as the first was, not copied
            elif not template.verified:
                check_of, template = template, None  # recorded, to compare with the template
            elif objects:
                self._watch(path, objects)
        call = _Call(self, m, path, forward, args, kwargs, flat, names, spec, key, template)
        call.objects, call.check_of = objects, check_of
        call.caller_trace = call.tracer._stack_trace(sys._getframe(1)) or ""
        call.order = template.order if template is not None else None
        self.inside = True
        try:
            outs = _BlockCall.apply(call, *(flat if call.order is None
                                             else [flat[i] for i in call.order]))
        finally:
            self.inside = False
        return call.unflatten(outs)

    def _template(self, key, flat) -> "_Template | None":
        """The template recorded with ``key``, sizes compared as the ShapeEnv now knows them
        (a template keyed before a replacement is found under its replaced key)."""
        template = self.templates.get(key)
        if template is None and self.templates:
            env = _shape_env_of(flat)
            self.templates = {_replaced(k, env): t for k, t in self.templates.items()
                              if not _specialized(k, env)}
            template = self.templates.get(_replaced(key, env))
        return template

    def fell_back(self, path: str, why: str) -> None:
        """Note that block ``path`` was recorded as it ran, not copied, and why."""
        self.fallbacks.setdefault(why, []).append(path)

    def _objects_state(self, objects) -> tuple:
        with self.watch.pause():
            return step_objects.state(step_objects.reachable(objects))

    def _watch(self, path: str, objects) -> None:
        """A block passed ``objects`` is copied: from now on nothing may read them, and they
        must be gone after the step (:meth:`finish`)."""
        self.copied_with_objects = self.copied_with_objects or path
        self.objects += [weakref.ref(o) for o in objects]
        with self.watch.pause():
            self.watch.add(step_objects.reachable(objects))

    def finish(self) -> None:
        """After the step's recording: log the blocks recorded as they ran, and raise
        ``BlockMismatch`` if a copied block's skipped Python could have shown (see
        spmd_compiler/trace/step_objects.py)."""
        self.watch.stop()
        for why, paths in self.fallbacks.items():
            log.info("spmd_compiler: block reuse: %s recorded as %s ran, not copied: %s",
                     _listed(paths), "it" if len(paths) == 1 else "they", why)
        if self.watch.read is not None:
            raise self.mismatch()
        alive = [type(r()).__name__ for r in self.objects if r() is not None]
        if alive:
            raise BlockMismatch(f"the {alive[0]} passed to block {self.copied_with_objects} "
                                f"outlives the step, without the entries its copies skipped")

    def mismatch(self) -> BlockMismatch:
        """The error of a step that read a step object after a block passed it was copied."""
        return BlockMismatch(f"the step read {self.watch.read} after block "
                             f"{self.copied_with_objects} was copied without running")

    def _key(self, m, args, kwargs):
        """(key, flat tensors, state names, argument spec, step objects) of a call of block
        ``m``, or (None, why not) + 3 * (None,)."""
        if any(module_hooks(s) for s in m.modules()):
            return None, "it has hooks", None, None, None
        if _autocast_on():
            return None, "autocast is on", None, None, None
        names = [n for n, _ in m.named_parameters()] + [n for n, _ in m.named_buffers()]
        state = [t for _, t in m.named_parameters()] + [t for _, t in m.named_buffers()]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        why = _refused(state, leaves) or next(
            (f"it is passed the model's {type(x).__name__} (an object that outlives the step)"
             for x in leaves if id(x) in self.held and step_objects.is_step_object(x)), None)
        if why:
            return None, why, None, None, None
        flat, slot = list(state), {id(t): k for k, t in enumerate(state)}
        arg_key, objects = [], []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if id(x) not in slot:
                    slot[id(x)] = len(flat)
                    flat.append(x)
                arg_key.append(("tensor", slot[id(x)]))
            elif type(x) in _PRIMITIVES:
                arg_key.append((type(x), x))
            else:
                arg_key.append(("object", type(x), id(x)))
                objects.append(x)
        key = (_structure_at_call(m), tuple(s.training for s in m.modules()),
               torch.get_default_dtype(),
               spec, tuple(arg_key), tuple(_tensor_key(t) for t in flat))
        return key, flat, names, spec, objects


def _refused(state, leaves) -> str | None:
    """Why a block with parameters and buffers ``state`` called with argument leaves
    ``leaves`` cannot be copied, or None."""
    if not all(_plain(t) for t in state):
        return "its parameters or buffers are not plain tensors"
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if not _plain(x):
                return f"it is passed a {type(x).__name__}, not a plain tensor"
        elif type(x) not in _PRIMITIVES and not step_objects.is_step_object(x):
            return f"it is passed a {type(x).__name__} (neither a tensor, a number nor an object)"
    return None


def _verify(template: "_Template", second: "_Template") -> None:
    """Copies of ``template``, which read an int attribute that may differ between blocks
    (``layer_idx``), are made only if a second block with another value recorded the same nodes
    (torch code reading the int, ``x * self.layer_idx``, would show in them)."""
    why = second.why_not or _recorded_alike(template, second)
    template.verified = why is None
    template.object_state = second.object_state  # (the second block wrote its own entries)
    if why is not None:
        template.why_not = template.why_not or why
        template.reusable = False


def _recorded_alike(a: "_Template", b: "_Template") -> str | None:
    """How block ``b``'s recording differs from ``a``'s (ops, arguments, sizes), or None."""
    def rows(t):
        nodes = [n for n in t.fwd_nodes + t.bwd_nodes if not _is_sym(n)]
        index = {n: ("in", k) for k, n in enumerate(t.input_nodes)}
        index.update((n, ("grad", k)) for k, n in enumerate(t.grad_nodes))
        index.update((n, k) for k, n in enumerate(nodes))

        def ref(x):
            if x in index:
                return index[x]
            return ("size", str(x.meta["val"])) if _is_sym(x) else ("node", x)

        return [(n.op, "constant" if n.op == "get_attr" else n.target,
                 torch.fx.map_arg((n.args, n.kwargs), ref),
                 str(getattr(n.meta.get("val"), "shape", None))) for n in nodes]

    for row_a, row_b in zip(rows(a), rows(b)):
        if row_a != row_b:
            return (f"block {b.path} records {row_b[1]} otherwise than block {a.path} (an int "
                    f"attribute that differs between them reaches torch code)")
    return None if len(rows(a)) == len(rows(b)) else \
        f"block {b.path} records other nodes than block {a.path}"


def _listed(paths: list[str]) -> str:
    shown = ", ".join(paths[:4])
    return f"block {shown}" if len(paths) == 1 else \
        f"blocks {shown}" + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def _structure_at_call(m) -> tuple:
    return (type(m), tuple((n, type(s)) for n, s in m.named_modules(remove_duplicate=False)),
            tuple(n for n, _ in m.named_parameters(remove_duplicate=False)))


def _autocast_on() -> bool:
    """Is autocast on for any device type (``torch.is_autocast_enabled()`` alone asks about
    CUDA only)?"""
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


@dataclass
class _BlockReads:
    """What a block's recording read (spmd_compiler/trace/reads.py), to compare before a copy: the
    attributes of its own modules (by their path in the block) and of other watched objects,
    the globals and closure cells of the code that ran inside it, the environment."""

    inside: list = field(default_factory=list)  # (submodule path, name, resolved)
    outside: list = field(default_factory=list)  # (object, name, resolved)
    names: list = field(default_factory=list)  # (mapping, key, fingerprint): globals, cells
    environ: dict = field(default_factory=dict)
    why_not: str | None = None  # a read that cannot be compared: the block is never copied

    def differs(self, m: torch.nn.Module) -> str | None:
        """What ``m``'s recording would read otherwise than the template's did, or None."""
        if self.why_not is not None:
            return self.why_not
        subs = dict(m.named_modules(remove_duplicate=False))
        inside = {id(s): p for p, s in subs.items()}
        for p, n, r in self.inside:
            if p not in subs or not _same_read(_resolved(subs[p], n, inside), r):
                return f"it reads {'.'.join(filter(None, (p, n)))}, which differs"
        for o, n, r in self.outside:
            if _resolved(o, n, inside) != r:
                return f"it reads {n} of a {type(o).__name__}, which differs"
        for mp, k, r in self.names:
            if fingerprint(_get(mp, k), inside) != r:
                return f"it reads the global or closure variable {k or ''}, which differs"
        for k, v in self.environ.items():
            if os.environ.get(k, ABSENT_READ) != v:
                return f"it reads the environment variable {k}, which differs"
        return None


_ANY_INT = ("instance", "any int")  # a read of an int only the step objects' methods used


def _same_read(actual: tuple, read: tuple) -> bool:
    if read == _ANY_INT:
        return actual[0] == "instance" and actual[1][0] is int
    return actual == read


def _get(mapping, key):
    if isinstance(mapping, types.CellType):
        try:
            return mapping.cell_contents
        except ValueError:
            return ABSENT_READ
    return mapping.get(key, ABSENT_READ)


def _resolved(obj, name: str, inside: dict) -> tuple:
    where = resolve(obj, name)
    return where[:-1] + (fingerprint(where[-1], inside),) if len(where) > 1 else where


_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_ATTR", "DELETE_ATTR"})


def _block_reads(m: torch.nn.Module, attrs: list, codes: dict, environ: dict,
                 owners=frozenset(), free=frozenset()) -> _BlockReads:
    """The reads of a block ``m``'s recording: ``attrs`` (reads.AttrRead), the code that ran
    inside it (code -> globals), the environment variables read. ``owners``: the methods of the
    step objects it was passed (they may assign attributes); ``free``: (submodule path, name)
    of the int attributes only those methods used (any int will do for a copy)."""
    inside = {id(s): p for p, s in m.named_modules(remove_duplicate=False)}
    out = _BlockReads(environ=dict(environ))
    for r in attrs:
        if r.write:
            out.why_not = f"it sets {r.name!r}"
            return out
        if r.name == "training" or r.name.startswith("__"):
            continue
        row = (r.name, _resolved(r.obj, r.name, inside))
        if id(r.obj) in inside:
            path = inside[id(r.obj)]
            out.inside.append((path, r.name, _ANY_INT) if (path, r.name) in free else
                              (path, *row))
        else:
            out.outside.append((r.obj, *row))
    user = {c: g for c, g in codes.items() if is_user_file(c.co_filename)}
    cells = {v for c in user for v in c.co_cellvars}
    for code, g in user.items():
        writes = _WRITES - {"STORE_ATTR", "DELETE_ATTR"} if code in owners else _WRITES
        if writes.intersection(_opnames(code)):
            out.why_not = f"{code.co_qualname} assigns an attribute or a global"
            return out
        for n in code.co_names:
            if n in g:
                out.names.append((g, n, fingerprint(g[n], inside)))
                if isinstance(g[n], types.ModuleType) and _user_module(g[n]):
                    out.names += [(vars(g[n]), a, fingerprint(vars(g[n])[a], inside))
                                  for a in code.co_names if a in vars(g[n])]
    free = {c: set(c.co_freevars) - cells - {"__class__"} for c in user}
    for f in functions_of([c for c, names in free.items() if names]):
        out.names += [(cell, None, fingerprint(_get(cell, None), inside))
                      for cell in f.__closure__ or ()]
    return out


@functools.lru_cache(maxsize=4096)
def _opnames(code) -> frozenset:
    return frozenset(ins.opname for ins in dis.get_instructions(code))


def _user_module(module: types.ModuleType) -> bool:
    return is_user_file(getattr(module, "__file__", None) or "<")


class _Call:
    """One call of a block: records its template or copies one."""

    def __init__(self, reuse, m, path, forward, args, kwargs, flat, names, spec, key, template):
        self.reuse, self.m, self.path, self.forward = reuse, m, path, forward
        self.args, self.kwargs, self.flat, self.names, self.spec = args, kwargs, flat, names, spec
        self.key, self.template = key, template
        self.tracer = get_proxy_mode().tracer
        self.env: dict = {}
        self.inner = None
        self.caller_trace = ""
        self.objects: list = []  # the step objects it is passed (spmd_compiler/trace/step_objects.py)
        self.check_of: "_Template | None" = None  # the template its recording checks
        self.order: list | None = None  # its inputs' order in the autograd node (_BlockCall)
        self.uniform_objects: str | None = None  # why their state may read otherwise per block

    # forward ------------------------------------------------------------------------------

    def run_forward(self, flat):
        if self.template is None:
            return self._record(flat)
        return self._copy_forward(flat)

    def _record(self, flat):
        tracer, graph = self.tracer, self.tracer.graph
        mark = next(iter(reversed(graph.nodes)))
        with untraced():
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in flat]
        for leaf, x in zip(leaves, flat):
            bind_proxy(leaf, tracer, proxy_node(x, tracer), like=x)
        alias = {id(x): leaf for x, leaf in zip(flat, leaves)}
        state = dict(zip(self.names, leaves))
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda x: alias[id(x)],
                                            (self.args, self.kwargs))
        self.args = self.kwargs = None  # (the step objects among them must not outlive it)
        objects = step_objects.reachable(self.objects)
        owners = step_objects.method_codes(objects) if objects else frozenset()
        with step_objects.tracked_ints(self.m, owners) if objects else \
                contextlib.nullcontext({}) as tracked:
            out, reads_of = self._run(args, kwargs, state)
            free = {k for k, v in tracked.items() if not v.used_outside}
        reads = reads_of(owners, free)
        out_leaves, out_spec = pytree.tree_flatten(out)
        fwd_nodes = []
        node = mark.next
        while node.op != "root":
            fwd_nodes.append(node)
            node = node.next
        outs = [o for o in out_leaves if isinstance(o, torch.Tensor)]
        t = _Template(self.path, self.caller_trace, [proxy_node(x, tracer) for x in flat],
                      fwd_nodes, set(),
                      [proxy_node(o, tracer) for o in outs], out_spec,
                      [_TENSOR if isinstance(o, torch.Tensor) else o for o in out_leaves],
                      [o.requires_grad for o in outs], reads)
        t.why_not = self._checked_forward(t, outs, out_leaves) or reads.why_not or (
            self.uniform_objects if self.objects else None)
        t.object_state = self.reuse._objects_state(self.objects) if self.objects else ()
        t.reusable = t.why_not is None
        if t.reusable:
            self._record_backward(t, leaves, outs)
        if self.reuse._template(self.key, flat) is None:
            self.reuse.templates[self.key] = t
        t.verified = not any(r is _ANY_INT for _, _, r in reads.inside)
        if self.check_of:
            _verify(self.check_of, t)
        self.template = t
        self.inner = (leaves, outs)  # a block that cannot be copied: its own backward
        self.env = {n: n for n in t.input_nodes + t.fwd_nodes}
        return self._outputs(t)

    def _run(self, args, kwargs, state):
        """The block's forward run and recorded; (its output, a function of (owners, free)
        giving what it read, see ``_block_reads``)."""
        tracer, seen, codes = self.tracer, self.reuse.reads, {}
        read_mark = seen.mark()
        if self.objects:
            with self.reuse.watch.pause():
                objects = step_objects.reachable(self.objects)
                self.uniform_objects = step_objects.uniform(objects, self.reuse.written)
                before = step_objects.entries(objects)
        tracer.block_codes, tracer.block_frame = codes, sys._getframe()
        try:
            with torch.enable_grad(), _reparametrize_module(self.m, state, strict=False):
                out = self.forward(*args, **kwargs)
        finally:
            tracer.block_codes = tracer.block_frame = None
        if self.objects:
            with self.reuse.watch.pause():
                self.reuse.written |= step_objects.written(
                    before, step_objects.entries(step_objects.reachable(self.objects)))
        attrs, environ = seen.since(read_mark), seen.environ

        def reads_of(owners, free):
            every = expanded({**codes, **seen.readers(read_mark)})
            return _block_reads(self.m, attrs, every, environ, owners, free)

        return out, reads_of

    def _checked_forward(self, t: _Template, outs, out_leaves) -> str | None:
        """Why the forward recorded in ``t`` cannot be copied, or None."""
        inside = set(t.fwd_nodes) | set(t.input_nodes)
        if not all(type(o) in _PRIMITIVES for o in out_leaves if not isinstance(o, torch.Tensor)):
            return "it returns something other than tensors and numbers"
        if not all(n in set(t.fwd_nodes) for n in t.out_nodes) or len(set(t.out_nodes)) != len(outs):
            return "it returns a tensor it did not make, or one tensor twice"
        if any(not _plain(o) for o in outs):
            return "it returns a tensor that is not plain"
        for n in t.fwd_nodes:
            if n.op != "call_function" and not _constant(n):
                return f"its recording holds a {n.op} node"
            if _writes_input(n, t.input_nodes):
                return f"it updates an input in place ({n.target})"
            if n.target in _SIZE_OF and n.args[0] not in inside:
                t.shared.add(n)  # a size of a tensor from before the block: made once
            elif not all(a in inside or _outside_ok(a) for a in n.all_input_nodes):
                return (f"it uses a tensor it was not passed ({n.target}), e.g. one stored in "
                        f"an object or a global")
        return None

    def _record_backward(self, t: _Template, leaves, outs) -> None:
        tracer = self.tracer
        scratch = torch.fx.Graph()
        diff = [o for o, d in zip(outs, t.differentiable) if d]
        with untraced():
            grads = [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
                     for o in diff]
        for k, g in enumerate(grads):
            ph = scratch.placeholder(f"grad_{k}")
            ph.meta["val"] = g
            bind_proxy(g, tracer, ph)
            t.grad_nodes.append(ph)
            t.grad_keys.append(_tensor_key(g)[:1] + _tensor_key(g)[3:])
        wrt = [leaf for leaf in leaves if leaf.requires_grad]
        with recording_into(tracer, scratch):
            got = iter(torch.autograd.grad(diff, wrt, grads, retain_graph=True,
                                           allow_unused=True) if diff and wrt else [None] * len(wrt))
            results = [next(got) if leaf.requires_grad else None for leaf in leaves]
            t.results = [None if r is None else proxy_node(r, tracer) for r in results]
        t.bwd_nodes = [n for n in scratch.nodes if n.op != "placeholder"]
        inside = set(t.fwd_nodes) | set(t.input_nodes) | set(scratch.nodes)
        for n in t.bwd_nodes:
            if n.target in _SIZE_OF and n.args[0] not in inside:
                t.shared.add(n)  # a size of a tensor from before the block
            elif n.op != "call_function" or _writes_input(n, t.input_nodes) or not all(
                    a in inside or _outside_ok(a) for a in n.all_input_nodes):
                t.reusable = False
                t.why_not = t.why_not or f"its backward uses a tensor from outside it ({n.target})"
        t.dead = _dead_sizes(t)
        t.order = _accumulation_order(t, len(self.names))
        for n in scratch.nodes:  # the step's nodes do not list scratch nodes among their users
            for a in n.all_input_nodes:
                if a.graph is not scratch:
                    a.users.pop(n, None)

    def _copy_forward(self, flat):
        t, graph = self.template, self.tracer.graph
        env = self.env = dict(zip(t.input_nodes, (proxy_node(x, self.tracer) for x in flat)))
        stacks: dict = {}
        for n in t.fwd_nodes:
            if n in t.shared or n in t.dead:
                continue
            env[n] = self._copy(graph, n, env, stacks)
        return self._outputs(t)

    def _copy(self, graph, n, env, stacks, stack_trace=None, module_stack=None):
        args, kwargs = torch.fx.map_arg((n.args, n.kwargs), lambda a: env.get(a, a))
        target = n.target
        if n.op == "get_attr":  # a tensor the block made from Python data: its own, as recorded
            root = self.tracer.root
            target = self.tracer.get_fresh_qualname(n.target.rstrip("0123456789"))
            setattr(root, target, getattr(root, n.target))
        new = graph.create_node(n.op, target, args, kwargs)
        new.meta = dict(n.meta)
        new.meta.pop("REGION", None)
        new.meta.pop("region", None)
        if stack_trace is not None:
            new.meta["stack_trace"] = stack_trace
            new.meta.pop("nn_module_stack", None)
            if module_stack:
                new.meta["nn_module_stack"] = dict(module_stack)
        else:
            if "nn_module_stack" in n.meta:
                stack = n.meta["nn_module_stack"]
                if id(stack) not in stacks:
                    stacks[id(stack)] = self._moved_stack(stack)
                new.meta["nn_module_stack"] = stacks[id(stack)]
            if self.caller_trace != self.template.caller_trace and n.meta.get("stack_trace"):
                new.meta["stack_trace"] = self._moved_trace(n.meta["stack_trace"])
        return new

    def _moved_trace(self, trace: str) -> str:
        """A template node's stack trace with its call's frames replaced by this call's (a
        block called from another line than its template's)."""
        old, new = self.template.caller_trace, self.caller_trace
        if not trace.startswith(old):
            return trace
        rest = trace[len(old):].lstrip("\n")
        return "\n".join(p for p in (new, rest) if p)

    def _moved_stack(self, stack: dict) -> dict:
        old, new = self.template.path, self.path

        def moved(s):
            return new + s[len(old):] if s == old or s.startswith(old + ".") else s

        return {moved(k): (moved(p), ty) for k, (p, ty) in stack.items()}

    def _outputs(self, t: _Template):
        outs = []
        for n in t.out_nodes:
            v = n.meta["val"]
            with untraced():
                o = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            bind_proxy(o, self.tracer, self.env.get(n, n))
            outs.append(o)
        return outs

    def unflatten(self, outs):
        t = self.template
        outs = iter(outs)
        leaves = [next(outs) if v is _TENSOR else v for v in t.out_leaves]
        return pytree.tree_unflatten(leaves, t.out_spec)

    # backward -----------------------------------------------------------------------------

    def run_backward(self, grads):
        if torch.is_grad_enabled():  # create_graph=True: the copied nodes would not be differentiated
            raise BlockMismatch(f"the backward of block {self.path} is itself differentiated "
                                f"(autograd.grad or backward with create_graph=True)")
        t = self.template
        if not t.reusable:  # recorded as autograd would
            leaves, outs = self.inner
            wrt = [leaf for leaf in leaves if leaf.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                           allow_unused=True) if pairs and wrt else [None] * len(wrt))
            return [next(got) if leaf.requires_grad else None for leaf in leaves]
        used = [g for g, d in zip(grads, t.differentiable) if d]
        env = _shape_env_of([g for g in used if g is not None] + [
            n.meta["val"] for n in t.grad_nodes])
        if any(g is not None for g, d in zip(grads, t.differentiable) if not d) or any(
                g is None or _specialized(k, env) or _replaced(
                    _tensor_key(g)[:1] + _tensor_key(g)[3:], env) != _replaced(k, env)
                for g, k in zip(used, t.grad_keys)):
            raise BlockMismatch(f"the gradients reaching block {self.path} differ from its "
                                f"template's")
        tracer = self.tracer
        env = dict(self.env)
        env.update(zip(t.grad_nodes, (proxy_node(g, tracer) for g in used)))
        where = tracer._stack_trace(sys._getframe(1))
        for n in t.bwd_nodes:
            if n in t.dead:
                continue
            if n in t.shared:  # the size's node in the step's graph (made when first used)
                env[n] = sym_node(n.meta["val"], tracer)
                continue
            env[n] = self._copy(tracer.graph, n, env, {}, where or "", tracer.module_stack)
        out = []
        for n in t.results:
            if n is None:
                out.append(None)
                continue
            v = n.meta["val"]
            with untraced():
                g = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            bind_proxy(g, tracer, env.get(n, n))
            out.append(g)
        return out


def _is_sym(n) -> bool:
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _dead_sizes(t: _Template) -> set:
    """The template's size computations that nothing in a copy would use: make_fx's dead code
    elimination removes them from the step's graph (its rule: pure symbolic arithmetic and size
    reads without users), so a copy leaves them out rather than make and lose them."""
    nodes = t.fwd_nodes + t.bwd_nodes
    own, keep = set(nodes), set(t.out_nodes) | {n for n in t.results if n is not None}
    dead: set = set()
    for n in reversed(nodes):
        removable = _is_sym(n) and not n.is_impure() and (
            n.target in _SIZE_OF or all(_is_sym(a) for a in n.all_input_nodes))
        if removable and n not in keep and all(u in dead for u in n.users if u in own):
            dead.add(n)
    return dead


def _constant(n) -> bool:
    """A tensor constant (``torch.tensor([])`` in a block): a copy gets its own name for it."""
    return n.op == "get_attr" and n.target.startswith("_tensor_constant")


def _outside_ok(a) -> bool:
    """A node from before the block that a copy may use as it is: a size or a constant."""
    return a.op == "get_attr" or _is_sym(a)


def _writes_input(n, inputs) -> bool:
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    for arg, value in zip(schema.arguments, n.args):
        if arg.alias_info is not None and arg.alias_info.is_write and value in inputs:
            return True
    return any(arg.alias_info is not None and arg.alias_info.is_write
               and n.kwargs.get(arg.name) in inputs for arg in schema.arguments)


def _accumulation_order(t: "_Template", states: int) -> list | None:
    """The block's parameters and buffers (the first ``states`` inputs) in the order their
    gradients are made in the template's backward, then its other inputs; None when that is
    their order already. Autograd accumulates a block call's input gradients in the order of its
    inputs, where a plain recording accumulates each when it is made (a Linear's bias before
    its weight, whose gradient passes a transpose first): a copy called with its inputs so
    ordered accumulates them as the plain recording does, and the gradient buckets that follow
    that order are the same."""
    pos = {n: k for k, n in enumerate(t.bwd_nodes)}
    order = sorted(range(states), key=lambda i: pos.get(t.results[i], len(pos)))
    return None if order == list(range(states)) else order + list(range(states, len(t.results)))


class _BlockCall(torch.autograd.Function):
    """A block's call as one autograd node (see the module docstring); its inputs in the order
    ``call.order`` gives when it has one."""

    @staticmethod
    def forward(ctx, call, *flat):
        ctx.set_materialize_grads(False)
        ctx.call = call
        if call.order is not None:
            given, flat = flat, [None] * len(flat)
            for k, i in enumerate(call.order):
                flat[i] = given[k]
        outs = call.run_forward(flat)
        call.args = call.kwargs = None  # (the step objects among them must not outlive it)
        call.objects = ()
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, call.template.differentiable)
                                      if not d))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        got = ctx.call.run_backward(grads)
        order = ctx.call.order
        return (None, *(got if order is None else [got[i] for i in order]))
