"""The on-disk program cache (spmd_compiler/build/cache.py): a second run loads what the first one
compiled and trains bit-identically; anything the program depends on that changed, a corrupt
file or a stale one makes it compile again; ranks that disagree about a hit all compile.

"A second run" is a fresh model, optimizer and compiled step in the same worker processes: the
cache key holds no object identities, so this is what a restarted job sees.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from copy import deepcopy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.logs import messages, spmd_log
from tests.models import SimpleMLP, mse_step, train_step
from tests.multirank import ParityChecker, rank_data
from tests.steps import weighted_mse_step


def _train(step_fn, model, cache_dir, mode="replicate", steps=3, check_ranks=True,
           **options) -> dict:
    """Train ``steps`` steps (Adam: one program, its state made before recording); return the
    final parameters, the compile and cache-hit counts and the spmd_compiler log."""
    from spmd_compiler import DataParallel, spmd_compile

    with spmd_log() as records:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        step = spmd_compile(DataParallel(mode, **options), cache_dir=cache_dir,
                            check_ranks=check_ranks)(step_fn)
        for i in range(steps):
            step(model, opt, rank_data(300 + i, (8, 50), (8, 8)))
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return dict(params=params, compiles=step.compile_count, hits=step.cache_hits,
                log=messages(records))


def _programs(cache_dir: str) -> list[str]:
    """The program files in ``cache_dir`` (not its key)."""
    return sorted(f for f in os.listdir(cache_dir) if f.endswith(".program"))


def _fresh(cls=SimpleMLP):
    torch.manual_seed(0)
    return cls()


def hit_and_miss_job(cache_dir: str, mode: str) -> dict:
    first = _train(train_step, _fresh(), cache_dir, mode)
    dist.barrier()  # every rank has written its files
    files = _programs(cache_dir)
    second = _train(train_step, _fresh(), cache_dir, mode)
    # every rank compiling its own (no agreement: nothing is shared): what rank 1 must compute
    # with the program rank 0 built, received and stored, then loaded from rank 1's file
    own = _train(train_step, _fresh(), None, mode, check_ranks=False)
    out = dict(first=(first["compiles"], first["hits"]), second=(second["compiles"], second["hits"]),
               files=len(files),
               identical=all(torch.equal(first["params"][n], second["params"][n]) for n in first["params"]),
               as_built_here=all(torch.equal(own["params"][n], second["params"][n]) for n in own["params"]),
               loaded_logged=any("loaded train_step" in m for m in second["log"]))
    # Each of these changes what the program is: a miss, not a wrong program.
    wide = _fresh()
    wide.net1, wide.net2 = nn.Linear(50, 40), nn.Linear(40, 8)
    out["changed model"] = _train(train_step, wide, cache_dir, mode)["hits"]
    out["changed option"] = _train(train_step, _fresh(), cache_dir, mode, bucket_cap_mb=None)["hits"]
    out["changed step"] = _train(mse_step, _fresh(), cache_dir, mode)["hits"]
    return out


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_second_run_loads_the_programs_and_trains_identically(pool2, tmp_path, mode):
    for rank, res in enumerate(pool2.run(hit_and_miss_job, str(tmp_path), mode, timeout=300)):
        assert res["first"] == (1, 0), f"rank {rank}: {res}"
        assert res["files"] == 2, f"rank {rank}: one file per program and rank expected: {res}"
        assert res["second"] == (1, 1), f"rank {rank}: {res}"
        assert res["identical"], f"rank {rank}: a loaded program trained differently"
        assert res["as_built_here"], f"rank {rank}: the program stored by rank 0 serves it wrong"
        assert res["loaded_logged"] or rank != 0, f"rank {rank}: {res}"  # logged on rank 0
        for change in ("changed model", "changed option", "changed step"):
            assert res[change] == 0, f"rank {rank}: {change} loaded a cached program: {res}"


def bad_files_job(cache_dir: str) -> dict:
    _train(train_step, _fresh(), cache_dir)
    paths = [os.path.join(cache_dir, f) for f in _programs(cache_dir)]
    dist.barrier()
    if dist.get_rank() == 0:  # both ranks share the directory: damage every file once
        for k, path in enumerate(paths):
            with open(path, "r+b") as f:
                data = bytearray(f.read())
                if k % 2:
                    data[len(data) // 2] ^= 0xFF  # a flipped byte: checksum mismatch
                else:
                    data = data[: len(data) // 3]  # a truncated write
                f.seek(0)
                f.write(data)
                f.truncate()
    dist.barrier()
    damaged = _train(train_step, _fresh(), cache_dir)
    reference = _train(train_step, _fresh(), None)
    again = _train(train_step, _fresh(), cache_dir)  # the recompile rewrote them
    return dict(damaged=damaged["hits"], again=again["hits"],
                ignored=sum("ignored" in m for m in damaged["log"]),
                correct=all(torch.equal(damaged["params"][n], reference["params"][n])
                            for n in reference["params"]))


def test_corrupt_files_are_ignored_and_rewritten(pool2, tmp_path):
    for rank, res in enumerate(pool2.run(bad_files_job, str(tmp_path), timeout=300)):
        assert res["damaged"] == 0 and res["correct"], f"rank {rank}: {res}"
        assert res["ignored"] == (0 if rank else 1), f"rank {rank}: {res}"  # logged on rank 0
        assert res["again"] == 1, f"rank {rank}: {res}"


def misfit_program_job(cache_dir: str) -> dict:
    """A validly signed stored program whose code does not fit the runtime (its ``forward``
    lacks the ``agreement`` input) is not run: it is logged, compiled again and rewritten, and
    the run after that loads the rewritten program."""
    from spmd_compiler.build import cache

    _train(train_step, _fresh(), cache_dir)
    dist.barrier()
    if dist.get_rank() == 0:  # both ranks share the directory
        for name in _programs(cache_dir):
            program = cache.load(cache_dir, name[:-len(".program")])
            start = program.code.index("def forward(")
            end = program.code.index(":\n", start)
            head = program.code[start:end]
            assert head.endswith(", agreement)"), head
            program.code = program.code[:start] + head.replace(", agreement)", ")") + \
                program.code[end:]
            cache.store(cache_dir, program)  # signed with this user's key, as a compile writes
    dist.barrier()
    misfit = _train(train_step, _fresh(), cache_dir)
    reference = _train(train_step, _fresh(), None)
    dist.barrier()
    again = _train(train_step, _fresh(), cache_dir)
    return dict(misfit=(misfit["compiles"], misfit["hits"]), again=again["hits"],
                logged=[m for m in misfit["log"] if "agreement" in m],
                correct=all(torch.equal(misfit["params"][n], reference["params"][n])
                            for n in reference["params"]))


def test_a_stored_program_that_does_not_fit_the_runtime_is_rebuilt(pool2, tmp_path):
    for rank, res in enumerate(pool2.run(misfit_program_job, str(tmp_path), timeout=300)):
        assert res["misfit"] == (1, 0) and res["correct"], f"rank {rank}: {res}"
        assert res["again"] == 1, f"rank {rank}: {res}"
        assert bool(res["logged"]) == (rank == 0), f"rank {rank}: {res}"  # logged on rank 0


_MODEL_SOURCE = '''
import torch.nn as nn


class EditedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 32)
        self.net2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.net2(ACTIVATION(self.net1(x)))
'''


def _load_model_module(path: str):
    name = "spmd_cache_test_model"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stale_source_job(cache_dir: str) -> dict:
    """The model's source file changes between two runs (same class, same parameters, another
    activation): the stored program is stale; the new one must compute the new model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    path = os.path.join(cache_dir, "edited_model.py")
    out = {}
    # (sources of different lengths: a same-size rewrite within a second could be served from
    # the stale __pycache__ by the import system itself)
    for version, activation in enumerate(["nn.functional.relu", "nn.functional.leaky_relu"]):
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                f.write(_MODEL_SOURCE.replace("ACTIVATION", activation))
        dist.barrier()
        module = _load_model_module(path)
        model = _fresh(module.EditedMLP)
        ref = DDP(deepcopy(model))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        res = _train(train_step, model, os.path.join(cache_dir, "programs"))
        for i in range(3):
            train_step(ref, ref_opt, rank_data(300 + i, (8, 50), (8, 8)))
        chk = ParityChecker()
        for name, p in ref.module.named_parameters():
            chk.close("param", f"run {version}: {name}", res["params"][name], p.detach())
        out[activation] = dict(hits=res["hits"], problems=chk.problems,
                               stale=any("stale" in m for m in res["log"]))
        dist.barrier()
    return out


def test_stale_program_is_recompiled(pool2, tmp_path):
    for rank, res in enumerate(pool2.run(stale_source_job, str(tmp_path), timeout=300)):
        relu, gelu = res["nn.functional.relu"], res["nn.functional.leaky_relu"]
        assert relu["hits"] == 0 and not relu["problems"], f"rank {rank}: {res}"
        assert gelu["hits"] == 0, f"rank {rank}: a program of the old source was loaded: {res}"
        assert not gelu["problems"], f"rank {rank}: {gelu['problems']}"
        assert gelu["stale"] or rank != 0, f"rank {rank}: staleness not logged: {res}"


def ranks_disagree_job(cache_dir: str) -> dict:
    """Each rank has its own cache directory; rank 1 loses its files before the second run:
    rank 0 would hit, rank 1 miss. Both must compile, and train like DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mine = os.path.join(cache_dir, f"rank{dist.get_rank()}")
    _train(train_step, _fresh(), mine)
    if dist.get_rank() == 1:
        for f in _programs(mine):
            os.remove(os.path.join(mine, f))
    dist.barrier()
    model = _fresh()
    ref = DDP(deepcopy(model))
    res = _train(train_step, model, mine)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for i in range(3):
        train_step(ref, ref_opt, rank_data(300 + i, (8, 50), (8, 8)))
    chk = ParityChecker()
    for name, p in ref.module.named_parameters():
        chk.close("param", name, res["params"][name], p.detach())
    return dict(hits=res["hits"], compiles=res["compiles"], problems=chk.problems)


def test_ranks_that_disagree_about_a_hit_all_compile(pool2, tmp_path):
    results = pool2.run(ranks_disagree_job, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        assert res["hits"] == 0 and res["compiles"] == 1, f"rank {rank}: {res}"
    for rank, res in enumerate(results):
        assert not res["problems"], f"rank {rank}: {res['problems']}"


def test_key_ignores_process_specific_hashes_and_follows_values():
    """Keys are equal for equal programs in different processes (no ids, no hash() values)
    and differ when a value the trace reads differs (a module attribute)."""
    from spmd_compiler.build.cache import program_key
    from spmd_compiler.runtime.call_args import split_step_args

    def key(model, attr_value):
        model.scale = attr_value
        model.config_like = type("Config", (), {})()
        model.config_like._original_object_hash = id(object())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sa = split_step_args((model, opt, (torch.randn(4, 50), torch.randn(4, 8))), {}, 0)
        return program_key(fn=train_step, sa=sa, dynamic_dims={}, options={}, rank=0,
                           world_size=2, group_name="0")

    assert key(_fresh(), 1.0) == key(_fresh(), 1.0)
    assert key(_fresh(), 1.0) != key(_fresh(), 2.0)


# ---------------------------------------------------------------------------------------------
# Values read at run time, rank agreement on the settings, trust, unusable files


ARGS = argparse.Namespace(loss_weight=1.0)  # as parsed from the command line at run time
SHIFT = 0.0  # a module-level value the model's forward reads


def args_step(model, optim, batch):
    return weighted_mse_step(model, optim, batch, ARGS.loss_weight)


class ShiftMLP(SimpleMLP):
    def forward(self, x):
        return super().forward(x) + SHIFT


class WeightedTrainer:
    def __init__(self, weight):
        self.weight = weight

    def step(self, model, optim, batch):
        return weighted_mse_step(model, optim, batch, self.weight)


def _variant(name: str, value: float):
    """(step, model class) of variant ``name`` with its value set to ``value``."""
    global SHIFT
    if name == "argparse":
        ARGS.loss_weight = value
        return args_step, SimpleMLP
    if name == "forward global":
        SHIFT = value
        return mse_step, ShiftMLP
    return WeightedTrainer(value).step, SimpleMLP


def values_across_runs_job(cache_dir: str) -> dict:
    """Per variant: a run with the value at 1.0 stores its programs; a second run with the value
    at 2.0 must not load them and must train exactly as without a cache; a third run loads the
    programs the second one wrote."""
    out = {}
    for name in ("argparse", "forward global", "bound method"):
        here = os.path.join(cache_dir, name.replace(" ", "_"))
        try:
            step, cls = _variant(name, 1.0)
            _train(step, _fresh(cls), here)
            dist.barrier()
            step, cls = _variant(name, 2.0)
            second = _train(step, _fresh(cls), here)
            reference = _train(step, _fresh(cls), None)
            third = _train(step, _fresh(cls), here)
            out[name] = dict(
                second_hits=second["hits"], third_hits=third["hits"],
                exact=all(torch.equal(second["params"][n], reference["params"][n])
                          for n in reference["params"]))
        finally:
            _variant(name, 0.0 if name == "forward global" else 1.0)
    return out


def test_values_set_at_run_time_are_part_of_the_key(pool2, tmp_path):
    for rank, res in enumerate(pool2.run(values_across_runs_job, str(tmp_path), timeout=600)):
        for name, r in res.items():
            assert r["second_hits"] == 0, f"rank {rank}, {name}: a program of the old value loaded"
            assert r["exact"], f"rank {rank}, {name}: {r}"
            assert r["third_hits"] == 1, f"rank {rank}, {name}: {r}"


def settings_differ_job(cache_dir: str, setting: str) -> dict:
    """The cache on one rank only (``SPMD_CACHE_DIR``, or ``SPMD_DUMP_DIR`` on the other rank),
    over a process group whose collectives time out after 20 s: both ranks train, the cache off
    on both, with a warning naming the setting; no hang, no timeout."""
    from torch.distributed.device_mesh import DeviceMesh

    from spmd_compiler import DataParallel, spmd_compile

    mesh = DeviceMesh.from_group(dist.new_group(timeout=timedelta(seconds=20)), "cpu")
    variable = "SPMD_CACHE_DIR" if setting == "cache" else "SPMD_DUMP_DIR"
    if dist.get_rank() == 1:
        os.environ[variable] = os.path.join(cache_dir, f"rank{dist.get_rank()}")
    try:
        with spmd_log() as records:
            torch.manual_seed(0)
            model = SimpleMLP()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            cache = None if setting == "cache" else os.path.join(cache_dir, "shared")
            step = spmd_compile(DataParallel("replicate"), mesh=mesh, cache_dir=cache)(train_step)
            for i in range(3):
                step(model, opt, rank_data(300 + i, (8, 50), (8, 8)))
        return dict(compiles=step.compile_count, hits=step.cache_hits,
                    warned=[m for m in messages(records) if variable in m and "off on every rank" in m])
    except Exception as e:  # noqa: BLE001 - reported to the test
        return dict(error=f"{type(e).__name__}: {e}")
    finally:
        os.environ.pop(variable, None)


@pytest.mark.parametrize("setting", ["cache", "dump"])
def test_cache_settings_that_differ_across_ranks_turn_it_off_everywhere(pool2, tmp_path, setting):
    for rank, res in enumerate(pool2.run(settings_differ_job, str(tmp_path), setting, timeout=120)):
        assert "error" not in res, f"rank {rank}: {res}"
        assert res["compiles"] == 1 and res["hits"] == 0, f"rank {rank}: {res}"
        assert res["warned"], f"rank {rank}: no warning naming the setting: {res}"


class _Planted:
    """Unpickling this runs ``open(path, "w")``: what a planted file could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def planted_files_job(cache_dir: str) -> dict:
    """A safe directory whose program files someone without the user's key replaced (a pickle
    that runs code, with a correct sha256): refused without being unpickled, ignored, compiled
    and rewritten; a world-writable directory is not used at all."""
    import hashlib
    import pickle

    from spmd_compiler.build import cache

    marker = os.path.join(cache_dir, "ran-planted-code")
    _train(train_step, _fresh(), cache_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        for name in _programs(cache_dir):
            payload = pickle.dumps(_Planted(marker))
            with open(os.path.join(cache_dir, name), "wb") as f:
                f.write(b"spmd-compiler-program\n")
                f.write(f"{cache.FORMAT} {hashlib.sha256(payload).hexdigest()}\n".encode())
                f.write(payload)
    dist.barrier()
    planted = _train(train_step, _fresh(), cache_dir)
    again = _train(train_step, _fresh(), cache_dir)
    out = dict(planted_hits=planted["hits"], ran=os.path.exists(marker), again_hits=again["hits"],
               refused=sum("refused" in m for m in planted["log"]))
    shared = os.path.join(cache_dir, "shared")
    os.makedirs(shared, exist_ok=True)
    dist.barrier()
    os.chmod(shared, 0o777)
    open_dir = _train(train_step, _fresh(), shared)
    out.update(open_dir_files=len(_programs(shared)),
               open_dir_warned=any("cannot be trusted" in m for m in open_dir["log"]))
    return out


def test_planted_files_are_refused_without_running_them(pool2, tmp_path):
    for rank, res in enumerate(pool2.run(planted_files_job, str(tmp_path), timeout=300)):
        assert not res["ran"], f"rank {rank}: a planted file's code ran: {res}"
        assert res["planted_hits"] == 0 and res["again_hits"] == 1, f"rank {rank}: {res}"
        assert res["refused"] == (0 if rank else 1), f"rank {rank}: {res}"  # logged on rank 0
        assert res["open_dir_files"] == 0 and res["open_dir_warned"], f"rank {rank}: {res}"


def unusable_program_job(cache_dir: str) -> dict:
    """Files signed with the user's key whose program cannot be used (code that does not
    compile): ignored on every rank, compiled, rewritten; never a raw error."""
    from spmd_compiler.build import cache

    _train(train_step, _fresh(), cache_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        for name in _programs(cache_dir):
            key = name[: -len(".program")]
            program = cache.load(cache_dir, key)
            program.code = "def forward(self, *args):\n    return ("
            cache.store(cache_dir, program)
    dist.barrier()
    try:
        bad = _train(train_step, _fresh(), cache_dir)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return dict(error=f"{type(e).__name__}: {e}")
    reference = _train(train_step, _fresh(), None)
    again = _train(train_step, _fresh(), cache_dir)
    return dict(bad_hits=bad["hits"], again_hits=again["hits"],
                exact=all(torch.equal(bad["params"][n], reference["params"][n])
                          for n in reference["params"]))


def test_unusable_program_is_ignored_and_rewritten(pool2, tmp_path):
    for rank, res in enumerate(pool2.run(unusable_program_job, str(tmp_path), timeout=300)):
        assert "error" not in res, f"rank {rank}: {res}"
        assert res["bad_hits"] == 0 and res["exact"] and res["again_hits"] == 1, f"rank {rank}: {res}"
