"""Compile time by model depth, the program cache, and training with padding-per-batch sequence
lengths against DDP, on Hugging Face GPT-2 built from a tiny GPT2Config (needs ``transformers``;
nothing is downloaded).

    python -m benchmarks.compile_time [--depths 2,6,12,24,48] [--steps 40] [--baseline-src DIR]

- ``explain`` (one process, no process group) of the step at each depth, both modes, with the
  time per compiler stage, and where the trace's time goes (forward / backward / optimizer, and
  the same trace with a static batch size);
- a real first call at world size 2 (trace, compile, agreement, placement and the step itself;
  one rank compiles, the other receives the program), the second call, with every rank's CPU
  seconds, and the first call of a second run that loads the program from the program cache;
- the figures the compile-time goals name: the first call at each depth, the cost of one more
  layer, AdamW's first two calls against one compile, and the CPU seconds of the first call
  summed over the ranks against one rank's;
- 40 steps whose sequence lengths every rank draws on its own (each batch padded to its own
  longest sequence, 8..64), timed with every compile, against DDP, with the final parameters'
  largest difference from DDP's.

``--baseline-src DIR`` also times a checkout of an earlier version (a source tree whose
``spmd_compiler/passes`` resolves, e.g. a symlink to ``../passes``) on the workloads it can run.
Writes the JSON results to a scratch file; ``--write-docs`` writes the checkout's
docs/results/compile_time.json and docs/compile_time.md instead. Time it alone on the machine
(nothing else running): the page records the load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = Path(tempfile.gettempdir()) / "spmd_compiler_benchmarks"
HERE = Path(__file__).resolve()
VOCAB, WIDTH, HEADS, POSITIONS = 1000, 64, 4, 128


# ---------------------------------------------------------------------------------------------
# The workload (imported by the worker processes)


def build(depth: int):
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=depth, n_embd=WIDTH, n_head=HEADS,
                                       vocab_size=VOCAB, n_positions=POSITIONS))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def lm_step(model, optim, ids):
    optim.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optim.step()
    return loss


def tokens(step: int, rank: int, batch: int, length: int):
    import torch

    gen = torch.Generator().manual_seed(10_007 * step + rank)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def padded_length(step: int, rank: int) -> int:
    """The length of a batch padded to its longest sequence: drawn per rank and step."""
    import random

    return random.Random(f"{step}/{rank}").randint(8, 64)


# ---------------------------------------------------------------------------------------------
# Workers (run as ``python benchmarks/compile_time.py --worker ...`` so that ``--baseline-src``
# can put another spmd_compiler first on the path)


_STAMPS: list[float] = [0.0] * 4  # when the recording of _timed_step reached each part


def _stamp(k: int) -> None:
    """Outside the step's own state (the recording refuses a step that changes its state)."""
    _STAMPS[k] = time.perf_counter()


def _timed_step(model, optim, ids):
    _stamp(0)
    optim.zero_grad()
    loss = model(ids, labels=ids).loss
    _stamp(1)
    loss.backward()
    _stamp(2)
    optim.step()
    _stamp(3)
    return loss


def worker_explain(depth: int, mode: str, split: bool) -> dict:
    from spmd_compiler import DataParallel
    from spmd_compiler.api import explain

    model, opt = build(depth)
    ids = tokens(0, 0, 4, 32)
    start, cpu = time.perf_counter(), time.process_time()
    summary = explain(lm_step, model, opt, ids, parallel_mode=DataParallel(mode))
    out = dict(seconds=time.perf_counter() - start, cpu=time.process_time() - cpu,
               stages=dict(summary.compile_times), nodes=summary.num_nodes)
    if split:  # where the trace's time goes, on a warm process
        from spmd_compiler.trace.record import trace_step

        for batch_dim, name in ((0, "symbolic batch"), (None, "static batch")):
            model, opt = build(depth)
            start = time.perf_counter()
            trace_step(_timed_step, (model, opt, ids), {}, batch_dim, fuse_optimizer=True)
            t = _STAMPS
            out[name] = dict(total=time.perf_counter() - start, forward=t[1] - t[0],
                             backward=t[2] - t[1], optimizer=t[3] - t[2])
    return out


def _rank_main(rank: int, world: int, port: int, job: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = (_first_calls if job["kind"] == "first calls" else _lengths_run)(rank, job)
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # interpreter teardown with gloo's threads alive can abort; nothing is left


def _first_calls(rank: int, job: dict) -> dict:
    from spmd_compiler import DataParallel, spmd_compile

    model, opt = build(job["depth"])
    kwargs = {"cache_dir": job["cache_dir"]} if job.get("cache_dir") else {}
    step = spmd_compile(DataParallel(job["mode"]), **kwargs)(lm_step)
    seconds, cpu = [], []
    for i in range(3):
        ids = tokens(i, rank, 4, 32)
        start, cpu_start = time.perf_counter(), time.process_time()
        step(model, opt, ids)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return dict(calls=seconds, cpu=cpu, compiles=step.compile_count,
                hits=getattr(step, "cache_hits", 0))


def _lengths_run(rank: int, job: dict) -> dict:
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, opt = build(job["depth"])
    reference = copy.deepcopy(model)
    mode = job["mode"]
    if mode == "ddp":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = lm_step
    else:
        from spmd_compiler import DataParallel, spmd_compile

        options = dict(job.get("options") or {}, **({"dynamic_dims": 1} if job.get("declared") else {}))
        step = spmd_compile(DataParallel(mode, **options))(lm_step)
    times = []
    torch.manual_seed(1 + rank)  # dropout: the same random stream as the DDP run below
    start = time.perf_counter()
    for i in range(job["steps"]):
        length = job["lengths"][i][rank]
        ids = tokens(i, rank, 4, length)
        t = time.perf_counter()
        step(model, opt, ids)
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    out = dict(total=total, steady_ms=1e3 * statistics.median(times[-10:]),
               compiles=getattr(step, "compile_count", 0))
    if mode != "ddp":  # the same steps under DDP, from the same initial parameters
        ddp = DDP(reference)
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        torch.manual_seed(1 + rank)
        for i in range(job["steps"]):
            lm_step(ddp, ddp_opt, tokens(i, rank, 4, job["lengths"][i][rank]))
        ours = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for n, p in model.named_parameters()}
        out["max_diff"] = max(float((ours[n] - p.detach()).abs().max())
                              for n, p in ddp.module.named_parameters())
    return out


def worker_ranks(job: dict) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(2, port, job, queue), nprocs=2, start_method="spawn")
    results = sorted(queue.get() for _ in range(2))
    out = results[0][1]  # rank 0's, with every rank's CPU seconds per call
    out["cpu_by_rank"] = [r.get("cpu") for _, r in results]
    return out


# ---------------------------------------------------------------------------------------------
# The parent


def _run_worker(kind: str, payload: dict, src: str | None) -> dict | None:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT)])
    cmd = [sys.executable, str(HERE), "--worker", kind, "--payload", json.dumps(payload)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(f"  {kind} {payload} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])


def _load_average() -> float:
    return os.getloadavg()[0]


def measure(args) -> dict:
    depths = [int(d) for d in args.depths.split(",")]
    modes = ["replicate", "fully_shard"]
    sources = [("after", None)] + ([("before", args.baseline_src)] if args.baseline_src else [])
    results: dict = dict(load_start=_load_average(), explain={}, first_calls={}, lengths={})
    # Rounds interleave the versions, so load that comes and goes hits both alike; the fastest
    # round of each is kept.
    for round_ in range(args.rounds):
        for depth in depths:
            for mode in modes:
                for version, src in sources:
                    split = (version == "after" and depth == max(depths) and mode == "replicate"
                             and round_ == 0)
                    r = _run_worker("explain", dict(depth=depth, mode=mode, split=split), src)
                    key = f"{version}/{depth}/{mode}"
                    best = results["explain"].get(key)
                    if r and best:
                        r = dict(best, **{k: r[k] for k in ("seconds", "cpu", "stages")}) \
                            if r["cpu"] < best["cpu"] else best
                    results["explain"][key] = r or best
                    print(f"explain round {round_} {version} depth {depth} {mode}: "
                          f"{r and round(r['seconds'], 2)} s", flush=True)
    for depth in depths:
        for mode in modes:
            with tempfile.TemporaryDirectory() as cache:
                runs = {}
                for run in ("first run", "second run"):
                    runs[run] = _run_worker("ranks", dict(kind="first calls", depth=depth,
                                                          mode=mode, cache_dir=cache), None)
                results["first_calls"][f"{depth}/{mode}"] = runs
                print(f"first calls depth {depth} {mode}: {runs}", flush=True)
            if args.baseline_src:  # no cache: the calls that compile
                before = _run_worker("ranks", dict(kind="first calls", depth=depth, mode=mode),
                                     args.baseline_src)
                results.setdefault("first_calls_before", {})[f"{depth}/{mode}"] = before
                print(f"first calls before depth {depth} {mode}: {before}", flush=True)
    lengths = [[padded_length(i, r) for r in range(2)] for i in range(args.steps)]
    equal = [[padded_length(i, 0)] * 2 for i in range(args.steps)]
    runs = [("ddp", "ddp", lengths, False, None), ("spmd replicate", "replicate", lengths, False, None),
            ("spmd replicate, dynamic_dims=1", "replicate", lengths, True, None),
            ("spmd fully_shard", "fully_shard", lengths, False, None)]
    runs.append(("spmd replicate, fuse_optimizer=False (DDP's AdamW kernel)", "replicate", lengths,
                 False, None, {"fuse_optimizer": False}))
    if args.baseline_src:  # ranks with different lengths raised before; same lengths on all
        runs.append(("before: spmd replicate, equal lengths on both ranks", "replicate", equal,
                     False, args.baseline_src))
        runs.append(("after: spmd replicate, equal lengths on both ranks", "replicate", equal,
                     False, None))
    for name, mode, per_step, declared, src, *options in runs:
        r = _run_worker("ranks", dict(kind="lengths", depth=2, mode=mode, steps=args.steps,
                                      lengths=per_step, declared=declared,
                                      options=options[0] if options else None), src)
        results["lengths"][name] = r
        print(f"lengths {name}: {r}", flush=True)
    results["length_draws"] = lengths
    results["load_end"] = _load_average()
    return results


# ---------------------------------------------------------------------------------------------
# The page


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(res: dict, cfg: dict) -> str:
    from benchmarks.stale import measured_at

    depths = [int(d) for d in cfg["depths"].split(",")]
    has_before = any(k.startswith("before/") for k in res["explain"])
    lines = [
        "# Compile time and variable sequence lengths",
        "",
        "Generated by `python -m benchmarks.compile_time --write-docs` "
        f"(`{cfg['command']}`); do not edit by hand. See docs/benchmarks.md for step times.",
        "",
        f"- Date (UTC): {cfg['date']}; {measured_at(cfg.get('source') or cfg)}; {cfg['machine']}",
        f"- 1-minute load average at start / end: {res['load_start']:.1f} / {res['load_end']:.1f} "
        "(other processes on the 2 cores inflate every time here)",
        f"- Model: Hugging Face GPT2LMHeadModel from GPT2Config(n_layer=depth, n_embd={WIDTH}, "
        f"n_head={HEADS}, vocab_size={VOCAB}, n_positions={POSITIONS}), AdamW, 4 sequences per "
        "rank, loss `model(ids, labels=ids).loss`",
        "",
        "## Compile time by depth",
        "",
        "`explain` of the step (trace, analysis, expansion, optimization passes, lowering; one "
        "process, first compile in a fresh process), wall seconds with the process's CPU seconds "
        f"in parentheses, the fastest of {cfg['rounds']} rounds that alternate the versions "
        "(other load on the 2 cores inflates both)"
        + (", before (the baseline source) and after:" if has_before else ":"),
        "",
    ]
    head = ["depth", "nodes"] + [f"{m} {v} s" for m in ("replicate", "fully_shard")
                                 for v in (("before", "after") if has_before else ("after",))]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in depths:
        row = [str(d), str((res["explain"].get(f"after/{d}/replicate") or {}).get("nodes", "-"))]
        for m in ("replicate", "fully_shard"):
            for v in (("before", "after") if has_before else ("after",)):
                r = res["explain"].get(f"{v}/{d}/{m}")
                row.append("-" if not r else f"{r['seconds']:.1f} ({r['cpu']:.1f})")
        lines.append("| " + " | ".join(row) + " |")
    deepest = max(depths)
    r = res["explain"].get(f"after/{deepest}/replicate")
    if r:
        lines += ["", f"Where the time goes at depth {deepest} (replicate), seconds per stage:", "",
                  "| " + " | ".join(r["stages"]) + " |", "|" + "---|" * len(r["stages"]),
                  "| " + " | ".join(_fmt(v, 2) for v in r["stages"].values()) + " |"]
        split = [(k, r[k]) for k in ("symbolic batch", "static batch") if k in r]
        if split:
            lines += ["", "Inside the trace (make_fx over fake tensors, warm process):", "",
                      "| batch size | trace s | forward s | backward s | optimizer s |",
                      "|---|---|---|---|---|"]
            lines += [f"| {k} | {_fmt(v['total'], 2)} | {_fmt(v['forward'], 2)} | "
                      f"{_fmt(v['backward'], 2)} | {_fmt(v['optimizer'], 2)} |" for k, v in split]
    lines += ["", "## First calls at world size 2, and the program cache", "",
              "Seconds per call on rank 0 (2 ranks, one core each), CPU seconds of rank 0 in "
              "parentheses. Call 1 compiles (rank 0 builds the program, rank 1 receives it; "
              "AdamW's state is made before recording, so it is the steady program), calls 2 and "
              "3 run it. The second run is a new pair of processes with the same `cache_dir`: "
              "the program loads from disk.", "",
              "| depth | mode | run 1: call 1 | call 2 | call 3 | run 2 (cache): call 1 | call 2 | "
              "call 3 | loaded |", "|---|---|---|---|---|---|---|---|---|"]
    for d in depths:
        for m in ("replicate", "fully_shard"):
            runs = res["first_calls"].get(f"{d}/{m}") or {}
            a, b = runs.get("first run"), runs.get("second run")
            calls = [f"{w:.2f} ({c:.2f})" for w, c in zip(a["calls"], a["cpu"])] if a else ["-"] * 3
            calls += [f"{w:.2f} ({c:.2f})" for w, c in zip(b["calls"], b["cpu"])] if b else ["-"] * 3
            loaded = f"{b['hits']}/{b['compiles']}" if b else "-"
            lines.append(f"| {d} | {m} | " + " | ".join(calls) + f" | {loaded} |")
    before = res.get("first_calls_before") or {}
    if before:
        lines += ["", "The same first calls with the baseline source (no cache), for comparison:", "",
                  "| depth | mode | before: call 1 | call 2 | call 3 | after: call 1 | call 2 | call 3 |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in depths:
            for m in ("replicate", "fully_shard"):
                b, a = before.get(f"{d}/{m}"), (res["first_calls"].get(f"{d}/{m}") or {}).get("first run")
                calls = [f"{w:.2f} ({c:.2f})" for w, c in zip(b["calls"], b["cpu"])] if b else ["-"] * 3
                calls += [f"{w:.2f} ({c:.2f})" for w, c in zip(a["calls"], a["cpu"])] if a else ["-"] * 3
                lines.append(f"| {d} | {m} | " + " | ".join(calls) + " |")
    lines += goals(res, depths)
    lines += ["", "## Padding-per-batch lengths against DDP", "",
              f"{cfg['steps']} steps of the depth-2 model; every rank pads each of its batches to "
              "its own longest sequence, so lengths change every step and differ across ranks "
              "(drawn from 8..64). Total time includes every compile; the steady step is the "
              "median of the last 10 steps (where every new length compiles, so is it). max |diff| is the largest difference of any final "
              "parameter from DDP trained on the same batches (with dropout drawn from the same "
              "seed); with `fuse_optimizer=False` the step runs the AdamW kernel DDP runs, and "
              "the fused kernel's round-off is the only difference.", "",
              "| run | total s | compiles | steady step ms | max abs diff vs DDP |",
              "|---|---|---|---|---|"]
    for name, r in res["lengths"].items():
        if r is None:
            lines.append(f"| {name} | failed | | | |")
            continue
        diff = "-" if "max_diff" not in r else f"{r['max_diff']:.1e}"
        compiles = "-" if name == "ddp" else r["compiles"]
        lines.append(f"| {name} | {_fmt(r['total'])} | {compiles} | {_fmt(r['steady_ms'])} | {diff} |")
    lines += ["", "Lengths drawn (rank 0, rank 1) per step: "
              + ", ".join(f"({a}, {b})" for a, b in res["length_draws"]) + ".", ""]
    return "\n".join(lines)


def goals(res: dict, depths: list[int]) -> list[str]:
    """The figures the compile-time goals name, from the measurements above."""
    lines = ["", "## The goals' figures", "",
             "| figure | replicate | fully_shard | goal |", "|---|---|---|---|"]

    def row(name, goal, fn):
        cells = []
        for m in ("replicate", "fully_shard"):
            try:
                cells.append(fn(m))
            except (KeyError, TypeError, IndexError, ZeroDivisionError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {goal} |")

    def first(d, m):
        return (res["first_calls"][f"{d}/{m}"] or {}).get("first run")

    for d, goal in ((24, "3 s"), (48, "4 s")):
        if d in depths:
            row(f"{d} layers: first call, s (CPU s, rank 0)", goal,
                lambda m, d=d: f"{first(d, m)['calls'][0]:.2f} ({first(d, m)['cpu'][0]:.2f})")
    if len(depths) > 1:
        a, b = sorted(depths)[-2:]

        def per_layer(m):
            lo, hi = res["explain"][f"after/{a}/{m}"], res["explain"][f"after/{b}/{m}"]
            return (f"{1e3 * (hi['seconds'] - lo['seconds']) / (b - a):.0f} "
                    f"({1e3 * (hi['cpu'] - lo['cpu']) / (b - a):.0f})")

        row(f"one more layer, ms (CPU ms): compile at {b} minus at {a} layers, per layer",
            "50 ms", per_layer)
    for d in depths:
        row(f"{d} layers: AdamW's first two calls at world size 2 / one compile (explain, one "
            f"process), wall (CPU)", "1.2",
            lambda m, d=d: "{:.2f} ({:.2f})".format(
                sum(first(d, m)["calls"][:2]) / res["explain"][f"after/{d}/{m}"]["seconds"],
                sum(first(d, m)["cpu"][:2]) / res["explain"][f"after/{d}/{m}"]["cpu"]))
        row(f"{d} layers: CPU s of call 1 summed over the 2 ranks / rank 0's", "1.3",
            lambda m, d=d: "{:.2f} ({:.2f} / {:.2f})".format(
                sum(c[0] for c in first(d, m)["cpu_by_rank"]) / first(d, m)["cpu_by_rank"][0][0],
                sum(c[0] for c in first(d, m)["cpu_by_rank"]), first(d, m)["cpu_by_rank"][0][0]))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,6,12,24,48")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument("--rounds", type=int, default=3, help="explain runs per figure (fastest kept)")
    parser.add_argument("--json", default=None,
                        help=f"results file (default: {SCRATCH / 'compile_time.json'}; with "
                             f"--write-docs or --render: docs/results/compile_time.json in the checkout)")
    parser.add_argument("--md", default=None, help="page to write (default: none; with --write-docs "
                                                   "or --render: docs/compile_time.md in the checkout)")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the checkout's results file and page (a run to publish, on a "
                             "quiet machine)")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the page from the JSON file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--payload", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        payload = json.loads(args.payload)
        result = worker_explain(**payload) if args.worker == "explain" else worker_ranks(payload)
        print("RESULT " + json.dumps(result), flush=True)
        return
    checkout = args.write_docs or args.render
    args.json = args.json or str(ROOT / "docs" / "results" / "compile_time.json" if checkout
                                 else SCRATCH / "compile_time.json")
    args.md = args.md or (str(ROOT / "docs" / "compile_time.md") if checkout else None)
    if args.render:
        data = json.loads(Path(args.json).read_text())
        Path(args.md).write_text(markdown(data["results"], data["config"]))
        return
    from benchmarks.stale import source_revision

    source = source_revision()
    cfg = dict(depths=args.depths, steps=args.steps, commit=source["commit"], source=source,
               rounds=args.rounds,
               command="python -m benchmarks.compile_time " + " ".join(argv or sys.argv[1:]),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
               machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"Python {platform.python_version()}")
    res = measure(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(config=cfg, results=res), indent=1))
    print("\n".join(markdown(res, cfg).splitlines()[4:]))
    print(f"results: {args.json}")
    if args.md:
        Path(args.md).write_text(markdown(res, cfg))
        print(f"docs: {args.md}")


if __name__ == "__main__":
    if str(ROOT) not in sys.path and not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, str(ROOT))
    main()
