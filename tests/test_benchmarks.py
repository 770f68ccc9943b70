"""Smoke test of the benchmark harness: SimpleMLP, 2 timed steps per mode, world size 2.

Runs ``python -m benchmarks.run`` as a subprocess (real gloo ranks on loopback) and checks that
the JSON has every figure with sane values. No timing thresholds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.models import MODELS, param_count

pytestmark = pytest.mark.multirank  # real gloo ranks, in a subprocess

ROOT = Path(__file__).resolve().parents[1]
ABLATION = "spmd_replicate-no_bucketing"
MODES = ["ddp", "fsdp2", "ddp_compile", "fsdp2_compile", "spmd_replicate", ABLATION, "compute",
         "comm"]
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable, "-m", "benchmarks.run",
        "--models", "simple_mlp",
        "--modes", ",".join(MODES),
        "--world-size", str(WORLD),
        "--steps", "2",
        "--warmup", "1",
        "--batch", "16",
        "--out", str(out / "results.json"),
        "--md", str(out / "benchmarks.md"),
        "--png", str(out / "img" / "benchmarks.png"),
        "--timeout", "120",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in MODES:  # one progress line per finished job
        assert f" {mode} " in proc.stdout
    data = json.loads((out / "results.json").read_text())
    data["_md"] = (out / "benchmarks.md").read_text()
    return data


@pytest.fixture(scope="module")
def by_mode(results):
    (model,) = results["models"]
    return {r["mode"]: r for r in model["results"]}


@pytest.fixture(scope="module")
def sizes():
    numel, tensors = param_count(MODELS["simple_mlp"].build())
    return numel, tensors


def test_every_mode_ran(by_mode):
    assert list(by_mode) == MODES
    for mode, r in by_mode.items():
        assert r["status"] == "ok", (mode, r.get("reason"), r.get("traceback"))


def test_step_times(by_mode):
    for r in by_mode.values():
        s = r["step_ms"]
        assert len(r["steps_ms"]) == 2
        assert all(t > 0 for t in r["steps_ms"])
        assert 0 < s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"]
        assert r["first_call_s"] > 0 and r["cpu_ms_median"] > 0
        assert r["ratio_to_ddp"] > 0 and r["ratio_to_lower_bound"] > 0
    assert by_mode["ddp"]["ratio_to_ddp"] == pytest.approx(1.0)
    assert by_mode["ddp"]["cpu_ratio_to_ddp"] == pytest.approx(1.0)
    assert by_mode["spmd_replicate"]["compile_s"] > 0


def test_lower_bound(results, by_mode):
    lower = results["models"][0]["lower_bound_ms"]
    medians = [by_mode[m]["step_ms"]["median"] for m in ("compute", "comm")]
    assert lower == max(medians)


def test_persistent_bytes(by_mode, sizes):
    numel, tensors = sizes
    # params + grads + Adam exp_avg + exp_avg_sq, float32, plus one float32 step per tensor.
    full = {"params": 4 * numel, "grads": 4 * numel, "optim": 8 * numel + 4 * tensors}
    full["total"] = sum(full.values())
    for mode in ("ddp", "compute"):
        assert by_mode[mode]["persistent_breakdown_per_rank"] == [full] * WORLD
    # FSDP2's dim-0 shards add up to the full tensors; every rank has its own step counters.
    fsdp2 = by_mode["fsdp2"]["persistent_breakdown_per_rank"]
    counters = 4 * tensors * (WORLD - 1)
    assert sum(r["params"] for r in fsdp2) == full["params"]
    assert sum(r["grads"] for r in fsdp2) == full["grads"]
    assert sum(r["optim"] for r in fsdp2) == full["optim"] + counters
    for r in by_mode["spmd_replicate"]["persistent_breakdown_per_rank"]:
        assert r["params"] == full["params"] and r["optim"] == full["optim"]
        assert r["grads"] in (0, full["grads"])
    assert by_mode["comm"]["persistent_bytes_per_rank"] == [None] * WORLD


def test_comm_bytes(by_mode, sizes):
    grad_bytes = 4 * sizes[0]
    for mode in ("ddp", "spmd_replicate", "comm"):
        assert by_mode[mode]["comm_bytes_per_step"] == {"all_reduce": grad_bytes}
    # SimpleMLP's FSDP2 units are its two Linear layers: nothing stays gathered at the root.
    assert by_mode["fsdp2"]["comm_bytes_per_step"] == {
        "all_gather": 2 * grad_bytes,
        "reduce_scatter": grad_bytes,
    }
    assert by_mode["compute"]["comm_total_bytes"] == 0


def test_memory(by_mode):
    for r in by_mode.values():
        for base, peak in zip(r["rss_base_mb_per_rank"], r["rss_peak_mb_per_rank"]):
            assert 0 < base <= peak


def test_parity(by_mode):
    assert by_mode["ddp"]["parity_max_abs_diff"] == 0.0
    for mode in ("fsdp2", "ddp_compile", "fsdp2_compile", "spmd_replicate", ABLATION):
        assert by_mode[mode]["parity_max_abs_diff"] < 1e-5, mode
    for mode in ("compute", "comm"):
        assert by_mode[mode]["parity_max_abs_diff"] is None


def test_torch_compile_peers(by_mode):
    """DDP and FSDP2 under torch.compile: Dynamo compiled their forward before the timed steps,
    and the spmd modes are held against them."""
    for mode in ("ddp_compile", "fsdp2_compile"):
        r = by_mode[mode]
        assert r["compiles"] >= 1 and r["compile_s"] > 0 and r["compiles_while_timed"] == 0, r
    assert by_mode["spmd_replicate"]["ratio_to_ddp_compile"] == pytest.approx(
        by_mode["spmd_replicate"]["step_ms"]["median"] / by_mode["ddp_compile"]["step_ms"]["median"])
    assert by_mode["fsdp2_compile"]["ratio_to_fsdp2_compile"] == pytest.approx(1.0)


def test_ablation(by_mode):
    r, base = by_mode[ABLATION], by_mode["spmd_replicate"]
    assert (r["ablation"], r["ablation_of"]) == ("no_bucketing", "spmd_replicate")
    assert base["ablation"] is None
    # Bucketing off: one all_reduce per gradient instead of one bucket, same bytes.
    ablated = r["graph_collectives"]["all_reduce"]
    bucketed = base["graph_collectives"]["all_reduce"]
    assert ablated["count"] > bucketed["count"] and ablated["bytes"] == bucketed["bytes"]


def test_docs(results):
    md = results["_md"]
    assert results["machine"]["torch"] in md and results["command"] in md
    for mode in MODES:
        assert f"| {mode} " in md
    ratios = md[md.index("## Ratios"):md.index("## Results")]
    assert "## Ablation" in md and ABLATION not in ratios


def test_run_from_another_directory_leaves_the_checkout_alone(tmp_path):
    """Without --write-docs a run writes its results to a scratch file (or --out) and no page;
    it runs from any directory and records the checkout's commit."""
    tracked = ["docs/results/results.json", "docs/benchmarks.md", "docs/img/benchmarks.png"]
    before = {p: (ROOT / p).read_bytes() for p in tracked}
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "benchmarks.run", "--models", "simple_mlp", "--modes", "compute",
           "--steps", "1", "--warmup", "0", "--out", str(out), "--timeout", "120"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"results: {out}" in proc.stdout and "docs:" not in proc.stdout, proc.stdout
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert json.loads(out.read_text())["source"]["commit"] == head
    assert {p: (ROOT / p).read_bytes() for p in tracked} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("module, results, page", [
    ("run", "docs/results/results.json", "docs/benchmarks.md"),
    ("memory", "docs/results/memory_results.json", "docs/memory.md"),
])
def test_only_write_docs_names_the_checkouts_files(module, results, page):
    import importlib

    from benchmarks.run import SCRATCH

    parse = importlib.import_module(f"benchmarks.{module}").parse_args
    args = parse([])
    assert Path(args.out).parent == SCRATCH and args.md is None
    args = parse(["--write-docs"])
    assert (args.out, args.md) == (str(ROOT / results), str(ROOT / page))
