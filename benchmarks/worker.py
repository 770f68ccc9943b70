"""What every rank runs for one (model, mode) job, and how the parent launches the ranks.

Each job gets fresh processes, so the peak RSS of a rank belongs to that job alone (it includes
the Python + torch baseline, which is reported separately as ``rss_base_bytes``).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import resource
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .models import MODELS
from .modes import NotAvailable, full_params, get_mode, persistent_bytes


@dataclass(frozen=True)
class Job:
    """One (model, mode) measurement. ``batch`` is the per-rank batch size.

    With ``profile_dir``, three more steps run after everything is measured, under
    torch.profiler; rank 0 writes the op table to ``{profile_dir}/{model}_{mode}.txt`` and
    reports per-step totals (collectives, aten ops, the rest) with its figures.
    """

    model: str
    mode: str
    world_size: int
    batch: int
    warmup: int
    steps: int
    seed: int = 0
    timeout_s: float = 300.0
    profile_dir: str | None = None


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _unavailable(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (NotAvailable, NotImplementedError, ImportError)) or "SPMDError" in names


def _batch(job: Job, rank: int, step: int):
    """Different data on every rank and step, identical across modes; made outside the timing."""
    gen = torch.Generator().manual_seed(job.seed * 1_000_003 + rank * 10_007 + step)
    return MODELS[job.model].make_batch(gen, job.batch)


def _measure(job: Job, rank: int) -> dict:
    spec, mode = MODELS[job.model], get_mode(job.mode)
    torch.manual_seed(job.seed)  # same initial parameters on every rank and in every mode
    runner = mode.prepare(spec, job.world_size)

    compile_seconds, compiles = 0.0, 0

    def account_compiles() -> None:
        nonlocal compile_seconds, compiles
        count = runner.compiles()
        if count is not None and count > compiles:
            compile_seconds += runner.compile_seconds() or 0.0
            compiles = count

    batch = _batch(job, rank, 0)
    start = time.perf_counter()
    runner.step(batch)
    first_call = time.perf_counter() - start
    account_compiles()
    for i in range(1, 1 + job.warmup):
        runner.step(_batch(job, rank, i))
        account_compiles()
    warm_compiles = compiles
    wall, cpu = [], []
    for i in range(1 + job.warmup, 1 + job.warmup + job.steps):
        batch = _batch(job, rank, i)
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = runner.step(batch)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    account_compiles()
    rss_peak = _max_rss_bytes()  # before the memory measurement below (the profiler's own buffers)
    memory = _memory(runner, _batch(job, rank, 1 + job.warmup + job.steps))

    # Step time = slowest rank per step, reduced after the loop so timing has no extra syncs.
    per_step = torch.tensor([wall, cpu], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    first = torch.tensor([first_call], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    params = None if mode.reference else full_params(runner)
    profiled = _profile(job, rank, runner, batch) if job.profile_dir else None
    return {
        "step_seconds": per_step[0].tolist(),
        "step_cpu_seconds": per_step[1].tolist(),
        "first_call_seconds": first.item(),
        "compile_seconds": compile_seconds if runner.compiles() is not None else None,
        "compiles": runner.compiles(),
        "compiles_while_timed": compiles - warm_compiles,
        "graph_collectives": runner.collectives(),
        "persistent_bytes": persistent_bytes(runner),
        "loss": float(loss.detach()) if isinstance(loss, torch.Tensor) else None,
        "params": params,
        "profile": profiled,
        "rss_peak_bytes": rss_peak,
        "memory": memory,
    }


def _memory(runner, batch) -> dict | None:
    """Live tensor bytes between steps and at the peak of a step (measured from the CPU
    allocator's events, spmd_compiler.memory), next to the compiler's liveness estimate. Runs
    two more steps (the first unmeasured) after the timed ones."""
    if runner.module is None:
        return None
    try:
        from spmd_compiler.observe.memory import measure_step_memory
    except ImportError:
        return None
    report = measure_step_memory(lambda: runner.step(batch), runner.module, [runner.optim])
    return {
        "live_between_steps": report.live_between_steps,
        "peak_in_step": report.peak_in_step,
        "growth_at_end": report.growth_at_end,
        "workspace": report.workspace,
        "estimated_peak": runner.estimated_peak(),
    }


def _profile(job: Job, rank: int, runner, batch, steps: int = 3) -> dict | None:
    """Profile ``steps`` more steps; rank 0 writes the op table and returns per-step totals."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            runner.step(batch)
        wall = time.perf_counter() - start
    if rank != 0:
        return None
    events = prof.key_averages()
    path = Path(job.profile_dir) / f"{job.model}_{job.mode}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    path.write_text(f"{job.model} / {job.mode}: {steps} steps on rank 0\n{table}\n")

    def ms(evs) -> float:
        return sum(e.self_cpu_time_total for e in evs) / 1000 / steps

    comm = [e for e in events if e.key.startswith(("c10d::", "_c10d_functional::"))]
    aten = [e for e in events if e.key.startswith("aten::")]
    top = max(aten, key=lambda e: e.self_cpu_time_total, default=None)
    return {
        "wall_ms": 1000 * wall / steps,
        "collective_calls": sum(e.count for e in comm if e.key.startswith("c10d::")) / steps,
        "collective_ms": ms(comm),
        "aten_ms": ms(aten),
        "aten_calls": sum(e.count for e in aten) / steps,
        "other_ms": ms(events) - ms(comm) - ms(aten),
        "top_op": None if top is None else [top.key, ms([top])],
    }


def rank_main(rank: int, job: Job, port: int, out_dir: str) -> None:
    """Entry point of one rank: init gloo on loopback, measure, write ``rank{r}.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.enable(all_threads=True)  # a crash (abort, segfault) prints every stack
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=job.world_size,
        timeout=datetime.timedelta(seconds=job.timeout_s),
    )
    result = {"rank": rank, "status": "ok", "rss_base_bytes": _max_rss_bytes()}
    try:
        result.update(_measure(job, rank))
    except Exception as exc:  # reported per job; one failing mode must not end the run
        result["status"] = "n/a" if _unavailable(exc) else "error"
        first_line = (str(exc).strip().splitlines() or [""])[0]
        result["reason"] = f"{type(exc).__name__}: {first_line}"
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()
    result.setdefault("rss_peak_bytes", _max_rss_bytes())
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: seconds per job, nothing left to clean up


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """Fresh rank processes forked from a server that has already imported torch and the modes.

    Forking from that clean server saves the multi-second torch import per job while every job
    still gets new processes (own peak RSS, no state left from earlier jobs).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["benchmarks.worker", "torch.nn.parallel", "torch.distributed.fsdp", "torch._dynamo",
         "spmd_compiler"]
    )
    return ctx


def launch(job: Job) -> list[dict]:
    """Run ``job`` on ``world_size`` fresh spawned ranks; returns every rank's result dict."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="spmd_bench_") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=rank_main, args=(r, job, port, out_dir), daemon=True)
            for r in range(job.world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + job.timeout_s + 60
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        timed_out = [p for p in procs if p.is_alive()]
        for p in timed_out:
            p.kill()
            p.join()
        results = []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pt"
            if path.exists():
                results.append(torch.load(path, weights_only=False))
            else:
                reason = "timed out" if p in timed_out else f"exit code {p.exitcode}"
                results.append({"rank": r, "status": "error", "reason": f"rank {r} {reason}"})
        return results

