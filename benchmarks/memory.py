"""Memory per rank: eager DDP and FSDP2 against spmd replicate and fully_shard (also built on the
meta device, and with the compiler's activation budget) on a state-heavy model and a deep
transformer, with and without activation checkpointing in the model.

Every (model, mode) runs in fresh processes (benchmarks/worker.py): first call, warm-up steps,
a few timed steps, then one more step measured from the CPU allocator's events
(spmd_compiler.memory). Prints the table and writes the JSON results to a scratch file;
``--write-docs`` writes the checkout's docs/results/memory_results.json and docs/memory.md instead
(a run to publish, on a quiet machine).

    python -m benchmarks.memory
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

from .models import MODELS
from .stale import measured_at
from .modes import all_modes
from .report import _repo_relative
from .run import (
    add_output_options,
    output_paths,
    provenance,
    report_errors,
    run_model,
    write_results,
)

MIB = 2**20
RESULTS, PAGE = "docs/results/memory_results.json", "docs/memory.md"  # published, in the checkout
DEFAULT_MODELS = ["state_heavy", "deep_gpt", "deep_gpt_ckpt"]
DEFAULT_MODES = ["ddp", "fsdp2", "spmd_replicate", "spmd_replicate-meta_init", "spmd_fully_shard",
                 "spmd_fully_shard-meta_init", "spmd_fully_shard-activation_budget"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated (default: {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default: 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (default: 2)")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch for every model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    add_output_options(parser, RESULTS, PAGE)
    parser.add_argument("--no-docs", action="store_true", help="write only the JSON file")
    args = parser.parse_args(argv)
    output_paths(args, RESULTS, PAGE)
    modes = all_modes()
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS] + [m for m in args.modes if m not in modes]
    if unknown:
        parser.error(f"unknown model or mode: {', '.join(unknown)}")
    args.rounds, args.profile = 1, None
    return args


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def _span(values: list[float | None]) -> str:
    """One per-rank figure in MiB, or min-max when the ranks differ."""
    if not values or any(v is None for v in values):
        return "-"
    lo, hi = _mib(min(values)), _mib(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def memory_rows(results: dict) -> list[list[str]]:
    body = []
    for model in results["models"]:
        by_mode = {r["mode"]: r for r in model["results"]}
        reference = by_mode.get("spmd_replicate")
        ref_peak = (max(m["peak_in_step"] for m in reference["memory_per_rank"])
                    if reference and reference["status"] == "ok" else None)
        ref_rss = (max(_rss_above_base(reference)) if reference and reference["status"] == "ok"
                   else None)
        for r in model["results"]:
            if r["status"] != "ok":
                body.append([model["name"], r["mode"], r["status"], r.get("reason", "")[:80]]
                            + [""] * 6)
                continue
            mem = r["memory_per_rank"]
            peak = [m["peak_in_step"] for m in mem]
            rss = _rss_above_base(r)
            body.append([
                model["name"], r["mode"],
                _span([m["live_between_steps"] for m in mem]),
                _span(peak),
                _span([m["estimated_peak"] for m in mem]),
                f"{max(peak) / ref_peak:.2f}" if ref_peak else "-",
                _span(rss),
                f"{max(rss) / ref_rss:.2f}" if ref_rss else "-",
                f"{r['step_ms']['median']:.0f}",
                "-" if r.get("parity_max_abs_diff") is None else f"{r['parity_max_abs_diff']:.1e}",
            ])
    return body


def _rss_above_base(r: dict) -> list[float]:
    return [(peak - base) * MIB for peak, base in zip(r["rss_peak_mb_per_rank"],
                                                       r["rss_base_mb_per_rank"])]


HEADERS = ["model", "mode", "live between steps MiB", "in-step peak MiB", "estimate MiB",
           "peak x replicate", "peak RSS above base MiB", "RSS x replicate", "step ms",
           "parity max|diff|"]


def markdown(results: dict) -> str:
    m = results["machine"]
    src = results["source"]
    models = [[x["name"], MODELS[x["name"]].description, f"{x['params']:,}", x["optimizer"],
               x["batch"]] for x in results["models"]]
    modes = all_modes()
    return "\n".join([
        "# Memory",
        "",
        f"Generated by `python -m benchmarks.memory --write-docs` (results: "
        f"`{_repo_relative(results['config']['out'])}`); "
        "do not edit by hand. Speed: [benchmarks.md](benchmarks.md).",
        "",
        f"- Command: `{results['command']}`",
        f"- Date (UTC): {m['date']}; {measured_at(src)}",
        f"- Machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}; load average "
        f"{m['load_average_start']:.1f} / {m['load_average_end']:.1f} at start / end",
        f"- World size {results['config']['world_size']}, gloo on 127.0.0.1, every (model, mode) "
        "in fresh processes: first call, "
        f"{results['config']['warmup']} warm-up and {results['config']['steps']} timed steps, "
        "then one unmeasured and one measured step",
        "",
        tabulate(models, headers=["model", "what", "params", "optimizer", "batch/rank"],
                 tablefmt="github"),
        "",
        "Modes:",
        "",
        *[f"- `{name}`: {modes[name].description}" for name in dict.fromkeys(
            r["mode"] for x in results["models"] for r in x["results"])],
        "",
        tabulate(memory_rows(results), headers=HEADERS, tablefmt="github", disable_numparse=True),
        "",
        "- **live between steps**: distinct storages of parameters, gradients, buffers and "
        "optimizer state when a step starts (a sharded tensor counts its local, padded, part). "
        "DDP and FSDP2 keep gradients between steps; spmd frees them in the step.",
        "- **in-step peak**: live between steps + the largest growth of the live bytes of "
        "torch's CPU allocator during one step (every allocation and free, from the profiler's "
        "memory events; the collectives' own buffers included), per rank (min-max).",
        "- **estimate**: the compiler's liveness walk over the graph it runs (the summary's "
        "`peak`), evaluated at this batch size; it includes the batch.",
        "- **peak RSS above base**: the rank's `ru_maxrss` after the timed steps minus its value "
        "right after `init_process_group` (before the model is built).",
        "- **x replicate**: over spmd replicate's figure on the same model (largest rank).",
        "- **parity**: max |parameter - DDP's| after the same steps (float32). spmd runs Adam's "
        "fused kernel, DDP and FSDP2 the optimizer as written (foreach): Adam divides by "
        "sqrt(v) + eps, so where a gradient is near eps the two kernels' last-bit differences "
        "grow to about the learning rate. With the fused kernel on both sides the parameters are "
        "bitwise equal (measured after 4 steps: state_heavy under replicate, deep_gpt under "
        "fully_shard).",
        "",
    ])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = {
        **provenance("benchmarks.memory", argv),
        "config": {"world_size": args.world_size, "steps": args.steps, "warmup": args.warmup,
                   "seed": args.seed, "out": args.out},
        "models": [run_model(name, args) for name in args.models],
    }
    out = write_results(results, args.out)
    print(tabulate(memory_rows(results), headers=HEADERS, disable_numparse=True))
    print(f"\nresults: {out}")
    if args.md and not args.no_docs:
        Path(args.md).write_text(markdown(results))
        print(f"docs: {args.md}")
    return report_errors(results)


if __name__ == "__main__":
    sys.exit(main())
