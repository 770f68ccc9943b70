"""The compiled step's signature: what each input and output of its graph is, by name.

The tracer makes it (spmd_compiler/tracing.py), the pipeline adds what later stages append
(kept gradients, sharded state), the runtime binds live state with it and reads the outputs
back with it, and the disk cache stores it. Nothing else counts the graph's placeholders or
outputs.

Inputs, in order::

    params | buffers | states | hparams | inputs | grads_in | workspaces | agreement

(``workspaces``: the eager lowering's planned workspaces, passes/memory_plan.py; ``agreement``:
the per-call agreement a graph that checks the ranks itself awaits, passes/rank_check.py.)

Outputs, in order::

    user outputs | new_states | grads_out | kept_grads
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class StepOutputs(NamedTuple):
    """A run's flat outputs, split by the signature."""

    user: list[Any]  # the step's tensor return values (non-tensor ones are constants)
    new_states: list[Any]  # optimizer state the step created, one per ``new_states`` key
    grads_out: list[Any]  # this rank's accumulated gradients (no_sync calls)
    kept_grads: list[Any]  # averaged gradients kept in ``p.grad`` (``keep_grads``)


@dataclass(frozen=True)
class StepSignature:
    """Names of the compiled graph's inputs and outputs (see the module docstring)."""

    params: tuple[str, ...]  # unique parameters' qualified names (tied weights once)
    buffers: tuple[str, ...]  # unique buffers' qualified names
    states: tuple[tuple[str, str], ...]  # (parameter, state name) of optimizer state inputs
    # per lifted hyperparameter (the ``lr`` of each param group): bound as a float64 0-d tensor
    # (fused kernels) or a Python float
    hparams: tuple[bool, ...]
    inputs: tuple[int, ...]  # the step argument leaves (their positions) that are graph inputs
    grads_in: tuple[str, ...] = ()  # parameters whose accumulated gradient is an input
    user_outputs: int = 0  # the step's tensor return values
    new_states: tuple[tuple[str, str], ...] = ()  # optimizer state created by the step
    grads_out: tuple[str, ...] = ()  # parameters whose accumulated gradient is returned
    kept_grads: tuple[str, ...] = ()  # parameters whose averaged gradient is returned last
    # (device, bytes) of each workspace input of the lowered graph: a uint8 buffer at least
    # that long, owned by the runtime (runtime.Workspaces)
    workspaces: tuple[tuple[str, int], ...] = ()
    # optimizer state of the parameter's shape is bound as padded dim-0 shards (fully_shard)
    sharded_states: bool = False
    # tensor subclasses (spmd_compiler/subclass_params.py): per parameter, state, user output
    # and created state its Flat (one graph input or output per inner tensor), None when plain;
    # empty: all plain
    param_flats: tuple = ()
    state_flats: tuple = ()
    user_flats: tuple = ()
    new_state_flats: tuple = ()

    @property
    def input_groups(self) -> tuple[int, ...]:
        """How many placeholders each group has: params, buffers, states, hparams, then the
        rest (inputs and accumulated gradients)."""
        return (_width(self.param_flats, len(self.params)), len(self.buffers),
                _width(self.state_flats, len(self.states)), len(self.hparams))

    def split_outputs(self, outs) -> StepOutputs:
        """The run's flat outputs by kind (a subclass value rebuilt from its inner tensors)."""
        from .subclass_params import unflatten_outputs

        a = _width(self.user_flats, self.user_outputs)
        b = a + _width(self.new_state_flats, len(self.new_states))
        c = b + len(self.grads_out)
        user, new_states = list(outs[:a]), list(outs[a:b])
        if self.user_flats:
            user = unflatten_outputs(user, self.user_flats)
        if self.new_state_flats:
            new_states = unflatten_outputs(new_states, self.new_state_flats)
        return StepOutputs(user, new_states, list(outs[b:c]),
                           list(outs[c:c + len(self.kept_grads)]))


def _width(flats: tuple, count: int) -> int:
    """Graph inputs or outputs of ``count`` values whose flattenings are ``flats``."""
    if not flats:
        return count
    return sum(len(f.names) if f is not None else 1 for f in flats)


def split_inputs(flat, counts) -> list[list[Any]]:
    """``flat`` cut into ``len(counts)`` groups of those sizes, then the rest."""
    out, start = [], 0
    for c in counts:
        out.append(list(flat[start:start + c]))
        start += c
    out.append(list(flat[start:]))
    return out
