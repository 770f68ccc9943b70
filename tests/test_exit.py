"""A finished job lets go of its process groups: after ``destroy_process_group`` no gloo group
the compiler used stays alive and no gloo thread is left, while the user's model, optimizer,
compiled steps and meshes are still referenced (as in a ``main()`` that destroys the group
before returning).

A gloo thread alive at interpreter finalization can need the GIL there (dropping a finished
collective's tensor) and abort the process with ``terminate called without an active
exception`` (SIGABRT). torch's sharding-propagation caches keep every mesh a DTensor op ran on
alive to the end of the process, so a mesh must not keep its groups alive.

Two fresh ranks (this file run as a script, rendezvous through a file: no port) compile a
replicate step on the default mesh, a fully_shard step on the user's 1-D mesh and a
hybrid_shard step on a 1 x 2 mesh, use the model eagerly, destroy the default group, then
report the gloo threads left and whether the groups are freed, and exit normally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


def _rank_main(rank: int, init_file: str) -> None:
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    groups = [weakref.ref(dist.group.WORLD)]
    flat = init_device_mesh("cpu", (2,))
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    groups += [weakref.ref(g) for g in (*flat.get_all_groups(), *grid.get_all_groups())]

    def step(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        return loss

    kept = []
    for mode, mesh in (("replicate", None), ("fully_shard", flat), ("hybrid_shard", grid)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        compiled = spmd_compile(DataParallel(mode), mesh=mesh)(step)
        for _ in range(2):
            compiled(model, optim, (torch.randn(4, 8), torch.randint(0, 4, (4,))))
        with torch.no_grad():
            model(torch.randn(3, 8))  # eager use: DTensor ops fill torch's sharding caches
        kept.append((model, optim, compiled))
    assert _gloo_threads(), "gloo threads were expected while the group is up"
    dist.destroy_process_group()
    print(json.dumps({"gloo_threads": _gloo_threads(),
                      "groups_alive": sum(g() is not None for g in groups)}), flush=True)


def test_destroy_process_group_frees_groups_and_gloo_threads(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    init_file = str(tmp_path / "rendezvous")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), init_file], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {r} did not finish in 120 s")
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results == [{"gloo_threads": [], "groups_alive": 0}] * 2, results


def test_exit_stress_job_exits_clean():
    """One run of benchmarks/exit_stress.py's train / evaluate / save job under torchrun: exit 0,
    every rank's unflushed last line printed, no gloo thread left after destroy_process_group,
    nothing of the job left running, and nothing in its temporary directory but torch's own."""
    from benchmarks.exit_stress import run_once

    run = run_once("exit_job.py", "fully_shard", timeout=120)
    assert (run["rc"], run["abort"], run["hang"], run["missing_last_line"], run["gloo_threads_left"],
            run["stray_process"], run["tmp_left"]) == (0, False, False, [], 0, False, []), run


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2])
