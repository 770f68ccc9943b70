"""Tensor parallelism from torch's own plans, inside the compiled step.

The user applies ``parallelize_module`` / ``distribute_module`` / ``distribute_tensor`` before
compiling; parameters (and inputs) are then DTensors on a tensor-parallel mesh (the *plan*). The
step is recorded with each such tensor's local shard as a plain graph placeholder, wrapped back
into a DTensor with the plan's spec inside the recorded function: DTensor's own sharding
propagation runs while recording, and the graph holds plain local aten ops plus the functional
collectives DTensor issues (as torchtitan's graph_trainer records). No rule of our own decides a
tensor-parallel layout.

Data parallelism is then added over the mesh dims the plan does not use (``dp_mesh``): the graph's
parameter placeholders are the tensor-parallel local shards, and the placement-driven expansion
shards or replicates them over the data-parallel dims as it does a plain parameter. After the first
call a parameter is a DTensor on the whole mesh with the data-parallel placement stacked before the
plan's, as FSDP2 stacks them on a TP'd model: ``Shard(0)`` (``_StridedShard(0, split_factor=k)``
where the plan also shards dim 0 in ``k`` pieces) or ``Replicate()``, then the plan's placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import TensorParallelError
from ..parallel_mode import DataParallel, check_mesh, mesh_dims
from ..torch_internals import (
    _resolve_process_group,
    concatenate_meshes,
    dtensor_from_spec,
    dtensor_has_rule,
    dtensor_spec,
    is_dim_shard,
    local_tensor,
    shards_of_dim,
    strided_shard,
    tensor_hooks,
)
from spmd_compiler.passes import meta


@dataclass(frozen=True)
class Plan:
    """A tensor's tensor-parallel layout: the plan's DTensorSpec (mesh, placements, global shape
    and stride) and the shape of this rank's shard, which is what the step graph holds."""

    spec: Any  # DTensorSpec
    local_shape: tuple[int, ...]
    # made by context parallelism (replicated over the cp dim), not by the user: the model
    # used outside the step sees plain tensors (features/context_parallel.py)
    context: bool = False


def plan_of(t: Any, owner: Any = None) -> Plan | None:
    """The tensor-parallel layout of a parameter, optimizer state or input, if it has one: a
    DTensor the user placed (not one data parallelism alone placed), or one placed here on top
    of a plan. An optimizer state (``owner``: its parameter) has one only if its parameter has."""
    if not isinstance(t, DTensor) or (owner is not None and plan_of(owner) is None):
        return None
    plan = getattr(t, "_spmd_plan", None)
    if plan is not None:
        return plan
    if owner is not None and plan_of(owner).context and tuple(t.shape) == tuple(owner.shape):
        return plan_of(owner)  # a state of context parallelism's parameter: laid out like it
    if hasattr(t, "_spmd_buffer"):
        # placed by data parallelism alone (runtime.place_state marks each such DTensor; its
        # mesh is no sign: DTensor's propagation cache hands out equal meshes across steps)
        return None
    return Plan(dtensor_spec(t), tuple(local_tensor(t).shape), getattr(t, "_spmd_context", False))


def has_plan(module: torch.nn.Module) -> bool:
    return any(plan_of(p) is not None for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# Recording


def traced_shape(t: torch.Tensor, owner: Any = None) -> tuple[int, ...]:
    """The shape the step graph holds for ``t`` (an optimizer state of parameter ``owner``): a
    planned tensor's local shard, else the global shape."""
    plan = plan_of(t, owner)
    return plan.local_shape if plan is not None else tuple(t.shape)


def as_planned(fake_local: torch.Tensor, live: Any, owner: Any = None) -> torch.Tensor:
    """Inside the recording: the DTensor of the plan of ``live`` (an optimizer state of
    parameter ``owner``) around the graph placeholder ``fake_local`` (a leaf requiring grad when
    ``live`` does), or ``fake_local`` itself. The optimizer updates the placeholder itself in
    place, so nothing may stand between them."""
    plan = plan_of(live, owner)
    if plan is None:
        return fake_local
    dt = dtensor_from_spec(fake_local, plan.spec, requires_grad=live.requires_grad)
    for hook in tensor_hooks(live):
        dt.register_hook(hook)  # e.g. seed 000's gradient redistribute hook
    return dt


def input_as_planned(fake_local: torch.Tensor, live: Any) -> torch.Tensor:
    """Inside the recording: a DTensor input rebuilt around its local placeholder (its batch dim
    may be symbolic, so the global shape is the local one with every sharded dim's global size)."""
    if not isinstance(live, DTensor):
        return fake_local
    shape = list(fake_local.shape)
    for p in live.placements:
        if p.is_shard():
            shape[p.dim] = live.shape[p.dim]
    return DTensor.from_local(fake_local, live.device_mesh, live.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc = acc * s
    return tuple(reversed(stride))


def grad_as_planned(param: torch.Tensor) -> None:
    """Inside the recording, once a planned parameter's gradient is accumulated: a gradient
    DTensor left ``Replicate`` where the plan shards its parameter is cut to the parameter's
    placements in ``param.grad`` (a local slice, no collective), as each of the optimizer's ops
    (foreach, single-tensor) would cut it when reading it: the gradient the step holds is then
    shaped like the parameter's shard, which data parallelism reduces and shards. A ``Partial``
    gradient is left to the optimizer's reduction (one per gradient: passes/dedup_collectives)."""
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and \
            tuple(grad.placements) != tuple(param.placements) and \
            not any(p.is_partial() for p in grad.placements):
        with torch.no_grad():
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def refuses_fusing(opt: torch.optim.Optimizer, params: list) -> bool:
    """Must a param group record its optimizer unfused? When a plan placed some of its parameters
    and left others plain (one fused kernel cannot take both), or placed them and DTensor has no
    rule for the optimizer's fused kernel (SGD on torch 2.13)."""
    planned = {plan_of(p) is not None for p in params}
    return len(planned) > 1 or (True in planned and not dtensor_fuses(opt))


_FUSED_KERNELS = {torch.optim.SGD: torch.ops.aten._fused_sgd_.tensor_lr,
                  torch.optim.Adam: torch.ops.aten._fused_adam_.tensor_lr,
                  torch.optim.AdamW: torch.ops.aten._fused_adamw_.tensor_lr}


def dtensor_fuses(opt: torch.optim.Optimizer) -> bool:
    """Does DTensor have a sharding rule for ``opt``'s fused kernel (the one the recording calls
    with a tensor learning rate)?"""
    op = _FUSED_KERNELS.get(type(opt))
    return op is not None and dtensor_has_rule(op)


def plan_groups(sa) -> dict[str, str]:
    """The process groups of the meshes the user's plan placed parameters and inputs on, each
    with its mesh dim's name (``tp``; ``tp<d>`` for an unnamed dim)."""
    tensors = [*sa.module.parameters(), *(sa.leaves[i] for i in sa.input_indices)]
    meshes = {plan.spec.mesh for plan in map(plan_of, tensors) if plan is not None}
    return {m.get_group(d).group_name: (m.mesh_dim_names or ())[d] if m.mesh_dim_names else f"tp{d}"
            for m in meshes for d in range(m.ndim)}


# How each functional collective DTensor issues moves a tensor along its mesh dim.
_PLACEMENT_CHANGE = {"all_reduce": ("P({})", "R"), "all_gather_into_tensor": ("S(0)", "R"),
                     "reduce_scatter_tensor": ("P({})", "S(0)"), "all_to_all_single": ("S", "S"),
                     "broadcast": ("R", "R")}


def mark_plan_collectives(gm: torch.fx.GraphModule, groups: dict[str, str]) -> None:
    """Writes MODEL_PARALLEL (the process group) and ROLE (COLLECTIVE) on every functional
    collective and wait the recording holds over one of the plan's ``groups`` (group name ->
    mesh dim name): the step's own (DTensor's), not data parallelism's (an all-gather
    extension's gathers run over a data-parallel group). Writes PLAN_PLACEMENT on the issue
    nodes and ``gm.meta[PLAN_DIMS]``."""
    group_of = {}
    by_ranks = {_ranks_of(g): g for g in groups}
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        if node.target is torch.ops._c10d_functional.wait_tensor.default:
            group = group_of.get(node.args[0])
        else:
            group = _on_plan_group(node, by_ranks)
        if group in groups:
            group_of[node] = group
            node.meta[meta.MODEL_PARALLEL] = group
            node.meta[meta.ROLE] = meta.Role.COLLECTIVE
            change = _PLACEMENT_CHANGE.get(node.target._opname)
            if change is not None:
                op = next((a for a in node.args[1:] if isinstance(a, str)), "sum")
                node.meta[meta.PLAN_PLACEMENT] = (groups[group], change[0].format(op), change[1])
    if groups:
        gm.meta[meta.PLAN_DIMS] = dict(groups)


def _ranks_of(group_name: str) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))


def _on_plan_group(node: torch.fx.Node, by_ranks: dict) -> str | None:
    """The group a functional collective ``node`` runs over, as one of the plan's groups
    (``by_ranks``: their ranks -> name) when it has the same ranks: DTensor's propagation cache
    hands out meshes equal to the plan's (same ranks and dim names) made earlier in the process,
    whose groups are others; the collective is rewritten onto the plan's group."""
    k = max((i for i, a in enumerate(node.args) if isinstance(a, str)), default=None)
    if k is None:
        return None
    name = node.args[k]
    if name in by_ranks.values():
        return name
    try:
        mine = by_ranks.get(_ranks_of(name))
    except (ValueError, RuntimeError):  # a group destroyed since
        return None
    if mine is not None:
        node.args = (*node.args[:k], mine, *node.args[k + 1:])
    return mine


def local_of(t: Any) -> Any:
    """A DTensor's local tensor (what the graph computes), anything else as is."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def graph_inputs(sa) -> list:
    """The batch leaves of the step's arguments ``sa`` as the graph takes them: a DTensor input
    by its local shard."""
    return [local_of(sa.leaves[i]) for i in sa.input_indices]


def planned_names(module: torch.nn.Module, names: list[str]) -> set[str]:
    """Those of the parameters ``names`` (fqns of ``module``) that a tensor-parallel plan placed.
    Such a parameter that gets no gradient in the step is left unchanged, as eager DTensor leaves
    it (no gradient, no update): a plan may place more than the forward uses (seed 000's
    ``_conv_fn`` registers copies of every parameter on each ancestor module)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {n for n in names if plan_of(params[n]) is not None}


# ---------------------------------------------------------------------------------------------
# Meshes


def data_parallel_mesh(mesh: DeviceMesh, module: torch.nn.Module, inputs: list,
                       data_parallel_given: bool) -> DeviceMesh | None:
    """The mesh dims left to data parallelism once the plan's are taken out: ``mesh`` itself
    without a plan, None when the plan uses every dim (tensor parallelism alone).

    Raises a TensorParallelError (before any state changes) when a plan's mesh is not ``mesh``
    nor a named dim of it, when plans disagree on their mesh, or when ``DataParallel`` was asked
    for but the plan uses every dim."""
    meshes = {}
    for name, p in module.named_parameters():
        plan = plan_of(p)
        if plan is not None:
            meshes.setdefault(_mesh_key(plan.spec.mesh), (plan.spec.mesh, f"parameter {name!r}"))
    for k, t in enumerate(inputs):
        if isinstance(t, DTensor):
            meshes.setdefault(_mesh_key(t.device_mesh), (t.device_mesh, f"input {k}"))
    if not meshes:
        return mesh
    if len(meshes) > 1:
        found = "; ".join(f"{what} on {m}" for m, what in meshes.values())
        raise TensorParallelError(
            f"the tensor-parallel plans use different meshes ({found}); place every planned "
            f"parameter and input on one mesh (one dim of the step's mesh)")
    plan_mesh, what = next(iter(meshes.values()))
    if _mesh_key(plan_mesh) == _mesh_key(mesh):
        if data_parallel_given:
            raise TensorParallelError(
                f"DataParallel was asked for, but the tensor-parallel plan ({what} on "
                f"{plan_mesh}) already uses every dim of the step's mesh {mesh}. Give a mesh with "
                f"a data-parallel dim, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names="
                f"('dp', 'tp')), parallelize over mesh['tp'] and compile with mesh=mesh; or drop "
                f"DataParallel for tensor parallelism alone")
        return None
    names = plan_mesh.mesh_dim_names or ()
    mine = mesh.mesh_dim_names or ()
    if not names or not set(names) <= set(mine) or \
            _mesh_key(mesh[names if len(names) > 1 else names[0]]) != _mesh_key(plan_mesh):
        raise TensorParallelError(
            f"the tensor-parallel plan's mesh ({what} on {plan_mesh}) is not a dim of the "
            f"step's mesh {mesh}: parallelize over a named dim of the mesh given to "
            f"spmd_compile(mesh=...), e.g. parallelize_module(model, mesh['tp'], plan)")
    rest = tuple(n for n in mine if n not in names)
    return mesh[rest if len(rest) > 1 else rest[0]]


class DataParallelDims:
    """Per (mesh, module): the dims of the step's mesh left to data parallelism
    (``data_parallel_mesh``), checked once against the DataParallel asked for (None: none
    asked for, a plan over every dim runs alone)."""

    def __init__(self, asked):
        self.given = asked is not None
        self.mode = asked or DataParallel("replicate")
        self._dims: dict[tuple[int, int], DeviceMesh | None] = {}

    def __call__(self, mesh: DeviceMesh, sa) -> DeviceMesh | None:
        key = (id(mesh), id(sa.module))
        if key not in self._dims:
            dp_mesh = data_parallel_mesh(mesh, sa.module, [sa.leaves[i] for i in sa.input_indices],
                                         self.given)
            if dp_mesh is not None and dp_mesh is not mesh:
                check_mesh(self.mode, dp_mesh)
            self._dims[key] = dp_mesh
        return self._dims[key]

    def dims(self, mesh: DeviceMesh, sa) -> list[tuple[str, int]]:
        """(group name, size) of each data-parallel dim; none under tensor parallelism alone."""
        dp_mesh = self(mesh, sa)
        return mesh_dims(dp_mesh) if dp_mesh is not None else []


def _mesh_key(mesh: DeviceMesh) -> tuple:
    """The ranks of ``mesh`` (this rank's), whatever its dims are named."""
    return mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape)


# ---------------------------------------------------------------------------------------------
# Live state


def stacked_placements(plan: Plan, sharded: bool, dp_ndim: int = 1) -> tuple:
    """A planned parameter's placements on the whole mesh, the ``dp_ndim`` data-parallel dims
    first, as FSDP2 stacks them on a TP'd parameter: ``Replicate()`` on the outer ones (HSDP's
    replicate dim), then ``Shard(0)`` (``_StridedShard(0, split_factor=k)`` when the plan shards
    dim 0 in ``k`` pieces) or ``Replicate()``, then the plan's."""
    outer = (Replicate(),) * (dp_ndim - 1)
    if not sharded:
        return outer + (Replicate(),) + tuple(plan.spec.placements)
    split = shards_of_dim(plan.spec, 0)
    first = strided_shard(0, split) if split > 1 else Shard(0)
    return outer + (first,) + tuple(plan.spec.placements)


def dp_sharded(param: DTensor, dp_mesh: DeviceMesh) -> bool:
    """Is a placed tensor-parallel parameter sharded over the data-parallel dims?"""
    return any(is_dim_shard(p) for p in param.placements[:dp_mesh.ndim])


def root_mesh(dp_mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The mesh of the data-parallel dims and the plan's, data-parallel first."""
    return concatenate_meshes([dp_mesh, plan.spec.mesh])


def planned_dtensor(local: torch.Tensor, plan: Plan, dp_mesh: DeviceMesh | None,
                    sharded: bool) -> DTensor:
    """``local`` (this rank's piece of a planned tensor) as a DTensor with the plan's global
    shape: on the plan's mesh, or on the whole mesh with the data-parallel placement first."""
    spec = plan.spec
    if dp_mesh is None:
        dt = dtensor_from_spec(local, spec)
    else:
        dt = DTensor.from_local(local, root_mesh(dp_mesh, plan), stacked_placements(plan, sharded, dp_mesh.ndim),
                                run_check=False, shape=spec.shape, stride=spec.stride)
    dt._spmd_plan = plan
    return dt
