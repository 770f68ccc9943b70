"""Per-call agreement: on every call, every rank runs the same program, or all of them raise.
(Compile-time agreement, that every rank compiled the same program, is
spmd_compiler/build/program_check.py.)

Ranks that disagree (another model, optimizer config, batch structure, a branch that changes
what a rank communicates) would otherwise enter mismatched collectives and hang or compute
garbage. Ranks may differ in the sizes the program holds as symbols (the local batch size, a
dynamic sequence length); the collectives do not depend on them. Two checks:

- per call, ``agree_on_call``: ranks exchange (status, which compiled programs fit their
  inputs). Every compile happens on every rank together, so program ``k`` exists on all ranks;
  all ranks run the newest program that fits every rank's inputs, or, if none does, all of them
  compile a new one (one rank's new sequence length makes every rank recompile, never only one).
  In the steady state this costs no collective of its own: each eager program's check rides in
  its first collective (``passes/rank_check.carry``): the first gradient bucket, the first
  gathered parameter bucket (fully_shard), or the buffers' bytes (BatchNorm), whose broadcast
  from rank 0 becomes an all_reduce to which the other ranks add zeros; these depend on the
  parameters and buffers only, so every program of the step issues them with the same size.
  The running program appends a header to the bucket's ``cat``: (running a program, failed,
  the program's index in binary), pre-multiplied by the bucket's divisor so that the summed
  header counts ranks exactly (a gather brings every rank's own header, summed on arrival), and
  reads it back right after the bucket's wait, before any other collective or state update. All
  ranks ran the same program when every rank is running, none failed and every index bit is
  set on all ranks or none; otherwise it stops there (``Redispatch``, nothing changed) and every
  rank exchanges its fits (``agree_on_call``). A rank that runs no program (its guards fail, or
  it rejected its arguments) joins the same all_reduces with zeros and its header
  (``carry_alone``), so nobody waits in a collective the others never issue. Every rank knows
  the carrier of every program (it is part of ``program_check.describe_graph``, agreed on at
  compile time),
  so every rank takes the same path. Where a program cannot carry it (its first collective is
  over a sub-group of the step's ranks, as on a multi-dim mesh, or of a dynamic size, or a
  state update comes first) or the step's programs carry it in different collectives, the exchange is a dedicated small all_reduce
  (``start_agreement``) that the program awaits (``await_agreement``) before its first
  collective or state update, running while it travels;
- per compile, ``program_check.agree_on_program`` (built on ``exchange_objects``, here).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import pickle
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import RankMismatchError
from ..torch_internals import register_group_alias


class Redispatch(Exception):
    """Raised inside a running program whose rank learns that the ranks chose another program
    (``choice``, None: compile a new one); nothing has communicated or changed state yet."""

    def __init__(self, choice: int | None, resolved: bool = True):
        super().__init__(f"the ranks chose program {choice}" if resolved else
                         "the ranks run different programs; they agree on one next")
        self.choice, self.resolved = choice, resolved


# describe_graph: the collectives up to the one the per-call check rides in (carry_alone)
CARRIER = "per-call agreement carrier"
CACHED, COMPILE, COMPILE_FAILED = 0, 1, 2  # what a rank is about to do with this call
_BITS = 62  # programs per int64 word of the fits-mask


def agree_on_call(status: int, batch_size: int, group, fits: list[int], programs: int,
                  error: Exception | None = None) -> int | None:
    """Which program every rank runs for this call: the newest of the ``programs`` compiled so
    far that fits every rank's inputs (``fits``: the ones that fit this rank's), or None when
    every rank must compile a new one.

    ``status`` is CACHED, COMPILE or COMPILE_FAILED (this rank rejected its arguments: it
    re-raises ``error`` after telling the others, who raise a RankMismatchError naming it).
    """
    pending = start_agreement(status, batch_size, group, fits, programs)
    if error is not None:
        if pending is not None:
            pending.work.wait()
        raise error
    if pending is None:
        return max(fits) if fits else None
    return finish_agreement(pending)


class PendingAgreement:
    """An issued per-call agreement whose result is checked later (``finish_agreement``)."""

    def __init__(self, work, table: torch.Tensor, running: int | None):
        self.work, self.table = work, table
        self.running = running  # the program this rank started on while the exchange travels


def start_agreement(status: int, batch_size: int, group, fits: list[int], programs: int,
                    running: int | None = None) -> PendingAgreement | None:
    """Issue the per-call exchange; None on a single rank.

    Each rank fills its own row of a ``world x (2 + words)`` table of zeros (status, local batch
    size, a bit mask of the programs that fit its inputs) and the table is summed with one
    all_reduce (gloo's most used path), so every rank ends with every rank's row. Every rank has
    compiled the same number of programs, so the rows have the same width.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return None
    words = programs // _BITS + 1
    row = [status, batch_size] + [0] * words
    for k in fits:
        row[2 + k // _BITS] |= 1 << (k % _BITS)
    table = torch.zeros(world, 2 + words, dtype=torch.int64)
    table[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64)
    work = dist.all_reduce(table, group=group, async_op=True)
    return PendingAgreement(work, table, running)


def finish_agreement(pending: PendingAgreement) -> int | None:
    """Wait for an issued agreement; the program every rank runs (None: compile a new one).
    Raise RankMismatchError if a rank rejected its arguments."""
    pending.work.wait()
    rows = pending.table.tolist()
    failed = [r for r, row in enumerate(rows) if row[0] == COMPILE_FAILED]
    if failed:
        raise RankMismatchError(
            f"ranks {failed} rejected their step arguments (see the error raised there); this "
            f"rank stops too instead of waiting for them in a collective."
        )
    common = []
    for w in range(len(rows[0]) - 2):
        word = -1
        for row in rows:
            word &= row[2 + w]
        common += [w * _BITS + b for b in range(_BITS) if word >> b & 1]
    return max(common) if common else None


@contextlib.contextmanager
def agreement_in_flight(pending: PendingAgreement | None):
    """Run a compiled step while its agreement is in flight: yields the holder (a one-element
    list) to pass to the step's graph as its ``agreement`` input; the graph calls
    ``await_agreement(holder)`` before its first collective or state update. If the step stops
    before that, the agreement is still completed here (and, when the step raised nothing,
    checked); a carried agreement whose step raised before its carrier joins the carrier alone,
    as a failed rank."""
    holder = [pending]
    try:
        yield holder
    finally:
        left = holder[0]
        if isinstance(left, CarriedAgreement):
            if not left.sent:  # failed before its carrier: the others must not wait for it
                carry_alone(left.carrier, left.group, failed=True)
        elif left is not None and sys.exc_info()[0] is None:
            if finish_agreement(left) != left.running:
                raise RankMismatchError(
                    "the ranks chose another compiled program after this rank had run its own; "
                    "its program has no point to stop at before it communicates.")
        elif left is not None:
            left.work.wait()


def await_agreement(holder: list | None) -> None:
    """Graph node: complete the running step's per-call agreement (``holder[0]``, from
    ``agreement_in_flight``; None when the ranks agreed before the step); raise ``Redispatch``
    if the ranks chose another program than the one running (RankMismatchError if a rank
    failed)."""
    if holder is not None and holder[0] is not None:
        pending, holder[0] = holder[0], None
        choice = finish_agreement(pending)
        if choice != pending.running:
            raise Redispatch(choice)


# ---------------------------------------------------------------------------------------------
# The agreement carried in the step's first collective

HEADER_BITS = 16  # bits of the running program's index in the header
_PRESENT, _FAILED, _BITS0 = 0, 1, 2
HEADER = 2 + HEADER_BITS  # elements


class CarriedAgreement:
    """A per-call agreement that rides in the running program's carrier collective: nothing is
    issued for it before the program runs (``running``: the program this rank runs; ``carrier``:
    the collectives up to and with it, over ``group``: ``carry_alone``)."""

    def __init__(self, running: int, carrier: tuple[tuple[int, str], ...], group):
        self.running, self.carrier, self.group = running, carrier, group
        self.world = dist.get_world_size(group)
        self.sent = False


def header_row(running: int | None, failed: bool = False) -> list[int]:
    """This rank's header: (running a program, failed, the program's index in binary). Summed
    over the ranks, each element counts ranks: they agree when every rank runs a program, none
    failed and every index bit is set on all ranks or on none."""
    if failed or running is None:
        return [0, int(failed)] + [0] * HEADER_BITS
    return [1, 0] + [running >> b & 1 for b in range(HEADER_BITS)]


def agreement_header(holder: list | None, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Graph node, just before the carrier all_reduce: this rank's header, times ``scale`` (the
    carrier is divided by it before the sum, so the sum counts ranks exactly). With the
    dedicated exchange in flight instead (``PendingAgreement``), complete it first
    (``await_agreement``): the carrier is the program's first collective."""
    pending = holder[0] if holder is not None else None
    if isinstance(pending, CarriedAgreement):
        pending.sent = True
        return _header(pending.running, scale, dtype)
    await_agreement(holder)
    return _header(None, scale, dtype)


@functools.lru_cache(maxsize=None)
def _header(running: int | None, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``header_row(running) * scale`` as a tensor (made once; the graph's ``cat`` copies it)."""
    if running is not None and running >> HEADER_BITS:
        raise RankMismatchError(f"more than {2 ** HEADER_BITS} programs for one step")
    return torch.tensor(header_row(running), dtype=dtype) * scale


@functools.lru_cache(maxsize=None)
def _agreed(running: int, world: int) -> list[float]:
    """The summed header when all ``world`` ranks run program ``running``."""
    return [float(world * x) for x in header_row(running)]


def agreement_check(holder: list | None, result: torch.Tensor, rows: int = 1) -> None:
    """Graph node, right after the carrier's wait, before any other collective or state
    update: read the headers (the last ``HEADER`` elements of each of the ``rows`` rows of
    ``result``: one summed header, or every rank's own) and raise ``Redispatch`` (unresolved:
    the ranks then exchange which programs fit, ``agree_on_call``) unless every rank runs this
    program, or RankMismatchError if a rank failed."""
    pending = holder[0] if holder is not None else None
    if isinstance(pending, CarriedAgreement):
        holder[0] = None
        counts = _counts(result, rows)
        if counts != _agreed(pending.running, pending.world):
            decide_carried([round(x) for x in counts], pending.world)


def _counts(result: torch.Tensor, rows: int) -> list[float]:
    """The headers in ``result`` summed over its ``rows`` rows (exact: small integers). One
    row (a reduced carrier) is read as it is: one small copy, not four tensor ops per call."""
    if rows == 1:
        return result.view(-1)[-HEADER:].tolist()
    return result.view(rows, -1)[:, -HEADER:].double().sum(0).tolist()


def decide_carried(counts: list[int], world: int) -> None:
    """Raise unless the summed header ``counts`` says that all ``world`` ranks run the same
    program (see ``agreement_check``)."""
    if counts[_FAILED]:
        raise RankMismatchError(
            f"{counts[_FAILED]} rank(s) rejected their step arguments or failed before the "
            f"step's first collective (see the error raised there); this rank stops too "
            f"instead of waiting for them in a collective.")
    if counts[_PRESENT] != world or any(c not in (0, world) for c in counts[_BITS0:]):
        raise Redispatch(None, resolved=False)


class RankCheck:
    """What ``passes/rank_check.place_rank_check`` needs to let the agreement ride in a
    collective over ``group`` (the name of the process group every rank of the step is in)."""

    length = HEADER

    def __init__(self, group: str):
        self.group = group

    header = staticmethod(agreement_header)
    check = staticmethod(agreement_check)


def carry_alone(carrier: tuple[tuple, ...], group, failed: bool = False) -> None:
    """On a rank that runs no program this call (it must compile, or it failed), join the
    collectives the other ranks' programs issue up to and with the one their check rides in
    (``carrier``: (kind, elements, dtype, source rank, carries the header) of each, as
    ``passes/rank_check.describe_carrier`` names them): zeros, and this rank's header (not
    running; ``failed``) where its header goes. Raises RankMismatchError if a rank failed, and
    returns otherwise (the ranks then agree with ``agree_on_call``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = header_row(None, failed)
    works, headers = [], []
    for kind, n, dtype, source, carries in carrier:
        t = torch.zeros(n, dtype=getattr(torch, dtype.removeprefix("torch.")))
        if carries and (kind != "broadcast" or source == rank):
            t[-HEADER:] = torch.tensor(mine, dtype=t.dtype)
        if kind == "all_reduce":
            works.append(dist.all_reduce(t, group=group, async_op=True))
        elif kind == "broadcast":
            works.append(dist.broadcast(t, group=group, group_src=source, async_op=True))
        else:
            out = torch.zeros(n * world, dtype=t.dtype)
            works.append(dist.all_gather_into_tensor(out, t, group=group, async_op=True))
            t = out
        if carries:
            headers.append((t, world if kind == "all_gather" else 1))
    for work in works:
        work.wait()
    counts = [round(sum(x)) for x in zip(*(_counts(t, rows) for t, rows in headers))]
    if counts[_FAILED] and not failed:
        decide_carried(counts, 0)


def exchange_objects(obj: Any, group) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order.

    Each rank pickles its object into its own row of a zero ``world x max_len`` byte table and the
    table is summed with one all_reduce (after one all_reduce of the lengths). Unlike
    ``all_gather_object`` this needs no numpy and stays on gloo's plain all_reduce path. On the
    stand-in group ``explain`` builds on (torch's ``fake`` backend, whose collectives move
    nothing) every rank's is this rank's.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "fake":
        return [obj] * world
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = torch.zeros(world, dtype=torch.int64)
    lengths[rank] = mine.numel()
    dist.all_reduce(lengths, group=group)
    table = torch.zeros(world, int(lengths.max()), dtype=torch.uint8)
    table[rank, : mine.numel()] = mine
    dist.all_reduce(table, group=group)
    return [pickle.loads(bytes(table[r, : int(n)].tolist())) for r, n in enumerate(lengths)]


_FLAT_GROUPS: "weakref.WeakKeyDictionary[DeviceMesh, Any]" = weakref.WeakKeyDictionary()
_DIM_NAMES: "weakref.WeakKeyDictionary[DeviceMesh, list[str]]" = weakref.WeakKeyDictionary()


def mesh_group(mesh: DeviceMesh):
    """One process group over every rank of ``mesh`` (the cross-rank agreement's): the mesh's
    own for a 1-D mesh, its flattened dim for a larger one (made once per mesh, with the names
    of its dims' groups alike on every rank: ``dim_group_names``)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh not in _FLAT_GROUPS:
        flat = mesh._flatten().get_group()
        _DIM_NAMES[mesh] = _names_alike(mesh, flat)
        _FLAT_GROUPS[mesh] = flat
    return _FLAT_GROUPS[mesh]


def dim_group_names(mesh: DeviceMesh) -> list[str]:
    """The names a program calls the groups of ``mesh``'s dims by, outermost first: on a mesh
    ``mesh_group`` has seen, one name per dim alike on every rank (each rank's group of that dim
    under it), so the program is the same on every rank; else each rank's own group names."""
    own = [mesh.get_group(d).group_name for d in range(mesh.ndim)]
    return [alike or name for alike, name in zip(_DIM_NAMES.get(mesh) or [None] * mesh.ndim, own)]


def _name_of(group_names: list[str]) -> str:
    return "spmd-mesh-dim-" + hashlib.sha256(repr(group_names).encode()).hexdigest()[:16]


def _names_alike(mesh: DeviceMesh, flat) -> list[str | None]:
    """Per dim of ``mesh``: a name made of every rank's group name of that dim (the same on
    every rank, another for another set of groups), registered for this rank's group of the
    dim; None where the name is taken by another group. One exchange over ``flat``."""
    own = [mesh.get_group(d).group_name for d in range(mesh.ndim)]
    every = exchange_objects(own, flat)
    names = [_name_of([names[d] for names in every]) for d in range(mesh.ndim)]
    return [name if register_group_alias(name, mesh.get_group(d)) else None
            for d, name in enumerate(names)]
