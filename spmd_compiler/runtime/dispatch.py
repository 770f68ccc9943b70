"""Every call: which program runs. The call's key and inputs (``Call``), the newest program
whose guards hold, the agreement across ranks on it while it runs (``agree_and_run``), the run
and the step's replayed statements (``run``), and the refusal of a call whose arguments this
rank rejected (``refuse_call``)."""

from __future__ import annotations

import enum
import itertools
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import SPMDError
from ..features.subclass_params import extension_key
from ..features.tensor_parallel import graph_inputs
from ..state.module_walk import ModuleWalk, tensors, walk
from ..state.placement import communication_failures
from ..torch_internals import pytree
from .agreement import (
    CACHED,
    COMPILE,
    COMPILE_FAILED,
    CarriedAgreement,
    Redispatch,
    agree_on_call,
    agreement_in_flight,
    carry_alone,
    mesh_group,
    start_agreement,
)
from .call_args import LIFTED_HPARAMS, StepArgs, lifted_hparams, spec_text
from .program import CompiledGraph
from .replayed import run_after

DONE = object()  # agree_and_run's choice when it ran the step itself


class Call(NamedTuple):
    """One call's arguments as the programs' guards and the runtime read them."""

    sa: StepArgs
    inputs: list  # the graph's batch inputs (tensor_parallel.graph_inputs)
    dp_mesh: Any
    hparams: list[float]
    key: tuple  # step_key
    tree: ModuleWalk | None = None  # the module tree the key was read from (None: read again)

    @classmethod
    def of(cls, sa: StepArgs, dp_mesh, accumulation: Any) -> "Call":
        """This call's key, learning rates and graph inputs; ``accumulation``: the step's
        gradient-accumulation mode (part of the key). The key's walk over the module tree is
        kept for the program to bind parameters and buffers by name without walking again."""
        tree = walk(sa.module)
        key = step_key(sa, accumulation, tree)
        return cls(sa, graph_inputs(sa), dp_mesh, lifted_hparams(sa), key, tree)

    def fits(self, entry: CompiledGraph) -> bool:
        return entry.static_key == self.key and entry.guards_hold(self.inputs, self.hparams)

    def newest_fit(self, programs: list[CompiledGraph]) -> int | None:
        return next((k for k in range(len(programs) - 1, -1, -1) if self.fits(programs[k])), None)

    def all_fits(self, programs: list[CompiledGraph]) -> list[int]:
        return [k for k, e in enumerate(programs) if self.fits(e)]


def agree_and_run(programs: list[CompiledGraph], carrier, call: Call, group, choice: int | None,
                  grads: dict, fn: Callable):
    """(the program every rank runs, None: compile one; or DONE, the step's output).

    A rank with a cached eager program runs it while the agreement travels: inside its first
    gradient all_reduce (``carrier``) or in a dedicated exchange issued first; the graph
    checks it before its first collective or state update and stops there if the ranks chose
    otherwise. A rank that must compile joins the carrier alone. When the carried check finds
    that ranks differ, every rank exchanges which programs fit (``agree_on_call``)."""
    where = "the per-call agreement between ranks"
    if choice is not None and programs[choice].checks_ranks_inside:
        with communication_failures(where):
            pending = (CarriedAgreement(choice, carrier, group) if carrier else
                       start_agreement(CACHED, 0, group, call.all_fits(programs), len(programs),
                                       running=choice))
        try:
            with agreement_in_flight(pending) as agreement:
                out = run_program(programs[choice], call, grads, agreement)
            run_after(fn, programs[choice].traced.replay, call.sa)  # the step's Python state
            return DONE, out
        except Redispatch as r:
            if r.resolved:
                return r.choice, None
    elif carrier:
        with communication_failures(where):
            carry_alone(carrier, group)
    fits = call.all_fits(programs)
    with communication_failures(where):
        return agree_on_call(CACHED if fits else COMPILE, 0, group, fits, len(programs)), None


def run(entry: CompiledGraph, call: Call, grads: dict, fn: Callable):
    """Run ``entry`` for ``call`` (``grads``: the step's accumulated gradients), then the
    step's replayed Python statements; the step's output. The call's walk binds only a program
    of its key: compiling may have placed new parameters."""
    out = run_program(entry, call if call.key == entry.static_key else call._replace(tree=None),
                      grads)
    run_after(fn, entry.traced.replay, call.sa)  # the step's Python state changes
    return out


def run_program(entry: CompiledGraph, call: Call, grads: dict, agreement=None):
    """The program's output for ``call`` (``agreement``: the per-call agreement in flight)."""
    with torch.no_grad():
        return entry(call.sa, call.dp_mesh, call.hparams, grads, agreement, call.tree)


def refuse_call(carrier, mesh, args: tuple, kwargs: dict, programs: int, error: Exception) -> None:
    """This rank rejected its arguments (``error``): tell the other ranks, which must not wait
    for it in a collective, before the caller raises."""
    group = mesh_group(call_mesh(mesh, _device_of(args, kwargs)))
    with communication_failures("the per-call agreement between ranks"):
        if carrier:
            carry_alone(carrier, group, failed=True)
        else:
            agree_on_call(COMPILE_FAILED, 0, group, [], programs, error)


def call_mesh(mesh, device: torch.device):
    """The step's mesh: the one given, else the 1-D mesh over the default group."""
    if mesh is None:
        return default_mesh(device)
    if mesh.get_coordinate() is None:
        raise SPMDError(
            f"rank {dist.get_rank()} is not in the mesh the step was compiled for "
            f"({mesh}); call the compiled step only on the mesh's ranks")
    return mesh


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device of the first module or tensor among the arguments (for the error path)."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.nn.Module):
            return module_device(leaf)
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", id(x))


def step_key(sa: StepArgs, accumulation: Any = None, tree: ModuleWalk | None = None) -> tuple:
    """Everything a compiled graph depends on besides the input sizes (which its guards check).

    Named components, so a recompile can say what changed. Read on every call: one walk over
    the module tree (state/module_walk.py; ``tree``: that walk, when already made).
    ``accumulation``: the step's gradient-accumulation mode.
    """
    module = sa.module
    tree = walk(module) if tree is None else tree
    # shapes as torch.Size (a tuple, equal to one): no copy per tensor on every call
    params = tuple((id(p), p.shape, p.dtype, p.requires_grad) for _, p in tree.params)
    buffers = tuple((id(b), b.shape, b.dtype) for _, b in tree.buffers)
    training = tuple(m.training for m in tree.modules)
    optim = []
    for opt in sa.optimizers:
        groups = tuple(
            tuple(sorted((k, _hashable(v)) for k, v in g.items()  # plain values: trace/guards.py
                         if k != "params" and k not in LIFTED_HPARAMS and not is_plain(v)))
            + (tuple(map(id, g["params"])),)
            for g in opt.param_groups
        )
        state = tuple(
            (id(p), tuple(sorted(k for k, v in st.items() if isinstance(v, torch.Tensor))))
            for p, st in opt.state.items()
        )
        optim.append((type(opt), id(opt), groups, state))
    # Sizes are left to each program's guards (a dim may be static in one program and a
    # symbol in a later one); the rank and everything else that makes another program is here.
    inputs = []
    for i, d in zip(sa.input_indices, sa.batch_dims):
        t = sa.leaves[i]
        inputs.append((t.dim(), d, t.dtype, t.device, t.requires_grad))
    skip = {*sa.input_indices, *sa.module_indices, *sa.optimizer_indices}
    constants = tuple(_hashable(x) for j, x in enumerate(sa.leaves) if j not in skip)
    return (
        ("module", id(module)), ("parameters", params), ("buffers", buffers),
        ("train/eval mode", training), ("optimizer", tuple(optim)),
        ("input structure", spec_text(sa.spec)), ("inputs", tuple(inputs)), ("constants", constants),
        ("all-gather extensions", extension_key(module, tree.params)),
        ("gradient accumulation", accumulation),
    )


_MESHES: dict[str, DeviceMesh] = {}


def default_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D mesh over the default process group for ``device``'s type (one per type)."""
    kind = device.type
    if kind not in _MESHES:
        _MESHES[kind] = init_device_mesh(kind, (dist.get_world_size(),))
    return _MESHES[kind]


def module_device(module: torch.nn.Module, inputs=()) -> torch.device:
    """The device the module's state lives on. For a model built on the meta device: the
    device of the first tensor in ``inputs`` (the step's batch), where its state will be
    materialized, else the CPU."""
    for t in itertools.chain(tensors(module, "_parameters"), tensors(module, "_buffers")):
        if not t.is_meta:
            return t.device
    for t in inputs:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    return torch.device("cpu")


_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})


def is_plain(v: Any) -> bool:
    """A value a program may hold as a constant and a guard compares by equality."""
    if type(v) in _PLAIN_TYPES:  # the common case, read for every optimizer setting per call
        return True
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, enum.Enum)):
        return not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
    return type(v) is tuple and len(v) <= 16 and all(is_plain(x) for x in v)
