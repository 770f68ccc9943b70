"""What runs on every call: the compiled program bound to the live state (``CompiledGraph``:
check the guards, bind parameters, buffers, optimizer state and inputs in the signature's
order, run the lowered graph, write new state and gradients back), the planned workspaces it
runs in, and the host memory kept between calls."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

from ..features import tensor_parallel as tp
from .call_args import StepArgs
from ..state.placement import (
    communication_failures,
    grad_like,
    local_buffer,
    placed_state,
    state_from_local,
)
from .signature import StepSignature, TracedStep
from .step_modules import modules_of
from ..state.module_walk import ModuleWalk
from ..features.subclass_params import inner_tensors
from ..torch_internals import direct_op_calls, mark_stepped, pytree
@dataclass
class CompiledGraph:
    """A compiled step graph and how to bind live state to its placeholders."""

    traced: TracedStep  # the step as traced, its ``gm`` the final graph (None when loaded)
    run: Callable[..., Any]  # the lowered graph: flat tensors/floats in, flat outputs out
    guard_code: str | None
    static_key: tuple
    stage_seconds: dict[str, float] = field(default_factory=dict)
    checks_ranks_inside: bool = False  # the graph completes the per-call agreement itself
    summary: Any = None  # visualize.Summary of a program loaded from the disk cache
    values: Any = None  # guards.ValueGuards: the Python values the step read, bound to live objects
    carrier: tuple | None = None  # the collectives up to and with its rank check (carry_alone)

    def __post_init__(self):
        self._guards = compile(self.guard_code, "<shape guards>", "eval") if self.guard_code else None
        conditions = self.traced.hparam_conditions
        self._conditions = compile(" and ".join(f"({c})" for c in conditions), "<hparam conditions>",
                                   "eval") if conditions else None
        self._run = direct_op_calls(self.run)  # the same graph, its ops called directly

    @property
    def signature(self) -> StepSignature:
        return self.traced.signature

    @property
    def kept_grads(self) -> list[str]:
        """The parameters whose averaged gradient the graph returns last."""
        return list(self.traced.signature.kept_grads)

    def guards_hold(self, inputs: list[torch.Tensor], hparams: list[float]) -> bool:
        """Do this call's batch inputs, lifted hyperparameters and the Python values the step
        read (``values``) fit the graph?"""
        if self.values is not None:
            if not self.values.hold():
                return False
            hparams = self.with_lifted(hparams)
        for i, value in self.traced.specialized_hparams:
            if hparams[i] != value:
                return False
        if self._conditions is not None and not eval(self._conditions, {"math": math}, {
                f"h{i}": v for i, v in enumerate(hparams)}):
            return False
        for t, sizes in zip(inputs, self.traced.static_sizes):
            shape = t.shape
            for d, size in sizes:  # sizes the graph holds as constants; not in the guards
                if shape[d] != size:
                    return False
        for k, value in self.traced.specialized_inputs:  # unbatched inputs read at trace time
            if not torch.equal(inputs[k], value):
                return False
        if self._guards is None:
            return True
        # what ShapeEnv.evaluate_guards_expression does, with the expression compiled once
        return bool(eval(self._guards, SYMPY_INTERP, {"L": {f"t{i}": t for i, t in enumerate(inputs)}}))

    def with_lifted(self, hparams: list[float]) -> list:
        """The learning rates, then the numbers the step reads that the graph takes as inputs."""
        if self.values is None or not self.values.has_lifted:
            return hparams
        return hparams + self.values.lifted_values()

    def __call__(self, sa: StepArgs, mesh: DeviceMesh, hparams: list[float],
                 accumulated: dict[str, torch.Tensor] | None = None, agreement=None,
                 tree: ModuleWalk | None = None) -> Any:
        """Run the graph on the live state of ``sa``; ``hparams`` = ``lifted_hparams(sa)``.
        ``accumulated`` holds the gradients of a graph that takes (``grads_in``) or returns
        (``grads_out``) them (spmd_compiler/features/accumulation.py); updated in place. ``agreement``:
        the per-call agreement in flight, for a graph that completes it itself
        (``checks_ranks_inside``; agreement.agreement_in_flight). ``tree``: this call's walk
        over ``sa.module`` (dispatch.step_key's), whose first names are the signature's."""
        sig = self.traced.signature
        params, buffers = _named(sa.module, tree)
        numbers = self.with_lifted(hparams)
        flat = self._bind(sa, mesh, numbers, accumulated, params, buffers)
        flat += WORKSPACES.buffers(sig.workspaces)
        if self.checks_ranks_inside:
            flat.append(agreement)
        with communication_failures("the compiled step",
                                    "Parameters and optimizer state on this rank may be partly "
                                    "updated by this step."):
            outs = sig.split_outputs(self._run(*flat))
        if sig.new_states:
            opt_of = {id(p): opt for opt in sa.optimizers for g in opt.param_groups for p in g["params"]}
            for (fqn, k), t in zip(sig.new_states, outs.new_states):
                p = params[fqn]
                opt_of[id(p)].state[p][k] = state_from_local(t, p, mesh)
        if sig.grads_out:
            accumulated.update(zip(sig.grads_out, outs.grads_out))
        else:  # the optimizers stepped, on every rank (an LR scheduler reads it)
            for opt in sa.optimizers:
                mark_stepped(opt)
            if sig.grads_in:  # synced and applied
                accumulated.clear()
        for fqn, g in zip(sig.kept_grads, outs.kept_grads):
            params[fqn].grad = grad_like(g, params[fqn], mesh)
        if self.traced.assignments:  # numbers the step assigns outside its own lines
            self.values.assign(self.traced.assignments, numbers)
        leaves = outs.user
        for j in sorted(self.traced.out_constants):
            leaves.insert(j, self.traced.out_constants[j])
        return pytree.tree_unflatten(leaves, self.traced.out_spec)

    def _bind(self, sa: StepArgs, mesh: DeviceMesh, hparams: list[float],
              accumulated: dict[str, torch.Tensor] | None, params: dict[str, torch.Tensor],
              buffers: dict[str, torch.Tensor]) -> list:
        """The graph's flat inputs, in the signature's order, from the live state."""
        sig = self.traced.signature
        flat: list[Any] = [x for n in sig.params for x in inner_tensors(local_buffer(params[n]))]
        flat += [buffers[n] for n in sig.buffers]
        state_of = {}
        for opt in sa.optimizers:
            for p, st in opt.state.items():
                for k, v in st.items():  # re-padded (sharded), or loaded plain: placed
                    if sig.sharded_states or (type(v) is torch.Tensor and v.dim()):
                        st[k] = placed_state(v, p, mesh)
                state_of[id(p)] = st
        flat += [x for n, k in sig.states
                 for x in inner_tensors(local_buffer(state_of[id(params[n])][k]))]
        # a new tensor per call: a step that steps its scheduler may update it in place
        flat += [torch.tensor(v, dtype=torch.float64) if as_tensor else v
                 for v, as_tensor in zip(hparams, sig.hparams)]
        flat += tp.graph_inputs(sa)
        if sig.grads_in:
            flat += [accumulated[n] if n in accumulated else torch.zeros(
                params[n].shape, dtype=params[n].dtype, device=local_buffer(params[n]).device)
                for n in sig.grads_in]
        if sig.kept_grads:
            for fqn in sig.kept_grads:  # free the last step's before this one makes new ones
                params[fqn].grad = None
        else:
            for module in modules_of(sa.module):
                eager = module.__dict__.get("_spmd_eager")
                if eager is not None and eager.grads_written:  # an eager backward's, now stale
                    eager.clear_grads()
        return flat


class Workspaces:
    """The buffers compiled graphs' planned workspaces live in (passes/memory_plan.py): one per
    device, shared by every compiled step of the process (steps run one at a time), grown to
    the largest plan and kept between steps, like a caching allocator. ``CompiledGraph`` passes
    them to its graph as the inputs the signature's ``workspaces`` names."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def buffers(self, specs: tuple[tuple[str, int], ...]) -> list[torch.Tensor]:
        """A uint8 buffer of at least ``nbytes`` on ``device`` per (device, nbytes)."""
        out = []
        for device, nbytes in specs:
            buffer = self._buffers.get(device)
            if buffer is None or buffer.numel() < nbytes:
                self._buffers.pop(device, None)  # free the old one before making the larger one
                buffer = self._buffers[device] = torch.empty(nbytes, dtype=torch.uint8,
                                                             device=device)
            out.append(buffer)
        return out

    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(b.numel() for b in self._buffers.values())

    def free(self) -> None:
        """Drop the buffers (the next step makes them again), e.g. after the large model that
        grew them is gone."""
        self._buffers.clear()


WORKSPACES = Workspaces()  # the process's


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

_retained: bool | None = None


def retain_host_memory() -> bool:
    """Keep the host memory a step frees for the next step (glibc malloc; once per process).

    A step allocates and frees the same large tensors every call. By default glibc returns big
    freed blocks to the OS (``munmap`` and heap trimming), so every step page-faults its
    activations and gradient buckets in again: 30-45% of a small MLP's step and of ToyModel's
    in this project's measurements. Like CUDA's caching allocator, this keeps them: allocations up
    to 32 MiB (glibc's largest threshold) come from the heap and freed heap memory is not trimmed.
    The process's resident memory then stays at its peak. Returns whether the setting took
    effect (False on a C library without ``mallopt``).
    """
    global _retained
    if _retained is None:
        _retained = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c"))
                _retained = bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            except (OSError, AttributeError):
                pass
    return _retained


def _named(module: torch.nn.Module, tree: ModuleWalk | None) -> tuple[dict, dict]:
    """``module``'s parameters and buffers by name: from ``tree`` (each tensor under its first
    name, the name the recording gave it: trace/record.py) when given, else by every name."""
    if tree is not None:
        return dict(tree.params), dict(tree.buffers)
    return ({n: t for n, t in module.named_parameters(remove_duplicate=False)},
            {n: t for n, t in module.named_buffers(remove_duplicate=False)})
