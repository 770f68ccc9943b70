"""The command line: ``python -m spmd_compiler demo`` and ``explain`` end to end."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spmd_compiler import DataParallel, explain
from tests.models import SimpleMLP, train_step

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=600, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "spmd_compiler", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_the_readme_demo_command_trains_both_modes_like_ddp(tmp_path):
    """``python -m spmd_compiler demo`` exactly as the README has it, from a folder outside the
    repository (so the installed package is what runs)."""
    out = _run("demo", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    results = re.findall(r"^  (\w+) +max \|param - DDP\| over (\d+) steps = (\S+) "
                         r"\(tolerance (\S+)\) -> (\w+)", out.stdout, re.M)
    assert [(m, n, ok) for m, n, _, _, ok in results] == [
        ("replicate", "20", "OK"), ("fully_shard", "20", "OK")], out.stdout
    assert all(float(err) <= float(tol) for _, _, err, tol, _ in results)
    assert out.stdout.count("2 calls verified against the eager reference (verify=2)") == 2, out.stdout
    assert "collectives per step" in out.stdout
    dumps = Path(re.search(r"^graph dumps: (.+)$", out.stdout, re.M).group(1))
    try:
        for mode in ("replicate", "fully_shard"):
            top = {p.name for p in (dumps / mode / "demo_train_step").iterdir()}
            first = {p.name for p in (dumps / mode / "demo_train_step" / "compile_0").iterdir()}
            assert "summary.txt" in top and "summary.txt" in first
            assert any(name.endswith("_traced.dot") for name in first)
    finally:
        shutil.rmtree(dumps, ignore_errors=True)


def test_demo_exits_nonzero_when_parity_fails(tmp_path):
    # A tolerance no float computation can meet after the params moved: 0 is met only by
    # bitwise equality, so demand a negative one to force the MISMATCH path.
    out = _run("demo", "--steps", "2", "--modes", "replicate", "--tolerance", "-1",
               "--dump-dir", str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "MISMATCH" in out.stdout


def test_explain_cli_prints_the_summary():
    out = _run("explain", "--mode", "fully_shard", "--world-size", "3", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "reduce_scatter" in out.stdout and "Shard(0)" in out.stdout


@pytest.mark.parametrize("mode, kinds", [("replicate", {"all_reduce"}),
                                         ("fully_shard", {"all_gather", "reduce_scatter"})])
def test_explain_leaves_model_and_optimizer_alone(mode, kinds):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    summary = explain(train_step, model, opt, (torch.randn(8, 50), torch.randn(8, 8)),
                      parallel_mode=DataParallel(mode), world_size=2)
    assert {c.kind for c in summary.collectives} == kinds
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state and all(type(p) is torch.nn.Parameter for p in model.parameters())



def _figures(summary) -> dict:
    """Every table of a summary but the compile times and the explain-only notes on other
    world sizes, by title; and the header."""
    return {"header": summary.header(),
            **{title: rows for title, _, rows in summary.tables()
               if title != "compile time" and not title.startswith("at another world size")}}


def _run_figures(style: str) -> dict:
    """On each rank of a real gloo group: the summary of a compiled Adam step after two calls."""
    from spmd_compiler import spmd_compile
    from spmd_compiler.api import entry_summary
    from tests.multirank import rank_data

    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            if style == "hybrid_shard" else None)
    step = spmd_compile(DataParallel(style), mesh=mesh)(train_step)
    # explain under the real process group first: the same figures, the optimizer left alone
    explained = _figures(explain(step, model, opt, rank_data(0, (16, 50), (16, 8))))
    assert not opt.state
    for i in range(2):
        step(model, opt, rank_data(i, (16, 50), (16, 8)))
    assert step.compile_count == 1
    ran = _figures(entry_summary(step.last_compiled))
    assert explained == ran, (explained, ran)
    return ran


@pytest.mark.multirank
def test_explain_prints_the_figures_of_a_real_run(pool2):
    """explain without a process group (a stand-in group of 2 ranks in this process) gives a
    real 2-rank gloo run's summary, figure for figure: the collectives a call issues (the gloo
    lowering's broadcasts, the per-call agreement riding in a collective), the optimizer state
    Adam makes before recording, the persistent memory and the peak; and takes the state it
    made away again."""
    for style in ("replicate", "fully_shard"):
        torch.manual_seed(0)
        model = SimpleMLP()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        summary = explain(train_step, model, opt, (torch.randn(16, 50), torch.randn(16, 8)),
                          parallel_mode=DataParallel(style), world_size=2)
        assert not opt.state and not torch.distributed.is_initialized()
        ran = pool2.run(_run_figures, style)[0]
        assert _figures(summary) == ran, style
        assert summary.persistent_bytes["optimizer state"] > 0
        assert summary.to_text().startswith("at world size 2\n")
        assert "at another world size" in summary.to_text()


def test_explain_cli_explains_a_users_own_step(capsys):
    """``explain FILE.py:FUNCTION`` with the file's ``explain_args()`` hook (examples/train.py:
    AdamW and gradient clipping), and a clear error for a file without the hook."""
    from spmd_compiler.cli import main

    assert main(["explain", str(ROOT / "examples" / "train.py") + ":train_step",
                 "--mode", "replicate"]) == 0
    out = capsys.readouterr().out
    assert "at world size 2" in out and "all_reduce" in out and "optimizer state" in out
    assert main(["explain", str(ROOT / "tests" / "models.py") + ":train_step"]) == 2
    assert "defines no function 'explain_args'" in capsys.readouterr().err


def _two_steps_job(dump_dir: str) -> list:
    """Two steps (of two models) compiled with one SPMD_DUMP_DIR; their compile times."""
    import os

    from spmd_compiler import spmd_compile
    from tests.multirank import rank_data

    os.environ["SPMD_DUMP_DIR"] = dump_dir
    try:
        torch.manual_seed(0)
        models = [SimpleMLP(), SimpleMLP()]

        def other_step(model, optim, batch):
            return train_step(model, optim, batch)

        steps = [spmd_compile(DataParallel("replicate"))(train_step),
                 spmd_compile(DataParallel("replicate"))(other_step)]
        for step, model in zip(steps, models):
            step(model, torch.optim.SGD(model.parameters(), lr=0.1), rank_data(0, (8, 50), (8, 8)))
        return [s.last_compiled.stage_seconds for s in steps]
    finally:
        del os.environ["SPMD_DUMP_DIR"]


@pytest.mark.multirank
def test_steps_sharing_a_dump_dir_get_a_folder_each(pool2, tmp_path):
    """Each compiled step dumps into <dump_dir>/<step name>/compile_<n>, so two steps sharing
    SPMD_DUMP_DIR keep both their graphs; the time the dumps took is a compile time."""
    seconds = pool2.run(_two_steps_job, str(tmp_path))[0]
    for name in ("train_step", "other_step"):
        first = tmp_path / name / "compile_0"
        assert any(p.name.endswith("_traced.dot") for p in first.iterdir()), name
        assert (tmp_path / name / "summary.txt").exists() and (first / "timeline.svg").exists()
    assert all(s["dumps written"] > 0 for s in seconds)


@pytest.mark.multirank
def test_explain_prints_the_figures_of_a_real_hybrid_shard_run(pool4):
    """The same for hybrid_shard on a 2 x 2 mesh: explain's stand-in group of 4 ranks."""
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    summary = explain(train_step, model, opt, (torch.randn(16, 50), torch.randn(16, 8)),
                      parallel_mode=DataParallel("hybrid_shard"), world_size=(2, 2))
    assert _figures(summary) == pool4.run(_run_figures, "hybrid_shard")[0]
    assert summary.header() == "at world size 4 (mesh 2 x 2)"
