"""Tensor parallelism from torch's own plans inside the compiled step (seed 004, ported to
CPU/gloo): the compiled step against eager DTensor TP and against a single-device copy, over
several Adam steps, every parameter and optimizer state compared; collective counts against
CommDebugMode's count of the eager step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.multirank import ParityChecker, run_without_problems

pytestmark = pytest.mark.multirank

STEPS = 3


def mse_adam_step(model, optim, x, y, scale=1.0):
    optim.zero_grad()
    loss = ((model(x) - y) ** 2).mean() * scale
    loss.backward()
    optim.step()
    return loss


def full(t):
    """The whole tensor of a parameter or state, on every rank (a collective for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_models(chk: ParityChecker, name: str, model, opt, ref_model, ref_opt) -> None:
    """Every parameter and optimizer state of ``model``/``opt`` against the reference's, whole."""
    ref_params = dict(ref_model.named_parameters())
    for fqn, p in model.named_parameters():
        chk.close("param", f"{name} {fqn}", full(p.detach()), full(ref_params[fqn].detach()))
        st, ref_st = opt.state[p], ref_opt.state[ref_params[fqn]]
        chk.check(set(st) == set(ref_st), f"{name} {fqn}: states {sorted(st)} vs {sorted(ref_st)}")
        for k in ref_st:
            if k in st:
                chk.close("state", f"{name} {fqn} {k}", full(st[k]), full(ref_st[k]))


def collective_nodes(step) -> dict[str, int]:
    """Collectives in the last compiled graph, by name (issue nodes, not waits)."""
    counts: dict[str, int] = {}
    for n in step.last_compiled.traced.gm.graph.nodes:
        if n.op == "call_function" and "c10d" in str(n.target) and "wait" not in str(n.target):
            name = str(n.target).split(".")[-2]
            counts[name] = counts.get(name, 0) + 1
    return counts


def eager_counts(fn) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items() if v}


# --------------------------------------------------------------------------------------------------
# TP alone: seed 004's models, each against eager DTensor TP and a single-device copy
# --------------------------------------------------------------------------------------------------


def tp_alone_parity(build, batch, step_fn, ref_scale: float = 1.0, local_batch=None) -> dict:
    """``build(mesh)`` -> (single-device model, a function that parallelizes a copy of it);
    ``batch(i)`` -> the step's tensors (the same on every rank); ``local_batch(tensors, mesh)``
    -> this rank's part of them where the plan shards the input (sequence parallel).
    Runs STEPS Adam steps on the three and compares every parameter and optimizer state."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import spmd_compile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    single, parallelize = build(mesh)
    eager, compiled = parallelize(copy.deepcopy(single)), parallelize(copy.deepcopy(single))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (single, eager, compiled)]
    step = spmd_compile(mesh=mesh)(step_fn)
    chk = ParityChecker()
    counts = {}
    for i in range(STEPS):
        torch.manual_seed(100 + i)  # the same batch on every rank, as torch's TP tests
        tensors = batch(i)
        local = local_batch(tensors, mesh) if local_batch else tensors
        ref_loss = step_fn(single, opts[0], *tensors, scale=ref_scale)
        counts["eager"] = eager_counts(lambda: step_fn(eager, opts[1], *local))
        loss = step(compiled, opts[2], *local)
        if local_batch is None:
            chk.close("loss", f"step {i} loss", full(loss), ref_loss)
    compare_models(chk, "vs eager TP", compiled, opts[2], eager, opts[1])
    compare_models(chk, "vs single device", compiled, opts[2], single, opts[0])
    if local_batch is None:  # the model keeps working outside the step (outputs after layers of
        out = ParityChecker(atol=1e-5)  # sharded reductions: round-off of 1e-6 on logits near 0)
        with torch.no_grad():
            out.close("loss", "model(x) after the steps", full(compiled(tensors[0])), single(tensors[0]))
        chk.problems += out.problems
    counts["compiled"] = collective_nodes(step)
    placements = {n: (type(p).__name__, tuple(getattr(p, "placements", ()))) for n, p in compiled.named_parameters()}
    return dict(problems=chk.problems, max_err=chk.max_err, counts=counts, placements=placements,
                module=compiled)


def _mlp(is_seq_parallel: bool):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

    if is_seq_parallel:
        plan = {"net1": ColwiseParallel(input_layouts=Shard(0)),
                "net2": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    return lambda mesh: (MLPModule("cpu"), lambda m: parallelize_module(m, mesh, plan))


def _rows(tensors, mesh):
    """This rank's rows (sequence parallel over dim 0)."""
    n = tensors[0].shape[0] // mesh.size()
    return [t[mesh.get_local_rank() * n:][:n] for t in tensors]


def mlp_tp_job(is_seq_parallel: bool = False):
    # sequence parallel: each rank's loss is the mean over its rows, and the gradients the plan's
    # collectives produce are those of their sum over ranks
    rep = tp_alone_parity(_mlp(is_seq_parallel), lambda i: (torch.rand(8, 10), torch.rand(8, 10)),
                          mse_adam_step, ref_scale=dist.get_world_size() if is_seq_parallel else 1.0,
                          local_batch=_rows if is_seq_parallel else None)
    del rep["module"]
    return rep


@pytest.mark.parametrize("is_seq_parallel", [False, True])
def test_mlp_tp_alone(pool2, is_seq_parallel):
    reps = run_without_problems(pool2, mlp_tp_job, is_seq_parallel, timeout=300)
    counts = reps[0]["counts"]
    # the eager step's collectives (seed 004: the MLP's forward is one all_reduce; sequence
    # parallel's all_gather + reduce_scatter)
    assert counts["compiled"] == counts["eager"], counts
    if not is_seq_parallel:
        assert counts["compiled"] == {"all_reduce": 1}, counts
    p = reps[0]["placements"]
    assert p["net1.weight"][0] == "DTensor" and "Shard(dim=0)" in str(p["net1.weight"][1]), p


def token_ce_step(model, optim, tokens, target, scale=1.0):
    import torch.nn.functional as F

    optim.zero_grad()
    loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten()) * scale
    loss.backward()
    optim.step()
    return loss


def transformer_job(use_seq_parallel: bool):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    def build(mesh):
        args = ModelArgs(dropout_p=0.0, n_layers=2, vocab_size=16, max_seq_len=8, dim=16)
        return Transformer(args), lambda m: Transformer.parallelize(
            m, mesh, use_seq_parallel, local_output_for_attn=True)

    rep = tp_alone_parity(build, lambda i: (torch.randint(16, (4, 8)), torch.randint(16, (4, 8))),
                          token_ce_step)
    m = rep.pop("module")
    rep["tied"] = m.output.weight is m.tok_embeddings.weight
    return rep


@pytest.mark.parametrize("use_seq_parallel", [False, True])
def test_transformer_tp_alone(pool2, use_seq_parallel):
    reps = run_without_problems(pool2, transformer_job, use_seq_parallel, timeout=600)
    for rep in reps:
        assert rep["tied"], "output.weight is no longer tok_embeddings.weight"
    counts = reps[0]["counts"]
    assert sum(counts["compiled"].values()) <= sum(counts["eager"].values()), counts
    if use_seq_parallel:  # eager: each of the 10 norm gradients reduced three times; compiled:
        assert counts["compiled"]["all_reduce"] == 1, counts  # once, in one bucket on tp


def foreach_adam_sp_job():
    """Sequence parallel with the optimizer's own foreach Adam recorded (fuse_optimizer=False,
    a 1 x 2 dp x tp mesh): every op of Adam that reads a norm's Partial gradient asks DTensor for
    its reduction, as in eager; passes/dedup_collectives.py keeps one per gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = Transformer(ModelArgs(dropout_p=0.0, n_layers=2, vocab_size=16, max_seq_len=8, dim=16))
    eager, compiled = (Transformer.parallelize(copy.deepcopy(base), mesh["tp"], True,
                                               local_output_for_attn=True) for _ in range(2))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in (eager, compiled)]
    step = spmd_compile(DataParallel("replicate", fuse_optimizer=False), mesh=mesh)(token_ce_step)
    chk, counts = ParityChecker(), {}
    for i in range(STEPS):
        torch.manual_seed(100 + i)
        tokens, target = torch.randint(16, (4, 8)), torch.randint(16, (4, 8))
        counts["eager"] = eager_counts(lambda: token_ce_step(eager, opts[0], tokens, target))
        step(compiled, opts[1], tokens, target)
    compare_models(chk, "vs eager TP", compiled, opts[1], eager, opts[0])
    counts["compiled"] = collective_nodes(step)
    return dict(problems=chk.problems, counts=counts)


def test_partial_gradient_reduced_once(pool2):
    reps = pool2.run(foreach_adam_sp_job, timeout=600)
    for rank, rep in enumerate(reps):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
    eager, compiled = reps[0]["counts"]["eager"], reps[0]["counts"]["compiled"]
    # eager: 30 all_reduces (each of the 10 norm gradients three times); compiled: each once
    assert compiled["all_reduce"] * 2 < eager["all_reduce"], (eager, compiled)
    assert {k: v for k, v in compiled.items() if k != "all_reduce"} == \
        {k: v for k, v in eager.items() if k != "all_reduce"}, (eager, compiled)


class TiedModule(torch.nn.Module):
    """Seed 004's test_weight_tying module."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embedding = torch.nn.Embedding(16, 8)
        torch.manual_seed(2)
        self.fc = torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(self.embedding(x))


def weight_tying_job():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def build(mesh):
        def parallelize(m):
            parallelize_module(m, mesh, {"embedding": ColwiseParallel(), "fc": RowwiseParallel()})
            m.fc.weight = m.embedding.weight  # tied after parallelizing, as the seed does
            return m

        single = TiedModule()
        single.fc.weight = single.embedding.weight
        return single, parallelize

    rep = tp_alone_parity(build, lambda i: (torch.randint(16, (5,)), torch.rand(5, 16)),
                          mse_adam_step)
    m = rep.pop("module")
    rep["tied"] = m.fc.weight is m.embedding.weight
    return rep


def test_weight_tying(pool2):
    reps = run_without_problems(pool2, weight_tying_job, timeout=300)
    for rep in reps:
        assert rep["tied"], "the tie did not survive the compiled steps"


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.head(self.embedding(x))


def loss_parallel_step(model, optim, x, target, scale=1.0):
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    optim.zero_grad()
    with loss_parallel():
        loss = F.cross_entropy(model(x), target) * scale
        loss.backward()
    optim.step()
    return loss


def loss_parallel_job():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"embedding": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    rep = tp_alone_parity(lambda mesh: (Classifier(), lambda m: parallelize_module(m, mesh, plan)),
                          lambda i: (torch.randint(16, (6,)), torch.randint(16, (6,))),
                          loss_parallel_step)
    del rep["module"]
    return rep


def test_loss_parallel(pool2):
    reps = run_without_problems(pool2, loss_parallel_job, timeout=300)
    counts = reps[0]["counts"]
    assert sum(counts["compiled"].values()) <= sum(counts["eager"].values()), counts


# --------------------------------------------------------------------------------------------------
# Data parallel x tensor parallel on a 2 x 2 mesh
# --------------------------------------------------------------------------------------------------


def dp_averaged_step(model, optim, x, y, group):
    """Eager TP with each gradient averaged over the data-parallel group (DDP over TP)."""
    optim.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    for p in model.parameters():
        local = p.grad.to_local()
        dist.all_reduce(local, group=group)
        local.div_(dist.get_world_size(group))
    optim.step()
    return loss


def check_eager_use(chk: ParityChecker, compiled, eager, style: str, mesh) -> None:
    """``model(x)`` outside the compiled step (each dp rank its own x): the output without grad,
    then an eager forward + backward whose gradients (averaged over dp) match the reference's
    (FSDP2 + TP, or TP with gradients all-reduced over dp)."""
    torch.manual_seed(7 + 1000 * mesh["dp"].get_local_rank())
    x, y = torch.rand(8, 10), torch.rand(8, 10)
    eager.zero_grad()  # its last step left its gradients
    ref_out = eager(x)  # (on torch 2.13 FSDP2+TP gave wrong gradients after a no_grad forward)
    ((ref_out - y) ** 2).mean().backward()
    with torch.no_grad():
        chk.close("loss", "model(x) outside the step", compiled(x), ref_out)
    compiled.zero_grad()
    ((compiled(x) - y) ** 2).mean().backward()
    if style == "replicate":
        for p in eager.parameters():
            dist.all_reduce(p.grad.to_local(), group=mesh["dp"].get_group())
            p.grad.to_local().div_(mesh["dp"].size())
    ref = dict(eager.named_parameters())
    for n, p in compiled.named_parameters():
        chk.check(p.grad is not None and p.grad.placements == p.placements,
                  f"{n}: eager backward's grad {getattr(p.grad, 'placements', None)}")
        if p.grad is not None:
            chk.close("param", f"{n}.grad of an eager backward", full(p.grad), full(ref[n].grad))


def dp_tp_job(style: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    torch.manual_seed(0)
    base = MLPModule("cpu")
    eager = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
    if style == "fully_shard":
        fully_shard(eager, mesh=mesh["dp"])
    compiled = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    step = spmd_compile(DataParallel(style), mesh=mesh)(mse_adam_step)
    chk = ParityChecker()
    dp_rank = mesh["dp"].get_local_rank()
    for i in range(STEPS):
        torch.manual_seed(100 + i + 1000 * dp_rank)  # each dp rank its own batch
        x, y = torch.rand(8, 10), torch.rand(8, 10)
        if style == "fully_shard":
            ref = mse_adam_step(eager, opts[0], x, y)
        else:
            ref = dp_averaged_step(eager, opts[0], x, y, mesh["dp"].get_group())
        loss = step(compiled, opts[1], x, y)
        chk.close("loss", f"step {i} loss", loss, ref)
    compare_models(chk, f"vs eager {style}", compiled, opts[1], eager, opts[0])
    check_eager_use(chk, compiled, eager, style, mesh)
    placements = {}
    for (n, p), (_, q) in zip(compiled.named_parameters(), eager.named_parameters()):
        placements[n] = (str(p.placements), p.device_mesh.mesh_dim_names, tuple(p.to_local().shape))
        if style == "fully_shard":  # as FSDP2 places a TP'd parameter
            chk.check(p.placements == q.placements and p.to_local().shape == q.to_local().shape,
                      f"{n}: {p.placements} {tuple(p.to_local().shape)} vs FSDP2's "
                      f"{q.placements} {tuple(q.to_local().shape)}")
    return dict(problems=chk.problems, max_err=chk.max_err, placements=placements,
                counts=collective_nodes(step), shown=shown_collectives(step))


def _eager_dp_step(style: str, mesh, step_fn):
    """The eager reference of a dp x tp step: FSDP2 + TP runs the step as it is; TP under
    replicate averages each gradient over "dp" before the optimizer (DDP over TP)."""
    def ddp_step(model, optim, *batch):
        optim.zero_grad()
        loss = step_fn.loss(model, *batch)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=mesh["dp"].get_group())
                g.div_(mesh["dp"].size())
        optim.step()
        return loss

    return step_fn if style == "fully_shard" else ddp_step


def token_ce_loss(model, tokens, target):
    import torch.nn.functional as F

    return F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())


def mse_loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def user_step(loss_fn):
    """A step as users write it (zero_grad, loss, backward, step), the loss ``loss_fn``."""
    def step(model, optim, *batch):
        optim.zero_grad()
        loss = loss_fn(model, *batch)
        loss.backward()
        optim.step()
        return loss

    step.loss = loss_fn
    return step


def optimizer_as_written_job(style: str, model_name: str, optimizer: str, kwargs: dict):
    """dp x tp (2 x 2) with ``torch.optim.<optimizer>(model.parameters(), **kwargs)`` exactly as
    written (default single-tensor, or foreach): the common_dtensor Transformer without sequence
    parallel (its norms stay plain tensors, so the optimizer runs its own per-parameter path) or
    the MLP; against eager FSDP2 + TP (fully_shard) or eager TP with gradients averaged over dp
    (replicate), every parameter and optimizer state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        MLPModule, ModelArgs, Transformer)

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    if model_name == "transformer":
        base = Transformer(ModelArgs(dropout_p=0.0, n_layers=1, vocab_size=16, max_seq_len=8, dim=16))
        parallelize = lambda m: Transformer.parallelize(m, mesh["tp"], False, local_output_for_attn=True)
        step_fn = user_step(token_ce_loss)
        batch = lambda: (torch.randint(16, (4, 8)), torch.randint(16, (4, 8)))
    else:
        base = MLPModule("cpu")
        plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
        parallelize = lambda m: parallelize_module(m, mesh["tp"], plan)
        step_fn = user_step(mse_loss)
        batch = lambda: (torch.rand(8, 10), torch.rand(8, 10))
    eager, compiled = parallelize(copy.deepcopy(base)), parallelize(copy.deepcopy(base))
    if style == "fully_shard":
        fully_shard(eager, mesh=mesh["dp"])
    opt_cls = getattr(torch.optim, optimizer)
    opts = [opt_cls(m.parameters(), **kwargs) for m in (eager, compiled)]
    eager_step = _eager_dp_step(style, mesh, step_fn)
    step = spmd_compile(DataParallel(style), mesh=mesh)(step_fn)
    chk = ParityChecker()
    for i in range(STEPS):
        torch.manual_seed(100 + i + 1000 * mesh["dp"].get_local_rank())
        tensors = batch()
        ref = eager_step(eager, opts[0], *tensors)
        chk.close("loss", f"step {i} loss", step(compiled, opts[1], *tensors), ref)
    compare_models(chk, f"vs eager {style}", compiled, opts[1], eager, opts[0])
    return dict(problems=chk.problems, max_err=chk.max_err, compiles=step.compile_count)


def shown_collectives(step) -> dict:
    """How the summary, the cross-rank program description and the graph dump show the
    collectives of the last compiled graph."""
    from spmd_compiler.api import summary_text
    from spmd_compiler.build.program_check import describe_graph
    from spmd_compiler.observe.visualize import graph_to_dot

    gm = step.last_compiled.traced.gm
    return dict(summary=summary_text(step),
                described=[(op.split(".")[-2], dim) for op, _, _, dim in
                           describe_graph(gm)["collective sequence"]],
                dump=graph_to_dot(gm, "final").source)


def hybrid_tp_job(shape: tuple[int, int]):
    """hybrid_shard x TP on a 3-D mesh (replicate, shard, tp) against eager FSDP2's HSDP on the
    TP'd model (``fully_shard(model, mesh=mesh["replicate", "shard"])``), each dp rank its own
    batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (*shape, 2), mesh_dim_names=("replicate", "shard", "tp"))
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    torch.manual_seed(0)
    base = MLPModule("cpu")
    eager = fully_shard(parallelize_module(copy.deepcopy(base), mesh["tp"], plan),
                        mesh=mesh["replicate", "shard"])
    compiled = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    step = spmd_compile(DataParallel("hybrid_shard"), mesh=mesh)(mse_adam_step)
    chk = ParityChecker()
    coordinate = mesh.get_coordinate()
    dp_rank = coordinate[0] * shape[1] + coordinate[1]
    for i in range(STEPS):
        torch.manual_seed(100 + i + 1000 * dp_rank)
        x, y = torch.rand(8, 10), torch.rand(8, 10)
        chk.close("loss", f"step {i} loss", step(compiled, opts[1], x, y),
                  mse_adam_step(eager, opts[0], x, y))
    compare_models(chk, "vs eager HSDP + TP", compiled, opts[1], eager, opts[0])
    for (n, p), (_, q) in zip(compiled.named_parameters(), eager.named_parameters()):
        chk.check(p.placements == q.placements and p.to_local().shape == q.to_local().shape,
                  f"{n}: {p.placements} {tuple(p.to_local().shape)} vs FSDP2's "
                  f"{q.placements} {tuple(q.to_local().shape)}")
    torch.manual_seed(7 + 1000 * dp_rank)
    x = torch.rand(8, 10)
    with torch.no_grad():
        chk.close("loss", "model(x) outside the step", compiled(x), eager(x))
    return dict(problems=chk.problems, counts=collective_nodes(step))


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)], ids=["2x1x2", "1x2x2"])
def test_hybrid_shard_x_tp(pool4, shape):
    reps = pool4.run(hybrid_tp_job, shape, timeout=600)
    for rank, rep in enumerate(reps):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])


@pytest.mark.parametrize("pool", [8], indirect=True)
def test_hybrid_shard_x_tp_8_ranks(pool):
    """2 x 2 x 2 (replicate, shard, tp) on 8 ranks: every dim of size 2, so each parameter is
    replicated, sharded and tensor-parallel at once (one small case: 8 processes)."""
    reps = pool.run(hybrid_tp_job, (2, 2), timeout=1800)
    for rank, rep in enumerate(reps):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])


@pytest.mark.parametrize("style", ["fully_shard", "replicate"])
def test_dp_x_tp(pool4, style):
    reps = run_without_problems(pool4, dp_tp_job, style, timeout=600)
    p = reps[0]["placements"]
    assert p["net2.weight"][1] == ("dp", "tp"), p
    want = "(Shard(dim=0), Shard(dim=1))" if style == "fully_shard" else "(Replicate(), Shard(dim=1))"
    assert p["net2.weight"][0] == want, p
    # the plan's all_reduce, on the tp dim, next to data parallelism's collectives on dp
    shown = reps[0]["shown"]
    assert "all_reduce (plan dim tp)" in shown["summary"], shown["summary"]
    assert ("all_reduce", "plan dim tp") in shown["described"], shown["described"]
    dp_kind = "reduce_scatter_tensor" if style == "fully_shard" else "all_reduce"
    assert (dp_kind, "mesh dim 0") in shown["described"], shown["described"]
    assert "tp: P(sum) -&gt; R" in shown["dump"] or "tp: P(sum) -> R" in shown["dump"]
    assert [r["shown"]["described"] for r in reps] == [shown["described"]] * 4


@pytest.mark.parametrize("style,model_name,optimizer,kwargs", [
    ("fully_shard", "transformer", "Adam", {}),
    ("fully_shard", "transformer", "AdamW", {}),
    ("replicate", "transformer", "SGD", {"lr": 0.1, "momentum": 0.9}),
    ("replicate", "mlp", "Adam", {"foreach": True}),
], ids=["fully_shard-Adam", "fully_shard-AdamW", "replicate-SGD", "replicate-Adam-foreach"])
def test_optimizer_as_written_dp_x_tp(pool4, style, model_name, optimizer, kwargs):
    """The optimizer exactly as users write it on a TP'd model: Adam's single-tensor path reads
    its step count as a Python number (symbolic while recording), the learning rate reaches
    DTensor ops as a symbolic float, a gradient DTensor leaves Replicate on a sharded parameter."""
    reps = run_without_problems(pool4, optimizer_as_written_job, style, model_name, optimizer,
                                kwargs, timeout=900)
    # one program (Adam's state is made before recording); SGD's momentum: a first program that
    # makes its buffers, then the steady one (a step count specialized would compile each step)
    assert reps[0]["compiles"] == (2 if optimizer == "SGD" else 1), reps[0]["compiles"]


def lr_schedule_job():
    """TP alone, SGD as written (DTensor has no rule for its fused kernel: the per-parameter
    path records ``param.add_(grad, alpha=-lr)`` on DTensors) with a StepLR halving the learning
    rate every step, against eager TP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

    from spmd_compiler import spmd_compile

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = MLPModule("cpu")
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    eager, compiled = (parallelize_module(copy.deepcopy(base), mesh, plan) for _ in range(2))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    step = spmd_compile(mesh=mesh)(mse_adam_step)
    chk = ParityChecker()
    for i in range(4):
        torch.manual_seed(100 + i)
        x, y = torch.rand(8, 10), torch.rand(8, 10)
        chk.close("loss", f"step {i} loss", step(compiled, opts[1], x, y), mse_adam_step(eager, opts[0], x, y))
        for schedule in schedules:
            schedule.step()
    compare_models(chk, "vs eager TP", compiled, opts[1], eager, opts[0])
    return dict(problems=chk.problems, compiles=step.compile_count)


def test_lr_schedule_on_dtensor_parameters(pool2):
    """The learning rate reaches DTensor ops as a symbolic float and stays one: one compile
    over four learning rates, parity with eager TP."""
    reps = run_without_problems(pool2, lr_schedule_job, timeout=600)
    assert reps[0]["compiles"] == 1, reps[0]["compiles"]


# --------------------------------------------------------------------------------------------------
# Seed 000: a DTensor ConvNeXt whose activations are sharded on the image width
# --------------------------------------------------------------------------------------------------


def convnext_step(model, optim, x, y_target):
    y = model(x)
    loss = torch.nn.functional.cross_entropy(y, y_target)
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss


def convnext_job(partition: str):
    """Seed 000's width-sharded ConvNeXt, with the seed's partition function as written
    (``partition="seed"``: unused flattened copies of every parameter on each ancestor) or
    registering each module's own parameters ("own"), against one device over STEPS Adam steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    from spmd_compiler import spmd_compile
    from tests.convnext import ConvNeXt, conv_fn, seed_conv_fn

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(12)
    # Changes to the seed's tiny model for a parity test that can fail: its all-ones init makes
    # every channel alike (the loss would not depend on the input, nor show a wrong halo); with 2
    # channels its channel LayerNorm is flat and a layer scale of 1e-6 shrinks the rest, leaving
    # the first layers gradients of ~1e-8, below Adam's eps, whose updates then follow float32
    # round-off (their gradients agree to round-off): 4 and 8 channels, layer scale 0.5.
    single = ConvNeXt(depths=[1, 1], dims=[4, 8], num_classes=10, layer_scale_init_value=0.5)
    for m in single.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            m.reset_parameters()
    fn = seed_conv_fn if partition == "seed" else conv_fn
    compiled = distribute_module(copy.deepcopy(single), mesh, fn, input_fn=None, output_fn=None)
    eager = distribute_module(copy.deepcopy(single), mesh, fn, input_fn=None, output_fn=None)
    used = dict(single.named_parameters())
    unused = {n: p.detach().full_tensor() for n, p in compiled.named_parameters() if n not in used}
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (single, compiled)]
    step = spmd_compile(mesh=mesh)(convnext_step)
    chk = ParityChecker()
    eager_err = 0.0
    for i in range(STEPS):
        torch.manual_seed(100 + i)
        x = torch.randn(2, 3, 16, 64)  # width 64: 8 columns per rank after the stem
        y = torch.empty(2, dtype=torch.long).random_(10)
        dx, dy = distribute_tensor(x, mesh, [Shard(3)]), distribute_tensor(y, mesh, [Replicate()])
        ref = convnext_step(single, opts[0], x, y)
        loss = step(compiled, opts[1], dx, dy)
        chk.close("loss", f"step {i} loss", full(loss), ref)
        if i == 0:  # eager DTensor (before any update): its forward is wrong, its backward raises
            with torch.no_grad():
                eager_err = float((full(torch.nn.functional.cross_entropy(eager(dx), dy)) - ref).abs())
    params = dict(compiled.named_parameters())
    for fqn, ref_p in used.items():
        p = params[fqn]
        chk.close("param", fqn, full(p.detach()), ref_p.detach())
        for k, v in opts[0].state[ref_p].items():
            chk.close("state", f"{fqn} {k}", full(opts[1].state[p][k]), v)
    for fqn, before in unused.items():  # as in eager: no gradient, no update
        p = params[fqn]
        chk.check(p.grad is None and torch.equal(p.detach().full_tensor(), before),
                  f"{fqn}: the forward never uses it, yet it changed")
        state = opts[1].state.get(p, {})  # the zero state made before recording, never stepped
        chk.check(not any(full(v).any() for v in state.values() if torch.is_tensor(v)),
                  f"{fqn}: the optimizer stepped a parameter without gradient: {state}")
    return dict(problems=chk.problems, max_err=chk.max_err, eager_loss_err=eager_err,
                counts=collective_nodes(step), unused=len(unused), compiles=step.compile_count)


@pytest.mark.parametrize("partition", ["own", "seed"])
def test_convnext_width_sharded(pool2, partition):
    """Matches one device; eager DTensor does not on torch 2.13 (no halo exchange). The seed's
    partition function as written leaves copies the forward never uses: unchanged, as eager."""
    reps = run_without_problems(pool2, convnext_job, partition, timeout=600)
    assert (reps[0]["unused"] > 0) == (partition == "seed"), reps[0]["unused"]
    # the gradient hooks' closure over ``dist_spec`` is guarded by value: one program
    assert [r["compiles"] for r in reps] == [1, 1], [r["compiles"] for r in reps]


# --------------------------------------------------------------------------------------------------
# Plans that do not fit: a clear SPMDError before any state changes
# --------------------------------------------------------------------------------------------------


class TwoHeads(torch.nn.Module):
    """An MLP and a second head that forward never calls."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

        self.mlp = MLPModule("cpu")
        self.unused = torch.nn.Linear(10, 4)

    def forward(self, x):
        return self.mlp(x)


def errors_job():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from spmd_compiler import DataParallel, SPMDError, spmd_compile

    world = dist.get_world_size()
    tp_mesh = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    plan = {"mlp.net1": ColwiseParallel(), "mlp.net2": RowwiseParallel()}
    cases = {
        # the plan's mesh is not a dim of mesh=
        "not a dim": (tp_mesh, plan, dict(parallel_mode=DataParallel("fully_shard"), mesh=mesh_2d)),
        # DataParallel asked for, but the plan uses every dim of the mesh
        "dp dim used": (tp_mesh, plan, dict(parallel_mode=DataParallel("replicate"), mesh=tp_mesh)),
        # a plan on a module the step never calls: runs as in eager, the module left unchanged
        "never called": (tp_mesh, dict(plan, unused=ColwiseParallel()), dict(mesh=tp_mesh)),
    }
    out = {}
    for name, (pmesh, p, options) in cases.items():
        torch.manual_seed(0)
        model = parallelize_module(TwoHeads(), pmesh, p)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        before = {n: (id(t), t.placements if hasattr(t, "placements") else None, t.detach().clone())
                  for n, t in model.named_parameters()}
        try:
            spmd_compile(**options)(mse_adam_step)(model, opt, torch.rand(4, 10), torch.rand(4, 10))
            out[name] = ("no error", [n for n, t in model.named_parameters()
                                      if not torch.equal(t.detach(), before[n][2])])
        except SPMDError as e:
            same = all(id(t) == before[n][0] and getattr(t, "placements", None) == before[n][1]
                       and torch.equal(t.detach(), before[n][2]) for n, t in model.named_parameters())
            out[name] = (type(e).__name__, str(e), same and not opt.state)
    return out


def test_plan_errors(pool2):
    rep = pool2.run(errors_job, timeout=300)[0]
    # eager DTensor runs a plan on a module the forward never calls: no gradient, no update
    assert rep["never called"] == ("no error", ["mlp.net1.weight", "mlp.net1.bias", "mlp.net2.weight",
                                                "mlp.net2.bias"]), rep["never called"]
    for name, want in [("not a dim", "is not a dim of the step's mesh"),
                       ("dp dim used", "already uses every dim")]:
        assert rep[name][0] != "no error", name
        kind, text, unchanged = rep[name]
        assert want in text and kind == "TensorParallelError", (name, kind, text)
        assert unchanged, f"{name}: parameters or optimizer state changed before the error"


# --------------------------------------------------------------------------------------------------
# DCP checkpoints between eager FSDP2 + TP and the compiled step (2 x 2)
# --------------------------------------------------------------------------------------------------


def dcp_job(folder: str):
    """Checkpoints (torch.distributed.checkpoint, model and optimizer) move both ways between
    eager FSDP2 + TP and the compiled fully_shard x TP step; training then continues and matches
    eager FSDP2 + TP trained without a break (every parameter and Adam state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

    from spmd_compiler import DataParallel, spmd_compile

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    torch.manual_seed(0)
    base = MLPModule("cpu")

    def model(fsdp: bool):
        m = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
        if fsdp:
            fully_shard(m, mesh=mesh["dp"])
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def batch(i):
        torch.manual_seed(100 + i + 1000 * mesh["dp"].get_local_rank())
        return torch.rand(8, 10), torch.rand(8, 10)

    def train(step, m, opt, steps):
        for i in steps:
            step(m, opt, *batch(i))

    def save(m, opt, name):
        sd_model, sd_optim = get_state_dict(m, opt)
        dcp.save({"model": sd_model, "optim": sd_optim}, checkpoint_id=f"{folder}/{name}")

    def load(m, opt, name):
        sd_model, sd_optim = get_state_dict(m, opt)
        state = {"model": sd_model, "optim": sd_optim}
        dcp.load(state, checkpoint_id=f"{folder}/{name}")
        set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    first, second = range(2), range(2, 4)
    ref, ref_opt = model(True)
    train(mse_adam_step, ref, ref_opt, [*first, *second])
    chk = ParityChecker()
    # eager FSDP2 + TP -> compiled: into a model the step has not placed yet, and into one it has
    eager, eager_opt = model(True)
    train(mse_adam_step, eager, eager_opt, first)
    save(eager, eager_opt, "eager")
    for placed_first in (False, True):
        m, opt = model(False)
        step = spmd_compile(DataParallel("fully_shard"), mesh=mesh)(mse_adam_step)
        if placed_first:
            train(step, m, opt, range(7, 9))  # other batches, then overwritten by the load
        load(m, opt, "eager")
        train(step, m, opt, second)
        compare_models(chk, f"eager -> compiled (placed before the load: {placed_first})", m, opt,
                       ref, ref_opt)
    # compiled -> eager FSDP2 + TP
    m, opt = model(False)
    step = spmd_compile(DataParallel("fully_shard"), mesh=mesh)(mse_adam_step)
    train(step, m, opt, first)
    save(m, opt, "compiled")
    eager, eager_opt = model(True)
    load(eager, eager_opt, "compiled")
    train(mse_adam_step, eager, eager_opt, second)
    compare_models(chk, "compiled -> eager", eager, eager_opt, ref, ref_opt)
    # the compiled step goes on after saving, its optimizer's state re-made by load_state_dict
    # (new DTensors without the padded buffers the step binds)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(step, m, opt, second)
    compare_models(chk, "compiled after saving", m, opt, ref, ref_opt)
    return dict(problems=chk.problems, max_err=chk.max_err)


def test_dcp_between_fsdp2_tp_and_compiled(pool4, tmp_path):
    reps = pool4.run(dcp_job, str(tmp_path), timeout=900)
    for rank, rep in enumerate(reps):
        assert not rep["problems"], f"rank {rank}:\n  " + "\n  ".join(rep["problems"][:20])
