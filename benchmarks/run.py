"""Benchmark spmd_compiler against eager DDP and FSDP2, with the lower bound, in one run.

Every (model, mode) runs on WORLD_SIZE fresh gloo ranks on 127.0.0.1 with one thread each.
Prints one line per finished job, then a table, and writes the JSON results to a scratch file
(``--out`` names another). ``--write-docs`` writes the checkout's docs/results/results.json,
docs/benchmarks.md and the chart (when matplotlib is installed) instead: a run to publish, on a
quiet machine. Runs from any directory (the checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .stale import source_revision
from .models import MODELS, param_count
from .modes import ABLATIONS, VARIANTS, ablation_run, all_modes
from .report import progress_line, ratio_table, table, write_docs
from .results import add_comparisons, shared_core_bound, summarize
from .worker import Job, launch

ROOT = Path(__file__).resolve().parents[1]  # the checkout
SCRATCH = Path(tempfile.gettempdir()) / "spmd_compiler_benchmarks"


def add_output_options(parser: argparse.ArgumentParser, results: str, page: str) -> None:
    """``--out``, ``--md`` and ``--write-docs`` for a benchmark whose published results are
    ``results`` and ``page`` (paths in the checkout)."""
    parser.add_argument("--out", default=None,
                        help=f"JSON results file (default: {SCRATCH / Path(results).name}; with "
                             f"--write-docs: {results} in the checkout)")
    parser.add_argument("--md", default=None,
                        help=f"markdown page to write (default: none; with --write-docs: {page} "
                             f"in the checkout)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write {results} and {page} in the checkout (to publish a run "
                             f"made on a quiet machine)")


def output_paths(args: argparse.Namespace, results: str, page: str) -> None:
    """Set ``args.out`` and ``args.md`` as add_output_options' options say (``args.md`` None:
    no page)."""
    if args.out is None:
        args.out = str(ROOT / results if args.write_docs else SCRATCH / Path(results).name)
    if args.md is None and args.write_docs:
        args.md = str(ROOT / page)


def _csv(choices: dict):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    modes = all_modes()
    default_modes = [name for name, m in modes.items() if m.ablation is None and m.variant is None]
    ablations = {m.ablation for m in modes.values()}
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="models:\n"
        + "".join(f"  {k:<18} {v.description}\n" for k, v in MODELS.items())
        + "modes:\n"
        + "".join(f"  {k:<18} {modes[k].description}\n" for k in default_modes)
        + "ablations (not run by default; select SPMD_MODE-ABLATION, e.g. "
        "spmd_replicate-no_bucketing):\n"
        + "".join(f"  {k:<18} {v.description}\n" for k, v in ABLATIONS.items() if k in ablations)
        + "variants (not run by default; select SPMD_MODE-VARIANT, e.g. "
        "spmd_fully_shard-meta_init):\n"
        + "".join(f"  {k:<18} {v.description}\n" for k, v in VARIANTS.items()),
    )
    parser.add_argument(
        "--models",
        type=_csv(MODELS),
        default=[name for name, spec in MODELS.items() if spec.speed],
        help="comma-separated models to run (default: all but the memory workloads, which "
        "python -m benchmarks.memory runs)",
    )
    parser.add_argument(
        "--modes",
        type=_csv(modes),
        default=default_modes,
        help="comma-separated modes to run (default: all but the ablation modes; ddp is the "
        "parity/ratio baseline, compute and comm form the lower bound)",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also run, for every spmd mode selected, its ablation modes (one pass off in "
        "each) whose pass has work to do in its style: no_prefetch only with fully_shard",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps per job and round (default: 20)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every mode's job this many times, interleaved across modes, pooling the "
        "timed steps; evens out changing machine load (default: 1)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps after the first call (default: 3)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="per-rank batch size for every model (default: each model's own)",
    )
    add_output_options(parser, "docs/results/results.json", "docs/benchmarks.md")
    parser.add_argument(
        "--png", default=None,
        help="bar chart (default: with --md, docs/img/benchmarks.png beside the page; skipped "
        "without matplotlib)",
    )
    parser.add_argument("--no-docs", action="store_true", help="write only the JSON file")
    parser.add_argument("--seed", type=int, default=0, help="init and data seed (default: 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a job's collectives time out and it is reported as error "
        "(default: 600)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="after measuring, profile 3 more steps per job with torch.profiler and write rank "
        "0's op table to DIR/MODEL_MODE.txt (figures are unaffected)",
    )
    args = parser.parse_args(argv)
    output_paths(args, "docs/results/results.json", "docs/benchmarks.md")
    if args.md and args.png is None:
        args.png = str(Path(args.md).parent / "img" / "benchmarks.png")
    if args.steps < 1 or args.warmup < 0 or args.world_size < 1 or args.rounds < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --world-size >= 1, --rounds >= 1")
    if args.ablation:
        args.modes = args.modes + ablation_run(args.modes, modes)
    order = list(modes)
    args.modes = sorted(set(args.modes), key=order.index)
    return args


def machine() -> dict:
    cpu = "unknown CPU"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "load_average_start": os.getloadavg()[0],
    }


def provenance(module: str, argv: list[str]) -> dict:
    """How a results file was made: the command, the machine (load average at the start) and
    the source revision."""
    return {"command": shlex.join(["python", "-m", module, *argv]), "machine": machine(),
            "source": source_revision()}


def write_results(results: dict, out: str) -> Path:
    """Add the load average at the end and write ``results`` as JSON to ``out``."""
    results["machine"]["load_average_end"] = os.getloadavg()[0]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per rank: the first round's figures with every round's step timings pooled."""
    merged = []
    for per_rank in zip(*rounds):
        failed = next((r for r in per_rank if r["status"] != "ok"), None)
        if failed:
            merged.append(failed)
            continue
        first = dict(per_rank[0])
        for key in ("step_seconds", "step_cpu_seconds"):
            first[key] = [t for r in per_rank for t in r[key]]
        first["rss_peak_bytes"] = max(r["rss_peak_bytes"] for r in per_rank)
        merged.append(first)
    return merged


def run_model(name: str, args: argparse.Namespace) -> dict:
    spec, modes = MODELS[name], all_modes()
    batch = args.batch or spec.batch
    model = spec.build()
    numel, tensors = param_count(model)
    outputs: dict[str, list[list[dict]]] = {m: [] for m in args.modes}
    for round_ in range(args.rounds):  # modes interleaved, so load drift hits them alike
        for mode_name in args.modes:
            job = Job(name, mode_name, args.world_size, batch, args.warmup, args.steps, args.seed,
                      args.timeout, args.profile if round_ == 0 else None)
            outputs[mode_name].append(launch(job))
            if round_ == args.rounds - 1:
                mode = modes[mode_name]
                record = summarize(
                    mode, merge_rounds(outputs[mode_name]), mode.comm(spec, model),
                    args.world_size,
                )
                outputs[mode_name] = record
                print(progress_line(name, record), flush=True)
    records = [outputs[m] for m in args.modes]
    lower = add_comparisons(records)
    shared = shared_core_bound({r["mode"]: r for r in records if r["status"] == "ok"})
    return {
        "name": name,
        "description": spec.description,
        "params": numel,
        "param_tensors": tensors,
        "optimizer": spec.optim.label(),
        "batch": batch,
        "lower_bound_ms": lower,
        "shared_core_bound_ms": shared,
        "results": records,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = {
        **provenance("benchmarks.run", argv),
        "config": {
            "world_size": args.world_size,
            "steps": args.steps,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "seed": args.seed,
            "out": args.out,
            "profile": args.profile,
        },
        "models": [],
    }
    for name in args.models:
        results["models"].append(run_model(name, args))
    out = write_results(results, args.out)
    print()
    print(table(results))
    print()
    print(ratio_table(results))
    print(f"\nresults: {out}")
    if args.md and not args.no_docs:
        note = write_docs(results, Path(args.md), Path(args.png))
        print(f"docs: {args.md}" + (f" ({note})" if note else f", chart: {args.png}"))
    return report_errors(results)


def report_errors(results: dict) -> int:
    """Print every failed job's traceback to stderr; the exit status (1 if any failed)."""
    errors = [r for m in results["models"] for r in m["results"] if r["status"] == "error"]
    for r in errors:
        print(f"\n{r['mode']} failed:\n{r.get('traceback', r.get('reason'))}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
