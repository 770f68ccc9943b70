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
            top = {p.name for p in (dumps / mode).iterdir()}
            first = {p.name for p in (dumps / mode / "compile_0").iterdir()}
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
    assert "reduce_scatter" in out.stdout and "S(0)" in out.stdout


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

