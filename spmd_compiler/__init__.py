"""spmd_compiler: compile a single-device training step into a data-parallel step."""

from .api import compile, explain, spmd_compile
from .state.eager import unsharded
from .errors import SPMDError
from .parallel_mode import DataParallel

__all__ = ["spmd_compile", "compile", "explain", "unsharded", "DataParallel", "SPMDError"]
