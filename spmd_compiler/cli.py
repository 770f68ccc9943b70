"""Command line: ``python -m spmd_compiler demo`` (also the ``spmd-compiler`` console script).

Lives outside ``__main__`` so that spawned ranks can import the worker function."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoMLP(torch.nn.Module):
    """The acceptance tests' SimpleMLP: Linear(50, 32) -> ReLU -> Linear(32, 8) -> sigmoid."""

    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(50, 32)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return torch.sigmoid(self.net2(self.relu(self.net1(x))))


def demo_train_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    return loss


def _demo_rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        report = []
        for style in args.modes:
            torch.manual_seed(0)
            model = DemoMLP()
            ddp = DDP(copy.deepcopy(model))
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
            ddp_opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
            dump = os.path.join(args.dump_dir, style) if args.dump_dir else None
            step = spmd_compile(DataParallel(style), dump_dir=dump, verify=args.verify)(demo_train_step)
            gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
            worst = 0.0
            for i in range(args.steps):
                batch = (torch.randn(args.batch, 50, generator=gen), torch.rand(args.batch, 8, generator=gen))
                loss = step(model, opt, batch)
                if i == 0:
                    first_compile = step.last_compile_seconds
                ref = demo_train_step(ddp, ddp_opt, batch)
                diff = max(
                    (p.full_tensor() - q).abs().max().item()
                    for p, q in zip(model.parameters(), ddp.parameters())
                )
                worst = max(worst, diff)
                if rank == 0 and (i == 0 or (i + 1) % max(1, args.steps // 5) == 0):
                    print(f"[{style}] step {i + 1:3d}  loss {loss.item():.5f}  "
                          f"DDP loss {ref.item():.5f}  max |param - DDP| {diff:.2e}", flush=True)
            report.append((style, worst, first_compile, step))
        if rank == 0:
            results.put([(s, w, c, step.verification.checked if step.verification else 0)
                         for s, w, c, step in report])
            from .api import summary_text

            for style, _, _, step in report:
                text = summary_text(step)
                if text:
                    print(f"\n== {style}: compiled step summary (rank 0) ==\n{text}")
    finally:
        dist.destroy_process_group()


def demo(args: argparse.Namespace) -> int:
    """Spawn local gloo ranks, train the demo model with each mode next to DDP, report parity."""
    if args.dump_dir is None:
        args.dump_dir = tempfile.mkdtemp(prefix="spmd_demo_")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    print(f"spmd_compiler demo: {args.world_size} gloo ranks on 127.0.0.1, modes {', '.join(args.modes)}, "
          f"{args.steps} steps, local batch {args.batch}, Adam lr={args.lr}", flush=True)
    procs = [ctx.Process(target=_demo_rank, args=(r, args.world_size, port, args, results))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs) or results.empty():
        print("demo FAILED: a rank exited with an error (see above)", file=sys.stderr)
        return 1
    ok = True
    print("\nresult:")
    for style, worst, compile_s, checked in results.get():
        passed = worst <= args.tolerance
        ok &= passed
        print(f"  {style:12s} max |param - DDP| over {args.steps} steps = {worst:.2e} "
              f"(tolerance {args.tolerance:.0e}) -> {'OK' if passed else 'MISMATCH'}; "
              f"first compile {compile_s:.2f}s; {checked} calls verified against the eager "
              f"reference (verify={args.verify})")
    print(f"graph dumps: {args.dump_dir}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spmd_compiler", description="spmd_compiler command line")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on local gloo ranks and check it against DDP")
    d.add_argument("--world-size", type=int, default=2, help="number of local gloo ranks (default 2)")
    d.add_argument("--steps", type=int, default=20, help="training steps per mode (default 20)")
    d.add_argument("--batch", type=int, default=32, help="local batch size per rank (default 32)")
    d.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    d.add_argument("--modes", nargs="+", default=["replicate", "fully_shard"], choices=["replicate", "fully_shard"],
                   help="parallel styles to run (default: both)")
    d.add_argument("--verify", type=int, default=2,
                   help="check the first N calls against the step run eagerly with DDP's "
                        "semantics (spmd_compile(verify=N); default 2, 0: off)")
    d.add_argument("--dump-dir", default=None,
                   help="folder for per-stage graph dumps (default: a new temporary folder)")
    d.add_argument("--tolerance", type=float, default=1e-5,
                   help="max allowed |param - DDP param| (default 1e-5)")
    e = sub.add_parser(
        "explain", help="compile a step without running it and print what the compiler did (no "
                        "processes, no training): the demo model's, or your own",
        description="Compile a training step as its first call would and print the summary a "
                    "real run prints. STEP is path/to/file.py:train_step or package.module:train_step; "
                    "the file (or module) also defines explain_args() (or the function --args "
                    "names) returning the step's positional arguments, e.g. (model, optim, batch). "
                    "Without STEP: the demo model's step.")
    e.add_argument("step", nargs="?", default=None,
                   help="the step to explain: FILE.py:FUNCTION or MODULE:FUNCTION (default: the demo's)")
    e.add_argument("--args", default="explain_args",
                   help="the function next to the step returning its arguments (default explain_args)")
    e.add_argument("--mode", default=None,
                   choices=["replicate", "fully_shard", "hybrid_shard"],
                   help="parallel style (default: the step's own if it is spmd_compile'd, else "
                        "fully_shard; hybrid_shard on a (world // 2, 2) mesh)")
    e.add_argument("--world-size", type=int, default=2, help="world size to compile for (default 2)")
    e.add_argument("--batch", type=int, default=32, help="the demo's local batch size (default 32)")
    e.add_argument("--dump-dir", default=None, help="also write every stage's graph and the summary here")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    from .errors import SPMDError

    try:
        return explain_demo(args)
    except SPMDError as e:
        print(f"spmd_compiler explain: {e}", file=sys.stderr)
        return 2


def load_step(spec: str, args_name: str = "explain_args"):
    """(the step function, its arguments) from ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``; the
    arguments are what the file's ``args_name()`` returns (a tuple, or one value)."""
    import importlib
    import importlib.util

    from .errors import SPMDError

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise SPMDError(f"explain takes FILE.py:FUNCTION or MODULE:FUNCTION, got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise SPMDError(f"explain: no file {where!r}")
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        module_spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(module_spec.name, module)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    for attr in (name, args_name):
        if not callable(getattr(module, attr, None)):
            raise SPMDError(
                f"explain: {where} defines no function {attr!r}"
                + ("" if attr == name else f" (it returns the arguments of {name}, e.g. "
                   f"(model, optim, batch); see docs/observability.md)"))
    step_args = getattr(module, args_name)()
    return getattr(module, name), step_args if isinstance(step_args, tuple) else (step_args,)


def explain_demo(args: argparse.Namespace) -> int:
    """Print the summary of a step (the demo's, or ``args.step``) compiled for ``args.mode`` at
    ``args.world_size``."""
    from spmd_compiler import DataParallel, explain
    from spmd_compiler.api import CompiledStep

    if args.step:
        fn, step_args = load_step(args.step, args.args)
        what = args.step
    else:
        model = DemoMLP()
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        fn, step_args = demo_train_step, (model, optim, (torch.randn(args.batch, 50), torch.rand(args.batch, 8)))
        what = f"the demo step, local batch {args.batch}"
    if isinstance(fn, CompiledStep):
        mode = DataParallel(args.mode) if args.mode else fn.parallel_mode
        fn = fn if not args.mode else fn.fn
    else:
        mode = DataParallel(args.mode or "fully_shard")
    summary = explain(fn, *step_args, parallel_mode=mode, world_size=args.world_size,
                      dump_dir=args.dump_dir)
    print(f"{what}, DataParallel({mode.parallel_style!r}):\n")
    print(summary.to_text())
    if args.dump_dir:
        print(f"\ngraph dumps: {args.dump_dir}")
    return 0
