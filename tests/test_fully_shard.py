"""fully_shard data parallelism checked on real gloo groups (world sizes 2 and 3).

World size 3 makes shards uneven: a bias of 8 rows is split 3/3/2, and :class:`SmallRowsMLP`'s
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

from tests.models import MODELS, SimpleMLP, mse_step, train_step
from tests.multirank import rank_data
from tests.test_replicate import ATOL, RTOL, _Checker, _make_optimizer

BATCH = 16  # local batch size of the full steps
SHORT_BATCH = 11  # the last, short batch
FULL_STEPS = 5  # full steps, then one short step
MAX_NORM = 1.0  # clip_grad_norm_'s max_norm: the gradients of train_step's sum loss are far larger
ROUND_TRIP_ATOL = 1e-7


# --------------------------------------------------------------------------------------------------
# Models and steps (module level: the worker processes import them by name)
# --------------------------------------------------------------------------------------------------


class TransposedMLP(nn.Module):
    """The seed's non-0 batch dim model: inputs are ``(50, batch)``, outputs ``(8, batch)``."""

    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()

    def forward(self, x):
        reshaped_x = x.t().contiguous()
        return self.mlp(reshaped_x).t()


class SmallRowsMLP(nn.Module):
    """A first layer with 2 output rows: fewer rows than ranks at world size 3."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 2)
        self.net2 = nn.Linear(2, 8)

    def forward(self, x):
        return torch.sigmoid(self.net2(torch.relu(self.net1(x))))


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


FS_MODELS = {**MODELS, "TransposedMLP": TransposedMLP, "SmallRowsMLP": SmallRowsMLP}


def clip_step(model, optim, train_batch):
    """train_step with ``clip_grad_norm_`` between backward and step; returns the total norm too."""

    def loss_fn(out, labels):
        return (out - labels).sum()

    optim.zero_grad()
    inputs, labels = train_batch
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optim.step()
    return loss, total_norm


STEP_FNS = {"train_step": train_step, "mse_step": mse_step, "clip_step": clip_step}

# name -> case. "optim": (class name, kwargs); "raf": reshard_after_forward; "batch_dim":
# input_batch_dim (1: inputs are (features, batch)); "compiles": expected compile_count after all
# steps (an optimizer that creates state compiles twice: once creating it, once for the steady
# state); "bwd_gathers": the parameters whose gathered value the backward reads (the weight of
# every layer whose input gradient is needed), gathered a second time when raf is True.
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
    "adam_fused": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.1, "fused": True}), compiles=2,
                       bwd=_MLP_BWD),
    "batch_dim_model_sgd": dict(model="BatchDimModel", optim=("SGD", {"lr": 0.1}), compiles=1,
                                bwd=["mlp.net2.weight"]),
    "non_0_batch_dim_adam_fused": dict(
        model="TransposedMLP", optim=("Adam", {"lr": 0.1, "fused": True}), batch_dim=1,
        compiles=2, bwd=["mlp.net2.weight"],
    ),
    # More optimizers, both values of reshard_after_forward.
    "adam_foreach": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01, "foreach": True}),
                         compiles=2, bwd=_MLP_BWD),
    "adamw_weight_decay": dict(model="SimpleMLP",
                               optim=("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
                               compiles=2, bwd=_MLP_BWD),
    "adam_fused_no_reshard": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01, "fused": True}),
                                  raf=False, compiles=2, bwd=_MLP_BWD),
    "sgd_momentum_no_reshard": dict(model="SimpleMLP",
                                    optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
                                    raf=False, compiles=2, bwd=_MLP_BWD),
    # Tied weights, tiny shards, buffers, gradient clipping.
    "tied_weights": dict(model="TiedMLP", optim=("Adam", {"lr": 0.01}), compiles=2,
                         bwd=["hidden_a.weight", "out.weight"]),
    "tied_weights_no_reshard": dict(model="TiedMLP", optim=("SGD", {"lr": 0.01, "momentum": 0.9}),
                                    raf=False, compiles=2, bwd=["hidden_a.weight", "out.weight"]),
    "small_rows_adam": dict(model="SmallRowsMLP", optim=("Adam", {"lr": 0.01}), compiles=2,
                            bwd=["net2.weight"]),
    "batchnorm_buffers": dict(model="BatchNormMLP", optim=("SGD", {"lr": 0.1, "momentum": 0.9}),
                              step="mse_step", compiles=2, bwd=None),
    "clip_grad_norm_adam": dict(model="SimpleMLP", optim=("Adam", {"lr": 0.01}), step="clip_step",
                                compiles=2, bwd=_MLP_BWD),
    "clip_grad_norm_sgd_no_reshard": dict(
        model="SimpleMLP", optim=("SGD", {"lr": 0.05, "momentum": 0.9, "foreach": True}),
        step="clip_step", raf=False, compiles=2, bwd=_MLP_BWD,
    ),
}


# --------------------------------------------------------------------------------------------------
# Worker side: helpers
# --------------------------------------------------------------------------------------------------


def _mode(raf: bool = True, batch_dim: int = 0, bucketing: bool = True):
    """DataParallel("fully_shard", ...) with bucketing off on request (when the option exists)."""
    from spmd_compiler.parallel_mode import DataParallel

    kwargs = dict(reshard_after_forward=raf, input_batch_dim=batch_dim)
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


def check_layout(chk: _Checker, where: str, model, opt) -> None:
    """Shard(0) DTensors on a 1-D mesh of every rank, torch.chunk rows per rank, states placed like
    their parameter, and the padded buffer the graph updates: the DTensor's local tensor is its
    leading rows, and the padding rows are still zero."""
    from torch.distributed.tensor import DTensor, Shard

    from spmd_compiler.runtime import local_buffer

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


def compare_with_reference(chk: _Checker, where: str, model, opt, ref_model, ref_opt) -> None:
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
    from passes import meta

    c10d = torch.ops._c10d_functional
    kinds = {
        c10d.all_gather_into_tensor.default: "all_gather",
        c10d.reduce_scatter_tensor.default: "reduce_scatter",
        c10d.all_reduce.default: "all_reduce",
        c10d.broadcast.default: "broadcast",
    }
    counts: Counter = Counter()
    covered: dict[str, dict[str, list[str]]] = {}
    all_reduce_shapes = []
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
        region = str(getattr(node.meta.get(meta.REGION), "value", node.meta.get(meta.REGION)))
        for fqn in node.meta.get(meta.COLLECTIVE, {}).get("params", []):
            covered.setdefault(kind, {}).setdefault(region, []).append(fqn)
        if kind == "all_reduce":
            all_reduce_shapes.append(tuple(node.meta["val"].shape))
    return dict(counts=dict(counts), covered=covered, all_reduce_shapes=all_reduce_shapes,
                waits=waits)


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
    compiled = spmd_api_compile(parallel_mode=_mode(case.get("raf", True), batch_dim, bucketing=False))(step_fn)

    chk = _Checker()
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
    graph = graph_collectives(compiled.last_compiled.traced.gm)
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

_REPORTS: dict[int, list[dict]] = {}  # world size -> per-rank reports of every case


def _reports(pool) -> list[dict]:
    if pool.world_size not in _REPORTS:
        _REPORTS[pool.world_size] = pool.run(parity_job, list(CASES), timeout=900)
    return _REPORTS[pool.world_size]


def _case_report(pool, case: str, rank: int) -> dict:
    rep = _reports(pool)[rank][case]
    assert "exception" not in rep, f"{case} raised on rank {rank}: {rep.get('exception')}"
    return rep


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("case", list(CASES))
def test_fully_shard_matches_ddp(pool, case, record_property):
    expected_compiles = CASES[case]["compiles"]
    for rank in range(pool.world_size):
        rep = _case_report(pool, case, rank)
        record_property(f"rank{rank}_max_err", rep["max_err"])
        problems = rep["problems"]
        assert not problems, (
            f"{case} (world size {pool.world_size}) differs from DDP on rank {rank}: "
            f"{len(problems)} problem(s):\n  " + "\n  ".join(problems[:20])
        )
        counts = rep["counts"]
        assert counts[-1] == counts[-2], f"{case}: the short batch recompiled: counts {counts}"
        assert counts[1:] == [expected_compiles] * (len(counts) - 1), (
            f"{case}: compile_count after each step {counts}, expected {expected_compiles} from "
            f"the second step on"
        )
        if CASES[case].get("step") == "clip_step":
            # Clipping must actually scale the gradients, or the test proves nothing.
            assert min(rep["norms"]) > MAX_NORM, rep["norms"]


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c]["bwd"] is not None])
def test_collectives_cover_each_parameter(pool, case):
    """With the default options (bucketing may merge collectives): every parameter is
    reduce-scattered once, gathered once for the forward and, with reshard_after_forward, once more
    for the backward exactly when the backward reads it; no gradient is all-reduced whole (the only
    all_reduces are the scalar partial norms of clip_grad_norm_)."""
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
    shapes = rep["graph"]["all_reduce_shapes"]
    if spec.get("step") == "clip_step":
        assert shapes and all(math.prod(s) == 1 for s in shapes), shapes
    else:
        assert not shapes, f"all_reduce in a fully_shard step without clipping: {shapes}"
    assert "all_reduce" not in covered, f"all_reduce of parameter gradients: {covered}"


# --------------------------------------------------------------------------------------------------
# Collective counts with bucketing off
# --------------------------------------------------------------------------------------------------

GRAPH_CASES = {
    # name: (model, step, raf, expected all_gather, reduce_scatter, all_reduce) — SimpleMLP has 4
    # parameters; only net2.weight is read by the backward (net1's input needs no gradient).
    # TiedMLP has 7 distinct parameters; the backward reads hidden_a.weight (tied, gathered once
    # for both uses) and out.weight. clip_grad_norm_ adds one scalar all_reduce per parameter
    # (the partial sums of squares of _foreach_norm).
    "SimpleMLP_reshard": ("SimpleMLP", "train_step", True, 4 + 1, 4, 0),
    "SimpleMLP_no_reshard": ("SimpleMLP", "train_step", False, 4, 4, 0),
    "TiedMLP_reshard": ("TiedMLP", "train_step", True, 7 + 2, 7, 0),
    "TiedMLP_no_reshard": ("TiedMLP", "train_step", False, 7, 7, 0),
    "SimpleMLP_clip_reshard": ("SimpleMLP", "clip_step", True, 4 + 1, 4, 4),
    "SimpleMLP_clip_no_reshard": ("SimpleMLP", "clip_step", False, 4, 4, 4),
}


def graph_count_job() -> dict:
    """One plain SGD step (no optimizer state, one compile) per graph case, bucketing off."""
    out = {}
    for name, (model_name, step_name, raf, *_rest) in GRAPH_CASES.items():
        from spmd_compiler import spmd_compile

        torch.manual_seed(0)
        model = FS_MODELS[model_name]()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        compiled = spmd_compile(_mode(raf, bucketing=False))(STEP_FNS[step_name])
        compiled(model, opt, _batch(7, BATCH, 0))
        out[name] = graph_collectives(compiled.last_compiled.traced.gm)
    return out


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
def test_collective_counts_unbucketed(pool):
    reports = pool.run(graph_count_job, timeout=600)
    for name, (_, _, raf, n_ag, n_rs, n_ar) in GRAPH_CASES.items():
        for rank, rep in enumerate(reports):
            g = rep[name]
            got = {k: g["counts"].get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
            assert got == dict(all_gather=n_ag, reduce_scatter=n_rs, all_reduce=n_ar), (
                f"{name} (raf={raf}) on rank {rank}: {g['counts']}"
            )
            assert set(g["counts"]) <= {"all_gather", "reduce_scatter", "all_reduce"}, g["counts"]
            assert g["waits"] == n_ag + n_rs + n_ar, g
            assert all(math.prod(s) == 1 for s in g["all_reduce_shapes"]), g["all_reduce_shapes"]
