"""fully_shard data parallelism checked on real gloo groups (world sizes 2 and 3).

World size 3 makes shards uneven: a bias of 8 rows is split 3/3/2, and :func:`SmallRowsMLP`'s
first layer (2 rows) leaves the last rank of 3 with an empty shard.

What is checked:

- Parity with DDP (the seed's fully_shard cases and more): every case builds the same initial
  model on every rank, a DDP reference from a deepcopy of it with the same optimizer, and runs
  ``FULL_STEPS`` compiled steps plus one short batch with different data on every rank. After every
  step, on every rank: each parameter's ``full_tensor()``, each optimizer state (``full_tensor()``
  of DTensor states, plain tensors such as Adam's ``step`` as they are) and the returned loss
  against DDP's; the sharding layout (``Shard(0)`` on a 1-D mesh, torch.chunk row counts, states
  placed like their parameter, padding rows of the graph's buffers still zero).
- Parity with FSDP2 (``torch.distributed.fsdp.fully_shard`` per Linear, then the root).
- The collectives in the final graph: per-parameter counts with bucketing off, and with the
  default options every parameter covered by exactly the gathers / reduce-scatters the mode
  implies.
- Persistent memory per rank (parameters + optimizer state) against replicate.
- A ``torch.distributed.checkpoint`` round trip of model and optimizer state.

All parity cases of one world size run in one worker job (each compile costs about a second); the
job returns a report per case and each case is asserted in its own test.

Tolerances (float32 round-off; the reduce-scatter sums the same pre-divided gradients DDP's
all_reduce sums, so most results are exact or within a few ulps):
``|actual - expected| <= ATOL + RTOL * |expected|`` with RTOL = 1e-5 and ATOL = 1e-6, the same as
tests/test_replicate.py (its checker is reused). The checkpoint round trip must be identical up to
ROUND_TRIP_ATOL = 1e-7.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback
from collections import Counter
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import MODELS, SimpleMLP, TransposedMLP, TwoLayerMLP, mse_step, train_step
from tests.multirank import ParityChecker, SelectedCases, assert_parity_report, rank_data
from tests.steps import clip_norm, diff_sum, step_with
from tests.test_replicate import _make_optimizer

BATCH = 16  # local batch size of the full steps
SHORT_BATCH = 11  # the last, short batch
FULL_STEPS = 5  # full steps, then one short step
MAX_NORM = 1.0  # clip_grad_norm_'s max_norm: the gradients of train_step's sum loss are far larger
ROUND_TRIP_ATOL = 1e-7


# --------------------------------------------------------------------------------------------------
# Models and steps (module level: the worker processes import them by name)
# --------------------------------------------------------------------------------------------------


def SmallRowsMLP():  # noqa: N802 (a model constructor, named like the others)
    """A first layer with 2 output rows: fewer rows than ranks at world size 3."""
    return TwoLayerMLP(50, 2, 8, sigmoid=True)


class UnevenMLP(nn.Module):
    """50 -> 5 -> 2 -> 8: uneven shards at world size 2 (5 rows) and 3 (5 and 8 rows), and an
    empty shard on the last rank of 3 (2 rows)."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 5)
        self.net2 = nn.Linear(5, 2)
        self.net3 = nn.Linear(2, 8)

    def forward(self, x):
        return self.net3(torch.tanh(self.net2(torch.tanh(self.net1(x)))))


class ScalarParamMLP(nn.Module):
    """A 0-d parameter (not sharded: its gradient is all-reduced) beside sharded ones."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.net2 = nn.Linear(5, 8)

    def forward(self, x):
        return self.net2(torch.tanh(self.net1(x)) * self.scale)


class WideMLP(nn.Module):
    """Three Linear(1024, 1024): about 3.1 M parameters, for the memory numbers."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width),
        )

    def forward(self, x):
        return self.layers(x)


FS_MODELS = {**MODELS, "TransposedMLP": TransposedMLP, "SmallRowsMLP": SmallRowsMLP,
             "ScalarParamMLP": ScalarParamMLP}


# train_step with ``clip_grad_norm_`` between backward and step; each returns the total norm too
clip_step = step_with(diff_sum, between=clip_norm(MAX_NORM), name="clip_step")
# foreach=False: per-parameter ``linalg_vector_norm``, stacked
clip_step_loop = step_with(diff_sum, between=clip_norm(MAX_NORM, foreach=False), name="clip_step_loop")
# the max-norm (``norm_type=inf``): completed with an all_reduce(max)
clip_step_inf = step_with(diff_sum, between=clip_norm(MAX_NORM, norm_type=math.inf), name="clip_step_inf")


STEP_FNS = {"train_step": train_step, "mse_step": mse_step, "clip_step": clip_step,
            "clip_step_loop": clip_step_loop, "clip_step_inf": clip_step_inf}
_CLIP_STEPS = ("clip_step", "clip_step_loop", "clip_step_inf")

# name -> case. "optim": (class name, kwargs); "raf": reshard_after_forward; "batch_dim":
# input_batch_dim (1: inputs are (features, batch)); "compiles": expected compile_count after all
# steps (an optimizer that creates state compiles twice: once creating it, once for the steady
# state; Adam and AdamW once, their state made before recording); "bwd_gathers": the parameters
# whose gathered value the backward reads (the weight of every layer whose input gradient is
# needed), gathered a second time when raf is True.
_MLP_BWD = ["net2.weight"]
CASES: dict[str, dict] = {
    # The seed's fully_shard cases.
    "sgd_lr": dict(model="SimpleMLP", optim=("SGD", {"lr": 0.1}), compiles=1, bwd=_MLP_BWD),
    "sgd_momentum": dict(model="SimpleMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
                         compiles=2, bwd=_MLP_BWD),
    "sgd_momentum_foreach": dict(
        model="SimpleMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
        compiles=2, bwd=_MLP_BWD,
    ),
    "adam_fused": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.1, "fused": True}), compiles=1,
                       bwd=_MLP_BWD),
    "batch_dim_model_sgd": dict(model="BatchDimModel", optim=("SGD", {"lr": 0.1}), compiles=1,
                                bwd=["mlp.net2.weight"]),
    "non_0_batch_dim_adam_fused": dict(
        model="TransposedMLP", optim=("Adam", {"lr": 0.1, "fused": True}), batch_dim=1,
        compiles=1, bwd=["mlp.net2.weight"],
    ),
    # More optimizers, both values of reshard_after_forward.
    "adam_foreach": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01, "foreach": True}),
                         compiles=1, bwd=_MLP_BWD),
    "adamw_weight_decay": dict(model="SimpleMLP",
                               optim=("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
                               compiles=1, bwd=_MLP_BWD),
    # net1.weight (6.4 KB) keeps its own all_gathers and reduce_scatter (the memory caps leave
    # room for it alone), the rest are bucketed.
    "own_collective_and_bucket": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01}),
                                      compiles=1, bwd=_MLP_BWD,
                                      mode={"own_collective_mb": 0.004,
                                            "prefetch_cap_mb": 6400 / 2**20,
                                            "reduce_cap_mb": 6400 / 2**20}),
    "adam_fused_no_reshard": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01, "fused": True}),
                                  raf=False, compiles=1, bwd=_MLP_BWD),
    "sgd_momentum_no_reshard": dict(model="SimpleMLP",
                                    optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
                                    raf=False, compiles=2, bwd=_MLP_BWD),
    # Tied weights, tiny shards, buffers, gradient clipping.
    "tied_weights": dict(model="TiedMLP", optim=("Adam", {"lr": 0.01}), compiles=1,
                         bwd=["hidden_a.weight", "out.weight"]),
    "tied_weights_no_reshard": dict(model="TiedMLP", optim=("SGD", {"lr": 0.01, "momentum": 0.9}),
                                    raf=False, compiles=2, bwd=["hidden_a.weight", "out.weight"]),
    "small_rows_adam": dict(model="SmallRowsMLP", optim=("Adam", {"lr": 0.01}), compiles=1,
                            bwd=["net2.weight"]),
    "batchnorm_buffers": dict(model="BatchNormMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
                              step="mse_step", compiles=2, bwd=None),
    "clip_grad_norm_adam": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01}), step="clip_step",
                                compiles=1, bwd=_MLP_BWD),
    "clip_grad_norm_sgd_no_reshard": dict(
        model="SimpleMLP", optim=("SGD", {"lr": 0.05, "momentum": 0.9, "foreach": True}),
        step="clip_step", raf=False, compiles=2, bwd=_MLP_BWD,
    ),
    "clip_grad_norm_no_foreach": dict(model="SimpleMLP", optim=("SGD", {"lr": 0.05}),
                                      step="clip_step_loop", compiles=1, bwd=_MLP_BWD),
    "clip_grad_norm_inf": dict(model="SmallRowsMLP", optim=("Adam", {"lr": 0.01}),
                               step="clip_step_inf", compiles=1, bwd=["net2.weight"]),
    "scalar_param_adam": dict(model="ScalarParamMLP", optim=("Adam", {"lr": 0.01}), compiles=1,
                              bwd=["net2.weight"]),
    "scalar_param_clip": dict(model="ScalarParamMLP", optim=("SGD", {"lr": 0.05}),
                              step="clip_step", compiles=1, bwd=["net2.weight"]),
}


# --------------------------------------------------------------------------------------------------
# Worker side: helpers
# --------------------------------------------------------------------------------------------------


def _mode(raf: bool = True, batch_dim: int = 0, bucketing: bool = True, **options):
    """DataParallel("fully_shard", ...) with bucketing off on request (when the option exists)."""
    from spmd_compiler.parallel_mode import DataParallel

    kwargs = dict(reshard_after_forward=raf, input_batch_dim=batch_dim, **options)
    if not bucketing and "bucket_cap_mb" in {f.name for f in dataclasses.fields(DataParallel)}:
        kwargs["bucket_cap_mb"] = None
    return DataParallel("fully_shard", **kwargs)


def _chunk_rows(n: int, world: int) -> list[int]:
    """Rows of each rank under torch.chunk's split (what DTensor's Shard(0) uses)."""
    sizes = [c.shape[0] for c in torch.chunk(torch.empty(n), world)]
    return sizes + [0] * (world - len(sizes))


def _batch(seed: int, b: int, batch_dim: int, width: tuple[int, int] = (50, 8)):
    x, y = rank_data(seed, (b, width[0]), (b, width[1]))  # different on every rank
    if batch_dim == 1:
        x, y = x.t().contiguous(), y.t().contiguous()
    return x, y


def _unique_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters())  # named_parameters() already drops tied duplicates


def check_layout(chk: ParityChecker, where: str, model, opt) -> None:
    """Shard(0) DTensors on a 1-D mesh of every rank, torch.chunk rows per rank, states placed like
    their parameter, and the padded buffer the graph updates: the DTensor's local tensor is its
    leading rows, and the padding rows are still zero."""
    from torch.distributed.tensor import DTensor, Shard

    from spmd_compiler.state.placement import local_buffer

    ws, rank = dist.get_world_size(), dist.get_rank()

    def one(name: str, t, like) -> None:
        chk.check(isinstance(t, DTensor), f"{where}: {name} is {type(t).__name__}, not a DTensor")
        if not isinstance(t, DTensor):
            return
        chk.check(tuple(t.placements) == (Shard(0),), f"{where}: {name} placements {t.placements}")
        chk.check(t.device_mesh.ndim == 1 and t.device_mesh.size() == ws,
                  f"{where}: {name} mesh {t.device_mesh}")
        chk.check(tuple(t.shape) == tuple(like.shape),
                  f"{where}: {name} global shape {tuple(t.shape)} vs {tuple(like.shape)}")
        local = t.to_local()
        rows = _chunk_rows(t.shape[0], ws)[rank]
        chk.check(tuple(local.shape) == (rows,) + tuple(t.shape[1:]),
                  f"{where}: {name} local shape {tuple(local.shape)}, expected {rows} rows "
                  f"(torch.chunk of {t.shape[0]} over {ws})")
        buf = local_buffer(t)
        padded = -(-t.shape[0] // ws)
        chk.check(tuple(buf.shape) == (padded,) + tuple(t.shape[1:]),
                  f"{where}: {name} padded buffer shape {tuple(buf.shape)}, expected {padded} rows")
        if rows and buf.shape[0] >= rows:
            chk.check(local.data_ptr() == buf.data_ptr() and torch.equal(local, buf[:rows]),
                      f"{where}: {name} local tensor is not the head of the graph's buffer")
        if buf.shape[0] > rows:
            chk.check(bool((buf[rows:] == 0).all()),
                      f"{where}: {name} padding rows are not zero: {buf[rows:].abs().max()}")

    for name, p in _unique_params(model):
        if p.dim() == 0:
            continue
        one(f"parameter {name}", p, p)
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                one(f"optimizer state {name}.{k}", v, p)


def compare_with_reference(chk: ParityChecker, where: str, model, opt, ref_model, ref_opt) -> None:
    """Every parameter and optimizer state, gathered (``full_tensor()``), against the reference
    (DDP's plain tensors or FSDP2's DTensors, gathered too)."""
    ours = _unique_params(model)
    ref = _unique_params(ref_model)
    chk.check([n for n, _ in ours] == [n for n, _ in ref],
              f"{where}: parameter names {[n for n, _ in ours]} vs {[n for n, _ in ref]}")
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    for (name, p), (_, q) in zip(ours, ref):
        chk.close("param", f"{where}: parameter {name}", full(p), full(q).detach())
        st, ref_st = opt.state.get(p, {}), ref_opt.state.get(q, {})
        chk.check(sorted(st) == sorted(ref_st),
                  f"{where}: optimizer state keys of {name}: {sorted(st)} vs {sorted(ref_st)}")
        for k in ref_st:
            if k in st:
                chk.close("state", f"{where}: optimizer state {name}.{k}", full(st[k]),
                          full(ref_st[k]))
    ref_buffers = dict(ref_model.named_buffers())
    for name, b in model.named_buffers():
        chk.close("buffer", f"{where}: buffer {name}", b, ref_buffers[name])


def graph_collectives(gm) -> dict:
    """What the final graph communicates: node counts per kind, the parameters each kind covers
    (from the collective meta; a bucket lists several), and the all_reduce result shapes."""
    from spmd_compiler.passes import meta
    from spmd_compiler.passes.collectives import COLLECTIVE_OPS as kinds, c10d

    counts: Counter = Counter()
    covered: dict[str, dict[str, list[str]]] = {}
    all_reduce_shapes = []
    nbytes: dict[str, int] = {}
    waits = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is c10d.wait_tensor.default:
            waits += 1
            continue
        kind = kinds.get(node.target)
        if kind is None:
            chk_name = str(node.target)
            if "_c10d_functional" in chk_name or "c10d" in chk_name:
                counts[chk_name] += 1
            continue
        counts[kind] += 1
        nbytes[kind] = nbytes.get(kind, 0) + (node.meta.get(meta.COLLECTIVE, {}).get("bytes") or 0)
        region = str(getattr(node.meta.get(meta.REGION), "value", node.meta.get(meta.REGION)))
        for fqn in node.meta.get(meta.COLLECTIVE, {}).get("params", []):
            covered.setdefault(kind, {}).setdefault(region, []).append(fqn)
        if kind == "all_reduce":
            all_reduce_shapes.append(tuple(node.meta["val"].shape))
    return dict(counts=dict(counts), covered=covered, all_reduce_shapes=all_reduce_shapes,
                waits=waits, bytes=nbytes)


# --------------------------------------------------------------------------------------------------
# Worker side: parity with DDP
# --------------------------------------------------------------------------------------------------


def _run_case(case: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler.api import compile as spmd_api_compile

    torch.manual_seed(0)  # the same initial model on every rank
    model = FS_MODELS[case["model"]]()
    ddp = DDP(deepcopy(model))
    opt, ddp_opt = _make_optimizer(model, case), _make_optimizer(ddp.module, case)
    step_fn = STEP_FNS[case.get("step", "train_step")]
    batch_dim = case.get("batch_dim", 0)
    # The seed's spelling.
    compiled = spmd_api_compile(
        parallel_mode=_mode(case.get("raf", True), batch_dim, **case.get("mode", {})))(step_fn)

    chk = ParityChecker()
    counts, norms = [], []
    for i in range(FULL_STEPS + 1):
        b = BATCH if i < FULL_STEPS else SHORT_BATCH
        x, y = _batch(100 + i, b, batch_dim)
        out = compiled(model, opt, (x.clone(), y.clone()))
        ref_out = step_fn(ddp, ddp_opt, (x, y))
        counts.append(compiled.compile_count)
        loss, ref_loss = (out[0], ref_out[0]) if isinstance(out, tuple) else (out, ref_out)
        chk.check(loss.dim() == 0 and not hasattr(loss, "full_tensor"),
                  f"step {i}: loss is {type(loss).__name__} of shape {tuple(loss.shape)}")
        chk.close("loss", f"step {i}: loss", loss, ref_loss.detach())
        if isinstance(out, tuple):  # clip_step: the global gradient norm, before clipping
            chk.close("loss", f"step {i}: total grad norm", out[1], ref_out[1])
            norms.append(float(ref_out[1]))
        compare_with_reference(chk, f"step {i}", model, opt, ddp.module, ddp_opt)
        check_layout(chk, f"step {i}", model, opt)
    # The seed's spelling of gathering a parameter agrees with full_tensor().
    from torch.distributed.tensor import Replicate

    for name, p in _unique_params(model):
        gathered = p.redistribute(placements=[Replicate()]).to_local()
        chk.check(torch.equal(gathered, p.full_tensor()),
                  f"{name}: redistribute(Replicate()).to_local() differs from full_tensor()")
    gm = compiled.last_compiled.traced.gm  # None on a rank that received the program
    graph = graph_collectives(gm) if gm is not None else None
    params = {n: tuple(p.shape) for n, p in _unique_params(model)}
    return dict(max_err=chk.max_err, problems=chk.problems, counts=counts, norms=norms,
                graph=graph, params=params)


def parity_job(names: list[str]) -> dict[str, dict]:
    """Run the named cases one after the other; a case that raises is reported, not fatal."""
    out = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            out[name] = _run_case(CASES[name])
        except Exception as e:  # noqa: BLE001 - reported per case
            out[name] = dict(exception=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            dist.barrier()  # keep the ranks together for the next case
        out[name]["seconds"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------------------------------
# Tests: parity with DDP, layout, collective coverage
# --------------------------------------------------------------------------------------------------

_REPORTS = SelectedCases(parity_job, lambda item: item.callspec.params.get("case"), timeout=900)


def _case_report(pool, case: str, rank: int) -> dict:
    rep = _REPORTS.reports(pool)[rank][case]
    assert "exception" not in rep, f"{case} raised on rank {rank}: {rep.get('exception')}"
    return rep


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("case", list(CASES))
def test_fully_shard_matches_ddp(pool, case, record_property):
    expected_compiles = CASES[case]["compiles"]
    for rank in range(pool.world_size):
        rep = _case_report(pool, case, rank)
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert_parity_report(rep, case, pool.world_size, rank, expected_compiles)
        if CASES[case].get("step") in _CLIP_STEPS:
            # Clipping must actually scale the gradients, or the test proves nothing.
            assert min(rep["norms"]) > MAX_NORM, rep["norms"]


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c]["bwd"] is not None])
def test_collectives_cover_each_parameter(pool, case):
    """With the default options (bucketing may merge collectives): every parameter is
    reduce-scattered once, gathered once for the forward and, with reshard_after_forward, once more
    for the backward exactly when the backward reads it; no gradient is all-reduced whole (the only
    all_reduces are the scalar parameters' and clip_grad_norm_'s: one, of the parameters' partial
    norms stacked, not one per parameter)."""
    spec = CASES[case]
    raf = spec.get("raf", True)
    rep = _case_report(pool, case, 0)
    params = rep["params"]
    covered = rep["graph"]["covered"]
    sharded = sorted(n for n, s in params.items() if len(s) > 0)
    rs = covered.get("reduce_scatter", {})
    assert sorted(f for fqns in rs.values() for f in fqns) == sharded, rs
    ag = covered.get("all_gather", {})
    assert sorted(ag.get("forward", [])) == sharded, ag
    expected_bwd = sorted(spec["bwd"]) if raf else []
    assert sorted(ag.get("backward", [])) == expected_bwd, ag
    assert set(ag) <= {"forward", "backward"}, f"gathers outside forward/backward: {ag}"
    # Only 0-d parameters (not sharded) have their gradients all-reduced.
    scalars = sorted(n for n, s in params.items() if len(s) == 0)
    ar = covered.get("all_reduce", {})
    assert sorted(f for fqns in ar.values() for f in fqns) == scalars, ar
    shapes = rep["graph"]["all_reduce_shapes"]
    if spec.get("step") in _CLIP_STEPS:
        assert len(shapes) == len(scalars) + 1, shapes
        assert sorted(math.prod(s) for s in shapes)[:-1] == [1] * len(scalars), shapes
    else:
        assert all(math.prod(s) == 1 for s in shapes), f"non-scalar all_reduce: {shapes}"
        assert len(shapes) == len(scalars), f"all_reduce in a step without clipping: {shapes}"


# --------------------------------------------------------------------------------------------------
# Collective counts with bucketing off
# --------------------------------------------------------------------------------------------------

GRAPH_CASES = {
    # name: (model, step, raf, expected all_gather, reduce_scatter, all_reduce) — SimpleMLP has 4
    # parameters; only net2.weight is read by the backward (net1's input needs no gradient).
    # TiedMLP has 7 distinct parameters; the backward reads hidden_a.weight (tied, gathered once
    # for both uses) and out.weight. clip_grad_norm_ adds one all_reduce: the per-parameter
    # partial sums of squares of _foreach_norm, stacked (not one per parameter).
    "SimpleMLP_reshard": ("SimpleMLP", "train_step", True, 4 + 1, 4, 0),
    "SimpleMLP_no_reshard": ("SimpleMLP", "train_step", False, 4, 4, 0),
    "TiedMLP_reshard": ("TiedMLP", "train_step", True, 7 + 2, 7, 0),
    "TiedMLP_no_reshard": ("TiedMLP", "train_step", False, 7, 7, 0),
    "SimpleMLP_clip_reshard": ("SimpleMLP", "clip_step", True, 4 + 1, 4, 1),
    "SimpleMLP_clip_no_reshard": ("SimpleMLP", "clip_step", False, 4, 4, 1),
}


def graph_count_job(bucketing: bool = False) -> dict:
    """One plain SGD step (no optimizer state, one compile) per graph case, bucketing off unless
    asked for."""
    out = {}
    for name, (model_name, step_name, raf, *_rest) in GRAPH_CASES.items():
        from spmd_compiler import spmd_compile

        torch.manual_seed(0)
        model = FS_MODELS[model_name]()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        compiled = spmd_compile(_mode(raf, bucketing=bucketing))(STEP_FNS[step_name])
        compiled(model, opt, _batch(7, BATCH, 0))
        gm = compiled.last_compiled.traced.gm  # None on a rank that received the program
        out[name] = graph_collectives(gm) if gm is not None else None
    return out


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_collective_counts_unbucketed(pool):
    reports = pool.run(graph_count_job, timeout=600)
    for name, (_, _, raf, n_ag, n_rs, n_ar) in GRAPH_CASES.items():
        # rank 0 builds every program, the others receive it (build/shared_compile.py)
        assert reports[0][name] is not None and all(rep[name] is None for rep in reports[1:])
        for rank, rep in enumerate(reports[:1]):
            g = rep[name]
            got = {k: g["counts"].get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
            assert got == dict(all_gather=n_ag, reduce_scatter=n_rs, all_reduce=n_ar), (
                f"{name} (raf={raf}) on rank {rank}: {g['counts']}"
            )
            assert set(g["counts"]) <= {"all_gather", "reduce_scatter", "all_reduce"}, g["counts"]
            assert g["waits"] == n_ag + n_rs + n_ar, g
            # clipping's one all_reduce: a vector of the four parameters' partial norms
            assert g["all_reduce_shapes"] == [(4,)] * n_ar, g["all_reduce_shapes"]


# --------------------------------------------------------------------------------------------------
# Parity with FSDP2
# --------------------------------------------------------------------------------------------------

FSDP2_STEPS = 5


def fsdp2_job(raf: bool) -> dict:
    """SimpleMLP with Adam: ``torch.distributed.fsdp.fully_shard`` on each Linear, then the root,
    against the compiled fully_shard step, from the same initial model with the same data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spmd_compiler import spmd_compile

    ws = dist.get_world_size()
    torch.manual_seed(0)
    model = SimpleMLP()
    ref = deepcopy(model)
    mesh = init_device_mesh("cpu", (ws,))
    for m in ref.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, reshard_after_forward=raf)
    fully_shard(ref, mesh=mesh, reshard_after_forward=raf)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    compiled = spmd_compile(_mode(raf))(train_step)

    chk = ParityChecker()
    for i in range(FSDP2_STEPS):
        x, y = _batch(300 + i, BATCH, 0)
        loss = compiled(model, opt, (x.clone(), y.clone()))
        ref_loss = train_step(ref, ref_opt, (x, y))
        chk.close("loss", f"step {i}: loss", loss, ref_loss.detach())
        compare_with_reference(chk, f"step {i}", model, opt, ref, ref_opt)
        check_layout(chk, f"step {i}", model, opt)
        # Same layout as FSDP2's: the local shards themselves agree, not only the gathered values.
        for (name, p), (_, q) in zip(_unique_params(model), _unique_params(ref)):
            chk.check(tuple(p.placements) == tuple(q.placements),
                      f"step {i}: {name} placements {p.placements} vs FSDP2 {q.placements}")
            chk.close("param", f"step {i}: local shard of {name}", p.to_local(),
                      q.to_local().detach())
    return dict(max_err=chk.max_err, problems=chk.problems)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("raf", [True, False], ids=["reshard", "no_reshard"])
def test_fully_shard_matches_fsdp2(pool, raf, record_property):
    for rank, rep in enumerate(pool.run(fsdp2_job, raf, timeout=600)):
        record_property(f"rank{rank}_max_err", rep["max_err"])
        assert not rep["problems"], (
            f"differs from FSDP2 on rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
        )


# --------------------------------------------------------------------------------------------------
# Persistent memory per rank
# --------------------------------------------------------------------------------------------------

MEMORY_MODELS = {"SimpleMLP": (SimpleMLP, (50, 8)), "WideMLP": (WideMLP, (1024, 1024))}


def _persistent_bytes(model: nn.Module, opt) -> tuple[int, int]:
    """(bytes the step keeps between calls on this rank, bytes of the padding rows in them):
    parameters and optimizer state as the graph binds them (``local_buffer``: the padded buffer
    for shards), each storage counted once."""
    from torch.distributed.tensor import DTensor

    from spmd_compiler.state.placement import local_buffer

    seen: set[int] = set()
    total = padding = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total, padding
        buf = local_buffer(t)
        key = buf.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        total += buf.untyped_storage().nbytes()
        if isinstance(t, DTensor):
            padding += buf.untyped_storage().nbytes() - t.to_local().numel() * t.element_size()

    for p in model.parameters():
        add(p)
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                add(v)
    return total, padding


def _expected_bytes(model_cls, ws: int, fully_shard: bool) -> int:
    """Parameters + Adam's exp_avg and exp_avg_sq (padded dim-0 shards when fully_shard) + one
    float32 ``step`` per parameter."""
    total = 0
    for p in model_cls().parameters():
        rows = -(-p.shape[0] // ws) if fully_shard else p.shape[0]
        total += 3 * rows * (p.numel() // p.shape[0]) * p.element_size() + 4
    return total


def memory_job(model_names: list[str]) -> dict:
    from spmd_compiler import DataParallel, spmd_compile

    ws = dist.get_world_size()
    out = {}
    for name in model_names:
        model_cls, width = MEMORY_MODELS[name]
        for style in ("replicate", "fully_shard"):
            torch.manual_seed(0)
            model = model_cls()
            opt = torch.optim.Adam(model.parameters(), lr=0.001)
            mode = _mode() if style == "fully_shard" else DataParallel("replicate")
            compiled = spmd_compile(mode)(train_step)
            for i in range(2):  # creates the state, then runs the steady-state graph
                compiled(model, opt, _batch(400 + i, 8, 0, width))
            total, padding = _persistent_bytes(model, opt)
            out[(name, style)] = dict(
                bytes=total, padding=padding,
                expected=_expected_bytes(model_cls, ws, style == "fully_shard"),
                numel=sum(p.numel() for p in model.parameters()),
            )
    return out


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_persistent_memory_is_a_world_size_fraction(pool, record_property):
    ws = pool.world_size
    reports = pool.run(memory_job, list(MEMORY_MODELS), timeout=600)
    for rank, rep in enumerate(reports):
        for name in MEMORY_MODELS:
            rep_b = rep[(name, "replicate")]
            fs = rep[(name, "fully_shard")]
            record_property(f"rank{rank}_{name}",
                            {"replicate": rep_b["bytes"], "fully_shard": fs["bytes"]})
            assert rep_b["bytes"] == rep_b["expected"], (name, rep_b)
            assert fs["bytes"] == fs["expected"], (name, fs)
            # About 1/world of replicate's: over it only by this rank's share of the padding rows
            # (the same on every rank: each holds ceil(n / world) rows) and the replicated 0-d
            # ``step`` tensors (4 bytes per parameter).
            params = list(MEMORY_MODELS[name][0]().parameters())
            pad_rows_bytes = sum(
                3 * (-(-p.shape[0] // ws) * ws - p.shape[0]) * (p.numel() // p.shape[0]) * 4
                for p in params
            )
            slack = pad_rows_bytes / ws + 4 * len(params)
            if rank == ws - 1:  # the last rank's shards hold all the padding rows
                assert fs["padding"] == pad_rows_bytes, (name, fs, pad_rows_bytes)
            assert rep_b["bytes"] / ws <= fs["bytes"] <= rep_b["bytes"] / ws + slack, (
                name, rep_b, fs, slack
            )
            assert fs["bytes"] == reports[0][(name, "fully_shard")]["bytes"], "ranks differ"


# --------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint round trip
# --------------------------------------------------------------------------------------------------

ROUND_TRIP_VARIANTS = (
    # A fresh model and optimizer placed by one compiled call (on other data), then
    # model.state_dict() / optim.state_dict() as dcp.load targets and load_state_dict.
    "state_dict_after_first_call",
    # The same with torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict.
    "get_set_state_dict_after_first_call",
    # get_state_dict of the plain (not yet compiled) model and optimizer, dcp.load,
    # set_state_dict, and only then the first compiled call: no throw-away step.
    "get_set_state_dict_before_first_call",
)
# Full (unsharded) state dicts: get_state_dict / set_state_dict with
# StateDictOptions(full_state_dict=True), into a model placed by one compiled call.
# set_optimizer_state_dict re-distributes each optimizer state into a new DTensor without the
# padded buffer the graph binds; the next compiled call re-pads it (runtime.placed_state).
FULL_STATE_DICT_VARIANT = "full_state_dict_after_first_call"


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    out = {}
    for name, p in _unique_params(model):
        out[name] = full(p).detach().clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"{name}.{k}"] = full(v).detach().clone()
    return out


def round_trip_job(path: str) -> dict:
    """3 compiled steps, dcp.save of model and optimizer state, then for each variant a fresh
    model + optimizer loaded from the checkpoint and 3 more steps next to the original's 3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    from spmd_compiler import spmd_compile
    from spmd_compiler.state.placement import local_buffer

    ws = dist.get_world_size()
    make = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    torch.manual_seed(0)
    model_cls = UnevenMLP
    model = model_cls()
    opt = make(model)
    compiled = spmd_compile(_mode())(train_step)
    for i in range(3):
        compiled(model, opt, _batch(500 + i, BATCH, 0))
    saved = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(saved, checkpoint_id=f"{path}/plain")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/dsd")
    full_options = StateDictOptions(full_state_dict=True)
    # Deep-copied: plain tensors (Adam's step) in a state dict are the live ones, which the next
    # steps update in place, as eager Adam does.
    full_msd, full_osd = deepcopy(get_state_dict(model, opt, options=full_options))
    expected = []
    for i in range(3, 6):
        compiled(model, opt, _batch(500 + i, BATCH, 0))
        expected.append(_snapshot(model, opt))

    out = {}
    for variant in ROUND_TRIP_VARIANTS + (FULL_STATE_DICT_VARIANT,):
        res = dict(max_err=0.0, bitwise=True, problems=[])
        try:
            torch.manual_seed(1)  # a different initial model: loading must overwrite all of it
            model2 = model_cls()
            opt2 = make(model2)
            compiled2 = spmd_compile(_mode())(train_step)
            if variant == "state_dict_after_first_call":
                compiled2(model2, opt2, _batch(900, BATCH, 0))
                sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
                dcp.load(sd, checkpoint_id=f"{path}/plain")
                model2.load_state_dict(sd["model"])
                opt2.load_state_dict(sd["optim"])
            elif variant == FULL_STATE_DICT_VARIANT:
                compiled2(model2, opt2, _batch(900, BATCH, 0))
                set_state_dict(model2, opt2, model_state_dict=full_msd,
                               optim_state_dict=full_osd, options=full_options)
            else:
                if variant == "get_set_state_dict_after_first_call":
                    compiled2(model2, opt2, _batch(900, BATCH, 0))
                m2, o2 = get_state_dict(model2, opt2)
                sd = {"model": m2, "optim": o2}
                dcp.load(sd, checkpoint_id=f"{path}/dsd")
                set_state_dict(model2, opt2, model_state_dict=sd["model"],
                               optim_state_dict=sd["optim"])
            compiles_before = compiled2.compile_count
            for j, i in enumerate(range(3, 6)):
                compiled2(model2, opt2, _batch(500 + i, BATCH, 0))
                if j == 0:
                    # After the first resumed step the loaded state must be laid out as the graph
                    # binds it: a padded buffer of ceil(n / world) rows whose head is the
                    # DTensor's local tensor (the runtime re-pads states that arrived without).
                    for name, p in model2.named_parameters():
                        for what, t in [("", p)] + list(opt2.state.get(p, {}).items()):
                            if not hasattr(t, "to_local") or t.dim() == 0:
                                continue
                            rows = -(-t.shape[0] // ws)
                            buf = local_buffer(t)
                            if buf.shape[0] != rows or (
                                t.to_local().numel() and buf.data_ptr() != t.to_local().data_ptr()
                            ):
                                res["problems"].append(
                                    f"{name}{'.' if what else ''}{what}: the graph binds a buffer "
                                    f"of shape {tuple(buf.shape)} ({rows} rows expected)")
                got = _snapshot(model2, opt2)
                if sorted(got) != sorted(expected[j]):
                    res["problems"].append(f"step {i}: keys {sorted(got)} vs {sorted(expected[j])}")
                    continue
                for k, e in expected[j].items():
                    err = float((got[k].double() - e.double()).abs().max()) if e.numel() else 0.0
                    res["max_err"] = max(res["max_err"], err)
                    res["bitwise"] &= torch.equal(got[k], e)
                    if not err <= ROUND_TRIP_ATOL:
                        res["problems"].append(f"step {i}: {k} differs by {err:.3g}")
            res["compiles"] = (compiles_before, compiled2.compile_count)
        except Exception as e:  # noqa: BLE001 - reported per variant
            res["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            dist.barrier()
        out[variant] = res
    return out


_ROUND_TRIP: dict[int, list[dict]] = {}


def _check_round_trip(pool, variant, tmp_path_factory, record_property) -> None:
    if pool.world_size not in _ROUND_TRIP:
        path = str(tmp_path_factory.mktemp(f"dcp_ws{pool.world_size}"))
        _ROUND_TRIP[pool.world_size] = pool.run(round_trip_job, path, timeout=600)
    problems = []
    for rank, reports in enumerate(_ROUND_TRIP[pool.world_size]):
        rep = reports[variant]
        assert "exception" not in rep, f"rank {rank}: {rep.get('exception')}"
        record_property(f"rank{rank}_max_err", rep["max_err"])
        record_property(f"rank{rank}_bitwise", rep["bitwise"])
        problems += [f"rank {rank}: {p}" for p in rep["problems"][:10]]
    assert not problems, "\n  ".join(problems)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("variant", ROUND_TRIP_VARIANTS)
def test_checkpoint_round_trip(pool, variant, tmp_path_factory, record_property):
    """UnevenMLP: uneven shards at both world sizes and an empty one at 3, so a loaded state that
    lost the padded layout could not run."""
    _check_round_trip(pool, variant, tmp_path_factory, record_property)


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_checkpoint_round_trip_full_state_dict(pool, tmp_path_factory, record_property):
    _check_round_trip(pool, FULL_STATE_DICT_VARIANT, tmp_path_factory, record_property)


# --------------------------------------------------------------------------------------------------
# The numbers in docs/fully_shard.md: python -m tests.test_fully_shard
# --------------------------------------------------------------------------------------------------


def _print_report() -> None:
    from tests.multirank import WorkerPool

    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    for ws in (2, 3):
        with WorkerPool(ws) as pool:
            mem = pool.run(memory_job, list(MEMORY_MODELS), timeout=900)[-1]
            graphs = {b: pool.run(graph_count_job, b, timeout=900)[0] for b in (False, True)}
        print(f"\nworld size {ws}: persistent bytes per rank (last rank), Adam")
        print("| model | parameters | replicate | fully_shard | ratio | padding |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in MEMORY_MODELS:
            r, f = mem[(name, "replicate")], mem[(name, "fully_shard")]
            print(f"| {name} | {r['numel']:,} | {r['bytes']:,} | {f['bytes']:,} | "
                  f"{r['bytes'] / f['bytes']:.3f} | {f['padding']:,} |")
        print(f"\nworld size {ws}: collectives per step (count / bytes)")
        print("| graph | bucketing | " + " | ".join(kinds) + " |")
        print("|---|---|" + "---:|" * len(kinds))
        for b, reps in graphs.items():
            for name, g in reps.items():
                cells = [f"{g['counts'].get(k, 0)} / {g['bytes'].get(k, 0):,}" for k in kinds]
                print(f"| {name} | {'on' if b else 'off'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    from tests.test_fully_shard import _print_report as _report  # importable by the workers

    _report()
