"""A user-given DeviceMesh and hybrid sharding (HSDP) on a 2-D mesh, at 4 gloo ranks.

- A 1-D sub-mesh (one dim of a 2 x 2 mesh): replicate and fully_shard train each pair of ranks
  on its own, matching DDP over the same pair; a rank outside a mesh gets a clear error.
- hybrid_shard on a ("replicate", "shard") 2 x 2 mesh against FSDP2's HSDP
  (``fully_shard(model, mesh=2-D mesh)``) and against DDP over all 4 ranks: several steps,
  different data on every rank, Adam, and SGD with momentum and gradient clipping; every
  parameter and optimizer state (gathered) within rtol 1e-5 / atol 1e-6, and the local shards
  and placements the same as FSDP2's. The step's collectives per mesh dim are counted off the
  graph.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist

from tests.models import TwoLayerMLP
from tests.multirank import ParityChecker, rank_data
from tests.steps import clip_norm, square_mean_step, square_sum, square_sum_step, step_with
from tests.test_fully_shard import compare_with_reference

STEPS = 4
BATCH = 6


def OddMLP():  # noqa: N802 (a model constructor, named like the others)
    """33 hidden rows: shards over 2 ranks are 17 + 16 rows (padding in every collective)."""
    return TwoLayerMLP(20, 33, 5)


adam_step = square_sum_step
clip_sgd_step = step_with(square_sum, between=clip_norm(1.0, returned=False))


OPTIMS = {
    "adam": (adam_step, lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "sgd_clip": (clip_sgd_step, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
}


def _batch(seed: int):
    return rank_data(seed, (BATCH, 20), (BATCH, 5))  # different on every rank


# --------------------------------------------------------------------------------------------------
# A 1-D sub-mesh
# --------------------------------------------------------------------------------------------------


def sub_mesh_job() -> dict:
    """Each row of a 2 x 2 mesh trains its own model over its 'dp' dim (ranks {0,1} and {2,3}),
    against DDP over the same pair; then a mesh of ranks {0, 1} only, called on every rank."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, SPMDError, spmd_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"]
    chk = ParityChecker()
    for style in ("replicate", "fully_shard"):
        torch.manual_seed(dist.get_rank() // 2)  # each pair starts from its own model
        model = OddMLP()
        ref = DDP(deepcopy(model), process_group=dp.get_group())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
        step = spmd_compile(DataParallel(style), mesh=dp)(adam_step)
        for i in range(3):
            x, y = _batch(10 + i)
            loss = step(model, opt, (x, y))
            chk.close("loss", f"{style} step {i}: loss", loss, adam_step(ref, ref_opt, (x, y)).detach())
            compare_with_reference(chk, f"{style} step {i}", model, opt, ref.module, ref_opt)
        p = model.net1.weight
        chk.check(p.device_mesh == dp and p.device_mesh.size() == 2,
                  f"{style}: parameters on {p.device_mesh}, not the 'dp' sub-mesh")

    pair = DeviceMesh("cpu", [0, 1])
    model = OddMLP()
    step = spmd_compile(DataParallel("replicate"), mesh=pair)(adam_step)
    error = None
    if dist.get_rank() >= 2:
        try:
            step(model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(0))
        except SPMDError as e:
            error = str(e)
    else:
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(0))
    try:
        spmd_compile(DataParallel("hybrid_shard"), mesh=dp)
    except SPMDError as e:
        wrong_dims = str(e)
    return dict(problems=chk.problems, max_err=chk.max_err, error=error, wrong_dims=wrong_dims)


def test_sub_mesh(pool4):
    reps = pool4.run(sub_mesh_job, timeout=300)
    for rank, rep in enumerate(reps):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
        assert "needs a 2-D mesh" in rep["wrong_dims"], rep["wrong_dims"]
    assert reps[0]["error"] is None and reps[1]["error"] is None
    for rank in (2, 3):
        assert "is not in the mesh" in reps[rank]["error"], reps[rank]["error"]


# --------------------------------------------------------------------------------------------------
# hybrid_shard on a 2 x 2 mesh
# --------------------------------------------------------------------------------------------------


# name -> (optimizer, DataParallel options)
CASES = {
    "adam": ("adam", {}),
    "sgd_clip": ("sgd_clip", {}),
    # one collective per parameter and dim, each waited on at once, gathered again for the backward
    "adam_unbucketed_no_overlap": ("adam", dict(bucket_cap_mb=None, prefetch_cap_mb=0,
                                                 reduce_cap_mb=0, overlap=False)),
}


def hybrid_job(case: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.passes import meta
    from spmd_compiler.passes.expand import mesh_dim_of

    optim_name, options = CASES[case]
    step_fn, make_opt = OPTIMS[optim_name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = OddMLP()
    hsdp, ddp = deepcopy(model), DDP(deepcopy(model))
    for m in (hsdp.net1, hsdp.net2, hsdp):
        fully_shard(m, mesh=mesh)
    opt, hsdp_opt, ddp_opt = (make_opt(m.parameters()) for m in (model, hsdp, ddp))
    step = spmd_compile(DataParallel("hybrid_shard", **options), mesh=mesh)(step_fn)
    chk = ParityChecker()
    for i in range(STEPS):
        x, y = _batch(100 + i)
        loss = step(model, opt, (x.clone(), y.clone()))
        chk.close("loss", f"step {i}: loss vs HSDP", loss, step_fn(hsdp, hsdp_opt, (x, y)).detach())
        chk.close("loss", f"step {i}: loss vs DDP", loss, step_fn(ddp, ddp_opt, (x, y)).detach())
        compare_with_reference(chk, f"step {i} vs HSDP", model, opt, hsdp, hsdp_opt)
        compare_with_reference(chk, f"step {i} vs DDP", model, opt, ddp.module, ddp_opt)
        for (name, p), (_, q) in zip(model.named_parameters(), hsdp.named_parameters()):
            chk.check(isinstance(p, DTensor) and p.device_mesh == mesh
                      and tuple(p.placements) == (Replicate(), Shard(0)) == tuple(q.placements),
                      f"step {i}: {name} placements {getattr(p, 'placements', None)} vs HSDP {q.placements}")
            chk.close("param", f"step {i}: local shard of {name}", p.to_local(), q.to_local().detach())
            for k, v in opt.state[p].items():
                if v.dim():
                    chk.check(tuple(v.placements) == (Replicate(), Shard(0)),
                              f"step {i}: state {name}.{k} placements {v.placements}")
    x, y = _batch(999)
    with torch.no_grad():  # the model used outside the step gathers over the shard dim
        chk.close("param", "eval outside the step", model(x), hsdp(x))
    # an eager backward outside the step: gradients reduce-scattered, then all-reduced over the
    # replicate dim, as HSDP's
    hsdp_opt.zero_grad()
    ((model(x) - y) ** 2).sum().backward()
    ((hsdp(x) - y) ** 2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), hsdp.parameters()):
        chk.check(p.grad is not None and tuple(p.grad.placements) == tuple(q.grad.placements),
                  f"eager backward: {name}.grad {getattr(p.grad, 'placements', None)}")
        chk.close("param", f"eager backward: {name}.grad", p.grad.full_tensor(), q.grad.full_tensor())
    received = [any(s.startswith("received from rank") for s in e.stage_seconds)
                for e in step._programs]
    gm = step.last_compiled.traced.gm  # None on a rank that received the program
    if gm is None:
        return dict(problems=chk.problems, max_err=chk.max_err, per_dim=None, received=received)
    per_dim: dict[str, int] = {}
    for n in gm.graph.nodes:
        if meta.COLLECTIVE in n.meta:
            dim = mesh_dim_of(gm, n)
            key = f"{n.meta[meta.COLLECTIVE]['kind']}@{mesh.mesh_dim_names[dim]}"
            per_dim[key] = per_dim.get(key, 0) + 1
            if key == "all_reduce@replicate" and n.meta[meta.COLLECTIVE]["params"]:
                # the gradient bucket of the shard dim is all-reduced as it is (no copy)
                source = n.args[0].args[0] if n.args[0].target is torch.ops._c10d_functional.wait_tensor.default else None
                chk.check(getattr(source, "target", None) is torch.ops._c10d_functional.reduce_scatter_tensor.default,
                          f"the replicate dim's all_reduce reads {n.args[0].format_node()}, not a reduce_scatter's wait")
    return dict(problems=chk.problems, max_err=chk.max_err, per_dim=per_dim, received=received)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hybrid_shard_matches_hsdp_and_ddp(pool4, case, record_property):
    reps = pool4.run(hybrid_job, case, timeout=300)
    for rank, rep in enumerate(reps):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
    # rank 0 builds every program; ranks 1-3 (other coordinates on both dims) receive them
    assert not any(reps[0]["received"]), reps[0]["received"]
    for rank, rep in enumerate(reps[1:], 1):
        assert rep["received"] and all(rep["received"]), f"rank {rank}: {rep['received']}"
        assert rep["per_dim"] is None, f"rank {rank} built its own program"
    per_dim = reps[0]["per_dim"]
    # gathers and reduce-scatters only on the shard dim; the replicate dim all-reduces shards
    assert per_dim.get("all_gather@shard", 0) >= 1 and per_dim.get("reduce_scatter@shard", 0) >= 1
    assert per_dim.get("all_reduce@replicate", 0) >= 1
    assert not {k for k in per_dim if k.endswith("@replicate")} - {"all_reduce@replicate"}, per_dim


def uneven_batch_job() -> dict:
    """hybrid_shard on 2 x 2 with a local batch size of its own on every rank (a symbolic batch
    dim: one program, built on rank 0) against DDP over the 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = OddMLP()
    ddp = DDP(deepcopy(model))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    step = spmd_compile(DataParallel("hybrid_shard"), mesh=mesh)(adam_step)
    chk = ParityChecker()
    b = (6, 4, 5, 3)[dist.get_rank()]
    for i in range(3):
        x, y = rank_data(500 + i, (b, 20), (b, 5))
        loss = step(model, opt, (x.clone(), y.clone()))
        chk.close("loss", f"step {i}: loss", loss, adam_step(ddp, ddp_opt, (x, y)).detach())
        compare_with_reference(chk, f"step {i}", model, opt, ddp.module, ddp_opt)
    received = [any(s.startswith("received from rank") for s in e.stage_seconds)
                for e in step._programs]
    return dict(problems=chk.problems, received=received)


def test_hybrid_program_shared_across_local_batch_sizes(pool4):
    for rank, rep in enumerate(pool4.run(uneven_batch_job, timeout=300)):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
        assert rep["received"] == [rank > 0], f"rank {rank}: {rep['received']}"


def cached_hybrid_job(cache_dir: str) -> dict:
    """Three runs of 3 Adam steps with the program cache: on one 2 x 2 mesh twice (rank 0
    builds, the others receive and store; then every rank loads), then on the transposed mesh
    (other groups on both dims: the stored programs name the first mesh's, so it compiles)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    def run(mesh):
        torch.manual_seed(0)
        model = OddMLP()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        step = spmd_compile(DataParallel("hybrid_shard"), mesh=mesh, cache_dir=cache_dir)(adam_step)
        for i in range(3):
            step(model, opt, _batch(300 + i))
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        return params, (step.compile_count, step.cache_hits)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    first, first_counts = run(mesh)
    dist.barrier()  # every rank has written its file
    second, second_counts = run(mesh)
    _, other_counts = run(DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("replicate", "shard")))
    return dict(first=first_counts, second=second_counts, other=other_counts,
                identical=all(torch.equal(first[n], second[n]) for n in first))


def test_hybrid_programs_received_stored_and_loaded(pool4, tmp_path):
    for rank, rep in enumerate(pool4.run(cached_hybrid_job, str(tmp_path), timeout=300)):
        assert rep["first"] == (1, 0) and rep["second"] == (1, 1), f"rank {rank}: {rep}"
        assert rep["other"] == (1, 0), f"rank {rank}: a program of another mesh's groups loaded"
        assert rep["identical"], f"rank {rank}: {rep}"


# --------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint: saved by hybrid_shard at 4 ranks, loaded by fully_shard at 2
# --------------------------------------------------------------------------------------------------


mean_step = square_mean_step  # a mean loss: 4 ranks' batches averaged equal 2 ranks' of two each


def save_job(path: str) -> None:
    """3 hybrid_shard steps at 2 x 2, then dcp.save of get_state_dict(model, optim); rank 0 also
    saves the full tensors (torch.save) for the reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = OddMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = spmd_compile(DataParallel("hybrid_shard"), mesh=mesh)(mean_step)
    for i in range(3):
        step(model, opt, _batch(200 + i))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/dcp")
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    full.update({f"{n}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                 for n, p in model.named_parameters() for k, v in opt.state[p].items()})
    if dist.get_rank() == 0:
        torch.save(full, f"{path}/full.pt")
    dist.barrier()


def load_job(path: str) -> dict:
    """At 2 ranks: a fresh model loads the checkpoint (get_state_dict, dcp.load, set_state_dict,
    then the first compiled call: resharded to Shard(0) over 2); compared with the saved full
    tensors, then 2 steps next to DDP started from them. Rank k takes the batches of ranks 2k and
    2k+1 of the 4-rank run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    full = torch.load(f"{path}/full.pt")
    torch.manual_seed(1)  # another initial model: loading must overwrite all of it
    model = OddMLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=f"{path}/dcp")
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    ref = OddMLP()
    ref.load_state_dict({n: full[n] for n, _ in ref.named_parameters()})
    ref = DDP(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for (n, _), q in zip(model.named_parameters(), ref.module.parameters()):
        ref_opt.state[q] = {k: full[f"{n}.{k}"].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
    chk = ParityChecker()
    step = spmd_compile(DataParallel("fully_shard"))(mean_step)
    rank = dist.get_rank()
    for i in range(2):
        parts = [rank_data(300 + i, (BATCH, 20), (BATCH, 5), rank=r) for r in (2 * rank, 2 * rank + 1)]
        batch = tuple(torch.cat(t) for t in zip(*parts))
        if i == 0:  # before the first step: what was loaded (placed on the first call)
            for n, p in model.named_parameters():
                chk.close("param", f"loaded {n}", p, full[n])
        step(model, opt, batch)
        mean_step(ref, ref_opt, batch)
        compare_with_reference(chk, f"step {i} after loading", model, opt, ref.module, ref_opt)
    return dict(problems=chk.problems, max_err=chk.max_err)


def test_checkpoint_hybrid_4_to_fully_shard_2(pool4, pool2, tmp_path):
    pool4.run(save_job, str(tmp_path), timeout=300)
    for rank, rep in enumerate(pool2.run(load_job, str(tmp_path), timeout=300)):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])


# --------------------------------------------------------------------------------------------------
# The expansion of each layout, and what the cross-rank check compares (one process)
# --------------------------------------------------------------------------------------------------


def _expanded(names: tuple[str, str], placements):
    from spmd_compiler.passes.expand import MeshDim, expand_data_parallel
    from spmd_compiler.passes.bucketing import bucket_collectives
    from tests.test_passes import _traced

    layout = [MeshDim(n, 2, p) for n, p in zip(names, placements)]
    return bucket_collectives(expand_data_parallel(_traced(clip=True).gm, layout))


def test_collectives_follow_the_placements_per_mesh_dim():
    """(Replicate, Shard(0)): gathers and reduce-scatters on the shard dim's group only, one
    all_reduce of the whole reduce-scatter bucket on the replicate dim's, the gradient norm
    completed on the shard dim. The cross-rank description names mesh dims, not groups: the
    same on ranks whose groups differ, different when the layout is swapped."""
    from torch.distributed.tensor import Replicate, Shard

    from spmd_compiler.build.program_check import describe_graph
    from spmd_compiler.passes import meta

    gm = _expanded(("rep_a", "shard_a"), (Replicate(), Shard(0)))
    c10d = torch.ops._c10d_functional
    groups: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if meta.COLLECTIVE in n.meta:
            groups.setdefault(n.meta[meta.COLLECTIVE]["kind"], []).append(n.args[-1])
    assert set(groups["all_gather"]) == set(groups["reduce_scatter"]) == {"shard_a"}, groups
    assert groups["all_reduce"].count("rep_a") == 1, groups  # the gradient bucket
    assert set(groups["all_reduce"]) == {"rep_a", "shard_a"}, groups  # + the norms (shard dim)
    bucket_ar = next(n for n in gm.graph.nodes if n.target is c10d.all_reduce.default
                     and n.args[-1] == "rep_a")
    assert bucket_ar.args[0].args[0].target is c10d.reduce_scatter_tensor.default
    other_rank = describe_graph(_expanded(("rep_b", "shard_b"), (Replicate(), Shard(0))))
    assert describe_graph(gm) == other_rank
    swapped = describe_graph(_expanded(("shard_a", "rep_a"), (Shard(0), Replicate())))
    assert swapped != describe_graph(gm)
