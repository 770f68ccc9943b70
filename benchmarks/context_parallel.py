"""Context parallelism per rank: the in-step activation peak and the step time at cp = 1, 2, 4.

A causal language model (token and learned position embeddings, pre-norm blocks with
``scaled_dot_product_attention(is_causal=True)``, AdamW) trains on one long sequence. cp = 1 is
one rank without context parallelism (``DataParallel("replicate")`` on a world of one); cp = n
is n ranks on a ``("dp", "cp")`` mesh of shape ``(1, n)`` with ``input_seq_dim=1``, each rank
passing the whole sequence. Fresh processes per cp, one thread each, gloo on 127.0.0.1.

The activation peak is the measured peak of the allocator's live bytes in a step minus the
model's and optimizer's state (spmd_compiler.memory.measure_step_memory; the temporaries the
compiler keeps in its workspace count as activations); the step time is the median of the
timed steps on rank 0.

    python -m benchmarks.context_parallel                 # prints the table
    python -m benchmarks.context_parallel --write-docs    # docs/context_parallel_figures.md
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

from .run import machine
from .stale import measured_at, source_revision

PAGE = "docs/context_parallel_figures.md"
MIB = 2**20


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(
            2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def train_step(model, optim, ids, targets):
    optim.zero_grad()
    logits = model(ids)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    optim.step()
    return loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", default="1,2,4", help="cp sizes, comma-separated")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--write-docs", action="store_true", help=f"write {PAGE}")
    return p.parse_args(argv)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.memory import measure_step_memory

    torch.manual_seed(0)
    model = CausalLM(args.vocab, args.width, args.heads, args.layers, args.seq)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if world == 1:
        step = spmd_compile(DataParallel("replicate"))(train_step)
    else:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
        step = spmd_compile(DataParallel("replicate", input_seq_dim=1), mesh=mesh)(train_step)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    start = time.perf_counter()
    step(model, optim, ids, targets)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(model, optim, ids, targets)
        times.append(time.perf_counter() - start)
    report = measure_step_memory(lambda: step(model, optim, ids, targets), model, [optim])
    # the model's and optimizer's state; the step's temporaries count as activations, also those
    # the compiler places in its workspace (passes/memory_plan.py)
    state = report.live_between_steps - report.workspace
    if rank == 0:
        out.put(dict(cp=world, first_call_s=compile_s, step_s=statistics.median(times),
                     activation_peak=report.peak_in_step - state, peak_in_step=report.peak_in_step,
                     live=state))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    rows = []
    for cp in (int(c) for c in args.cp.split(",")):
        out = ctx.Queue()
        mp.start_processes(_worker, args=(cp, _free_port(), args, out), nprocs=cp,
                           start_method="spawn")
        rows.append(out.get())
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, argv: list[str], before: dict) -> str:
    base = next((r for r in rows if r["cp"] == 1), rows[0])
    table = [[r["cp"], f"{r['activation_peak'] / MIB:.1f}",
              f"{r['activation_peak'] / base['activation_peak']:.2f}",
              f"{r['live'] / MIB:.1f}", f"{1000 * r['step_s']:.0f}",
              f"{r['step_s'] / base['step_s']:.2f}", f"{r['first_call_s']:.1f}"] for r in rows]
    after = os.getloadavg()[0]
    return "\n".join([
        "# Context parallelism: memory and time per rank",
        "",
        f"Generated by `python -m benchmarks.context_parallel --write-docs` (`python -m "
        f"benchmarks.context_parallel {' '.join(argv)}`); do not edit by hand. See "
        f"docs/context_parallel.md for the feature.",
        "",
        f"- Date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}; "
        f"{measured_at(source_revision())}; {before['platform']}",
        f"- 1-minute load average at start / end: {before['load_average']:.1f} / {after:.1f} "
        f"(cp ranks share the machine's 2 cores: at cp = 4 two ranks run on each core)",
        f"- Model: causal LM, {args.layers} layers, width {args.width}, {args.heads} heads, "
        f"vocab {args.vocab}, learned positions, `scaled_dot_product_attention(is_causal=True)`, "
        f"AdamW; {args.batch} sequence(s) of {args.seq} tokens",
        "",
        tabulate(table, headers=["cp", "activation peak MiB (per rank)", "vs cp=1",
                                 "state MiB", "step ms (rank 0)", "vs cp=1", "first call s"],
                 tablefmt="github"),
        "",
    ])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    m = machine()
    before = dict(platform=f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}",
                  load_average=m["load_average_start"])
    rows = measure(args)
    text = markdown(rows, args, [a for a in argv if a != "--write-docs"], before)
    print(text)
    if args.write_docs:
        Path(__file__).resolve().parents[1].joinpath(PAGE).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
