"""The placed model outside the compiled step: ``model(x)``, ``generate()``, ``load_state_dict``.

After the first compiled call the parameters are DTensors (``Replicate()`` or ``Shard(0)``) and
plain tensor ops cannot mix them with ordinary tensors. As FSDP2 does, every module of a placed
model gets a forward pre-hook and a forward hook: a call from outside the compiled step binds
plain tensors into the parameter slots for the duration of the call and puts the DTensors back
afterwards:

- ``Replicate()`` parameters bind their local tensor (the same storage the compiled step
  updates): no copy, no communication, any rank may call the model alone;
- ``Shard(0)`` parameters are all-gathered (a few flat collectives for the whole model) into full
  tensors: the call is collective, every rank must make it, as with FSDP2. In-place changes to
  a gathered parameter are written back to the shard.
- Under data parallel x tensor parallel a planned parameter (a DTensor on the whole mesh) binds
  a DTensor of its plan (the tensor-parallel mesh and placements, what ``parallelize_module``
  left) around its tensor-parallel shard, gathered over the data-parallel dims if sharded there:
  the plan's own module hooks then run as in eager TP (or FSDP2 + TP).

With grad enabled the binding is differentiable and its backward is DDP's: gradients are
averaged over ranks (all_reduce, or reduce_scatter for shards) and land in ``p.grad`` as DTensors
placed like the parameters. ``unsharded(model)`` binds once for a whole block (``generate()``
calls the model once per token). While the step is traced the parameter slots hold the
tracer's tensors, so the hooks see no placed parameter and return at once; the compiled step
itself never calls a module.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..torch_internals import (
    FakeTensor,
    dtensor_from_spec,
    dtensor_spec,
    is_dim_shard,
    local_tensor,
)
from ..errors import StepSignatureError
from .placement import communication_failures, is_sharded, local_buffer, shard_dim, shard_size

log = logging.getLogger("spmd_compiler")

# A rank that waits this long in an eager collective logs why it may be waiting (gloo only).
COLLECTIVE_PATIENCE_S = 30.0
BUCKET_BYTES = 32 * 2**20  # eager collectives move parameters and gradients in buckets this big

_ONE_RANK_HINT = (
    "Under fully_shard a call of the model outside the compiled step gathers the parameters: "
    "every rank must make the same calls (as with FSDP2), e.g. evaluate on every rank, or gather "
    "a full copy first ({n: p.full_tensor() for n, p in model.named_parameters()}) on every "
    "rank and use it on one. An eager backward averages gradients over ranks (as DDP does), so "
    "every rank must run it too."
)


@dataclass(frozen=True)
class _Slot:
    module: torch.nn.Module
    name: str
    index: int  # into EagerUse.params (tied parameters share one)


class EagerUse:
    """Binds plain tensors for a placed model's parameters while it runs outside the step.

    One per placed model (``model._spmd_eager``, also set on every submodule); ``attach`` makes it.
    """

    def __init__(self, root: torch.nn.Module, mesh: DeviceMesh):
        self.root = root
        self.mesh = mesh
        self.params: list[DTensor] = []
        self.slots: list[_Slot] = []
        self.bound: list[torch.Tensor] | None = None  # the plain tensors while bound
        self._versions: list[int] = []
        self._calls: list[bool] = []  # per running module call: did its pre-hook bind
        self.grads_written = False  # an eager backward set p.grad since the last compiled step
        self._handles: list = []
        self.refresh()

    # -- which slots ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-read the model's placed parameters and (re)install the hooks on every module."""
        for h in self._handles:
            h.remove()
        self._handles = []
        index: dict[int, int] = {}
        self.params, self.slots = [], []
        for module in self.root.modules():
            module.__dict__["_spmd_eager"] = self
            self._handles.append(module.register_forward_pre_hook(_pre_forward, prepend=True))
            self._handles.append(module.register_forward_hook(_post_forward, always_call=True))
            own = False
            for name, p in module._parameters.items():
                if not isinstance(p, DTensor):
                    continue
                if id(p) not in index:
                    index[id(p)] = len(self.params)
                    self.params.append(p)
                self.slots.append(_Slot(module, name, index[id(p)]))
                own = True
            if own:
                self._handles.append(module.register_load_state_dict_pre_hook(_load_plain_tensors))

    def placed(self) -> bool:
        """Do the slots hold the placed parameters (not the tracer's, not bound tensors)?"""
        if not self.slots or self.bound is not None:
            return False
        for s in self.slots:
            current = s.module._parameters.get(s.name)
            if current is not self.params[s.index]:
                break
        else:
            return True
        if isinstance(current, DTensor) and not isinstance(local_tensor(current), FakeTensor):
            # parameters replaced since (load_state_dict(assign=True)); not the recording's
            # DTensors of a plan around the tracer's tensors
            self.refresh()
            return bool(self.slots)
        return False  # the tracer's tensors (or plain ones the user put there)

    # -- binding --------------------------------------------------------------------------------

    def bind(self) -> None:
        """Put plain tensors (local, or gathered full) into every parameter slot."""
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in self.params)
        if differentiable:
            tensors = list(_BindParams.apply(self, *self.params))
        else:
            tensors = self._plain_tensors()
        self.bound = tensors
        self._versions = [t._version for t in tensors]
        tensors = [_as_planned(t, p) for t, p in zip(tensors, self.params)]
        for s in self.slots:
            s.module._parameters[s.name] = tensors[s.index]

    def unbind(self) -> None:
        """Put the DTensors back; write in-place changes of gathered parameters to the shards."""
        tensors, self.bound = self.bound, None
        for s in self.slots:
            s.module._parameters[s.name] = self.params[s.index]
        rank = self.mesh.get_local_rank(shard_dim(self.mesh))
        with torch.no_grad():
            for p, t, version in zip(self.params, tensors, self._versions):
                if _sharded(p) and t._version != version:
                    start = rank * _rows(p, shard_size(self.mesh))
                    local_tensor(p).copy_(t[start: start + local_tensor(p).shape[0]])

    def _plain_tensors(self) -> list[torch.Tensor]:
        sharded = [i for i, p in enumerate(self.params) if _sharded(p)]
        out = [local_tensor(p) for p in self.params]
        if sharded:
            full = _gather([self.params[i] for i in sharded], self.mesh)
            for i, t in zip(sharded, full):
                out[i] = t
        return out

    def clear_grads(self) -> None:
        """Drop the gradients an eager backward left (a compiled step ran since)."""
        for p in self.params:
            p.grad = None
        self.grads_written = False


def _sharded(p: DTensor) -> bool:
    """Is ``p`` sharded over the data-parallel dims (the dims before a plan's)?"""
    plan = getattr(p, "_spmd_plan", None)
    if plan is None:
        return is_sharded(p)
    return any(is_dim_shard(q) for q in p.placements[:p.device_mesh.ndim - plan.spec.mesh.ndim])


def _whole(p: DTensor) -> tuple[int, ...]:
    """The shape data parallelism places: a planned parameter's tensor-parallel shard, else the
    parameter's."""
    plan = getattr(p, "_spmd_plan", None)
    return tuple(plan.local_shape) if plan is not None else tuple(p.shape)


def _as_planned(t: torch.Tensor, p: DTensor) -> torch.Tensor:
    """The plain tensor bound for ``p``, or for a planned parameter the DTensor of its plan
    around it (differentiable when ``t`` requires grad: the gradient comes back as the
    plan's local shard)."""
    plan = getattr(p, "_spmd_plan", None)
    if plan is None or plan.context:
        return t
    if not t.requires_grad:
        return dtensor_from_spec(t, plan.spec)
    spec = plan.spec
    return DTensor.from_local(t, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


def _rows(p: DTensor, world: int) -> int:
    """Rows of every rank's padded shard (runtime.Layout)."""
    return -(-_whole(p)[0] // world)


def _padded_shard(p: DTensor, world: int) -> torch.Tensor:
    """The rank's shard padded to ``_rows`` rows: the buffer the compiled step binds, or (for a
    parameter that arrived without one) a padded copy of its local tensor."""
    buffer = local_buffer(p)
    rows = _rows(p, world)
    if buffer.shape[0] == rows:
        return buffer
    return torch.cat([buffer, buffer.new_zeros((rows - buffer.shape[0],) + tuple(buffer.shape[1:]))])


def _pre_forward(module: torch.nn.Module, args) -> None:
    eager: EagerUse = module.__dict__["_spmd_eager"]
    eager._calls.append(False)
    if eager.placed():
        eager.bind()
        eager._calls[-1] = True


def _post_forward(module: torch.nn.Module, args, output) -> None:
    eager: EagerUse = module.__dict__["_spmd_eager"]
    if eager._calls and eager._calls.pop():
        eager.unbind()


def _load_plain_tensors(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` with plain tensors (a DDP or single-device checkpoint): each rank
    takes its part of the full value, no communication."""
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and tuple(value.shape) == tuple(p.shape):
            state_dict[prefix + name] = distribute_tensor(value.to(p.dtype), p.device_mesh,
                                                          p.placements, src_data_rank=None)


def refuse_bound(module: torch.nn.Module) -> None:
    """Raise if the model's parameter slots hold bound tensors (the compiled step was called
    inside ``unsharded(model)`` or from the model's forward): it would compile the wrong model."""
    eager = module.__dict__.get("_spmd_eager")
    if eager is not None and eager.bound is not None:
        raise StepSignatureError(
            "the compiled step was called while the model's parameters are bound for use "
            "outside it (inside spmd_compiler.unsharded(model), or from the model's own "
            "forward); call the compiled step after that block."
        )


def attach(module: torch.nn.Module, mesh: DeviceMesh) -> EagerUse:
    """Let the placed ``module`` run outside the compiled step (idempotent; after placement)."""
    eager = module.__dict__.get("_spmd_eager")
    if eager is None or eager.root is not module:
        eager = EagerUse(module, mesh)
    else:
        eager.refresh()
    module.__dict__["_spmd_eager"] = eager
    return eager


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Bind the model's full parameters once for a whole block, like FSDP2's ``unshard()`` /
    ``reshard()``: inside it ``model(x)`` and ``model.generate(...)`` gather nothing more.

    fully_shard: collective (every rank enters it), holds a full copy of the parameters until
    the block ends; in-place changes to them are written back to the shards. replicate: binds
    the local tensors (free). A model no compiled step has placed yet is used as it is. The
    binding is differentiable if grad mode is on when the block starts. Don't call the compiled
    step inside the block.
    """
    eager: EagerUse | None = model.__dict__.get("_spmd_eager")
    if eager is None or not eager.placed():
        yield model
        return
    eager.bind()
    try:
        yield model
    finally:
        eager.unbind()


# ---------------------------------------------------------------------------------------------
# Collectives of the eager path: buckets of flat tensors, DDP's averaging


class _BindParams(torch.autograd.Function):
    """Plain tensors for the placed parameters; backward averages their gradients over ranks."""

    @staticmethod
    def forward(ctx, eager: EagerUse, *params: DTensor):
        ctx.eager, ctx.params = eager, params
        # A local tensor is returned as a detached alias (same storage): autograd then makes the
        # alias this function's output and leaves the DTensor's own local tensor alone.
        out = tuple(t if _sharded(p) else t.detach() for t, p in zip(eager._plain_tensors(), params))
        ctx.mark_non_differentiable(*[t for t, p in zip(out, params) if not p.requires_grad])
        return out

    @staticmethod
    def backward(ctx, *grads):
        eager: EagerUse = ctx.eager
        params = ctx.params
        out: list[DTensor | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.requires_grad]
        for sharded in (False, True):
            idx = [i for i in want if _sharded(params[i]) == sharded]
            if not idx:
                continue
            gs = [grads[i] if grads[i] is not None else torch.zeros(_whole(params[i]),
                                                                  dtype=params[i].dtype,
                                                                  device=local_tensor(params[i]).device)
                  for i in idx]
            averaged = (_reduce_scatter_mean if sharded else _all_reduce_mean)(
                gs, [params[i] for i in idx], eager.mesh)
            for i, g in zip(idx, averaged):
                out[i] = g
        eager.grads_written = True
        return (None, *out)


def _buckets(tensors: list[torch.Tensor], nbytes) -> list[list[int]]:
    """Indices grouped by dtype and device into buckets of at most BUCKET_BYTES."""
    groups: dict[tuple, list[list[int]]] = {}
    sizes: dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        size = nbytes(i)
        if key not in groups or sizes[key] + size > BUCKET_BYTES:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(i)
        sizes[key] += size
    return [b for bs in groups.values() for b in bs]


def _gather(params: list[DTensor], mesh: DeviceMesh) -> list[torch.Tensor]:
    """The full tensors of Shard(0) parameters: their padded buffers gathered in flat buckets."""
    world, group = shard_size(mesh), mesh.get_group(shard_dim(mesh))
    shards = [_padded_shard(p, world) for p in params]
    pending = []
    for bucket in _buckets(shards, lambda i: shards[i].numel() * shards[i].element_size()):
        flat = torch.cat([shards[i].reshape(-1) for i in bucket])
        out = flat.new_empty(world * flat.numel())
        pending.append((bucket, out, dist.all_gather_single(out, flat, group=group, async_op=True)))
    full: list[torch.Tensor | None] = [None] * len(params)
    for bucket, out, work in pending:
        _wait(work, group, "the parameter all_gather of a call of the model outside the compiled step")
        by_rank = out.view(world, -1)
        offset = 0
        for i in bucket:
            shard, p = shards[i], params[i]
            n = shard.numel()
            rows = by_rank[:, offset:offset + n].reshape((world * shard.shape[0],) + tuple(shard.shape[1:]))
            full[i] = rows[: _whole(p)[0]]
            offset += n
    return full


def _all_reduce_mean(grads: list[torch.Tensor], params: list[DTensor], mesh: DeviceMesh) -> list[DTensor]:
    out: list[DTensor | None] = [None] * len(grads)
    for bucket in _buckets(grads, lambda i: grads[i].numel() * grads[i].element_size()):
        flat = torch.cat([grads[i].reshape(-1) for i in bucket]).div_(mesh.size())
        _all_reduce_over(flat, range(mesh.ndim), mesh, "the gradient all_reduce of an eager backward")
        offset = 0
        for i in bucket:
            n = grads[i].numel()
            out[i] = _like(flat[offset:offset + n].view(grads[i].shape), params[i])
            offset += n
    return out


def _reduce_scatter_mean(grads: list[torch.Tensor], params: list[DTensor], mesh: DeviceMesh) -> list[DTensor]:
    inner = shard_dim(mesh)
    world, group = mesh.size(inner), mesh.get_group(inner)
    rank = mesh.get_local_rank(inner)
    padded = []
    for g, p in zip(grads, params):
        pad = _rows(p, world) * world - g.shape[0]
        padded.append(torch.cat([g, g.new_zeros((pad,) + tuple(g.shape[1:]))]) if pad else g)
    out: list[DTensor | None] = [None] * len(grads)
    for bucket in _buckets(padded, lambda i: padded[i].numel() * padded[i].element_size()):
        by_rank = torch.cat([padded[i].reshape(world, -1) for i in bucket], dim=1).div_(mesh.size())
        shard = by_rank.new_empty(by_rank.shape[1])
        _wait(dist.reduce_scatter_single(shard, by_rank.reshape(-1), group=group, async_op=True),
              group, "the gradient reduce_scatter of an eager backward")
        _all_reduce_over(shard, range(inner), mesh, "the gradient all_reduce of an eager backward")
        offset = 0
        for i in bucket:
            p = params[i]
            rows = padded[i].shape[0] // world
            n = padded[i].numel() // world
            local = shard[offset:offset + n].view((rows,) + tuple(padded[i].shape[1:]))
            valid = max(0, min(rows, _whole(p)[0] - rank * rows))
            out[i] = _like(local[:valid], p)
            offset += n
    return out


def _all_reduce_over(flat: torch.Tensor, dims, mesh: DeviceMesh, what: str) -> None:
    """Sum ``flat`` in place over the mesh dims ``dims``, one after the other."""
    for d in dims:
        if mesh.size(d) > 1:
            group = mesh.get_group(d)
            _wait(dist.all_reduce(flat, group=group, async_op=True), group, what)


def _like(local: torch.Tensor, p: DTensor) -> DTensor:
    """A DTensor with ``p``'s placement, global shape and stride around ``local``."""
    return DTensor(local, dtensor_spec(p), requires_grad=False)


def _wait(work, group, what: str) -> None:
    """Wait for an eager collective; on gloo, say after COLLECTIVE_PATIENCE_S why it may hang."""
    with communication_failures(what, _ONE_RANK_HINT):
        if dist.get_backend(group) != "gloo":
            work.wait()
            return
        started = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=COLLECTIVE_PATIENCE_S))
            return
        except RuntimeError:
            if time.monotonic() - started < COLLECTIVE_PATIENCE_S:
                raise  # failed (the group's own timeout, a dead peer), not merely slow
        log.warning("spmd_compiler: rank %d has waited %.0f s in %s; another rank is busy, or "
                    "not making the call. %s", dist.get_rank(), COLLECTIVE_PATIENCE_S, what,
                    _ONE_RANK_HINT)
        work.wait()
