"""CPU time of a cached call of a compiled step: SimpleMLP, replicate, 2 gloo ranks, one thread,
against eager DDP with the same model, optimizer and batch in the same processes.

    python -m benchmarks.cached_call [--calls 2000] [--warmup 50] [--profile N]

Prints, per rank, the median ``time.process_time()`` of one call of the compiled step after its
programs exist (the per-call dispatch, guards, binding and the graph's run) and of one DDP step
(calls alternate, so both see the same load), in microseconds, their ratio, the calling
thread's own share (``time.thread_time()``: without gloo's threads), and the load average. ``--profile N``: rank 0 also prints cProfile's top N functions over the spmd calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .worker import free_port

ROOT = Path(__file__).resolve().parent.parent


def _run(rank: int, world: int, port: int, calls: int, warmup: int, profile: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, str(ROOT))
    from spmd_compiler import DataParallel, spmd_compile
    from tests import models

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = models.SimpleMLP()
    ddp = DDP(models.SimpleMLP())
    ddp.module.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    step = spmd_compile(DataParallel("replicate"))(models.train_step)
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, models.IN_FEATURES, generator=gen),
             torch.randn(8, models.OUT_FEATURES, generator=gen))
    for _ in range(warmup):
        step(model, optim, batch)
        models.train_step(ddp, ddp_optim, batch)
    compiles = step.compile_count
    cpu, ddp_cpu, main, ddp_main = [], [], [], []
    for _ in range(calls):
        for run, total, own in ((lambda: step(model, optim, batch), cpu, main),
                                (lambda: models.train_step(ddp, ddp_optim, batch), ddp_cpu, ddp_main)):
            start, start_own = time.process_time(), time.thread_time()
            run()
            own.append(time.thread_time() - start_own)
            total.append(time.process_time() - start)
    assert step.compile_count == compiles, "a timed call compiled"
    text = None
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile(time.thread_time)  # this thread: not gloo's
        prof.enable()
        for _ in range(calls):
            step(model, optim, batch)
        prof.disable()
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(profile)
        text = stream.getvalue() if rank == 0 else None
    out.put((rank, *(statistics.median(x) * 1e6 for x in (cpu, ddp_cpu, main, ddp_main)), text))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--profile", type=int, default=0, help="print cProfile's top N (rank 0)")
    a = p.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_run, args=(2, port, a.calls, a.warmup, a.profile, out), nprocs=2, start_method="spawn")
    results = sorted(out.get() for _ in range(2))
    for rank, us, ddp_us, main_us, ddp_main_us, text in results:
        if text:
            print(text)
        print(f"rank {rank}: median cached call {us:.1f} us CPU, DDP {ddp_us:.1f} us, "
              f"ratio {us / ddp_us:.3f} (the calling thread alone: {main_us:.1f} us, DDP "
              f"{ddp_main_us:.1f} us)")
    print("load average: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
