"""Multi-rank test harness: persistent gloo worker pools on loopback.

A :class:`WorkerPool` owns ``world_size`` worker processes. Each worker puts the repository root
on ``sys.path``, calls ``torch.set_num_threads(1)``, joins a real gloo default process group
(``torch.distributed.init_process_group("gloo", ...)``) and then serves jobs until the pool is
closed. A job is a module-level function, sent by name
(``(fn.__module__, fn.__qualname__)``) together with picklable arguments; every rank runs
``fn(*args, **kwargs)`` and sends back the return value. The function reads its rank and the world
size from ``torch.distributed`` itself::

    def _allreduce(x):                      # module level, in an importable module (tests.*)
        t = torch.tensor([float(dist.get_rank() + x)])
        dist.all_reduce(t)
        return t.item()

    def test_sum(pool2):
        assert pool2.run(_allreduce, 1.0) == [3.0, 3.0]

Failure handling (``WorkerPool.run``):

- A rank raised: :class:`RankError` (an ``AssertionError``) naming the failing rank(s), with the
  exception type, message and full formatted traceback of each. Ranks that were still running
  ``error_grace`` seconds after the first failure (typically waiting in a collective that the
  failed rank never joined) are stopped, and their Python stacks are included.
- A rank did not answer within ``timeout``: :class:`WorkerTimeout` (a ``TimeoutError``) naming the
  function and the silent ranks, with each silent rank's Python stack (dumped with ``faulthandler``
  on SIGUSR1 just before the pool is killed), so a hung collective shows where it hung.
- A worker process died (``os._exit``, a crash, a signal): :class:`WorkerDied` with its exit code.

After any failure the worker processes are killed at once (ranks may be out of sync: one rank left
a collective that the others are still in) and fresh ones are launched right away; the next
``run`` waits for them to join the process group, transparently. A job that destroyed the default
process group also gets the pool restarted. A job that should check an expected exception must
catch it inside the worker function and return something, so the pool stays up.

Start method: "forkserver" by default, "spawn" with ``start_method="spawn"`` or the environment
variable ``MULTIRANK_START_METHOD=spawn``. Neither forks the test process itself (which may hold
threads and locks): spawn starts fresh interpreters, the fork server is a fresh interpreter that
has only imported the preload modules. With spawn every worker imports torch (about 2 s of CPU
each, so a world-size-3 pool on 2 cores takes 3-5 s to start, and as long again after every
failure); the fork server imports torch once per test session (``_FORKSERVER_PRELOAD``) and every
later pool start or restart forks ready workers in well under a second. A side effect: workers
see the environment variables of the moment the fork server started (right after collection
under pytest, see tests/conftest.py, else the first pool start), not later changes.

Loopback only: workers set ``GLOO_SOCKET_IFNAME=lo`` (unless it is already set) so gloo never
picks the interface the host name resolves to.

Process group rendezvous: the test process hosts a ``TCPStore`` on 127.0.0.1, port 0 (the kernel
picks a free port, so there is no race between finding a port and binding it), and the workers
join it as clients. This is equivalent to ``init_method="tcp://127.0.0.1:<port>"`` but the store
does not live inside rank 0, so it survives the death of any worker long enough to report it.

What is reset in a worker before every job (nothing else is):

- ``torch.set_num_threads(1)``;
- ``torch.set_default_dtype`` back to the dtype the worker started with (float32);
- grad mode enabled (``torch.set_grad_enabled(True)``).

What is *not* reset, and leaks from one job to the next on a healthy pool: RNG state (seed inside
the test function, e.g. with :func:`rank_data` or ``torch.manual_seed``), imported modules and
their globals, ``logging`` configuration (including the ``spmd_compiler`` logger level),
``torch._dynamo`` caches, process subgroups created with ``dist.new_group``, the working
directory and environment variables. A test that changes any of these should undo it.

Workers leave with ``os._exit`` after ``destroy_process_group`` (interpreter teardown with torch
loaded costs seconds), so ``atexit`` handlers registered by job code do not run.

Worker output goes to the inherited stdout/stderr (pytest shows it under the test that was running
when the pool started, if at all); return what you want to check instead of printing it.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import hashlib
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_TIMEOUT = 120.0  # seconds for one job on all ranks
DEFAULT_START_TIMEOUT = 120.0  # seconds for all workers to import torch and join the group
DEFAULT_PG_TIMEOUT = 300.0  # gloo's own collective timeout (a backstop; the job timeout is shorter)
DEFAULT_ERROR_GRACE = 3.0  # seconds to wait for the other ranks once one rank has failed
# Imported once by the fork server, so that neither pool starts nor restarts pay for them. Only
# modules that exist and import cleanly: an exception other than ImportError would stop the fork
# server (so never the project's own modules, which may be mid-edit).
_FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",  # ~2 s on its own on a loaded machine
    "torch.distributed.fsdp",
    "torch.fx.experimental.proxy_tensor",
    "pytest",  # imported by every test module that holds job functions
    "tests.multirank",
)

__all__ = [
    "WorkerPool",
    "RankError",
    "RankFailure",
    "WorkerTimeout",
    "WorkerDied",
    "PoolStartError",
    "rank_data",
    "assert_close_all",
    "prestart_forkserver",
]


# --------------------------------------------------------------------------------------------------
# Errors reported to the test process
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """An exception raised by the job function on one rank (as text: it crossed a process)."""

    rank: int
    exc_type: str  # qualified name, e.g. "ValueError" or "spmd_compiler.errors.SPMDError"
    message: str
    traceback: str  # the full formatted traceback, including chained exceptions


class RankError(AssertionError):
    """The job function raised on one or more ranks. ``failures`` maps rank -> RankFailure."""

    def __init__(self, message: str, failures: dict[int, RankFailure], stopped: Sequence[int] = ()):
        super().__init__(message)
        self.failures = failures
        self.stopped = list(stopped)


class WorkerTimeout(TimeoutError):
    """Some ranks did not answer within the timeout. ``ranks`` are the silent ranks,
    ``stacks`` their Python stacks (rank -> text) at the moment the pool was killed."""

    def __init__(self, message: str, fn_name: str, ranks: Sequence[int], stacks: dict[int, str]):
        super().__init__(message)
        self.fn_name = fn_name
        self.ranks = list(ranks)
        self.stacks = stacks


class WorkerDied(RuntimeError):
    """A worker process exited while running a job. ``exitcodes`` maps rank -> exit code
    (negative: killed by that signal); ``failures`` holds what the surviving ranks raised (often
    a gloo "connection reset" caused by the death)."""

    def __init__(self, message: str, exitcodes: dict[int, int | None],
                 failures: dict[int, RankFailure] | None = None):
        super().__init__(message)
        self.exitcodes = exitcodes
        self.failures = failures or {}


class PoolStartError(RuntimeError):
    """The worker processes could not be started or could not form the process group."""


# --------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_test_process(test_pid: int) -> None:
    """Exit when the test process is gone, so killed test runs leave no workers behind. (With
    the forkserver start method the worker's parent is the fork server, so check the test
    process itself.)"""
    while True:
        time.sleep(1.0)
        try:
            os.kill(test_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:
            pass


def _send(conn: Any, obj: Any) -> None:
    # Plain pickle (not multiprocessing's ForkingPickler): tensors are copied into the message
    # instead of being passed as shared-memory handles, which would not survive a killed sender.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    conn: Any,
    stack_dump_path: str,
    pg_timeout: float,
    test_pid: int,
) -> None:
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    t0 = time.monotonic()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    t_import = time.monotonic() - t0

    dump_file = open(stack_dump_path, "w")  # kept open for the life of the worker
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    # The worker's standard error goes to a file the test process reads when the worker dies: a
    # C++ abort's message ("terminate called after ...") and faulthandler's stacks of a fatal
    # signal (abort, segfault) are then part of the WorkerDied error, not lost in a capture.
    sys.stderr.flush()
    err = os.open(_stderr_path(stack_dump_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    faulthandler.enable(all_threads=True)
    threading.Thread(target=_watch_test_process, args=(test_pid,), daemon=True).start()

    if os.path.exists("/sys/class/net/lo"):
        # gloo would otherwise use the interface the host name resolves to: keep it on loopback.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, False, timeout=timedelta(seconds=pg_timeout)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid(), time.time(), t_import))

    default_dtype = torch.get_default_dtype()
    exit_code = 1
    try:
        while True:
            try:
                msg = _recv(conn)
            except (EOFError, OSError):
                break  # the test process closed the pipe
            if msg[0] == "stop":
                break
            _, job_id, module, qualname, args, kwargs = msg

            torch.set_num_threads(1)
            torch.set_default_dtype(default_dtype)
            torch.set_grad_enabled(True)
            try:
                fn = _resolve(module, qualname)
                result = fn(*args, **kwargs)
                reply = ("ok", job_id, result)
            except BaseException as e:  # noqa: BLE001 - everything is reported to the test
                reply = ("err", job_id, _type_name(e), str(e), traceback.format_exc())
            pg_ok = dist.is_initialized()
            try:
                payload = pickle.dumps(reply + (pg_ok,), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # noqa: BLE001
                payload = pickle.dumps(
                    (
                        "err",
                        job_id,
                        _type_name(e),
                        f"the return value of {module}.{qualname} is not picklable: {e}",
                        traceback.format_exc(),
                        pg_ok,
                    )
                )
            conn.send_bytes(payload)
        exit_code = 0
    except BaseException:  # noqa: BLE001 - e.g. the pipe broke; os._exit below would hide it
        traceback.print_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Skip the interpreter's teardown of torch (1-3 s per process on a loaded machine): the
        # worker owns nothing else that needs it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def _stderr_path(stack_dump_path: str) -> str:
    return stack_dump_path + ".stderr"


def _tail(path: str, start: int, limit: int = 6000) -> str:
    """What was written to ``path`` after byte ``start``, at most its last ``limit`` bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _labelled(label: str, text: str) -> str:
    return f"\n--- {label}:\n{text.rstrip()}" if text.strip() else ""


def _type_name(e: BaseException) -> str:
    t = type(e)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# --------------------------------------------------------------------------------------------------
# Test-process side
# --------------------------------------------------------------------------------------------------

_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _default_start_method() -> str:
    return os.environ.get("MULTIRANK_START_METHOD", "forkserver")


def prestart_forkserver() -> bool:
    """Launch the fork server now, without waiting for it: it imports ``_FORKSERVER_PRELOAD``
    (several seconds of CPU) while the test process goes on, e.g. with single-process tests, and
    the first pool start later only forks. Returns False (and does nothing) when the start method
    is not forkserver."""
    if _default_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    forkserver.ensure_running()
    return True


@atexit.register
def _close_live_pools() -> None:
    # Runs before multiprocessing's own atexit hook (registered earlier, atexit is LIFO), which
    # would otherwise join our non-daemon workers forever.
    for p in list(_LIVE_POOLS):
        p.close()


def _trim_stack_dump(text: str) -> str:
    """Drop the harness's own frames from a faulthandler dump: the watchdog thread, and the
    process bootstrap below ``_worker_main``."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "in _watch_test_process" in block:
            continue
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.rstrip().endswith("in _worker_main"):
                lines = lines[: i + 1]
                break
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exit code {code}"


class WorkerPool:
    """``world_size`` gloo worker processes that run test functions on every rank.

    The processes start on the first :meth:`run` (or :meth:`start`) and are reused by every later
    job; after any failure they are killed and the next job starts a fresh set. Use as a context
    manager or call :meth:`close`.

    Attributes for reporting: ``starts`` (how many times processes were started), ``start_times``
    (wall seconds of each start, spawn to the last rank in the group), ``start_waits`` (how long
    the test process actually waited for each start; less after a failure, since the replacement
    workers are launched at once), ``jobs`` (jobs run), and ``restart_reasons`` (one line per
    failure that forced a restart).
    """

    def __init__(
        self,
        world_size: int,
        *,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        pg_timeout: float = DEFAULT_PG_TIMEOUT,
        error_grace: float = DEFAULT_ERROR_GRACE,
        start_method: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        start_method = start_method or _default_start_method()
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.world_size = world_size
        self.start_method = start_method
        self.start_timeout = start_timeout
        self.pg_timeout = pg_timeout
        self.error_grace = error_grace
        self.starts = 0
        self.start_times: list[float] = []
        self.start_waits: list[float] = []
        self.jobs = 0
        self.restart_reasons: list[str] = []
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._dump_dir: str | None = None
        self._dump_paths: list[str] = []
        self._healthy = False
        self._starting = False  # processes spawned, not yet all in the process group
        self._spawned_at = 0.0
        self._job_id = 0
        _LIVE_POOLS.add(self)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True when worker processes are up and in sync (the next job will not restart them)."""
        return self._healthy and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Start the worker processes if they are not running (no-op on a healthy pool) and wait
        until every rank has joined the process group."""
        if self.healthy:
            return
        t0 = time.monotonic()
        if not self._starting:
            self._kill()
            self._spawn()
        self._await_ready(t0)

    def _spawn(self) -> None:
        """Launch the worker processes without waiting for them."""
        import torch.distributed as dist

        self._spawned_at = time.time()
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Imported once in the fork server; every worker (and every restart) forks from it.
            ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=timedelta(seconds=self.start_timeout),
            wait_for_workers=False,
        )
        self._dump_dir = tempfile.mkdtemp(prefix=f"multirank_ws{self.world_size}_")
        self._dump_paths = [
            os.path.join(self._dump_dir, f"rank{r}.stacks") for r in range(self.world_size)
        ]
        self._starting = True
        for r in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    r,
                    self.world_size,
                    self._store.port,
                    child_conn,
                    self._dump_paths[r],
                    self.pg_timeout,
                    os.getpid(),
                ),
                name=f"multirank-ws{self.world_size}-rank{r}",
                daemon=False,  # daemonic processes may not start children (e.g. DataLoader workers)
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)

    def _await_ready(self, t0: float) -> None:
        deadline = time.monotonic() + max(0.0, self._spawned_at + self.start_timeout - time.time())
        replies, dead, pending = self._gather(deadline, grace=1.0)
        problems = []
        for r, msg in sorted(replies.items()):
            if msg[0] == "init_error":
                problems.append(f"rank {r} failed to join the gloo group:\n{msg[1]}")
            elif msg[0] != "ready":
                problems.append(f"rank {r} sent {msg[0]!r} instead of 'ready'")
        for r, code in sorted(dead.items()):
            problems.append(f"rank {r} died during start-up: {_describe_exit(code)}")
        if pending:
            problems.append(
                f"ranks {sorted(pending)} did not join within {self.start_timeout:.0f} s"
            )
        if problems:
            self._kill()
            raise PoolStartError(
                f"could not start a gloo worker pool of world size {self.world_size}:\n"
                + "\n".join(problems)
            )
        self._starting = False
        self._healthy = True
        self.starts += 1
        # spawn -> last rank in the group, as measured by the workers' wall clocks
        self.start_times.append(max(m[2] for m in replies.values()) - self._spawned_at)
        self.start_waits.append(time.monotonic() - t0)

    def close(self) -> None:
        """Stop the workers: each destroys its process group and exits; stragglers are killed."""
        if not self._procs:
            return
        if self._healthy:
            for conn in self._conns:
                try:
                    _send(conn, ("stop",))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 10.0
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> "WorkerPool":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None
        if self._dump_dir is not None:
            shutil.rmtree(self._dump_dir, ignore_errors=True)
            self._dump_dir = None
        self._healthy = False
        self._starting = False

    def _fail(self, reason: str, respawn: bool = True) -> None:
        """Kill the workers after a failure. With ``respawn``, launch fresh ones right away: they
        import torch while the test process reports the failure, and the next job only waits for
        the rest of their start-up."""
        self.restart_reasons.append(reason)
        self._kill()
        if respawn:
            try:
                self._spawn()
            except Exception:  # noqa: BLE001 - the next start() retries and reports
                self._kill()

    # -- jobs ----------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be a module-level function of an importable module (not a lambda, a nested
        function or something defined in ``__main__``); arguments and return values must pickle.
        (``timeout`` is taken by this method: a job function cannot receive a keyword argument of
        that name.)
        """
        __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this harness
        module, qualname = self._job_name(fn)
        name = f"{module}.{qualname}"
        job = pickle.dumps(
            ("run", self._job_id + 1, module, qualname, args, kwargs),
            protocol=pickle.HIGHEST_PROTOCOL,
        )  # pickling errors surface here, before any rank starts
        self.start()
        self._job_id += 1
        self.jobs += 1
        try:
            return self._run(name, job, timeout)
        except BaseException:
            if self._healthy:  # interrupted (e.g. KeyboardInterrupt): ranks are in unknown state
                self._fail(f"{name}: interrupted", respawn=False)
            raise

    @staticmethod
    def _job_name(fn: Callable[..., Any]) -> tuple[str, str]:
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname:
            raise ValueError(f"{fn!r} has no __module__/__qualname__; pass a module-level function")
        if "<" in qualname:  # <lambda>, <locals>
            raise ValueError(
                f"{module}.{qualname} cannot be sent to worker processes: only module-level "
                "functions can be imported there by name"
            )
        if module == "__main__":
            raise ValueError(
                f"{qualname} is defined in __main__, which worker processes cannot import; "
                "define it in an importable module (e.g. under tests/)"
            )
        return module, qualname

    def _run(self, name: str, job: bytes, timeout: float) -> list[Any]:
        __tracebackhide__ = True
        ws = self.world_size
        dead: dict[int, int | None] = {}
        stderr_at = [_size(_stderr_path(p)) for p in self._dump_paths]
        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(job)
            except OSError:
                dead[r] = None  # exit code read below, once the process is reaped
        replies, died, pending = self._gather(time.monotonic() + timeout, self.error_grace)
        dead.update(died)

        ok = (
            not dead
            and not pending
            and all(m[0] == "ok" and m[1] == self._job_id for m in replies.values())
        )
        if ok:
            results = [replies[r][2] for r in range(ws)]
            if not all(replies[r][3] for r in range(ws)):
                self._fail(f"{name}: destroyed the default process group")
            return results

        stacks = self._dump_stacks(sorted(pending))
        for r in list(dead):
            self._procs[r].join(2.0)
            dead[r] = self._procs[r].exitcode
        failures = {
            r: RankFailure(r, m[2], m[3], m[4]) for r, m in sorted(replies.items()) if m[0] == "err"
        }
        stack_text = "".join(
            f"\n--- Python stack of rank {r} when it was stopped:\n{stacks[r]}"
            for r in sorted(stacks)
        )
        dead_text = "".join(
            f"\nrank {r} (worker process) exited: {_describe_exit(c)}"
            + _labelled(f"its standard error during {name}",
                        _tail(_stderr_path(self._dump_paths[r]), stderr_at[r]))
            for r, c in sorted(dead.items())
        )

        failure_text = ""
        shown: dict[str, int] = {}  # traceback text -> first rank that showed it
        for r, f in failures.items():
            if f.traceback in shown:
                first = shown[f.traceback]
                failure_text += f"\n--- rank {r}: the same {f.exc_type} as rank {first}"
            else:
                shown[f.traceback] = r
                failure_text += f"\n--- rank {r}: {f.exc_type}: {f.message}\n{f.traceback.rstrip()}"
        if dead:  # the root cause; errors on the other ranks are usually its consequence
            ranks = sorted(dead)
            msg = (
                f"worker process of rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))} died while running {name}:"
                + dead_text
            )
            if failures:
                msg += f"\nthen ranks {sorted(failures)} raised:" + failure_text
            if pending:
                msg += f"\nranks {sorted(pending)} were still running and were stopped"
            msg += stack_text
            self._fail(f"{name}: worker of ranks {ranks} died")
            raise WorkerDied(msg, dict(dead), failures)
        if failures:
            ranks = sorted(failures)
            plural = "s" if len(ranks) > 1 else ""
            msg = f"{name} raised on rank{plural} {', '.join(map(str, ranks))}"
            msg += failure_text
            if pending:
                msg += (
                    f"\nranks {sorted(pending)} had not answered {self.error_grace:g} s after the "
                    "first failure and were stopped (probably waiting in a collective)"
                )
            msg += stack_text
            self._fail(f"{name}: raised on ranks {ranks}")
            raise RankError(msg, failures, sorted(pending))
        if pending:
            msg = (
                f"{name} did not finish within {timeout:g} s: ranks {sorted(pending)} did not "
                f"answer (answered: {sorted(replies)}); the pool was killed and will restart"
                + stack_text
            )
            self._fail(f"{name}: timed out on ranks {sorted(pending)}")
            raise WorkerTimeout(msg, name, sorted(pending), stacks)
        bad = {r: m[:2] for r, m in replies.items()}
        self._fail(f"{name}: protocol error")
        raise RuntimeError(f"unexpected replies from workers for job {self._job_id}: {bad}")

    def _gather(
        self, deadline: float, grace: float
    ) -> tuple[dict[int, tuple], dict[int, int | None], set[int]]:
        """Read one message from every rank until ``deadline``; once a rank fails (error reply or
        process death) wait at most ``grace`` more seconds for the others. Returns
        (replies by rank, dead ranks with exit code, ranks that did not answer)."""
        pending = set(range(self.world_size))
        replies: dict[int, tuple] = {}
        dead: dict[int, int | None] = {}
        first_failure: float | None = None
        while pending:
            limit = deadline if first_failure is None else min(deadline, first_failure + grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables: dict[Any, int] = {}
            for r in pending:
                waitables[self._conns[r]] = r
                waitables[self._procs[r].sentinel] = r
            ready_ranks = {waitables[o] for o in _mp_wait(list(waitables), timeout=remaining)}
            for r in sorted(ready_ranks):
                conn = self._conns[r]
                try:
                    if not conn.poll(0):
                        raise EOFError  # process exited without a message
                    msg = _recv(conn)
                except (EOFError, OSError):
                    self._procs[r].join(2.0)
                    dead[r] = self._procs[r].exitcode
                    first_failure = first_failure or time.monotonic()
                else:
                    replies[r] = msg
                    if msg[0] not in ("ok", "ready"):
                        first_failure = first_failure or time.monotonic()
                pending.discard(r)
        return replies, dead, pending

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Python stacks of the given (live) ranks, via faulthandler on SIGUSR1."""
        sizes = {}
        for r in ranks:
            proc = self._procs[r]
            if not proc.is_alive():
                continue
            try:
                sizes[r] = os.path.getsize(self._dump_paths[r])
                os.kill(proc.pid, signal.SIGUSR1)
            except OSError:
                continue
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        while sizes and time.monotonic() < deadline:
            time.sleep(0.05)
            if all(os.path.getsize(self._dump_paths[r]) > s for r, s in sizes.items()):
                time.sleep(0.1)  # let the dump finish
                break
        for r, size in sizes.items():
            with open(self._dump_paths[r]) as f:
                f.seek(size)
                stacks[r] = _trim_stack_dump(f.read()) or "(no stack dump received)"
        return stacks

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "starting" if self._starting else "stopped"
        return (
            f"WorkerPool(world_size={self.world_size}, {state}, starts={self.starts}, "
            f"jobs={self.jobs})"
        )


# --------------------------------------------------------------------------------------------------
# Helpers for parity tests
# --------------------------------------------------------------------------------------------------


def _rank_seed(seed: int, rank: int) -> int:
    digest = hashlib.sha256(f"rank_data/{seed}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rank_data(seed: int, *shapes: Any, rank: int | None = None, dtype: Any = None,
              high: int = 10) -> Any:
    """Tensors that differ per rank, reproducibly: seeded from ``(seed, rank)`` with a private
    generator (the global RNG is untouched).

    ``rank`` defaults to the current ``torch.distributed`` rank (0 without a process group); pass
    it explicitly to rebuild another rank's data in a single-process reference. Each shape is an
    int or a tuple. Floating dtypes (default float32) are ``randn``; integer dtypes are
    ``randint(0, high)`` (e.g. class labels). Returns one tensor for one shape, else a tuple; for
    mixed dtypes call it twice with different seeds.
    """
    import torch
    import torch.distributed as dist

    if not shapes:
        raise ValueError("rank_data needs at least one shape")
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dtype = torch.float32 if dtype is None else dtype
    gen = torch.Generator().manual_seed(_rank_seed(seed, rank))
    out = []
    for shape in shapes:
        size = (shape,) if isinstance(shape, int) else tuple(shape)
        if dtype.is_floating_point or dtype.is_complex:
            out.append(torch.randn(size, generator=gen, dtype=dtype))
        else:
            out.append(torch.randint(0, high, size, generator=gen, dtype=dtype))
    return out[0] if len(out) == 1 else tuple(out)


def _named(tensors: Any, what: str) -> list[tuple[str, Any]]:
    import torch

    if isinstance(tensors, torch.Tensor):
        return [(what, tensors)]
    if isinstance(tensors, Mapping):
        return [(str(k), v) for k, v in tensors.items()]
    if isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
        return [(f"{what}[{i}]", t) for i, t in enumerate(tensors)]
    raise TypeError(f"expected a tensor, a sequence or a mapping of tensors, got {type(tensors)}")


def _full(t: Any) -> Any:
    full_tensor = getattr(t, "full_tensor", None)  # DTensor: a collective, same order on all ranks
    return full_tensor() if callable(full_tensor) else t


class ParityChecker:
    """Max |diff| per kind ("param", "state", "buffer", "loss") over a parity run, and every
    tolerance violation as text (checked once at the end, so one run reports all of them).
    Tensors compare by their local parts (DTensor.to_local()) with torch.isclose's rule."""

    def __init__(self, rtol: float = 1e-5, atol: float = 1e-6):
        self.rtol, self.atol = rtol, atol
        self.max_err = {"param": 0.0, "state": 0.0, "buffer": 0.0, "loss": 0.0}
        self.problems: list[str] = []

    def close(self, kind: str, where: str, actual, expected) -> None:
        import math

        import torch
        from torch.distributed.tensor import DTensor

        if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
            if actual != expected:
                self.problems.append(f"{where}: {actual!r} != {expected!r}")
            return
        actual = actual.to_local() if isinstance(actual, DTensor) else actual
        expected = expected.to_local() if isinstance(expected, DTensor) else expected
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            self.problems.append(f"{where}: shape/dtype {tuple(actual.shape)} {actual.dtype} vs "
                                 f"expected {tuple(expected.shape)} {expected.dtype}")
            return
        a, e = actual.detach().double(), expected.detach().double()
        err = float((a - e).abs().max()) if a.numel() else 0.0
        self.max_err[kind] = max(self.max_err[kind], math.inf if math.isnan(err) else err)
        if not bool(torch.isclose(a, e, rtol=self.rtol, atol=self.atol).all()):
            self.problems.append(f"{where}: max abs err {err:.3g} (rtol={self.rtol}, "
                                 f"atol={self.atol})")

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.problems.append(msg)


def assert_close_all(actual: Any, expected: Any, rtol: float, atol: float, *,
                     what: str = "tensor", equal_nan: bool = False) -> None:
    """Compare tensors pairwise with ``|a - e| <= atol + rtol * |e|`` (torch.isclose's rule).

    ``actual`` and ``expected`` are both tensors, sequences of tensors (named ``what[i]``) or
    mappings name -> tensor (same keys, compared in ``expected``'s order). DTensors are compared
    by their ``full_tensor()`` (a collective: call this on every rank with the same structure).
    On failure raises ``AssertionError`` naming the first mismatching tensor with its max abs and
    max rel error, where the max abs error is, the number of bad elements, the other mismatching
    names, and the rank when a process group is up.
    """
    import torch
    import torch.distributed as dist

    act, exp = _named(actual, what), _named(expected, what)
    if isinstance(expected, Mapping) != isinstance(actual, Mapping):
        raise TypeError("actual and expected must both be mappings or both not be")
    where = ""
    if dist.is_available() and dist.is_initialized():
        where = f" on rank {dist.get_rank()}"
    if isinstance(expected, Mapping):
        missing = [k for k, _ in exp if k not in actual]
        extra = [k for k, _ in act if k not in expected]
        if missing or extra:
            raise AssertionError(
                f"{what} names differ{where}: missing {missing}, unexpected {extra}"
            )
        act_map = dict(act)
        act = [(k, act_map[k]) for k, _ in exp]
    elif len(act) != len(exp):
        raise AssertionError(f"{len(act)} actual vs {len(exp)} expected {what}s{where}")

    act = [(k, _full(t)) for k, t in act]
    exp = [(k, _full(t)) for k, t in exp]

    problems: list[str] = []
    for (name, a), (_, e) in zip(act, exp):
        if not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor):
            problems.append(f"'{name}': not a tensor ({type(a).__name__} vs {type(e).__name__})")
            continue
        if a.shape != e.shape:
            problems.append(f"'{name}': shape {tuple(a.shape)} vs expected {tuple(e.shape)}")
            continue
        if a.dtype != e.dtype:
            problems.append(f"'{name}': dtype {a.dtype} vs expected {e.dtype}")
            continue
        a64 = a.detach().to("cpu", torch.float64) if not a.dtype.is_complex else a.detach().cpu()
        e64 = e.detach().to("cpu", torch.float64) if not e.dtype.is_complex else e.detach().cpu()
        close = torch.isclose(a64, e64, rtol=rtol, atol=atol, equal_nan=equal_nan)
        if bool(close.all()):
            continue
        err = (a64 - e64).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        rel = err / e64.abs()
        rel = torch.where(e64 == 0, torch.where(err == 0, 0.0, float("inf")), rel)
        idx = int(err.reshape(-1).argmax())
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), a.shape))
        bad = int((~close).sum())
        problems.append(
            f"'{name}': max abs err {float(err.max()):.3g} at {pos} "
            f"(actual {a64.reshape(-1)[idx].item():.9g}, "
            f"expected {e64.reshape(-1)[idx].item():.9g}), "
            f"max rel err {float(rel.max()):.3g}; {bad}/{a.numel()} elements outside "
            f"rtol={rtol:g}, atol={atol:g}"
        )
    if problems:
        first, rest = problems[0], problems[1:]
        msg = f"{len(problems)} of {len(exp)} {what}s differ{where}; first: {first}"
        if rest:
            names = [p.split("'")[1] for p in rest[:10]]
            msg += f"\nalso differ: {', '.join(names)}" + (" ..." if len(rest) > 10 else "")
        raise AssertionError(msg)


class SelectedCases:
    """The per-rank reports of ``job(cases)``, a job that runs catalogue cases one after the other
    on every rank: run once per world size and session, for the cases the session selected only
    (``pytest -k one_case`` runs that case, not its whole catalogue), and kept for every test
    that reads them.

    ``case_of(item)`` names the case a collected test reads (None: it reads none); tests of the
    job's module whose ``pool`` parameter is the pool's world size (or that have none) and that
    are not skipped by a ``skipif`` mark count. A job that raised fails every test that reads
    it, without running again. ``session_items`` is the session's selected tests (set by
    tests/conftest.py once collection is done).
    """

    session_items: list = []

    def __init__(self, job: Callable[[list], Any], case_of: Callable[[Any], Any], timeout: float):
        self.job, self.case_of, self.timeout = job, case_of, timeout
        self._reports: dict[int, Any] = {}

    def reports(self, pool: "WorkerPool") -> list:
        ws = pool.world_size
        if ws not in self._reports:
            try:
                self._reports[ws] = pool.run(self.job, self.selected(ws), timeout=self.timeout)
            except Exception as e:
                self._reports[ws] = e
                raise
        result = self._reports[ws]
        if isinstance(result, BaseException):
            raise AssertionError(
                f"{self.job.__name__} at world size {ws} failed: {result!r}") from result
        return result

    def selected(self, world_size: int) -> list:
        """The cases the session's tests of the job's module read at ``world_size``."""
        cases = []
        for item in self.session_items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if (item.module.__name__ != self.job.__module__
                    or params.get("pool", world_size) != world_size
                    or any(m.name == "skipif" and m.args and m.args[0] for m in item.iter_markers())):
                continue
            case = self.case_of(item)
            if case is not None and case not in cases:
                cases.append(case)
        return cases


def assert_parity_report(rep: dict, case: str, world_size: int, rank: int,
                         expected_compiles: int) -> None:
    """One rank's report of a catalogue parity case (``problems`` against the DDP reference,
    ``counts``: compile_count after each step, the last step a short batch): no problem, and
    ``expected_compiles`` after every step from the second on (the short last batch runs on the
    graph compiled for the full batches)."""
    problems = rep["problems"]
    assert not problems, (
        f"{case} (world size {world_size}) differs from DDP on rank {rank}: "
        f"{len(problems)} problem(s):\n  " + "\n  ".join(problems[:20])
    )
    counts = rep["counts"]
    assert counts[-1] == counts[-2], f"{case}: the short batch recompiled: counts {counts}"
    assert counts[1:] == [expected_compiles] * (len(counts) - 1), (
        f"{case}: compile_count after each step {counts}, expected {expected_compiles} from "
        f"the second step on"
    )


def run_without_problems(pool: "WorkerPool", job: Callable[..., Any], *args: Any,
                         timeout: float = DEFAULT_TIMEOUT) -> list:
    """``pool.run(job, *args)`` for a job whose per-rank report has ``problems`` (a
    ParityChecker's): asserts that no rank has any, and returns the reports."""
    reps = pool.run(job, *args, timeout=timeout)
    for rank, rep in enumerate(reps):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
    return reps
