"""Errors raised by spmd_compiler. Every one says what is wrong and, where it can, where in the
user's code."""


class SPMDError(Exception):
    """Base class of every error spmd_compiler raises on bad input or unsupported programs."""


class NoProcessGroupError(SPMDError):
    """The default process group is not initialized."""


class StepSignatureError(SPMDError):
    """The step's arguments do not hold exactly one nn.Module and at least one optimizer."""


class TraceError(SPMDError):
    """The step could not be recorded as one graph (data-dependent control flow, ...)."""


class MissingGradientError(SPMDError):
    """A trainable parameter got no gradient in the step."""


class BatchDimError(SPMDError):
    """An input's batch dim is wrong, disagrees with another input's, or cannot be propagated."""


class UnsupportedError(SPMDError):
    """The program uses something spmd_compiler does not support (yet)."""


class CollectiveError(SPMDError):
    """A collective inside the compiled step failed or timed out: another rank failed, died or
    is far behind. The process group's ``timeout`` bounds the wait."""


class InitializationError(SPMDError):
    """A model built on the meta device could not be materialized on the ranks."""


class MixedPrecisionError(SPMDError):
    """A mixed-precision policy that is not one, or that the process group's backend cannot
    honour (a dtype it cannot gather or reduce)."""


class TensorParallelError(SPMDError):
    """A tensor-parallel plan that does not fit the step: its mesh is not a dim of the step's
    mesh, it leaves no dim to the DataParallel asked for, or it is on a module the step never
    calls."""


class ContextParallelError(SPMDError):
    """Context parallelism (a ``cp`` mesh dim, ``input_seq_dim``) asked for in a way it cannot
    run: no ``cp`` dim, a sequence the cp ranks cannot split evenly, attention dropout."""


class RankMismatchError(SPMDError):
    """Ranks disagree about the program they run (or one of them failed to compile it)."""


class SideEffectError(SPMDError):
    """The step changes Python state while it is recorded; the compiled step would not repeat
    the change on later calls."""


class DivergenceError(SPMDError):
    """``verify``: the compiled step's result differs from the step run eagerly with DDP's
    semantics (spmd_compiler/verify.py)."""


class RecompileLimitError(SPMDError):
    """A step needed more programs than its recompile limit (``recompile_limit=``,
    ``SPMD_RECOMPILE_LIMIT``, default 8): the error names what changed at each recompile."""
