"""A rank that fails or dies mid-step: the others fail with a clear CollectiveError within the
process group's timeout instead of hanging. Fresh processes per case (a pool would be broken)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, fault: str, timeout_s: float, results) -> None:
    sys.path.insert(0, ROOT)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from spmd_compiler import DataParallel, spmd_compile
    from tests.models import SimpleMLP, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_compile(DataParallel("replicate"))(train_step)
    batch = (torch.randn(8, 50), torch.randn(8, 8))
    step(model, opt, batch)  # compiled and run once on both ranks
    started = time.monotonic()
    try:
        if rank == 1:
            if fault == "dies":
                os._exit(3)
            time.sleep(timeout_s * 4)  # "stuck": alive but never joins the next step
            results.put((rank, "slept", None, time.monotonic() - started))
            return
        step(model, opt, batch)
        results.put((rank, "ran", None, time.monotonic() - started))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put((rank, type(e).__name__, str(e) + traceback.format_exc(), time.monotonic() - started))
    finally:
        os._exit(0)


def run_two_ranks(target, *args, patience: float = 120.0) -> tuple[dict, list]:
    """Run ``target(rank, port, *args, results)`` in two fresh processes, wait at most
    ``patience`` seconds for both, kill what is left. Returns the reports each rank put in
    ``results`` (rank -> (kind, message, seconds)) and the processes (for their exit codes)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + patience
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    reports = {}
    while not results.empty():
        rank, kind, message, seconds = results.get()
        reports[rank] = (kind, message, seconds)
    return reports, procs


@pytest.mark.parametrize("fault", ["dies", "stuck"])
def test_peer_failure_raises_collective_error_within_timeout(fault):
    timeout_s = 5.0
    reports, procs = run_two_ranks(_rank, fault, timeout_s)
    assert 0 in reports, f"rank 0 reported nothing (exit codes {[p.exitcode for p in procs]})"
    kind, message, seconds = reports[0]
    assert kind == "CollectiveError", (kind, message)
    assert "another rank" in message.lower() and "timeout" in message.lower()
    assert seconds < timeout_s * 3, f"rank 0 waited {seconds:.1f}s with a {timeout_s}s timeout"
