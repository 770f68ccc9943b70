"""One compile per job: the ranks that would build the same program let the first of them build
it and receive it through the job's key-value store.

Every rank computes the program cache's key of its compile (cache.program_key) without its rank:
the step function, the model's and optimizers' structure, the batch's structure with the sizes
that are not symbols, the options, the world and its group, torch's and this package's versions.
Ranks with equal keys form a set; the lowest rank of each set builds the program, packs it as the
disk cache stores it (cache.pack: the generated Python, the constants, the traced fields, the
shape and value guards) and hands it, with the cache FORMAT, its key and a sha256 of its
bytes, to the others through the job's key-value store (a wait there has its own time limit,
not the collectives'), which unpack it and check it as a file from the disk cache is checked
(cache.usable: the description of the arguments, the value guards on their own objects:
every Python value the recording read, spmd_compiler/trace/reads.py, so a class attribute or an
environment variable set per rank makes that rank build its own) and then against their own
inputs (the shape guards, the sizes held as constants). A rank whose
local batch size differs shares the program when the batch dim is a symbol; a rank whose key
differs, or for which the received program does not hold, builds its own. The cross-rank
agreement on the program (program_check.agree_on_program) follows as before, on every rank.

A program the builder cannot share is built by every rank of its set: one whose recording asked
for the rank (``dist.get_rank()`` however it was imported, a process group's ``rank()``, a
mesh's ``get_rank``/``get_coordinate``, asked by the user's code: another rank may take another
branch; torch_internals.rank_queries), one whose guards never hold (a read that cannot be
guarded, trace/guards.py), one that
cannot be packed (a global of its code not importable by name). A step that may change
Python state (it assigns a global or reaches a plain object such as an LR scheduler or a
counter: side_effects.may_change_python_state) is not shared either: its recording runs that
Python on the building rank's objects, and each rank's objects must see it.

A program holds no rank of its own: where the lowering needs this rank's index (gloo's gathers
and scatters on CPU, written as broadcasts into and copies out of this rank's rows,
passes/gloo_collectives.py; the buffers' bytes of rank 0, passes/rank_check.py) the program
reads it from its process group at each call, and parameters and optimizer state are sharded
outside it (every rank's shard padded to the same rows). On a multi-dim mesh (hybrid_shard)
each dim's groups are called by a name alike on every rank (runtime/agreement.dim_group_names;
each rank's own group under it), part of the key: a rank whose names differ builds its own.
An error while building reaches every rank of the set: an SPMDError (the user's step or
arguments) is raised there as the builder raised it, with a note naming the builder; anything
else as a ``RankMismatchError`` naming the builder and the error.

Sharing needs the eager backend, no per-stage dumps (each rank's dumps show its own compile), no
gradient accumulation, ``check_ranks`` (every rank compiles together) and a mesh without a
tensor-parallel plan or all-gather extensions (their programs hold each rank's own groups and
shards). The bytes travel over the job's own process group: they are trusted as the job's
collectives are (a peer that can send them can already send wrong gradients); the digest guards
against a transfer gone wrong, the guards against a program that does not fit.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import inspect
import logging
import os
import pickle
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import cache
from .. import torch_internals
from ..runtime.agreement import exchange_objects
from ..errors import RankMismatchError, SPMDError
from ..trace.side_effects import may_change_python_state, step_constants
from ..runtime.call_args import StepArgs

log = logging.getLogger("spmd_compiler")

_HEADER = b"spmd-compiler-shared-program\n"


@dataclasses.dataclass
class Sets:
    """Who builds what: ``leader[r]``, the rank of the group that builds rank r's program
    (r itself: r builds its own)."""

    key: str | None  # this rank's key (None: it shares with nobody)
    leader: list[int]
    rank: int

    @property
    def builds(self) -> bool:
        return self.leader[self.rank] == self.rank

    def followers(self, leader: int) -> list[int]:
        return [r for r, lead in enumerate(self.leader) if lead == leader and r != leader]


def eligible(step, sa: StepArgs, mesh) -> bool:
    """Can this step's programs be shared between ranks at all (see the module doc)?"""
    from ..features.subclass_params import extension_key
    from ..features.tensor_parallel import has_plan

    return (step.check_ranks and step.backend == "eager" and not step.dump_dir
            and not step._kept.mode and not has_plan(sa.module)
            and not extension_key(sa.module)
            and not may_change_python_state(step.fn, step_constants(sa), sa.module))


def plan(key: str | None, group) -> Sets:
    """Every rank's key exchanged; the lowest rank of each set of equal keys builds."""
    keys = exchange_objects(key, group)
    leader = [next(q for q in range(r + 1) if keys[q] == k) if k is not None else r
              for r, k in enumerate(keys)]
    return Sets(key, leader, dist.get_rank(group))


def shared_key(fn: Callable, sa: StepArgs, dynamic: dict, group, options: dict) -> str | None:
    """The program key without the rank (None if it cannot be computed: no sharing)."""
    try:
        return cache.program_key(fn=fn, sa=sa, dynamic_dims=dynamic, options=options, rank=-1,
                                 world_size=dist.get_world_size(group),
                                 group_name=group.group_name)
    except Exception as e:  # noqa: BLE001 - then this rank builds its own
        log.info("spmd_compiler: program not shared (%s)", e)
        return None


def build_jointly(step, sa: StepArgs, mesh, group, dynamic: dict, *, options: dict,
                  check: Callable, build: Callable, fits: Callable):
    """This rank's program (a pipeline-built or received ``_Ready``/``cache.Loaded``) and the
    ``cache.StoredProgram`` received, if one was. Every rank of ``group`` calls it together
    (``check_ranks``, more than one rank, no rank loaded from the disk cache); ``options`` are
    the step's options its programs depend on (part of the key); ``check()``
    refuses this rank's arguments before anything is built, ``build()`` builds, ``fits(ready)``
    says whether a received program serves this rank's inputs. Raises the build's error (or,
    on a rank that waited for it, a RankMismatchError) after every rank has heard of it."""
    error = key = None
    try:
        check()
        if eligible(step, sa, mesh):
            key = shared_key(step.fn, sa, dynamic, group, options)
    except Exception as e:  # noqa: BLE001 - raised below, after the others heard of it
        error = e
    sets = plan(key if error is None else None, group)
    ready = mine = None
    with torch_internals.rank_queries() as asked:
        if sets.builds and error is None:
            try:
                ready = build()
            except Exception as e:  # noqa: BLE001 - sent to the ranks waiting for this program
                error = e
    if sets.builds and sets.followers(sets.rank):
        mine = _wrap(("own", f"the step asked for its rank ({asked[0]})")) if asked and \
            error is None else payload(sets, sa, step.fn, ready, error)
    blob = broadcast(sets, mine, group)
    program = None
    if blob is not None:
        ready, error, program = receive(sets, blob, step.fn, sa, fits)
        if ready is None and error is None:
            ready = build()
    if error is not None:
        raise error
    return ready, program


def save(disk: tuple[str, str], received: cache.StoredProgram) -> None:
    """Store a received program in this rank's disk cache, under this rank's key."""
    try:
        cache.store(disk[0], dataclasses.replace(received, key=disk[1]))
    except Exception as e:  # noqa: BLE001 - the cache never stops a step
        log.info("spmd_compiler: program not cached (%s)", e)


def payload(sets: Sets, sa: StepArgs, fn: Callable, ready, error: Exception | None) -> bytes:
    """What the builder sends: its error, the reason it cannot share, or its packed program."""
    if error is not None:
        return _wrap(("error", (f"{type(error).__name__}: {error}", _picklable(error))))
    try:
        program = cache.pack(sets.key, ready.traced, ready.runnable, ready.guard_code,
                             ready.graph, ready.num_nodes, ready.seconds, _summary(ready),
                             cache.class_files(sa) + [inspect.getsourcefile(fn) or ""])
    except Exception as e:  # noqa: BLE001 - the others build their own
        program, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "it cannot be packed (see the log)"
    if program is not None:
        try:
            return _wrap(("program", program))
        except Exception as e:  # noqa: BLE001 - the others wait for an answer: send the reason
            why = f"it cannot be pickled ({type(e).__name__}: {e})"
    return _wrap(("own", why))


def _picklable(error: Exception) -> bytes | None:
    """An SPMDError (the user's mistake, the same on every rank), pickled to be raised on the
    ranks that waited for the program; None for anything else (they raise RankMismatchError)."""
    if not isinstance(error, SPMDError):
        return None
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001
        return None


def _summary(ready):
    from ..observe.visualize import summarize

    lowered = ready.runnable if isinstance(ready.runnable, torch.fx.GraphModule) else None
    return summarize(ready.traced.gm, compile_times=ready.seconds, lowered=lowered)


def _wrap(obj: Any) -> bytes:
    body = pickle.dumps((cache.FORMAT, obj), protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def _unwrap(blob: bytes, key: str | None) -> tuple[str, Any]:
    if not blob.startswith(_HEADER):
        raise ValueError("not a shared program")
    digest, body = blob[len(_HEADER):].split(b"\n", 1)
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise ValueError("its bytes were damaged on the way")
    fmt, (kind, value) = pickle.loads(body)
    if fmt != cache.FORMAT:
        raise ValueError(f"format {fmt}, expected {cache.FORMAT}")
    if kind == "program" and value.key != key:
        raise ValueError("it was built for another key")
    return kind, value


WAIT_SECONDS = float(os.environ.get("SPMD_SHARED_COMPILE_WAIT_S", 3600))
_ROUNDS: dict[str, int] = {}  # per group: programs shared so far (the same count on its ranks)


def broadcast(sets: Sets, mine: bytes | None, group) -> bytes | None:
    """Each builder with followers puts its bytes in the default store under a key of the group
    and the round; a follower waits for its builder's (up to ``SPMD_SHARED_COMPILE_WAIT_S``,
    default an hour: a compile may take longer than the process group's collective timeout)
    and the last follower to read removes them. Returns what this rank's builder sent (None if
    this rank builds)."""
    name = group.group_name
    round_ = _ROUNDS[name] = _ROUNDS.get(name, -1) + 1
    store = torch_internals.default_store()
    key = f"spmd_compiler/shared/{name}/{round_}/{sets.leader[sets.rank]}"
    if sets.builds:
        if sets.followers(sets.rank):
            store.set(key, mine)
        return None
    store.wait([key], datetime.timedelta(seconds=WAIT_SECONDS))
    blob = store.get(key)
    if store.add(key + "/read", 1) == len(sets.followers(sets.leader[sets.rank])):
        store.delete_key(key)
        store.delete_key(key + "/read")
    return bytes(blob)


def receive(sets: Sets, blob: bytes, fn: Callable, sa: StepArgs, fits: Callable):
    """(a cache.Loaded program, None, its StoredProgram), (None, the builder's error as a
    RankMismatchError, None), or (None, None, None): this rank builds its own (the reason
    logged)."""
    start = time.perf_counter()
    leader = sets.leader[sets.rank]
    try:
        kind, value = _unwrap(blob, sets.key)
    except Exception as e:  # noqa: BLE001 - build our own
        log.info("spmd_compiler: the program from rank %d refused (%s); compiling", leader, e)
        return None, None, None
    if kind == "error":
        text, same = value
        where = f"rank {leader}, which compiles the step for ranks {sets.followers(leader)}"
        if same is not None:  # the builder's own error, as every rank would have raised it
            error = pickle.loads(same)
            error.add_note(f"raised while compiling on {where}")
            return None, error, None
        return None, RankMismatchError(f"compiling the step failed on {where}: {text}"), None
    if kind == "own":
        log.info("spmd_compiler: rank %d's program is its own (%s); compiling", leader, value)
        return None, None, None
    loaded = cache.usable(value, fn, sa)
    if loaded is None or not fits(loaded):
        log.info("spmd_compiler: the program from rank %d does not fit this rank's inputs; "
                 "compiling", leader)
        return None, None, None
    seconds = {f"received from rank {leader}": time.perf_counter() - start}
    return dataclasses.replace(loaded, seconds=seconds), None, value
