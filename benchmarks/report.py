"""Render results: terminal table, docs/benchmarks.md and the bar chart, all from the JSON.

``python -m benchmarks.report [--json F] [--md F] [--png F]`` regenerates the docs from a results
file without rerunning anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from tabulate import tabulate

from .stale import measured_at
from .modes import ABLATIONS
from .results import MB

HEADERS = [
    "model",
    "mode",
    "step ms (median)",
    "p10-p90 ms",
    "CPU ms",
    "x DDP",
    "x FSDP2",
    "x lower bound",
    "compile s",
    "persistent/rank",
    "peak RSS/rank",
    "comm/step",
    "parity max|diff|",
]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _compile(r: dict) -> str:
    """Seconds spent compiling, with the number of compiles when there was more than one."""
    text = _fmt(r["compile_s"], ".2f")
    if (r.get("compiles") or 0) > 1:
        text += f" ({r['compiles']} compiles"
        text += f", {r['compiles_while_timed']} while timed)" if r["compiles_while_timed"] else ")"
    return text


def _size(n: float) -> str:
    """Bytes in binary units: 7.4 KiB, 68.2 MiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _per_rank(values) -> str:
    """A per-rank byte figure as one value, or min-max when ranks differ."""
    if not values or any(v is None for v in values):
        return "-"
    lo, hi = _size(min(values)), _size(max(values))
    return lo if lo == hi else f"{lo} - {hi}"


def rows(results: dict, reason_width: int | None = 60) -> list[list[str]]:
    out = []
    for model in results["models"]:
        for r in model["results"]:
            if r["status"] != "ok":
                reason = r.get("reason", "")
                if reason_width and len(reason) > reason_width:
                    reason = reason[: reason_width - 3] + "..."
                out.append([model["name"], r["mode"], r["status"], reason] + [""] * 9)
                continue
            s = r["step_ms"]
            out.append(
                [
                    model["name"],
                    r["mode"],
                    f"{s['median']:.1f}",
                    f"{s['p10']:.1f}-{s['p90']:.1f}",
                    _fmt(r.get("cpu_ms_median"), ".1f"),
                    _fmt(r["ratio_to_ddp"], ".2f"),
                    _fmt(r["ratio_to_fsdp2"] if r.get("sharded") else None, ".2f"),
                    _fmt(r["ratio_to_lower_bound"], ".2f"),
                    _compile(r),
                    _per_rank(r["persistent_bytes_per_rank"]),
                    _per_rank([mb * MB for mb in r["rss_peak_mb_per_rank"]]),
                    _size(r["comm_total_bytes"]),
                    _fmt(r["parity_max_abs_diff"], ".1e"),
                ]
            )
    return out


def table(results: dict, fmt: str = "simple") -> str:
    return tabulate(rows(results), headers=HEADERS, tablefmt=fmt, disable_numparse=True)


def ratio_table(results: dict, fmt: str = "simple") -> str:
    """Models x modes: wall-time median over DDP's (over the lower bound), CPU time over DDP's.

    Ablation modes have their own table (``ablation_section``).
    """
    modes = list(
        dict.fromkeys(
            r["mode"] for m in results["models"] for r in m["results"] if not r.get("ablation")
        )
    )
    body = []
    for model in results["models"]:
        by_mode = {r["mode"]: r for r in model["results"]}
        row = [model["name"]]
        for mode in modes:
            r = by_mode.get(mode)
            if r is None:
                row.append("")
            elif r["status"] != "ok":
                row.append(r["status"])
            else:
                row.append(
                    f"{_fmt(r['ratio_to_ddp'], '.2f')} ({_fmt(r['ratio_to_lower_bound'], '.2f')}) "
                    f"[{_fmt(r.get('cpu_ratio_to_ddp'), '.2f')}]"
                )
        body.append(row)
    return tabulate(body, headers=["x DDP (x lower bound) [CPU x DDP]", *modes], tablefmt=fmt,
                    disable_numparse=True)


def bounds_table(results: dict, fmt: str = "github") -> str | None:
    """Per model: the references that bound a step, and each replicate-style mode over the
    shared-core bound. None when no model has both references."""
    models = [m for m in results["models"] if m.get("shared_core_bound_ms")]
    if not models:
        return None
    modes = list(dict.fromkeys(
        r["mode"] for m in models for r in m["results"]
        if r.get("ratio_to_shared_core_bound") and not r["reference"] and not r.get("ablation")
    ))
    body = []
    for model in models:
        by_mode = {r["mode"]: r for r in model["results"] if r["status"] == "ok"}
        compute, comm = by_mode["compute"], by_mode["comm"]
        body.append([
            model["name"], _fmt(compute["step_ms"]["median"], ".1f"),
            _fmt(comm["step_ms"]["median"], ".1f"), _fmt(comm["cpu_ms_median"], ".1f"),
            _fmt(model["lower_bound_ms"], ".1f"), _fmt(model["shared_core_bound_ms"], ".1f"),
            *[_fmt(by_mode[m]["ratio_to_shared_core_bound"], ".2f") if m in by_mode else ""
              for m in modes],
        ])
    headers = ["model", "compute ms", "comm ms", "comm CPU ms", "lower bound ms",
               "shared-core bound ms", *[f"{m} x shared-core" for m in modes]]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def progress_line(model: str, record: dict) -> str:
    """One line per finished (model, mode) job."""
    if record["status"] != "ok":
        return f"{model:>11} {record['mode']:<22} {record['status']}: {record.get('reason', '')}"
    s = record["step_ms"]
    return (
        f"{model:>11} {record['mode']:<22} median {s['median']:8.1f} ms "
        f"(p10 {s['p10']:.1f}, p90 {s['p90']:.1f}), first call {record['first_call_s']:.2f} s"
    )


def chart(results: dict, path: Path) -> str | None:
    """Bar chart of median step time (p10-p90 whiskers) per mode, one panel per model.

    Ablation modes are left out. Returns a note instead of drawing when matplotlib is not
    installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): chart skipped"
    models = results["models"]
    cols = min(3, len(models))
    rows_ = -(-len(models) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.6 * cols, 4.2 * rows_), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        ok = [r for r in model["results"] if r["status"] == "ok" and not r.get("ablation")]
        names = [r["mode"] for r in ok]
        med = [r["step_ms"]["median"] for r in ok]
        err = [
            [m - r["step_ms"]["p10"] for m, r in zip(med, ok)],
            [r["step_ms"]["p90"] - m for m, r in zip(med, ok)],
        ]
        colors = ["tab:gray" if r.get("reference") else "tab:blue" for r in ok]
        colors = [
            "tab:orange" if n.startswith("spmd") else c for n, c in zip(names, colors)
        ]
        ax.bar(range(len(ok)), med, yerr=err, color=colors, capsize=3)
        if model.get("lower_bound_ms"):
            ax.axhline(model["lower_bound_ms"], color="black", ls="--", lw=1, label="lower bound")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xticks(range(len(ok)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(model["name"])
        ax.set_ylabel("step time, ms (median, p10-p90)")
    fig.suptitle(
        f"world size {results['config']['world_size']}, gloo on loopback, 1 thread per rank"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def collectives_table(results: dict) -> list[str]:
    """Counted from the compiled graph, next to the analytic payload used for comm/step."""
    body = []
    for model in results["models"]:
        for r in model["results"]:
            for kind, c in sorted((r.get("graph_collectives") or {}).items()):
                analytic = r["comm_bytes_per_step"].get(kind)
                body.append(
                    [model["name"], r["mode"], kind, c["count"], _size(c["bytes"]),
                     "-" if analytic is None else _size(analytic)]
                )
    if not body:
        return ["No spmd mode ran."]
    headers = ["model", "mode", "collective", "count", "bytes (graph)", "bytes (analytic)"]
    return [tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)]


COUNTED_MODES = ("ddp", "ddp_tuned", "spmd_replicate", "fsdp2", "spmd_fully_shard")


def counted_collectives_table(results: dict) -> list[str]:
    """Collectives issued per step, counted by torch.profiler on rank 0 (``--profile``): every
    ``c10d::`` op a step ran (what DDP, FSDP2 and the compiled graph hand to the process group,
    the per-call agreement between ranks included)."""
    body = []
    for model in results["models"]:
        by_mode = {r["mode"]: r.get("profile") for r in model["results"]}
        if not any(by_mode.get(m) for m in COUNTED_MODES):
            continue
        body.append([model["name"]] + [
            "-" if not by_mode.get(m) else f"{by_mode[m]['collective_calls']:.0f}"
            for m in COUNTED_MODES])
    if not body:
        return []
    return [
        "## Collectives issued per step (counted)",
        "",
        "Every `c10d::` op one step runs, counted by torch.profiler on rank 0 over the profiled "
        "steps (`--profile`): DDP's bucket all-reduces and buffer broadcasts, FSDP2's gathers "
        "and reduce-scatters, and for spmd the compiled graph's collectives plus the per-call "
        "agreement between ranks (one all_reduce; `check_ranks=False` drops it). A gather of "
        "fully_shard runs on gloo as one broadcast per rank.",
        "",
        tabulate(body, headers=["model", *COUNTED_MODES], tablefmt="github",
                 disable_numparse=True),
        "",
    ]


def profile_table(results: dict) -> list[str]:
    """Per-step totals from torch.profiler on rank 0 (``--profile``), one row per job."""
    body = []
    for model in results["models"]:
        for r in model["results"]:
            p = r.get("profile")
            if not p:
                continue
            top = "-" if p["top_op"] is None else f"{p['top_op'][0]} {p['top_op'][1]:.1f}"
            body.append(
                [model["name"], r["mode"], f"{p['wall_ms']:.1f}", f"{p['collective_calls']:.0f}",
                 f"{p['collective_ms']:.1f}", f"{p['aten_calls']:.0f}", f"{p['aten_ms']:.1f}",
                 f"{p['other_ms']:.1f}", top]
            )
    if not body:
        return []
    headers = ["model", "mode", "wall ms", "collective calls", "collective ms", "aten calls",
               "aten ms", "other ms", "top aten op (ms)"]
    return [
        "## Where the time goes (torch.profiler, rank 0, per step)",
        "",
        "Three extra steps after the measurement, under the profiler (which slows small ops "
        "down). *collective ms* is the self time of c10d / functional-collective ops, including "
        "time blocked in `wait_tensor`; *other ms* is time in framework code outside aten ops "
        "(module hooks, optimizer Python, DDP/FSDP2 bookkeeping); the generated Python of an "
        "FX graph emits no such events, so its overhead shows only as wall time not covered by "
        "ops. The full op tables were written to "
        f"`{results['config'].get('profile') or 'PROFILE_DIR'}` (not kept in the repository).",
        "",
        tabulate(body, headers=headers, tablefmt="github", disable_numparse=True),
        "",
    ]


TARGET_RATIO = 0.75  # geometric mean of spmd replicate over DDP
# (style, reference, ratio key, target of the geometric mean or None): every model at most 1.00
TARGETS = (
    ("replicate", "DDP", "ratio_to_ddp", TARGET_RATIO),
    ("replicate", "DDP + fused optimizer (ddp_tuned)", "ratio_to_ddp_tuned", 0.9),
    ("fully_shard", "FSDP2", "ratio_to_fsdp2", 0.6),
    ("replicate", "DDP + torch.compile (ddp_compile)", "ratio_to_ddp_compile", 0.75),
    ("fully_shard", "FSDP2 + torch.compile (fsdp2_compile)", "ratio_to_fsdp2_compile", None),
)
TARGET_SHARED_CORE = 1.10  # spmd replicate over compute + comm CPU, compute-bound models
CACHED_CALL_MODEL = "simple_mlp_b32"  # the cached call whose CPU time is held against DDP's
TARGET_LOWER_BOUND = 1.15  # spmd replicate over max(compute, comm)


def _spmd_backends(results: dict, style: str) -> dict[str, dict[str, dict]]:
    """{backend: {model: record}} of the spmd modes of ``style`` that ran ok (no ablations)."""
    out: dict[str, dict[str, dict]] = {}
    prefix = f"spmd_{style}"
    for model in results["models"]:
        for r in model["results"]:
            mode = r["mode"]
            if r["status"] != "ok" or r.get("ablation") or not mode.startswith(prefix):
                continue
            backend = mode[len(prefix):].lstrip("_") or "eager"
            out.setdefault(backend, {})[model["name"]] = r
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def targets_section(results: dict) -> list[str]:
    """The speed targets, computed from this run: geometric means and worst ratios of every spmd
    backend over its eager reference, and replicate over the lower bound."""
    models = [m["name"] for m in results["models"]]
    body = []
    for style, ref, key, target in TARGETS:
        backends = _spmd_backends(results, style)
        per_model_best: dict[str, float] = {}
        rows = []
        for backend, recs in backends.items():
            ratios = {m: recs[m][key] for m in models if m in recs and recs[m].get(key)}
            if not ratios:
                continue
            for m, x in ratios.items():
                per_model_best[m] = min(per_model_best.get(m, x), x)
            rows.append((f"spmd {style}, {backend} backend", ratios))
        if len(rows) > 1 and per_model_best:
            rows.append((f"spmd {style}, faster backend per model", per_model_best))
        for label, ratios in rows:
            worst = max(ratios, key=ratios.get)
            mean = _geomean(list(ratios.values()))
            met = (target is None or mean <= target) and ratios[worst] <= 1.0
            body.append([label, ref, "-" if target is None else f"{target:.2f}", len(ratios),
                         f"{mean:.2f}", f"{ratios[worst]:.2f} ({worst})", "yes" if met else "no"])
    lines = [
        "## Targets",
        "",
        "Geometric mean over the models of median step time over the reference's (target in the "
        "third column, where there is one), and the largest ratio (target at most 1.00: no model "
        "slower). *met*: both hold in this run.",
        "",
        tabulate(body, headers=["spmd", "over", "target (geo. mean)", "models", "geometric mean",
                                "largest (model)", "met"],
                 tablefmt="github", disable_numparse=True) if body else "No spmd mode ran.",
        "",
    ]
    checks = bound_and_count_checks(results)
    if checks:
        lines += [
            "The other targets of this run (the shared-core bound and the counted collectives "
            "are detailed below; counting needs `--profile`):",
            "",
            tabulate(checks, headers=["target", "this run", "target", "met"], tablefmt="github",
                     disable_numparse=True),
            "",
        ]
    bound_rows = []
    for backend, recs in _spmd_backends(results, "replicate").items():
        for m in models:
            r = recs.get(m)
            if r and r.get("ratio_to_lower_bound"):
                bound_rows.append((m, backend, r["ratio_to_lower_bound"]))
    if bound_rows:
        lines += [
            f"spmd replicate over the lower bound max(compute, comm) (target at most "
            f"{TARGET_LOWER_BOUND} on the compute-heavy models; here compute exceeds comm on "
            f"every model):",
            "",
            tabulate([[m, b, f"{x:.2f}"] for m, b, x in bound_rows],
                     headers=["model", "backend", "x lower bound"], tablefmt="github",
                     disable_numparse=True),
            "",
        ]
    return lines


def _ok(model: dict) -> dict[str, dict]:
    return {r["mode"]: r for r in model["results"] if r["status"] == "ok"}


def bound_and_count_checks(results: dict) -> list[list[str]]:
    """Rows (what, figure, target, met) for the targets beyond the geometric means: replicate
    over the shared-core bound on the compute-bound models (compute above comm), the cached
    SimpleMLP call's CPU time over DDP's, and collectives counted per step against DDP's and
    FSDP2's."""
    rows = []
    bound = {m["name"]: _ok(m)["spmd_replicate"]["ratio_to_shared_core_bound"]
             for m in results["models"] if "spmd_replicate" in _ok(m) and "compute" in _ok(m)
             and "comm" in _ok(m) and _ok(m)["spmd_replicate"].get("ratio_to_shared_core_bound")
             and _ok(m)["compute"]["step_ms"]["median"] > _ok(m)["comm"]["step_ms"]["median"]}
    if bound:
        worst = max(bound, key=bound.get)
        rows.append(["spmd replicate x shared-core bound, compute-bound models (largest)",
                     f"{bound[worst]:.2f} ({worst})", f"<= {TARGET_SHARED_CORE:.2f}",
                     "yes" if bound[worst] <= TARGET_SHARED_CORE else "no"])
    cached = next((_ok(m) for m in results["models"] if m["name"] == CACHED_CALL_MODEL), {})
    if "spmd_replicate" in cached and "ddp" in cached:
        spmd, ddp = cached["spmd_replicate"]["cpu_ms_median"], cached["ddp"]["cpu_ms_median"]
        rows.append([f"cached call CPU ms, {CACHED_CALL_MODEL}: spmd replicate / DDP",
                     f"{spmd:.2f} / {ddp:.2f} = {spmd / ddp:.2f}", "<= 1.00",
                     "yes" if spmd <= ddp else "no"])
    for spmd, ref in (("spmd_replicate", "ddp"), ("spmd_fully_shard", "fsdp2")):
        counts = {m["name"]: (_ok(m)[spmd]["profile"]["collective_calls"],
                              _ok(m)[ref]["profile"]["collective_calls"])
                  for m in results["models"] if _ok(m).get(spmd, {}).get("profile")
                  and _ok(m).get(ref, {}).get("profile")}
        if counts:
            over = [n for n, (a, b) in counts.items() if a > b]
            rows.append([f"collectives per step (counted), {spmd} <= {ref} on every model",
                         f"{len(counts) - len(over)} of {len(counts)} models"
                         + (f" (more on {', '.join(over)})" if over else ""), "all",
                         "yes" if not over else "no"])
    return rows


def slower(results: dict) -> list[str]:
    """Bullets for every spmd mode whose median is above DDP's (or FSDP2's, when sharded).

    Ablation modes are left out: they have their own table.
    """
    out = []
    for model in results["models"]:
        for r in model["results"]:
            if r["status"] != "ok" or not r["mode"].startswith("spmd") or r.get("ablation"):
                continue
            refs = [("DDP", r["ratio_to_ddp"])]
            if r.get("sharded"):
                refs.append(("FSDP2", r["ratio_to_fsdp2"]))
            worse = [f"{x:.2f}x {name}" for name, x in refs if x and x > 1]
            if worse:
                out.append(f"- {model['name']} / {r['mode']}: {', '.join(worse)}")
    return out or ["- nowhere in this run"]


def _ablation_cell(r: dict | None, base: dict | None) -> str:
    """Median step ms, with the ratio to the base mode's median in parentheses."""
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    median = r["step_ms"]["median"]
    if r is base:
        return f"{median:.1f}"
    if base is None or base["status"] != "ok":
        return f"{median:.1f} (-)"
    return f"{median:.1f} ({median / base['step_ms']['median']:.2f})"


def ablation_table(results: dict, base_mode: str) -> str:
    """Models x (base mode and each of its ablation modes that ran)."""
    ablations = dict.fromkeys(
        (r["mode"], r["ablation"])
        for m in results["models"]
        for r in m["results"]
        if r.get("ablation") and r.get("ablation_of") == base_mode
    )
    modes = [base_mode, *(mode for mode, _ in ablations)]
    body = []
    for model in results["models"]:
        by_mode = {r["mode"]: r for r in model["results"]}
        if any(mode in by_mode for mode, _ in ablations):
            base = by_mode.get(base_mode)
            body.append([model["name"], *(_ablation_cell(by_mode.get(m), base) for m in modes)])
    headers = ["model", "all passes on (ms)", *(name for _, name in ablations)]
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def ablation_section(results: dict) -> list[str]:
    """One table per spmd mode that has ablation modes in the results; nothing if none ran."""
    records = [r for m in results["models"] for r in m["results"] if r.get("ablation")]
    if not records:
        return []
    bases = dict.fromkeys(r["ablation_of"] for r in records)
    names = dict.fromkeys(r["ablation"] for r in records)
    lines = [
        "## Ablation",
        "",
        "Each spmd mode with one optimization switched off (`--ablation`). Cells: median step ms; "
        "in parentheses over the same mode with every pass on (above 1.00: switching the pass "
        "off made the step slower). Their parity and collectives are in the tables above.",
        "",
    ]
    for name in names:
        a = ABLATIONS.get(name)
        lines.append(f"- `{name}`" + (f" (`{a.overrides()}`): {a.description}" if a else ""))
    lines.append("")
    for base in bases:
        lines += [f"### {base}", "", ablation_table(results, base), ""]
    return lines


def _repo_relative(path: str) -> str:
    """``path`` relative to the repository when it lies inside it."""
    root = Path(__file__).resolve().parent.parent
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


def markdown(results: dict, chart_rel: str | None, chart_note: str | None) -> str:
    m, cfg = results["machine"], results["config"]
    src = results.get("source") or {"commit": "unknown", "compiler_sources_modified": False}
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks.run --write-docs` (or `python -m benchmarks.report` "
        "from its results) from "
        f"`{_repo_relative(results['config']['out'])}`; do not edit by hand. Memory per rank "
        "(between steps, in-step peak, RSS): [memory.md](memory.md). Compile time, the program "
        "cache and padding-per-batch sequence lengths: [compile_time.md](compile_time.md). "
        "Step time against the batch size (where replicate overtakes DDP): "
        "[batch_sweep.md](batch_sweep.md).",
        "",
        "## Setup",
        "",
        f"- Command: `{results['command']}`",
        f"- Date (UTC): {m['date']}; {measured_at(src)}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB; "
        f"Python {m['python']}, torch {m['torch']}",
        f"- 1-minute load average at start / end: {m['load_average_start']:.1f} / "
        f"{m['load_average_end']:.1f} (above {m['cores']} means other processes shared the "
        "cores and inflated the times)",
        f"- World size {cfg['world_size']} (gloo on 127.0.0.1, one process per rank, "
        "`torch.set_num_threads(1)`), every (model, mode) in fresh processes",
        f"- First call (compiles for spmd modes) + {cfg['warmup']} warm-up steps, "
        f"then {cfg['steps']} timed steps"
        + (f"; every job run {cfg['rounds']} times, interleaved across modes, steps pooled"
           if cfg.get("rounds", 1) > 1 else ""),
        "",
        "## Models",
        "",
        tabulate(
            [
                [x["name"], x["description"], f"{x['params']:,}", x["optimizer"], x["batch"]]
                for x in results["models"]
            ],
            headers=["model", "what", "params", "optimizer", "batch/rank"],
            tablefmt="github",
        ),
        "",
        *targets_section(results),
        "## Ratios",
        "",
        "Median wall time per step over eager DDP's; in parentheses over the lower bound "
        "max(compute, comm); in brackets median CPU time per step over DDP's (robust to other "
        "load on the machine, blind to time blocked on the peer).",
        "",
        ratio_table(results, "github"),
        "",
    ]
    bounds = bounds_table(results)
    if bounds:
        lines += [
            "## Against the bounds",
            "",
            "The lower bound max(compute, comm) assumes communication costs no CPU. Here every "
            "core runs a rank, so a rank's all_reduce work (gloo's reductions and loopback "
            "copies: `comm CPU ms`) shares the core with its compute. The shared-core bound "
            "compute + comm CPU is what a replicate step (DDP's or spmd's) can reach on this "
            "machine; below 1.00 means part of the collective's CPU work ran while the rank "
            "itself waited.",
            "",
            bounds,
            "",
        ]
    lines += [
        "## Results",
        "",
        tabulate(rows(results, reason_width=160), headers=HEADERS, tablefmt="github",
                 disable_numparse=True),
        "",
    ]
    lines += counted_collectives_table(results)
    lines += ["## Collectives in the compiled spmd graphs (per step)", ""] + collectives_table(
        results
    ) + [""]
    if chart_rel:
        lines += [f"![step time per mode]({chart_rel})", ""]
    if chart_note:
        lines += [f"Chart: {chart_note}.", ""]
    lines += [
        "## How to read this",
        "",
        "- **step ms**: per step, the slowest rank's wall time (every rank times each step; the "
        "max over ranks is taken after the loop with one all_reduce(MAX), so timing adds no "
        "synchronisation). Median and p10-p90 over the timed steps.",
        "- **CPU ms**: median per step of the process CPU time (all threads, max over ranks). "
        "Unlike wall time it is barely inflated when other processes share the cores; it "
        "excludes time spent blocked waiting for a peer.",
        "- **x DDP / x FSDP2**: median over eager DDP's (FSDP2's, for the sharded modes) median.",
        "- **lower bound** = max(`compute`, `comm`): `compute` is the same single-device step on "
        "the local batch with no communication (run on every rank at once, so the machine is as "
        "loaded as in the real modes); `comm` is one all_reduce of all gradient bytes as a single "
        "flat buffer. No data-parallel step can beat either; a ratio near 1 means nothing is left "
        "to gain from overlap.",
        "- **compile s**: total of the compiler's own compile times (spmd modes), with the "
        "number of compiles when there was more than one (a compile while timed would show in "
        "the step times); the first call's wall time of every mode is in the JSON "
        "(`first_call_s`).",
        "- **persistent/rank**: params + grads + optimizer state that stay alive between steps, "
        "counted from the real local tensors (`to_local()` of DTensors), per rank (min-max).",
        "- **peak RSS/rank**: `ru_maxrss` of the rank's process (each job has fresh processes; "
        "this includes the Python + torch baseline, listed as `rss_base_mb_per_rank` in the JSON).",
        "- **comm/step**: analytic collective payload per step (full tensor bytes): replicate "
        "and DDP all-reduce every gradient; fully_shard gathers the parameters for forward and "
        "again for backward and reduce-scatters the gradients; FSDP2 keeps its root's own "
        "parameters gathered after forward, so those are gathered once. Ring wire bytes per rank "
        "are in the JSON (`wire_bytes_per_rank`).",
        "- **parity**: max |parameter - DDP's parameter| after the same steps from the same "
        "initialization on the same per-rank data (float32). References have none.",
        "",
    ]
    lines += ablation_section(results)
    lines += ["## Where spmd is slower than the eager references", ""] + slower(results) + [""]
    lines += profile_table(results)
    return "\n".join(lines)


def write_docs(results: dict, md_path: Path, png_path: Path) -> str | None:
    """Write the chart and the markdown page; returns the chart note (None if drawn)."""
    note = chart(results, png_path)
    rel = None if note else os.path.relpath(png_path, md_path.parent)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(results, rel, note))
    return note


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent  # the checkout, whatever the directory
    parser.add_argument("--json", default=str(root / "docs" / "results" / "results.json"),
                        help="results file to read (default: the checkout's)")
    parser.add_argument("--md", default=str(root / "docs" / "benchmarks.md"),
                        help="markdown page to write (default: the checkout's)")
    parser.add_argument("--png", default=str(root / "docs" / "img" / "benchmarks.png"),
                        help="chart to write (default: the checkout's)")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.json).read_text())
    print(table(results))
    print()
    print(ratio_table(results))
    note = write_docs(results, Path(args.md), Path(args.png))
    if note:
        print(note)


if __name__ == "__main__":
    main()
