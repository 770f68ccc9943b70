"""Do finished jobs exit cleanly? Launch short torchrun jobs in a loop and count what goes wrong
on the way out.

    python -m benchmarks.exit_stress [--runs 10] [--starve] [--out exit_stress.json]

Each round runs, for each style (replicate, fully_shard), the README's torchrun example
(examples/train.py, a few steps, with --ckpt-dir) and a train / evaluate / save job
(benchmarks/exit_job.py), 2 ranks each (``torchrun --standalone --nproc-per-node 2``).
``--starve`` runs every job next to two processes burning a core each.

Per run it records the exit status and flags: an abort (a signal, ``terminate called``, SIGABRT
in torchrun's report), a missing last line (train.py's final "saved checkpoint" line; each
rank's unflushed ``rank R done`` of exit_job.py), gloo threads a rank of exit_job.py still had
after ``destroy_process_group`` (they would live into interpreter finalization), a hang (no exit within ``--timeout``), a
process of the job still alive after torchrun returned (it would hold the job's ports), and
the entries the job left in its temporary directory (torch's own are counted apart:
torchrun's empty log directory ``torchelastic_*``, kept unless ``--log-dir`` is given, and
Inductor's cache directory ``torchinductor_<user>``, shared by later runs). Prints one line per
run and a summary per (script, style, load), and writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ABORT = re.compile(r"terminate called|SIGABRT|Signal 6|exitcode\s*:\s*-6|Aborted|Fatal Python error")

SCRIPTS = {
    # the README's example, shortened: a few steps, a validation and a checkpoint at the end
    "train.py": lambda style, out: (
        ["examples/train.py", "--mode", style, "--steps", "6", "--batch-size", "32", "--width", "32",
         "--train-size", "1024", "--val-size", "256", "--log-every", "3", "--eval-every", "6",
         "--ckpt-every", "6", "--ckpt-dir", out],
        [re.escape("step      6  saved checkpoint")]),
    "exit_job.py": lambda style, out: (
        ["benchmarks/exit_job.py", "--mode", style, "--out", out],
        [r"rank 0 done", r"rank 1 done"]),
}
STYLES = ("replicate", "fully_shard")
TORCH_TMP = ("torchelastic_", "torchinductor_")  # torch's own temporary directories


def _burners(n: int = 2) -> list[subprocess.Popen]:
    """``n`` processes each burning a core until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(n)]


def run_once(script: str, style: str, timeout: float) -> dict:
    """One torchrun job: its exit status and what went wrong on the way out. The job gets a
    temporary directory of its own (``TMPDIR``) to see what it leaves there."""
    work = Path(tempfile.mkdtemp(prefix="exit_stress_"))
    (work / "ckpt").mkdir()
    (work / "tmp").mkdir()
    args, last_lines = SCRIPTS[script](style, str(work / "ckpt"))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(work / "tmp"))
    start = time.perf_counter()
    proc = subprocess.Popen([*TORCHRUN, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    hang = False
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hang = True
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
    seconds = time.perf_counter() - start
    try:  # anything of the job still alive (holding its ports)?
        os.killpg(proc.pid, 0)
        stray = True
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        stray = False
    left = sorted(os.listdir(work / "tmp"))
    shutil.rmtree(work, ignore_errors=True)
    missing = [p for p in last_lines if not re.search(p, text)]
    gloo_left = sum(int(n) for n in re.findall(r"gloo threads left: (\d+)", text))
    return {"script": script, "style": style, "rc": proc.returncode, "seconds": round(seconds, 1),
            "abort": bool(ABORT.search(text)) or proc.returncode in (-6, 134), "hang": hang,
            "missing_last_line": missing, "gloo_threads_left": gloo_left, "stray_process": stray,
            "tmp_left": [e for e in left if not e.startswith(TORCH_TMP)],
            "torch_tmp": [e for e in left if e.startswith(TORCH_TMP)],
            "load_avg": round(os.getloadavg()[0], 2),
            "tail": text[-3000:] if proc.returncode or missing or hang else ""}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (script, style, load): runs, exits 0, aborts, missing last lines, hangs, strays."""
    rows = []
    keys = sorted({(r["script"], r["style"], r["load"]) for r in runs})
    for script, style, load in keys:
        rs = [r for r in runs if (r["script"], r["style"], r["load"]) == (script, style, load)]
        rows.append({"script": script, "style": style, "load": load, "runs": len(rs),
                     "exit_0": sum(r["rc"] == 0 for r in rs), "aborts": sum(r["abort"] for r in rs),
                     "missing_last_line": sum(bool(r["missing_last_line"]) for r in rs),
                     "gloo_threads_left": sum(bool(r.get("gloo_threads_left")) for r in rs),
                     "hangs": sum(r["hang"] for r in rs),
                     "stray_processes": sum(r["stray_process"] for r in rs),
                     "tmp_left": sorted({e for r in rs for e in r["tmp_left"]}),
                     "torch_tmp": dict(Counter(t + "*" for r in rs for e in r["torch_tmp"]
                                               for t in TORCH_TMP if e.startswith(t))),
                     "median_s": sorted(r["seconds"] for r in rs)[len(rs) // 2]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="rounds (each: every script x style)")
    p.add_argument("--starve", action="store_true", help="two processes burn both cores meanwhile")
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    p.add_argument("--styles", nargs="+", default=list(STYLES), choices=STYLES)
    p.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    p.add_argument("--out", default=None, help="write every run and the summary here (JSON)")
    args = p.parse_args()
    load = "starved" if args.starve else "idle"
    burners = _burners() if args.starve else []
    runs: list[dict] = []
    try:
        for i in range(args.runs):
            for script in args.scripts:
                for style in args.styles:
                    r = run_once(script, style, args.timeout)
                    r.update(round=i, load=load)
                    runs.append(r)
                    flags = [k for k in ("abort", "hang", "missing_last_line", "gloo_threads_left",
                                         "stray_process", "tmp_left") if r[k]]
                    print(f"{i:3d} {script:11s} {style:11s} {load:7s} rc {r['rc']:4d} "
                          f"{r['seconds']:6.1f} s {' '.join(flags) or 'ok'}", flush=True)
                    if r["tail"]:
                        print(r["tail"], flush=True)
                    if args.out:
                        _write(args.out, runs)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    rows = summarize(runs)
    for row in rows:
        print(json.dumps(row))
    total = Counter()
    for row in rows:
        total.update({k: row[k] for k in ("runs", "exit_0", "aborts", "missing_last_line",
                                          "gloo_threads_left", "hangs", "stray_processes")})
    print("total", json.dumps(dict(total)))
    if args.out:
        _write(args.out, runs)
    clean = total["runs"] == total["exit_0"] and not (total["missing_last_line"]
                                                      or total["gloo_threads_left"])
    sys.exit(0 if clean else 1)


def _write(path: str, runs: list[dict]) -> None:
    Path(path).write_text(json.dumps({"runs": runs, "summary": summarize(runs)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
