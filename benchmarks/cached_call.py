"""CPU time of a cached call of a compiled step: SimpleMLP, replicate, 2 gloo ranks, one thread.

    python -m benchmarks.cached_call [--calls 2000] [--warmup 50]

Prints, per rank, the median ``time.process_time()`` of one call of the compiled step after its
programs exist (the per-call dispatch, guards, binding and the graph's run), in microseconds, and
the load average. The per-call overhead is what the runtime adds on top of the graph's own ops.
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

ROOT = Path(__file__).resolve().parent.parent


def _run(rank: int, world: int, port: int, calls: int, warmup: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, str(ROOT))
    from spmd_compiler import DataParallel, spmd_compile
    from tests import models

    torch.manual_seed(0)
    model = models.SimpleMLP()
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = spmd_compile(DataParallel("replicate"))(models.train_step)
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, models.IN_FEATURES, generator=gen),
             torch.randn(8, models.OUT_FEATURES, generator=gen))
    for _ in range(warmup):
        step(model, optim, batch)
    compiles = step.compile_count
    cpu = []
    for _ in range(calls):
        start = time.process_time()
        step(model, optim, batch)
        cpu.append(time.process_time() - start)
    assert step.compile_count == compiles, "a timed call compiled"
    out.put((rank, statistics.median(cpu) * 1e6))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    a = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_run, args=(2, port, a.calls, a.warmup, out), nprocs=2, start_method="spawn")
    results = sorted(out.get() for _ in range(2))
    for rank, us in results:
        print(f"rank {rank}: median cached call {us:.1f} us CPU")
    print("load average: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
