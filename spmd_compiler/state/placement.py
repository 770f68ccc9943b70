"""Live state on the mesh: the layouts of parameters and optimizer state, their placement once
per compile (``place_state``: parameters become DTensors on the step's DeviceMesh, the
optimizer's state is keyed by them), meta-device materialization, and the conversions the
runtime and eager use make between local buffers and DTensors.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..features import tensor_parallel as tp
from ..torch_internals import _broadcast_coalesced, dtensor_spec, local_tensor
from ..errors import CollectiveError, InitializationError
from ..features.subclass_params import copy_hooks, inner_tensors
from . import optimizer_state


def shard_dim(mesh: DeviceMesh) -> int:
    """The mesh dim that sharded parameters are split over: the innermost (the only one of a
    1-D mesh; ``"shard"`` of a ``("replicate", "shard")`` mesh). The others replicate them."""
    return mesh.ndim - 1


def shard_size(mesh: DeviceMesh) -> int:
    return mesh.size(shard_dim(mesh))


def param_placements(mesh: DeviceMesh, sharded: bool) -> tuple:
    """A parameter's placements on ``mesh``: ``Shard(0)`` on the shard dim when ``sharded``,
    ``Replicate()`` on every other dim."""
    inner = Shard(0) if sharded else Replicate()
    return (Replicate(),) * (mesh.ndim - 1) + (inner,)


def is_sharded(t: Any) -> bool:
    """Is ``t`` a DTensor sharded on some mesh dim?"""
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


def broadcast_from_first(tensors: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Give every rank of ``mesh`` the values of its first rank (coordinate 0 on every dim):
    one coalesced broadcast per mesh dim."""
    tensors = [t for t in tensors if t.numel()]
    for d in range(mesh.ndim):
        if tensors and mesh.size(d) > 1:
            _broadcast_coalesced(mesh.get_group(d), tensors, 250 * 2**20, 0)


# ---------------------------------------------------------------------------------------------
# Sharding layout


@dataclass(frozen=True)
class Layout:
    """How one parameter (and its same-shaped optimizer states) lives on a rank.

    ``Replicate``: the local tensor is the whole tensor. ``Shard(0)``: rank r holds rows
    ``[r*rows, (r+1)*rows)`` of the parameter padded to ``rows * world`` rows; the DTensor's local
    tensor is the unpadded part of that buffer (torch.chunk's split, as DTensor uses).
    """

    shape: tuple[int, ...]
    sharded: bool
    world: int

    @property
    def rows(self) -> int:
        return -(-self.shape[0] // self.world) if self.sharded else self.shape[0]

    def valid_rows(self, rank: int) -> int:
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))

    def padded_shape(self) -> tuple[int, ...]:
        return (self.rows,) + self.shape[1:]


def layout_for(t: torch.Tensor, fully_shard: bool, world: int) -> Layout:
    shape = tuple(t.shape)
    return Layout(shape, bool(fully_shard and len(shape) > 0), world)


def to_dtensor(full: torch.Tensor, layout: Layout, mesh: DeviceMesh) -> tuple[DTensor, torch.Tensor]:
    """Make a DTensor of ``full`` with ``layout``; return it and the padded local buffer that the
    compiled graph reads and updates in place."""
    local, buffer = padded_rows(full, layout, mesh)
    if not layout.sharded:
        return DTensor.from_local(local, mesh, param_placements(mesh, False), run_check=False), local
    dt = DTensor.from_local(
        local, mesh, param_placements(mesh, True), run_check=False, shape=torch.Size(layout.shape),
        stride=full.stride() if full.is_contiguous() else  # (an expanded zero: contiguous)
        torch.empty(layout.shape, device="meta").stride(),
    )
    return dt, buffer


def padded_rows(full: torch.Tensor, layout: Layout, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``full`` under ``layout`` and the padded buffer they head (both
    ``full`` itself, detached, when the layout does not shard)."""
    if not layout.sharded:
        return full.detach(), full.detach()
    rank = mesh.get_local_rank(shard_dim(mesh))
    buffer = full.new_zeros(layout.padded_shape())
    start = rank * layout.rows
    valid = layout.valid_rows(rank)
    if valid:
        buffer[:valid].copy_(full.detach()[start:start + valid])
    return buffer[:valid], buffer


def local_buffer(dt: torch.Tensor) -> torch.Tensor:
    """The tensor the graph binds for a placed parameter or state (the padded buffer)."""
    local = local_tensor(dt) if isinstance(dt, DTensor) else dt
    return getattr(dt, "_spmd_buffer", local)


def ensure_padded(t: Any, mesh: DeviceMesh, param: Any) -> Any:
    """A sharded state DTensor (of parameter ``param``) backed by a padded buffer whose head is
    its local tensor.

    Optimizer state loaded from a checkpoint arrives as new DTensors without one; such a state
    is re-made (same values) on a padded buffer. Anything else is returned as is. Whether the
    state follows a tensor-parallel plan is its parameter's to say: a loaded state carries no
    mark of its own.
    """
    if getattr(param, "_spmd_plan", None) is not None and isinstance(t, DTensor) and t.dim() > 0:
        return _planned_state_placed(t, param, mesh)
    if not is_sharded(t) or t.dim() == 0 or tp.plan_of(t, param) is not None:
        return t
    layout = layout_for(t, True, shard_size(mesh))
    buffer, local = local_buffer(t), local_tensor(t)
    if tuple(buffer.shape) == layout.padded_shape() and (
        local.numel() == 0 or buffer.data_ptr() == local.data_ptr()
    ):
        return t
    buffer = local.new_zeros(layout.padded_shape())
    valid = layout.valid_rows(mesh.get_local_rank(shard_dim(mesh)))
    buffer[:valid].copy_(local)
    new = DTensor.from_local(buffer[:valid], mesh, param_placements(mesh, True), run_check=False,
                             shape=t.shape, stride=t.stride())
    return _attach(new, buffer)


def _planned_state_placed(t: DTensor, param: DTensor, mesh: DeviceMesh) -> DTensor:
    """A state DTensor of a placed tensor-parallel parameter, placed like it on the padded
    buffer the graph binds: one still on the plan's mesh (made by eager TP before the first
    compiled call, or loaded into it) gets the data-parallel dims stacked on (its local tensor
    is the whole tensor-parallel shard; the first data-parallel rank's values win, as for the
    parameter); one on the whole mesh without the buffer (a checkpoint load made it) gets one."""
    plan = param._spmd_plan
    sharded = tp.dp_sharded(param, mesh)
    layout = Layout(plan.local_shape, sharded, shard_size(mesh))
    buffer, local = local_buffer(t), local_tensor(t)
    if t.device_mesh.ndim == plan.spec.mesh.ndim:
        broadcast_from_first([local.detach()], mesh)
        local, buffer = padded_rows(local, layout, mesh)
    elif tuple(buffer.shape) == layout.padded_shape() and (
            local.numel() == 0 or buffer.data_ptr() == local.data_ptr()):
        return t
    else:
        buffer = local.new_zeros(layout.padded_shape())
        valid = layout.valid_rows(mesh.get_local_rank(shard_dim(mesh))) if sharded else layout.rows
        buffer[:valid].copy_(local)
        local = buffer[:valid]
    return _attach(tp.planned_dtensor(local, plan, mesh, sharded), buffer)


def _attach(dt: DTensor, buffer: torch.Tensor) -> DTensor:
    if buffer is not local_tensor(dt):
        dt._spmd_buffer = buffer
    return dt


def place_state(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], mesh: DeviceMesh,
                fully_shard: bool, init_fn: Callable[[torch.nn.Module], None] | None = None,
                device: torch.device | None = None) -> None:
    """Make the module's parameters DTensors on ``mesh`` (``param_placements``: ``Shard(0)`` on
    the shard dim when ``fully_shard``, ``Replicate()`` elsewhere) and key each optimizer's state
    and param_groups by them. The mesh's first rank's values win (as DDP's broadcast at
    construction). Idempotent: already-placed parameters are left alone. Parameters and buffers
    on the meta device are materialized on ``device`` first (``materialize_meta``).
    """
    world = shard_size(mesh)
    seen: dict[int, torch.nn.Parameter] = {}
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        if any(opt.state.get(p) for opt in optimizers for p in module.parameters() if p.is_meta):
            raise InitializationError(
                "the optimizer holds state for parameters on the meta device; create the "
                "optimizer's state (or load it) after the first compiled call has materialized "
                "the model.")
        seen.update(materialize_meta(module, mesh, fully_shard, init_fn,
                                     device or torch.device("cpu")))
    seen.update(_place_planned(module, mesh, fully_shard))
    plain = []
    for _, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is None or isinstance(p, DTensor) or id(p) in seen:
                continue
            plain.append(p)
            seen[id(p)] = None
    if not plain:
        _rekey_optimizers(optimizers, seen, mesh)
        return
    whole_states(optimizers, plain)  # DTensor state of parameters made plain again
    states = [  # (the zero state optimizer_state.py made is the same on every rank)
        v for opt in optimizers for p in plain for v in opt.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and not optimizer_state.same_on_every_rank(v)
        and not (v.dim() and 0 in v.stride() and v.numel() > 1)
    ]
    broadcast_from_first([x.detach() for t in plain + list(module.buffers()) + states
                          for x in inner_tensors(t)], mesh)

    for p in plain:
        layout = layout_for(p, fully_shard, world)
        dt, buffer = to_dtensor(p, layout, mesh)
        new = torch.nn.Parameter(_attach(dt, buffer), requires_grad=p.requires_grad)
        new._spmd_buffer = buffer
        copy_hooks(p, new)
        seen[id(p)] = new
    for _, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is not None and seen.get(id(p)) is not None:
                sub._parameters[name] = seen[id(p)]
    _rekey_optimizers(optimizers, seen, mesh)


def _place_planned(module: torch.nn.Module, mesh: DeviceMesh, fully_shard: bool) -> dict:
    """Stack the data-parallel layout on the tensor-parallel parameters not yet placed: their
    local shards become ``Shard(0)`` rows (padded buffers) or replicas over ``mesh`` (the
    data-parallel dims), DTensors on the whole mesh (spmd_compiler/features/tensor_parallel.py). The
    first data-parallel rank's values win. Returns {old id: new parameter}, swapped in."""
    placed: dict[int, torch.nn.Parameter] = {}
    todo = [p for p in module.parameters() if tp.plan_of(p) is not None
            and getattr(p, "_spmd_plan", None) is None]
    broadcast_from_first([local_tensor(p).detach() for p in todo], mesh)
    for p in todo:
        plan = tp.plan_of(p)
        layout = Layout(plan.local_shape, fully_shard and len(plan.local_shape) > 0, shard_size(mesh))
        local, buffer = padded_rows(local_tensor(p), layout, mesh)
        new = torch.nn.Parameter(tp.planned_dtensor(local, plan, mesh, layout.sharded),
                                 requires_grad=p.requires_grad)
        new._spmd_buffer, new._spmd_plan = buffer, plan
        placed[id(p)] = new
    for _, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is not None and id(p) in placed:
                sub._parameters[name] = placed[id(p)]
    return placed


def _rekey_optimizers(optimizers, seen: dict, mesh: DeviceMesh) -> None:
    """Point param_groups and state at the placed parameters (``seen``: old id -> new)."""
    for opt in optimizers:
        for g in opt.param_groups:
            g["params"] = [_placed(seen, p) for p in g["params"]]
        new_state = defaultdict(dict)
        for p, st in opt.state.items():
            np_ = _placed(seen, p)
            new_state[np_] = {k: place_state_tensor(v, np_, mesh) for k, v in st.items()}
        opt.state = new_state


def _post_order(module: torch.nn.Module):
    """Every module once, children (in registration order) before their parent."""
    seen: set[int] = set()

    def visit(m):
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            yield from visit(child)
        yield m

    yield from visit(module)


def _unset(t: torch.Tensor) -> torch.Tensor:
    """Fill a freshly materialized tensor with a value no initialization leaves behind (NaN,
    or the largest integer), so one the init never wrote is found."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t
    return t.fill_(torch.iinfo(t.dtype).max)


def _is_unset(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or t.numel() == 0:
        return False
    return bool((t == torch.iinfo(t.dtype).max).all())


def materialize_meta(module: torch.nn.Module, mesh: DeviceMesh, fully_shard: bool,
                     init_fn: Callable[[torch.nn.Module], None] | None,
                     device: torch.device) -> dict[int, torch.nn.Parameter]:
    """Materialize a model built under ``torch.device("meta")`` one module at a time, so the
    whole model never exists on a rank; return {id(meta parameter): placed parameter}.

    Modules are visited children first (registration order), each once. A module that holds
    meta parameters or buffers itself gets them as full tensors on ``device`` and is
    initialized by ``init_fn(module)`` (default ``module.reset_parameters()``); then each of its
    parameters is placed (fully_shard: only this rank's padded rows are kept) and its full
    tensor freed. A parameter shared by several modules takes its first module's values; a
    later owner's init runs on a scratch tensor (it draws from the generator as it would on the
    full model, its values are dropped). Buffers stay whole.

    The values are exactly those of the same procedure on the whole model on one device, from
    rank 0's default generator state at the call (broadcast to every rank); every rank's
    generator is left as it was. Replicated parameters are broadcast from rank 0 afterwards, as
    at any placement. An init that writes parameters of modules already placed (an ancestor
    resetting a child's) writes the placed DTensors: exact for deterministic inits, per-rank
    values for random ones. Raises InitializationError (the model stays on the meta device)
    when a module has no ``reset_parameters`` and no ``init_fn`` is given, or an init leaves a
    tensor unwritten.
    """
    m = _Materializer(module, mesh, fully_shard, init_fn, device)
    try:
        with torch.no_grad(), _Generators(device).from_rank0(mesh):
            for sub in m.modules:
                if m.own[id(sub)] or m.own_buffers[id(sub)]:
                    m.materialize(sub)
    except BaseException:
        m.restore()  # back to the meta model: nothing half-done
        raise
    if not fully_shard:
        broadcast_from_first([local_tensor(p) for p in m.placed.values()], mesh)
    broadcast_from_first(list(m.made_buffers.values()), mesh)
    return m.placed


class _Materializer:
    """One ``materialize_meta``: which module owns which meta tensors, and what is made so far."""

    def __init__(self, root: torch.nn.Module, mesh: DeviceMesh, fully_shard: bool, init_fn,
                 device: torch.device):
        self.root, self.mesh, self.fully_shard, self.init_fn, self.device = (
            root, mesh, fully_shard, init_fn, device)
        self.world = shard_size(mesh)
        self.modules = list(_post_order(root))
        self.own: dict[int, list[tuple[str, torch.Tensor]]] = {}  # id(module) -> its meta params
        self.own_buffers: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.owners: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
        self.buffer_owners: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
        for sub in self.modules:
            self.own[id(sub)] = [(n, p) for n, p in sub._parameters.items()
                                 if p is not None and p.is_meta]
            self.own_buffers[id(sub)] = [(n, b) for n, b in sub._buffers.items()
                                         if b is not None and b.is_meta]
            for name, p in self.own[id(sub)]:
                self.owners[id(p)].append((sub, name))
            for name, b in self.own_buffers[id(sub)]:
                self.buffer_owners[id(b)].append((sub, name))
        self.placed: dict[int, torch.nn.Parameter] = {}
        self.made_buffers: dict[int, torch.Tensor] = {}
        # Sharded parameters are made whole in one scratch buffer reused by every module (the
        # heap would otherwise fragment between the whole tensors and the shards kept).
        scratch_bytes = max((sum(_aligned(p) for _, p in self.own[id(sub)]) for sub in self.modules),
                            default=0)
        self.scratch = torch.empty(scratch_bytes if fully_shard else 0, dtype=torch.uint8,
                                   device=device)

    def materialize(self, sub: torch.nn.Module) -> None:
        """Make ``sub``'s own meta tensors, initialize it, place its parameters."""
        later, first = self._make_parameters(sub)
        for name, b in self.own_buffers[id(sub)]:
            if id(b) not in self.made_buffers:
                self.made_buffers[id(b)] = full = _unset(
                    torch.empty(b.shape, dtype=b.dtype, device=self.device))
                for owner, slot in self.buffer_owners[id(b)]:
                    owner._buffers[slot] = full
        _initialize(sub, self.init_fn, self.root)
        for name in later:
            meta_p = next(p for n, p in self.own[id(sub)] if n == name)
            sub._parameters[name] = self.placed[id(meta_p)]
        for meta_p, new in first:
            self._place(sub, meta_p, new)
        for name, b in self.own_buffers[id(sub)]:
            if _is_unset(self.made_buffers[id(b)]):
                raise InitializationError(
                    f"{_where(self.root, sub)}: its initialization left buffer {name!r} "
                    f"unwritten (buffers made in __init__ from data are lost on the meta "
                    f"device); set it in reset_parameters() or in DataParallel(param_init_fn=...).")

    def _make_parameters(self, sub: torch.nn.Module):
        """Full tensors for ``sub``'s meta parameters: (names of those an earlier module
        placed, whose init output is dropped; (meta, new) of the others)."""
        later, first, offset = [], [], 0
        for name, p in self.own[id(sub)]:
            if self.fully_shard:
                size = p.numel() * p.element_size()
                full = self.scratch[offset:offset + size].view(p.dtype).view(p.shape)
                offset += _aligned(p)
            else:
                full = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            new = torch.nn.Parameter(_unset(full), requires_grad=p.requires_grad)
            if id(p) in self.placed:  # a later owner: its init writes a copy that is dropped
                later.append(name)
                sub._parameters[name] = new
                continue
            first.append((p, new))
            for owner, slot in self.owners[id(p)]:
                owner._parameters[slot] = new
        return later, first

    def _place(self, sub: torch.nn.Module, meta_p: torch.Tensor, new: torch.nn.Parameter) -> None:
        if _is_unset(new):
            raise InitializationError(
                f"{_where(self.root, sub)}: its initialization left parameter "
                f"{_name_in(sub, new)!r} (partly) unwritten; initialize every "
                f"parameter in reset_parameters() or pass DataParallel(param_init_fn=...).")
        dt, buffer = to_dtensor(new.detach(), layout_for(new, self.fully_shard, self.world), self.mesh)
        placed_p = torch.nn.Parameter(_attach(dt, buffer), requires_grad=new.requires_grad)
        placed_p._spmd_buffer = buffer
        self.placed[id(meta_p)] = placed_p
        for owner, slot in self.owners[id(meta_p)]:
            owner._parameters[slot] = placed_p

    def restore(self) -> None:
        for sub in self.modules:
            for name, p in self.own[id(sub)]:
                sub._parameters[name] = p
            for name, b in self.own_buffers[id(sub)]:
                sub._buffers[name] = b


def _aligned(t: torch.Tensor, align: int = 64) -> int:
    return -(-t.numel() * t.element_size() // align) * align


class _Generators:
    """The default generators that an init on ``device`` draws from (the CPU's, and the
    device's own)."""

    def __init__(self, device: torch.device):
        self.modules = [torch] + ([torch.get_device_module(device)] if device.type != "cpu" else [])

    @contextlib.contextmanager
    def from_rank0(self, mesh: DeviceMesh):
        """Every rank draws from the mesh's first rank's generator states; each rank's own are
        restored after."""
        saved = [m.get_rng_state() for m in self.modules]
        try:
            for m, state in zip(self.modules, saved):
                rank0 = state.to(mesh.device_type, copy=True)  # where the mesh's collectives run
                broadcast_from_first([rank0], mesh)
                m.set_rng_state(rank0.cpu())
            yield
        finally:
            for m, state in zip(self.modules, saved):
                m.set_rng_state(state)


def _initialize(sub: torch.nn.Module, init_fn, root: torch.nn.Module) -> None:
    if init_fn is not None:
        init_fn(sub)
    elif callable(getattr(sub, "reset_parameters", None)):
        sub.reset_parameters()
    else:
        raise InitializationError(
            f"{_where(root, sub)} holds parameters or buffers on the meta device but has no "
            f"reset_parameters(); pass DataParallel(param_init_fn=fn), fn(module) initializing "
            f"the module's own parameters and buffers in place.")


def _where(root: torch.nn.Module, sub: torch.nn.Module) -> str:
    name = next((n for n, m in root.named_modules(remove_duplicate=False) if m is sub), "?")
    return f"module {name or '<root>'!r} ({type(sub).__name__})"


def _name_in(sub: torch.nn.Module, t: torch.Tensor) -> str:
    return next((n for n, p in sub._parameters.items() if p is t), "?")


def _placed(seen: dict, p: torch.Tensor) -> torch.Tensor:
    new = seen.get(id(p))
    return p if new is None else new


def place_state_tensor(v: Any, param: torch.Tensor, mesh: DeviceMesh) -> Any:
    """An optimizer state value placed like ``param`` when it has the parameter's shape."""
    if isinstance(v, DTensor) and getattr(param, "_spmd_plan", None) is not None and v.dim() > 0:
        return _planned_state_placed(v, param, mesh)
    if not isinstance(v, torch.Tensor) or isinstance(v, DTensor):
        return v
    if isinstance(param, DTensor) and tuple(v.shape) == tuple(param.shape) and v.dim() > 0:
        layout = layout_for(v, is_sharded(param), shard_size(mesh))
        dt, buffer = to_dtensor(v, layout, mesh)
        return _attach(dt, buffer)
    return v


def placed_state(v: Any, param: torch.Tensor, mesh: DeviceMesh) -> Any:
    """An optimizer state value as the compiled graph binds it: placed like ``param`` (a plain
    one that arrived by ``load_state_dict``), on its padded buffer when sharded."""
    if isinstance(v, DTensor):
        return ensure_padded(v, mesh, param)
    if isinstance(v, torch.Tensor) and isinstance(param, DTensor):
        return place_state_tensor(v, param, mesh)
    return v


def whole_states(optimizers: list[torch.optim.Optimizer], plain: list[torch.Tensor]) -> None:
    """Make DTensor state of the ``plain`` parameters whole plain tensors (collective for
    sharded ones: every rank places its state together), so they are placed like the rest."""
    for opt in optimizers:
        for p in plain:
            st = opt.state.get(p, {})
            for k, v in st.items():
                if isinstance(v, DTensor):
                    st[k] = v.full_tensor() if is_sharded(v) else v._local_tensor


def state_from_local(buffer: torch.Tensor, param: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Wrap a state tensor the compiled graph created (padded local shard or whole) like ``param``."""
    if not isinstance(param, DTensor) or buffer.dim() == 0:
        return buffer
    plan = tp.plan_of(param)
    if plan is not None:
        return _planned_state(buffer, param, plan, mesh)
    if is_sharded(param):
        layout = layout_for(param, True, shard_size(mesh))
        if tuple(buffer.shape) != layout.padded_shape():
            return buffer
        local = buffer[: layout.valid_rows(mesh.get_local_rank(shard_dim(mesh)))]
        dt = DTensor.from_local(local, mesh, param.placements, run_check=False,
                                shape=param.shape, stride=param.stride())
        return _attach(dt, buffer)
    if tuple(buffer.shape) != tuple(param.shape):
        return buffer
    return DTensor.from_local(buffer, mesh, param.placements, run_check=False)


def _planned_state(buffer: torch.Tensor, param: DTensor, plan: "tp.Plan",
                   mesh: DeviceMesh | None) -> torch.Tensor:
    """A state the graph created for a tensor-parallel parameter, placed like the parameter."""
    sharded = mesh is not None and tp.dp_sharded(param, mesh)
    layout = Layout(plan.local_shape, sharded, shard_size(mesh) if mesh is not None else 1)
    if tuple(buffer.shape) != layout.padded_shape():
        return buffer
    local = buffer[: layout.valid_rows(mesh.get_local_rank(shard_dim(mesh)))] if sharded else buffer
    return _attach(tp.planned_dtensor(local, plan, mesh, sharded), buffer)


def grad_like(g: torch.Tensor, param: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A gradient the graph returned (whole, or a padded local shard) as ``param.grad``: a DTensor
    with the parameter's placement, shape and stride."""
    if not isinstance(param, DTensor):
        return g
    if is_sharded(param):
        g = g[: layout_for(param, True, shard_size(mesh)).valid_rows(
            mesh.get_local_rank(shard_dim(mesh)))]
    return DTensor(g, dtensor_spec(param), requires_grad=False)


_COMMUNICATION_FAILURES = ("timed out", "timeout", "connection closed", "connection reset",
                           "broken pipe", "gloo", "nccl", "peer")


@contextlib.contextmanager
def communication_failures(where: str, consequence: str = ""):
    """Turn a failed or timed-out collective inside the block into a CollectiveError."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as e:
        text = str(e).lower()
        if not (isinstance(e, dist.DistBackendError) or any(w in text for w in _COMMUNICATION_FAILURES)):
            raise
        raise CollectiveError(
            f"a collective in {where} failed on rank {dist.get_rank()}: "
            f"{str(e).strip().splitlines()[0]}. Another rank probably raised, died or is stuck; "
            f"look at its output. The wait is bounded by the process group's timeout "
            f"(torch.distributed.init_process_group(..., timeout=...)). {consequence}".rstrip()
        ) from e


