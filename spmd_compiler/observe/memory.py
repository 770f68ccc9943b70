"""Measured memory of a training step: the peak of live tensor bytes and the peak resident set.

The summary's figure (``visualize.estimate_peak_memory``) is read off the graph; this module
measures a run. Every allocation and free of torch's CPU allocator is recorded by the profiler
(``profile_memory=True``), on the calling thread and on the threads its collectives run on (the
process group hands its thread-local state to them), with the allocator's running total after
each event. The measured step runs right after an unmeasured one inside the same recording, so
every tensor the measured step frees (the last step's gradients, say) was allocated under the
recording and its free is counted.

    report = measure_step_memory(lambda: step(model, optim, batch), model, [optim])
    report.peak_in_step, report.live_between_steps, report.rss_peak
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..runtime.program import WORKSPACES
from ..state.placement import local_buffer

_MEASURED = "spmd_compiler.measured_step"


@dataclass(frozen=True)
class StepMemory:
    """One measured step, in bytes, on this rank.

    ``live_between_steps``: distinct storages of the model's parameters, gradients and buffers
    and of the optimizers' state when the step starts (a sharded parameter counts its local
    padded buffer), plus the ``workspace`` that compiled steps keep for their fixed-size
    temporaries (passes/memory_plan.py). ``peak_in_step``: that plus the largest growth of the allocator's live
    bytes during the step. ``growth_at_end``: live bytes after the step minus before it (0 in
    a steady state; the first step's created optimizer state shows here). ``rss_peak``: the
    process's peak resident set size so far (``ru_maxrss``), including Python and torch
    themselves.
    """

    live_between_steps: int
    peak_in_step: int
    growth_at_end: int
    rss_peak: int
    workspace: int = 0

    @property
    def peak_growth(self) -> int:
        return self.peak_in_step - self.live_between_steps


def live_state_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Bytes of the distinct storages of ``module``'s parameters, their gradients, its buffers
    and the optimizers' state tensors (meta tensors count nothing)."""
    tensors: list[torch.Tensor] = []
    for p in module.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    tensors.extend(module.buffers())
    for opt in optimizers:
        for state in opt.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    seen: dict[int, int] = {}
    for t in tensors:
        local = local_buffer(t)  # a DTensor's local tensor (fully_shard: its padded buffer)
        if local.is_meta:
            continue
        storage = local.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def rss_peak_bytes() -> int:
    """The process's peak resident set size so far (Linux reports ``ru_maxrss`` in KiB)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def measure_step_memory(step: Callable[[], Any], module: torch.nn.Module,
                        optimizers: Iterable[torch.optim.Optimizer] = (), *,
                        warmup: int = 1) -> StepMemory:
    """Run ``step()`` ``warmup`` times and once more, under the profiler's memory recording,
    and measure the last call. Every rank that takes part in the step's collectives must call
    this too (it runs the step)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    optimizers = list(optimizers)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(warmup):
            step()
        workspace = WORKSPACES.nbytes()
        before = live_state_bytes(module, optimizers) + workspace
        with record_function(_MEASURED):
            step()
    start, end, events = _measured_window(prof)
    baseline = next((total for t, _, total in reversed(events) if t < start), None)
    if baseline is None:  # nothing allocated before: the first event's total before it
        first = next(((size, total) for t, size, total in events if t >= start), (0, 0))
        baseline = first[1] - first[0]
    inside = [total for t, _, total in events if start <= t <= end]
    after = next((total for t, _, total in reversed(events) if t <= end), baseline)
    peak = max(inside, default=baseline)
    return StepMemory(before, before + max(0, peak - baseline), after - baseline, rss_peak_bytes(),
                      workspace)


def _measured_window(prof) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(start ns, end ns) of the measured call and every CPU allocation event as
    (time ns, bytes allocated (negative: freed), allocator total after it), in time order."""
    from ..torch_internals import _EventType

    window = None
    events: list[tuple[int, int, int]] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
        elif event.name == _MEASURED:
            window = (event.start_time_ns, event.end_time_ns)
    if window is None:
        raise RuntimeError("the profiler recorded no measured step")
    events.sort()
    return window[0], window[1], events
