"""Tensor parallelism: the compiled step against eager DTensor TP (2 ranks) and FSDP2 + TP (2 x 2),
and seed 000's timing harness on a small width-sharded ConvNeXt.

    python -m benchmarks.tensor_parallel [--steps 20] [--jobs mlp,transformer_sp,...]

Every job runs on fresh gloo ranks on 127.0.0.1 with one thread each; prints one line per job:
median step time (ms), collectives per step (the compiled graph's; CommDebugMode's count for the
eager step) and the peak resident memory of rank 0 (MiB). CPU only: the ratios say what the
whole-step graph saves in Python and dispatch overhead, not what a GPU would see.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _mlp(dim: int = 256):
    return torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                               torch.nn.Linear(4 * dim, dim))


def _mse_step(model, optim, x, y):
    optim.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optim.step()
    return loss


def _ce_step(model, optim, x, y):
    optim.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    return loss


def _timed(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _eager_collectives(fn) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return comm.get_total_counts()


def _compiled_collectives(step) -> int:
    return sum(1 for n in step.last_compiled.traced.gm.graph.nodes
               if n.op == "call_function" and "c10d" in str(n.target) and "wait" not in str(n.target))


def _measure(name: str, label: str, step, compiled: bool, args: tuple, steps: int) -> str:
    """One result line: ``step(*args)``'s time per step and how many collectives it runs."""
    ms = _timed(lambda: step(*args), steps)
    count = _compiled_collectives(step) if compiled else _eager_collectives(lambda: step(*args))
    return f"{name:15s} {label:22s} {ms:8.2f} ms  {count:3d} collectives"


def _tp_model(name: str, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    if name == "mlp":
        model = _mlp()
        return (parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}),
                _mse_step, lambda: (torch.rand(32, 256), torch.rand(32, 256)))
    args = ModelArgs(dropout_p=0.0, n_layers=2, vocab_size=128, max_seq_len=32, dim=64)
    model = Transformer.parallelize(Transformer(args), mesh, name == "transformer_sp",
                                    local_output_for_attn=True)
    return model, _ce_step, lambda: (torch.randint(128, (8, 32)), torch.randint(128, (8, 32)))


def _tp_job(name: str, steps: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import spmd_compile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = []
    for compiled in (False, True):
        model, step_fn, batch = _tp_model(name, mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        torch.manual_seed(1)
        x, y = batch()
        step = spmd_compile(mesh=mesh)(step_fn) if compiled else step_fn
        out.append(_measure(name, "compiled TP" if compiled else "eager DTensor TP", step, compiled,
                            (model, opt, x, y), steps))
    return out


def _dp_tp_job(name: str, steps: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    out = []
    for compiled in (False, True):
        model, step_fn, batch = _tp_model(name, mesh["tp"])
        if not compiled:
            fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        torch.manual_seed(1 + mesh["dp"].get_local_rank())
        x, y = batch()
        step = spmd_compile(DataParallel("fully_shard"), mesh=mesh)(step_fn) if compiled else step_fn
        out.append(_measure(name, "compiled fully_shard x TP" if compiled else "eager FSDP2 + TP",
                            step, compiled, (model, opt, x, y), steps))
    return out


def _convnext_job(steps: int) -> list[str]:
    """Seed 000's harness on a small ConvNeXt: forward / backward split for the single-device
    model, the whole compiled step for the width-sharded one (one graph: no split), peak RSS."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    from spmd_compiler import spmd_compile
    from tests.convnext import ConvNeXt, conv_fn

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(12)
    model = ConvNeXt(depths=[1, 1, 3, 1], dims=[16, 32, 64, 128], num_classes=100)
    x = torch.randn(4, 3, 64, 256)
    y = torch.empty(4, dtype=torch.long).random_(100)
    single = copy.deepcopy(model)
    opt = torch.optim.Adam(single.parameters(), lr=1e-4)
    fwd, bwd = [], []
    for i in range(steps + 3):
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(single(x), y)
        t2 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        if i >= 3:
            fwd.append(t2 - t1)
            bwd.append(t3 - t2)
    out = [f"convnext        single device           forward {statistics.median(fwd) * 1e3:8.2f} ms, "
           f"backward {statistics.median(bwd) * 1e3:8.2f} ms"]
    sharded = distribute_module(model, mesh, conv_fn, input_fn=None, output_fn=None)
    opt = torch.optim.Adam(sharded.parameters(), lr=1e-4)
    dx, dy = distribute_tensor(x, mesh, [Shard(3)]), distribute_tensor(y, mesh, [Replicate()])

    def step_fn(model, optim, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        return loss

    step = spmd_compile(mesh=mesh)(step_fn)
    ms = _timed(lambda: step(sharded, opt, dx, dy), steps)
    out.append(f"convnext        compiled, width-sharded step {ms:8.2f} ms  "
               f"{_compiled_collectives(step):3d} collectives")
    return out


def _worker(rank: int, world: int, port: int, job: str, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if job == "convnext":
            lines = _convnext_job(steps)
        elif job.startswith("dp_tp:"):
            lines = _dp_tp_job(job.split(":")[1], steps)
        else:
            lines = _tp_job(job, steps)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if rank == 0:
            queue.put([f"{line}  (rank 0 peak RSS {rss:.0f} MiB)" for line in lines])
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """A port nobody listens on now (other jobs on the machine may hold fixed ones)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jobs", default=None, help="comma-separated subset of the jobs")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}")
    jobs = [("mlp", 2), ("transformer", 2), ("transformer_sp", 2), ("dp_tp:mlp", 4),
            ("convnext", 2)]
    if args.jobs:
        jobs = [j for j in jobs if j[0] in args.jobs.split(",")]
    ctx = mp.get_context("spawn")
    for job, world in jobs:
        queue = ctx.Queue()
        mp.start_processes(_worker, args=(world, _free_port(), job, args.steps, queue), nprocs=world,
                           start_method="spawn")
        for line in queue.get():
            print(line, flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
