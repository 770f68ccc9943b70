"""Steps with several modules against the same steps written with DDP: a GAN (two optimizers,
two backward calls) and a model with an EMA copy, 2 gloo ranks, one thread each.

    python -m benchmarks.several_modules [--steps 60] [--warmup 5] [--width 512]

Per step kind and style (replicate, fully_shard), the median wall time of one compiled step and
of one DDP step (``DDP(G)``, ``DDP(D)``; ``DDP(model)`` with a plain EMA copy updated by
``lerp_``), calls alternating so both see the same load, their ratio, and the load average.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from .worker import free_port

ROOT = Path(__file__).resolve().parent.parent
BATCH = 64


def _mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.LeakyReLU(0.2)]
    return nn.Sequential(*layers[:-1])


def gan_step(G, D, opt_g, opt_d, real, z):
    """The discriminator's step, then the generator's (two optimizers, two backward calls)."""
    opt_d.zero_grad()
    fake = G(z)
    d_loss = (F.softplus(-D(real)) + F.softplus(D(fake.detach()))).mean()
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = F.softplus(-D(fake)).mean()
    g_loss.backward()
    opt_g.step()
    return d_loss.detach(), g_loss.detach()


def ema_step(model, ema, opt, x, y, decay=0.999):
    """A training step, then an EMA copy moved towards the model (timm's ``lerp_``)."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1.0 - decay)
    return loss.detach()


def _gan(width: int, rank: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    G, D = _mlp(64, width, width, width, 128), _mlp(128, width, width, width, 1)
    rG, rD = copy.deepcopy(G), copy.deepcopy(D)
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-4, betas=(0.5, 0.9))  # noqa: E731
    opts, ref_opts = (adam(G), adam(D)), (adam(rG), adam(rD))
    gen = torch.Generator().manual_seed(rank)
    data = (torch.randn(BATCH, 128, generator=gen), torch.randn(BATCH, 64, generator=gen))
    return (gan_step, (G, D, *opts, *data), (DDP(rG), DDP(rD), *ref_opts, *data))


def _ema(width: int, rank: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _mlp(128, width, width, width, 128)
    ema = copy.deepcopy(model).requires_grad_(False)
    ref, ref_ema = copy.deepcopy(model), copy.deepcopy(ema)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (model, ref))
    gen = torch.Generator().manual_seed(rank)
    data = (torch.randn(BATCH, 128, generator=gen), torch.randn(BATCH, 128, generator=gen))
    return (ema_step, (model, ema, opt, *data), (DDP(ref), ref_ema, ref_opt, *data))


def _time(rank: int, kind: str, style: str, width: int, steps: int, warmup: int) -> tuple:
    from spmd_compiler import DataParallel, spmd_compile

    fn, ours, ref = (_gan if kind == "GAN" else _ema)(width, rank)
    step = spmd_compile(DataParallel(style))(fn)
    for _ in range(warmup):
        step(*ours)
        fn(*ref)
    compiles = step.compile_count
    times, ddp_times = [], []
    for _ in range(steps):
        for run, out in ((lambda: step(*ours), times), (lambda: fn(*ref), ddp_times)):
            dist.barrier()
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
    assert step.compile_count == compiles, "a timed call compiled"
    return statistics.median(times) * 1e3, statistics.median(ddp_times) * 1e3


def _run(rank: int, world: int, port: int, steps: int, warmup: int, width: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, str(ROOT))
    results = [(kind, style, *_time(rank, kind, style, width, steps, warmup))
               for kind in ("GAN", "EMA") for style in ("replicate", "fully_shard")]
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=512)
    a = p.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_run, args=(2, port, a.steps, a.warmup, a.width, out), nprocs=2,
                       start_method="spawn")
    for rank, results in sorted(out.get() for _ in range(2)):
        for kind, style, ms, ddp_ms in results:
            print(f"rank {rank}: {kind} step, {style}: {ms:.2f} ms, DDP {ddp_ms:.2f} ms, "
                  f"ratio {ms / ddp_ms:.3f}")
    print("load average: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
