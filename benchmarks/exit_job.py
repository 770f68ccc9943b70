"""A short train / evaluate / save job for ``benchmarks/exit_stress.py``, launched by torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/exit_job.py --mode fully_shard --out DIR

A few compiled AdamW steps of a small MLP, an eager evaluation, a checkpoint (replicate:
``torch.save`` of the plain state dicts on rank 0; fully_shard: torch.distributed.checkpoint),
``destroy_process_group``, then each rank's last line ``rank R done, gloo threads left: N``
printed *without* a flush, so a process killed during interpreter teardown loses it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from spmd_compiler import DataParallel, spmd_compile


def train_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("replicate", "fully_shard"), default="fully_shard")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True, help="directory for the checkpoint")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd_compile(DataParallel(args.mode))(train_step)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        step(model, optim, (torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)))
    with torch.no_grad():  # evaluation: the model used eagerly, outside the compiled step
        x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
        val = F.cross_entropy(model(x), y)
        acc = (model(x).argmax(-1) == y).float().mean()
    if args.mode == "replicate":
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict()},
                       os.path.join(args.out, "ckpt.pt"))
        dist.barrier()
    else:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.out, "ckpt"))
    print(f"rank {rank} validation loss {float(val):.4f} accuracy {float(acc):.3f}")
    dist.destroy_process_group()
    # gloo's threads left after destroy_process_group live into interpreter finalization, where
    # one may need the GIL and abort the process (docs/troubleshooting.md); no flush: the line is
    # lost if the process dies at exit
    print(f"rank {rank} done, gloo threads left: {len(_gloo_threads())}")


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if "gloo" in n]


if __name__ == "__main__":
    main()
