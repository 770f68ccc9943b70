"""Measured memory of a step (spmd_compiler/observe/memory.py), importable where users import it."""

from .observe.memory import StepMemory, live_state_bytes, measure_step_memory, rss_peak_bytes

__all__ = ["StepMemory", "live_state_bytes", "measure_step_memory", "rss_peak_bytes"]
