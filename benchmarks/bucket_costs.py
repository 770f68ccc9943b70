"""What merging a tensor into a bucket costs against what it saves, on this machine.

    python -m benchmarks.bucket_costs [--repeat 30]

Two gloo ranks on 127.0.0.1, one thread each (as the benchmarks run). Per tensor size it
measures, on rank 0, the median wall time of:

- ``copy``: flattening one tensor into a bucket (``torch.cat`` of its flat view with a small
  neighbour), the copy a bucketed all_reduce adds (its results are views of the bucket);
- ``all_reduce``: one gloo all_reduce of a tensor of that size (both ranks issue it);
- ``two halves``: two all_reduces of half that size each, issued back to back and waited on
  together (what keeping two tensors apart costs over one bucket of both).

Prints a table and the fitted latency ``alpha`` (the fixed cost of one collective: the
all_reduce time at the smallest sizes) and the copy bandwidth, and the size at which one copy
costs more than ``alpha``: the own-collective threshold. A tensor below that size is cheaper to
copy into a bucket than to send alone. The figures quoted in docs/architecture.md ("Bucketing
costs") and the default ``DataParallel.own_collective_mb`` come from this script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .worker import free_port

SIZES = [2**k for k in range(12, 26, 1)]  # 4 KiB .. 32 MiB


def _time(fns, repeat: int) -> list[float]:
    """Median wall time of each of ``fns``, run interleaved (so load drifts hit all alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeat + 3):
        for fn, out in zip(fns, times):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= 3:
                out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _measure(repeat: int) -> list[tuple[int, float, float, float]]:
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4
        t, neighbour = torch.randn(n), torch.randn(256)
        halves = [torch.randn(n // 2), torch.randn(n - n // 2)]

        def copy():
            torch.cat([t.view(-1), neighbour])

        def one():
            dist.all_reduce(t)

        def two():
            works = [dist.all_reduce(h, async_op=True) for h in halves]
            for w in works:
                w.wait()

        rows.append((nbytes, *_time([copy, one, two], repeat)))
    return rows


def _run(rank: int, world: int, port: int, repeat: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = _measure(repeat)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def summarize(rows: list[tuple[int, float, float, float]]) -> dict[str, float]:
    """alpha (s): the median all_reduce time over sizes up to 64 KiB; copy bandwidth (bytes/s):
    the median of bytes/copy time over sizes from 1 MiB; threshold (bytes): alpha x bandwidth."""
    alpha = statistics.median(one for nbytes, _, one, _ in rows if nbytes <= 64 * 2**10)
    bandwidth = statistics.median(nbytes / copy for nbytes, copy, _, _ in rows if nbytes >= 2**20)
    return {"alpha_s": alpha, "copy_bytes_per_s": bandwidth, "threshold_bytes": alpha * bandwidth}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=30)
    a = p.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, 2, port, a.repeat, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=1200)
    for proc in procs:
        proc.join()
    print(f"{'bytes':>10} {'copy us':>9} {'all_reduce us':>14} {'two halves us':>14}")
    for nbytes, copy, one, two in rows:
        print(f"{nbytes:>10} {copy * 1e6:>9.1f} {one * 1e6:>14.1f} {two * 1e6:>14.1f}")
    s = summarize(rows)
    print(f"alpha {s['alpha_s'] * 1e6:.0f} us, copy {s['copy_bytes_per_s'] / 2**30:.2f} GiB/s, "
          f"own-collective threshold {s['threshold_bytes'] / 2**20:.2f} MiB; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
