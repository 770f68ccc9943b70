"""Train a classifier with spmd_compiler under torchrun: the loop of a real job.

    torchrun --nproc-per-node 2 examples/train.py --mode fully_shard --steps 300

A DataLoader with a DistributedSampler, AdamW with warmup + cosine learning-rate schedule,
gradient clipping inside the compiled step, a validation loop between steps (the model used
eagerly, outside the compiled step), logging of loss, learning rate, gradient norm and
throughput, and checkpoints with torch.distributed.checkpoint that a restarted job resumes from
(``--ckpt-dir``; torchrun's ``--max-restarts`` restarts it after a failure). The same script
runs on CPU (gloo) and on CUDA (NCCL, one GPU per process): the backend follows the device.

``--mode hybrid_shard`` shards within a node and replicates across nodes (a 2-D mesh of
nodes x processes per node, from torchrun's environment):

    torchrun --nnodes 2 --nproc-per-node 8 ... examples/train.py --mode hybrid_shard

``--mode ddp`` / ``--mode fsdp2`` run the same loop with torch's DistributedDataParallel and
FSDP2 (``fully_shard``) instead of the compiled step, to compare results and speed.

The data is a synthetic classification task made from ``--seed`` (random inputs labelled by a
fixed random "teacher" network), so the script needs no download. The model has no dropout, so
a resumed run repeats the uninterrupted one exactly; with dropout, also save each rank's RNG
state.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import time
from itertools import islice

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from spmd_compiler import DataParallel, spmd_compile, unsharded


# -- model and data ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_datasets(sizes: list[int], features: int, classes: int, seed: int) -> list[TensorDataset]:
    """Splits of Gaussian inputs labelled by one random two-layer teacher network (the same on
    every rank)."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(features, 64, generator=gen) / math.sqrt(features)
    w2 = torch.randn(64, classes, generator=gen) / 8.0
    splits = []
    for n in sizes:
        x = torch.randn(n, features, generator=gen)
        splits.append(TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)))
    return splits


# -- the training step: written for one device --------------------------------------------------


def train_step(model, optim, batch, max_norm: float):
    optim.zero_grad()
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optim.step()
    return loss, grad_norm


def explain_args():
    """The arguments ``python -m spmd_compiler explain examples/train.py:train_step`` compiles
    the step with: this script's model, optimizer and one local batch at its default options."""
    args = parse_args([])
    model = Classifier(args.features, args.width, args.depth, args.classes)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    batch = (torch.randn(args.batch_size, args.features),
             torch.randint(0, args.classes, (args.batch_size,)))
    return model, optim, batch, args.max_norm


# -- the job ----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", default="fully_shard", choices=["replicate", "fully_shard", "hybrid_shard", "ddp", "fsdp2"],
                   help="spmd_compiler's DataParallel style, or torch's DDP / FSDP2 for comparison")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=64, help="local batch size per rank")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--width", type=int, default=128, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=2, help="hidden layers of the MLP")
    p.add_argument("--features", type=int, default=32, help="input features of the synthetic data")
    p.add_argument("--classes", type=int, default=10, help="classes of the synthetic data")
    p.add_argument("--train-size", type=int, default=8192, help="training samples (all ranks together)")
    p.add_argument("--val-size", type=int, default=1024, help="validation samples")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the data and the initial model (the same on every rank)")
    p.add_argument("--log-every", type=int, default=20, help="log loss and throughput every N steps")
    p.add_argument("--eval-every", type=int, default=100, help="validate every N steps (and at the end)")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here; resume from the latest one")
    p.add_argument("--ckpt-every", type=int, default=100, help="save a checkpoint every N steps (with --ckpt-dir)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA (NCCL) when available, else CPU (gloo)")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="for trying out resuming: the last rank kills itself (SIGKILL) after this "
                        "step, in the first attempt only (TORCHELASTIC_RESTART_COUNT=0)")
    return p.parse_args(argv)


def setup(device: str) -> torch.device:
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1 for several processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    return torch.device("cpu")


def lr_schedule(warmup: int, total: int):
    """Linear warmup, then cosine decay to 10% of the peak."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last)."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    done = sorted(d for d in os.listdir(ckpt_dir)
                  if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata")))
    return os.path.join(ckpt_dir, done[-1]) if done else None


def save_checkpoint(ckpt_dir: str, step: int, model, optim, sched) -> None:
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "train": {"step": step, "sched": sched.state_dict()}}
    dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, f"step_{step:07d}"))


def load_checkpoint(path: str, model, optim, sched) -> int:
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "train": {"step": 0, "sched": sched.state_dict()}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["train"]["sched"])
    return int(state["train"]["step"])


def evaluate(model, loader, device, mode: str) -> tuple[float, float]:
    """Mean loss and accuracy over the validation set (every rank its share, then summed)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    # unsharded: gather a fully_shard model's parameters once for the whole loop (every rank
    # runs it); without it each model(x) gathers them itself.
    spmd = mode in ("replicate", "fully_shard", "hybrid_shard")
    whole = unsharded(model) if spmd else contextlib.nullcontext()
    with torch.no_grad(), whole:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            totals += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(),
                                   (logits.argmax(1) == y).sum().double(),
                                   torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main(argv=None) -> None:
    args = parse_args(argv)
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    torch.manual_seed(args.seed)  # the same initial model everywhere (rank 0's wins anyway)
    model = Classifier(args.features, args.width, args.depth, args.classes).to(device)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif args.mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_schedule(args.warmup, args.steps))
    if args.mode in ("replicate", "fully_shard"):
        step_fn = spmd_compile(DataParallel(args.mode))(train_step)
    elif args.mode == "hybrid_shard":  # shard within a node, replicate across nodes
        from torch.distributed.device_mesh import init_device_mesh

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mesh = init_device_mesh(device.type, (world // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))
        step_fn = spmd_compile(DataParallel("hybrid_shard"), mesh=mesh)(train_step)
    else:
        step_fn = train_step

    train_set, val_set = make_datasets([args.train_size, args.val_size], args.features,
                                       args.classes, args.seed)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    val_loader = DataLoader(val_set, batch_size=256,
                            sampler=DistributedSampler(val_set, shuffle=False))
    per_epoch = len(loader)
    if per_epoch == 0:
        raise SystemExit(f"--train-size {args.train_size} gives no full batch of {args.batch_size} "
                         f"on each of {world} ranks")

    step = 0
    resume = latest_checkpoint(args.ckpt_dir)
    if resume:
        step = load_checkpoint(resume, model, optim, sched)
        log(f"resumed from {resume} at step {step}")
    if step >= args.steps:
        log(f"nothing to do: the run in {args.ckpt_dir} already finished {step} of --steps "
            f"{args.steps} (a larger --steps continues it, another --ckpt-dir starts afresh)")
        del model
        dist.destroy_process_group()
        return
    log(f"{args.mode} on {world} {device.type} rank(s) ({dist.get_backend()}), {args.steps} steps, "
        f"global batch {args.batch_size * world}, {per_epoch} steps per epoch")

    losses, window_start, window_steps = [], time.perf_counter(), 0
    while step < args.steps:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)  # the same order as an uninterrupted run
        for x, y in islice(loader, skip, None):
            batch = (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            loss, grad_norm = step_fn(model, optim, batch, args.max_norm)
            sched.step()
            step += 1
            losses.append(loss.detach())
            window_steps += 1
            if step % args.log_every == 0 or step == args.steps:
                mean_loss = torch.stack(losses).mean()
                dist.all_reduce(mean_loss)
                norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                seconds = time.perf_counter() - window_start
                log(f"step {step:6d}  loss {mean_loss.item() / world:.4f}  "
                    f"lr {sched.get_last_lr()[0]:.2e}  grad_norm {norm.item():.3f}  "
                    f"{window_steps * args.batch_size * world / seconds:,.0f} samples/s")
                losses, window_start, window_steps = [], time.perf_counter(), 0
            paused = time.perf_counter()  # validation and checkpoints don't count as training
            if step % args.eval_every == 0 or step == args.steps:
                val_loss, val_acc = evaluate(model, val_loader, device, args.mode)
                log(f"step {step:6d}  validation loss {val_loss:.4f}  accuracy {val_acc:.3f}")
            if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps):
                save_checkpoint(args.ckpt_dir, step, model, optim, sched)
                log(f"step {step:6d}  saved checkpoint {args.ckpt_dir}/step_{step:07d}")
            window_start += time.perf_counter() - paused
            if (step == args.crash_at_step and rank == world - 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                print(f"rank {rank}: killing myself after step {step} (--crash-at-step)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.steps:
                break
    del model  # torch 2.13: a DDP model freed after its gloo group was destroyed can hang at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
