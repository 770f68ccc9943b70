"""examples/train.py as users launch it: torchrun on one node, two torchrun agents as two nodes on
this host (fully_shard; and hybrid_shard with two processes per node against DDP), a rank killed mid-training (SIGKILL) and the job restarted by torchrun from its last
checkpoint, and torch's DDP running the same script as the reference.

Runs compare the final checkpoints (torch.distributed.checkpoint, read with
``dcp_to_torch_save``): model parameters, AdamW state and the scheduler. A resumed run must equal
the uninterrupted one bit for bit (same world size, one thread per process, the same data order);
the compiled step against DDP to float32 round-off (RTOL/ATOL: the compiled step records AdamW
with its fused kernel, DDP runs the foreach one).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train.py")
# torchrun with this interpreter (a venv's torchrun script may name another interpreter in its
# shebang, whose installed spmd_compiler is not this checkout's)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS = ["--steps", "12", "--batch-size", "32", "--width", "32", "--train-size", "1024",
         "--val-size", "256", "--log-every", "2", "--eval-every", "6", "--ckpt-every", "4"]
RTOL, ATOL = 1e-5, 1e-6


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([*TORCHRUN, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _final_state(ckpt_dir: Path, tmp: Path, steps: int = 12) -> dict:
    """Everything in the last checkpoint, flattened to ``model.x.weight`` ... keys."""
    final = sorted(p for p in ckpt_dir.iterdir() if p.name.startswith("step_"))[-1]
    assert final.name == f"step_{steps:07d}", sorted(p.name for p in ckpt_dir.iterdir())
    dcp_to_torch_save(str(final), str(tmp / f"{ckpt_dir.name}.pt"))
    state = torch.load(tmp / f"{ckpt_dir.name}.pt", weights_only=False)

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(state)


def _compare(a: dict, b: dict, rtol: float, atol: float) -> list[str]:
    assert sorted(a) == sorted(b)
    assert any(k.startswith("model.") for k in a) and any(k.startswith("optim.state.") for k in a)
    problems = []
    for k in a:
        x, y = a[k], b[k]
        if not torch.is_tensor(x):
            if x != y:
                problems.append(f"{k}: {x} vs {y}")
        elif rtol == 0 and not torch.equal(x, y):
            problems.append(f"{k}: max diff {(x - y).abs().max().item():.3g} (bitwise expected)")
        elif not torch.allclose(x.double(), y.double(), rtol=rtol, atol=atol):
            problems.append(f"{k}: max diff {(x - y).abs().max().item():.3g}")
    return problems


def _check_log(out: str, min_logs: int = 6) -> None:
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    losses = [float(ln.split("loss ")[1].split()[0]) for ln in lines if "samples/s" in ln]
    assert len(losses) >= min_logs and losses[-1] < losses[0], out[-3000:]
    assert any("validation loss" in ln and "accuracy" in ln for ln in lines), out[-3000:]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """fully_shard, uninterrupted, as two nodes (one process each) on this host."""
    ckpt = tmp_path_factory.mktemp("two_nodes")
    port = _free_port()
    agents = [_start(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
                      "--rdzv-endpoint", f"127.0.0.1:{port}", SCRIPT, "--mode", "fully_shard",
                      *STEPS, "--ckpt-dir", str(ckpt)], _env()) for i in range(2)]
    outs = [_finish(a) for a in agents]
    return ckpt, outs[0]


def test_two_nodes_on_one_host(two_nodes):
    ckpt, out = two_nodes
    assert "fully_shard on 2 cpu rank(s) (gloo)" in out
    _check_log(out)


def _killed_and_restarted(mode: str, ckpt: Path) -> str:
    """torchrun restarts the job after the last rank SIGKILLs itself after step 6; it resumes
    from the checkpoint of step 4. (The environment variable works around torch 2.13's elastic
    agent, whose shared TCPStore hands a restarted gloo group the old attempt's addresses.)"""
    out = _finish(_start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", SCRIPT,
                          "--mode", mode, *STEPS, "--ckpt-dir", str(ckpt), "--crash-at-step", "6"],
                         _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")))
    assert "killing myself after step 6" in out, out[-3000:]
    assert f"resumed from {ckpt}/step_0000004 at step 4" in out, out[-3000:]
    _check_log(out)
    return out


def test_fully_shard_killed_and_resumed_equals_uninterrupted(two_nodes, tmp_path):
    reference, _ = two_nodes
    _killed_and_restarted("fully_shard", tmp_path / "resumed")
    problems = _compare(_final_state(tmp_path / "resumed", tmp_path),
                        _final_state(reference, tmp_path), 0, 0)
    assert not problems, "\n".join(problems)


def test_replicate_killed_and_resumed_matches_ddp(two_nodes, tmp_path):
    out = _killed_and_restarted("replicate", tmp_path / "resumed")
    # the compiled step leaves the optimizer stepped for the LR scheduler on every rank
    assert "lr_scheduler.step()" not in out, out[-3000:]
    ddp_out = _finish(_start(["--standalone", "--nproc-per-node", "2", SCRIPT, "--mode", "ddp",
                              *STEPS, "--ckpt-dir", str(tmp_path / "ddp")], _env()))
    _check_log(ddp_out)
    ddp = _final_state(tmp_path / "ddp", tmp_path)
    problems = _compare(_final_state(tmp_path / "resumed", tmp_path), ddp, RTOL, ATOL)
    assert not problems, "replicate vs DDP:\n" + "\n".join(problems)
    reference, _ = two_nodes
    problems = _compare(_final_state(reference, tmp_path), ddp, RTOL, ATOL)
    assert not problems, "fully_shard vs DDP:\n" + "\n".join(problems)


def test_hybrid_shard_two_nodes_matches_ddp(tmp_path):
    """hybrid_shard launched as two nodes of two processes (a 2 x 2 mesh from torchrun's
    environment: replicate across the nodes, shard within each) against DDP on the same 4
    ranks: the final checkpoints agree to float32 round-off."""
    steps = ["--steps", "6", *STEPS[2:]]
    steps[steps.index("--ckpt-every") + 1] = "6"
    steps[steps.index("--eval-every") + 1] = "6"
    port = _free_port()
    agents = [_start(["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                      "--rdzv-endpoint", f"127.0.0.1:{port}", SCRIPT, "--mode", "hybrid_shard",
                      *steps, "--ckpt-dir", str(tmp_path / "hybrid")], _env()) for i in range(2)]
    ddp = _start(["--standalone", "--nproc-per-node", "4", SCRIPT, "--mode", "ddp", *steps,
                  "--ckpt-dir", str(tmp_path / "ddp")], _env())
    out = [_finish(a) for a in agents][0]
    assert "hybrid_shard on 4 cpu rank(s) (gloo)" in out, out[-3000:]
    _check_log(out, min_logs=3)
    _finish(ddp)
    problems = _compare(_final_state(tmp_path / "hybrid", tmp_path, 6),
                        _final_state(tmp_path / "ddp", tmp_path, 6), RTOL, ATOL)
    assert not problems, "hybrid_shard vs DDP:\n" + "\n".join(problems)


def test_resuming_a_finished_run_says_so_and_exits_0(two_nodes):
    ckpt, _ = two_nodes
    out = _finish(_start(["--standalone", "--nproc-per-node", "2", SCRIPT, "--mode", "fully_shard",
                          *STEPS, "--ckpt-dir", str(ckpt)], _env()))
    assert f"nothing to do: the run in {ckpt} already finished 12 of --steps 12" in out, out[-3000:]
    assert "samples/s" not in out, out[-3000:]
