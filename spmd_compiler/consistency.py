"""Cross-rank agreement: every rank must run the same compiled program, or all of them raise.

Ranks that disagree (another model, optimizer config, batch structure, a branch taken on one rank
only, a batch size outside the guards on one rank) would otherwise enter mismatched collectives
and hang or compute garbage. Two checks prevent that:

- per call, ``agree_on_compile``: one small all_reduce of every rank's (needs a compile?, local batch size);
  if some ranks would recompile and others would not, every rank raises the same error. A
  rank running a cached eager graph only issues it (``start_agreement``) and lets the graph
  await it (``await_agreement``) before its first collective or state update;
- per compile, ``agree_on_program``: ranks exchange a description of what they compiled (or the
  error they hit) as pickled bytes in one all_reduce; any difference, or any rank's failure, raises on
  every rank naming the ranks and the first difference.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from spmd_compiler.passes import meta

from .errors import SPMDError
from .tracing import StepArgs


class RankMismatchError(SPMDError):
    """Ranks disagree about the program they run (or one of them failed to compile it)."""


CACHED, COMPILE, COMPILE_FAILED = 0, 1, 2  # what a rank is about to do with this call


def agree_on_compile(status: int, batch_size: int, reason: str, group,
                     error: Exception | None = None) -> None:
    """All ranks must agree on whether this call compiles; raise the same error on all if not.

    ``status`` is CACHED, COMPILE or COMPILE_FAILED (this rank rejected its arguments: it
    re-raises ``error`` after telling the others, who raise a RankMismatchError naming it).
    """
    pending = start_agreement(status, batch_size, reason, group)
    if error is not None:
        if pending is not None:
            pending.work.wait()
        raise error
    finish_agreement(pending)


class PendingAgreement:
    """An issued per-call agreement whose result is checked later (``finish_agreement``)."""

    def __init__(self, work, everyone: list[torch.Tensor], status: int, reason: str):
        self.work, self.everyone, self.status, self.reason = work, everyone, status, reason


def start_agreement(status: int, batch_size: int, reason: str, group) -> PendingAgreement | None:
    """Issue the per-call exchange of (status, local batch size); None on a single rank.

    Each rank fills its own row of a ``world x 2`` table of zeros and the table is summed with
    one all_reduce (gloo's most used path; its list all_gather copies through a flat buffer on
    its worker thread), so every rank ends with every rank's row.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return None
    table = torch.zeros(world, 2, dtype=torch.int64)
    table[dist.get_rank(group)] = torch.tensor([status, batch_size], dtype=torch.int64)
    work = dist.all_reduce(table, group=group, async_op=True)
    return PendingAgreement(work, list(table.unbind(0)), status, reason)


def finish_agreement(pending: PendingAgreement | None) -> None:
    """Wait for an issued agreement; raise RankMismatchError if the ranks disagree."""
    if pending is None:
        return
    pending.work.wait()
    everyone, status, reason = pending.everyone, pending.status, pending.reason
    world = len(everyone)
    flags = [int(t[0]) for t in everyone]
    failed = [r for r, f in enumerate(flags) if f == COMPILE_FAILED]
    if failed:
        raise RankMismatchError(
            f"ranks {failed} rejected their step arguments (see the error raised there); this "
            f"rank stops too instead of waiting for them in a collective."
        )
    if 0 < sum(flags) < world:
        compiling = [r for r, f in enumerate(flags) if f]
        sizes = ", ".join(f"rank {r}: {int(t[1])}" for r, t in enumerate(everyone))
        raise RankMismatchError(
            f"ranks {compiling} need to recompile this step and the others do not, so they would "
            f"run different programs. Local batch sizes: {sizes}. This rank: "
            f"{'recompile (' + reason + ')' if status else 'cached graph'}. Give every rank "
            f"inputs of the same structure, dtype, requires_grad and non-batch shape."
        )


_IN_FLIGHT: list[PendingAgreement | None] = []  # the agreement of the step now running


@contextlib.contextmanager
def agreement_in_flight(pending: PendingAgreement | None):
    """Run a compiled step while its agreement is in flight; the step's graph calls
    ``await_agreement`` before its first collective or state update. If the step stops before
    that, the agreement is still completed (and checked) here."""
    _IN_FLIGHT.append(pending)
    try:
        yield
    finally:
        left = _IN_FLIGHT.pop()
        if left is not None and sys.exc_info()[0] is None:
            finish_agreement(left)
        elif left is not None:
            left.work.wait()


def await_agreement() -> None:
    """Graph node: complete the running step's per-call agreement (raise if ranks disagree)."""
    if _IN_FLIGHT and _IN_FLIGHT[-1] is not None:
        pending, _IN_FLIGHT[-1] = _IN_FLIGHT[-1], None
        finish_agreement(pending)


def describe_program(gm: fx.GraphModule, sa: StepArgs, guard_code: str | None) -> dict[str, Any]:
    """What must be equal across ranks, by name, in the order a difference is reported."""
    module = sa.module
    optimizers = [
        (type(opt).__name__, [
            sorted((k, repr(v)) for k, v in g.items() if k != "params") + [("params", len(g["params"]))]
            for g in opt.param_groups
        ])
        for opt in sa.optimizers
    ]
    inputs = [
        (tuple(None if j == d else s for j, s in enumerate(sa.leaves[i].shape)), d,
         str(sa.leaves[i].dtype), str(sa.leaves[i].device))
        for i, d in zip(sa.input_indices, sa.batch_dims)
    ]
    constants = [
        repr(x) for j, x in enumerate(sa.leaves)
        if j not in sa.input_indices and j != sa.module_index and j not in sa.optimizer_indices
    ]
    collectives = [
        (str(n.target), tuple(n.meta["val"].shape) if hasattr(n.meta.get("val"), "shape") else ())
        for n in gm.graph.nodes if n.meta.get(meta.COLLECTIVE) is not None
    ]
    return {
        "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in module.named_parameters()],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
        "train/eval mode": [m.training for m in module.modules()],
        "optimizer": optimizers,
        "input structure": str(sa.spec),
        "inputs": inputs,
        "constants": constants,
        "shape guards": guard_code,
        "collective sequence": [(t, repr(shape)) for t, shape in collectives],
        "graph": hashlib.sha1(gm.code.encode()).hexdigest(),
    }


def agree_on_program(description: dict[str, Any] | Exception, group) -> None:
    """Exchange what each rank compiled (or its compile error); raise on every rank on mismatch."""
    world = dist.get_world_size(group)
    if world == 1:
        if isinstance(description, Exception):
            raise description
        return
    mine = ("error", f"{type(description).__name__}: {description}") \
        if isinstance(description, Exception) else ("ok", description)
    everyone = exchange_objects(mine, group)
    if isinstance(description, Exception):
        raise description
    failed = [(r, msg) for r, (status, msg) in enumerate(everyone) if status == "error"]
    if failed:
        details = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise RankMismatchError(f"compiling the step failed on other ranks: {details}")
    reference = everyone[0][1]
    for r, (_, desc) in enumerate(everyone[1:], start=1):
        for name, value in reference.items():
            if desc.get(name) != value:
                differing = [k for k, (_, d) in enumerate(everyone) if d.get(name) != value]
                raise RankMismatchError(
                    f"ranks disagree on the step's {name}: ranks {differing} differ from rank 0 "
                    f"(rank 0: {_short(value)}; rank {differing[0]}: {_short(desc.get(name))}). "
                    f"Every rank must run the same model, optimizer configuration and batch "
                    f"structure, and take the same Python branches in the step."
                )


def exchange_objects(obj: Any, group) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order.

    Each rank pickles its object into its own row of a zero ``world x max_len`` byte table and the
    table is summed with one all_reduce (after one all_reduce of the lengths). Unlike
    ``all_gather_object`` this needs no numpy and stays on gloo's plain all_reduce path.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = torch.zeros(world, dtype=torch.int64)
    lengths[rank] = mine.numel()
    dist.all_reduce(lengths, group=group)
    table = torch.zeros(world, int(lengths.max()), dtype=torch.uint8)
    table[rank, : mine.numel()] = mine
    dist.all_reduce(table, group=group)
    return [pickle.loads(bytes(table[r, : int(n)].tolist())) for r, n in enumerate(lengths)]


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
