"""Bad input, unusual-but-legal input and atomicity, on real gloo groups against DDP.

Three parts:

- **The bad-input catalogue.** Every case is something a user can pass that is not the plain
  ``(x, y)`` float32 batch of a model whose every parameter the optimizer trains: non-tensor
  leaves in the batch, a batch dim other than 0, a float64 batch, a parameter outside the
  optimizer, a frozen parameter, optimizers outside the tested set, a step that returns nothing,
  eager and compiled steps on the same model, eval()/train() switches, a changed momentum, an
  empty batch. Each case either matches DDP (parameters and optimizer states compared after every
  step, ``|a - e| <= ATOL + RTOL * |e|`` with the tolerances of tests/test_replicate.py) and
  recompiles exactly when it should, or raises an ``SPMDError`` subclass with the words that tell
  the user what to fix. All cases of both modes run in one worker job (world size 2; a few also at
  world size 3, where shards are uneven) and each case is asserted in its own test.
- **Atomicity.** A call that fails to compile leaves the model's parameters, buffers and
  gradients and the optimizer's param_groups and state exactly as they were: same objects
  (identities), same types (no half-converted DTensors), same placements, same bytes; on a fresh
  model and on a model an earlier compile already placed on the mesh.
- **Cross-rank disagreement** (a rank with another model, optimizer configuration, batch
  structure, a batch size outside the guards, or an empty batch): every rank raises an
  ``SPMDError`` naming the ranks and the first difference, on the same call, never hangs or
  diverges. A hung collective fails the test through the job timeout.
"""

from __future__ import annotations

import traceback
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import SimpleMLP, UnusedParamMLP, train_step
from tests.multirank import SelectedCases, rank_data
from tests.steps import square_mean, step_with
from tests.test_replicate import ATOL, RTOL

# The seed's loss is a sum of b x 8 signed differences that mostly cancel: its float32 round-off is
# that of every term added up (a few 1e-6 after two Adam steps), not of its small result.
# Parameters and optimizer states, which are what training keeps, are held to ATOL.
LOSS_ATOL = 1e-5

BATCH = 16

# --------------------------------------------------------------------------------------------------
# Models and steps used by the cases (module level: the workers import them by name)
# --------------------------------------------------------------------------------------------------


class ExtraHead(nn.Module):
    """SimpleMLP followed by an ``extra`` Linear(8, 8): a layer to freeze or leave out of the
    optimizer while the rest trains."""

    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        return self.extra(self.mlp(x))


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 32)
        self.drop = nn.Dropout(0.5)
        self.net2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.net2(self.drop(torch.relu(self.net1(x))))


class SmallConvNet(nn.Module):
    """Conv2d -> ReLU -> Flatten -> Linear on (b, 3, 5, 5) inputs, (b, 3) outputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def constants_step(model, optim, batch):
    """The batch carries a number and a string besides the tensors; the step returns the string."""
    optim.zero_grad()
    x, y, scale, kind = batch
    out = model(x)
    if kind == "sum":
        loss = ((out - y) * scale).sum()
    else:
        loss = ((out - y) ** 2).mean() * scale
    loss.backward()
    optim.step()
    return loss, kind


def weighted(model, batch):
    """``w`` is a per-feature weight shared by all samples (not batched)."""
    x, y, w = batch
    return ((model(x) - y) * w).sum()


def feature_major(model, batch):
    """``x`` comes feature-major, ``(50, b)``: its batch dim is 1."""
    x, y = batch
    return (model(x.t()) - y).sum()


weighted_step = step_with(weighted)
feature_major_step = step_with(feature_major)


def returns_none_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    (model(x) - y).sum().backward()
    optim.step()


def maybe_branch_step(model, optim, batch, branch=False):
    """With ``branch=True`` the step branches on a tensor's value: that cannot be compiled."""
    optim.zero_grad()
    x, y = batch
    loss = (model(x) - y).sum()
    if branch and loss > 0:
        loss = loss * 2
    loss.backward()
    optim.step()
    return loss


def grad_norm_step(model, optim, batch):
    """Logs the global gradient norm the way many training loops do: one flat vector. Written
    out: the test of its error names the norm's line, a line of the step itself."""
    optim.zero_grad()
    loss = square_mean(model, batch)
    loss.backward()
    grad_norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()  # FLAT-NORM
    optim.step()
    return loss, grad_norm


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _sgd_momentum(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def _adam(m):
    return torch.optim.Adam(m.parameters(), lr=0.01)


# Optimizers outside the tested set (DESIGN.md: SGD, Adam, AdamW) that turn out to work: their
# update is traced like any other and every test step matches DDP.
EXTRA_OPTIMIZERS = {
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01, weight_decay=0.1),
    "RMSprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9, centered=True),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=0.01),
    "NAdam": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01),
    "Adadelta": lambda m: torch.optim.Adadelta(m.parameters()),
    "Adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
}
# Optimizers whose CPU step reads a tensor's value (``.item()`` of the step count) and so cannot be
# recorded as one graph.
ITEM_OPTIMIZERS = {
    "RAdam": lambda m: torch.optim.RAdam(m.parameters(), lr=0.01),
    # Not an .item() reader; its masked update (index_put_ with a boolean mask) runs on shards.
    "Rprop": lambda m: torch.optim.Rprop(m.parameters(), lr=0.01),
    "ASGD": lambda m: torch.optim.ASGD(m.parameters(), lr=0.01),
}


# --------------------------------------------------------------------------------------------------
# Worker-side helpers
# --------------------------------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for DTensors: call on every rank in the same order)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


class Report:
    """What a case found: problems (text), max errors, free-form facts for the test to check."""

    def __init__(self):
        self.problems: list[str] = []
        self.max_err = 0.0
        self.facts: dict = {}

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.problems.append(msg)

    def close(self, where: str, actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
        a, e = _full(actual), _full(expected)
        if a.shape != e.shape or a.dtype != e.dtype:
            self.problems.append(f"{where}: {tuple(a.shape)} {a.dtype} vs DDP {tuple(e.shape)} {e.dtype}")
            return
        a, e = a.to(torch.float64), e.to(torch.float64)
        err = float((a - e).abs().max()) if a.numel() else 0.0
        self.max_err = max(self.max_err, err if err == err else float("inf"))
        if not bool(torch.isclose(a, e, rtol=RTOL, atol=atol).all()):
            self.problems.append(f"{where}: max abs err {err:.3g} (rtol={RTOL}, atol={atol})")

    def as_dict(self) -> dict:
        return dict(problems=self.problems, max_err=self.max_err, facts=self.facts)


def compare(rep: Report, where: str, model, opt, ref_model, ref_opt) -> None:
    """Every parameter and optimizer state tensor against the DDP reference's."""
    ours, ref = list(model.named_parameters()), list(ref_model.named_parameters())
    rep.check([n for n, _ in ours] == [n for n, _ in ref], f"{where}: parameter names differ")
    for (name, p), (_, q) in zip(ours, ref):
        rep.close(f"{where}: parameter {name}", p, q)
        st, ref_st = opt.state.get(p, {}), ref_opt.state.get(q, {})
        rep.check(sorted(st) == sorted(ref_st),
                  f"{where}: state keys of {name}: {sorted(st)} vs DDP {sorted(ref_st)}")
        for k in sorted(ref_st):
            if k in st and isinstance(ref_st[k], torch.Tensor):
                rep.close(f"{where}: state {name}.{k}", st[k], ref_st[k])


def _loss_of(out):
    return out[0] if isinstance(out, tuple) else out


def fresh_adam_mlp(mode: str, step=train_step):
    """The seeded SimpleMLP, its Adam (no state yet) and ``step`` compiled for ``mode``."""
    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = SimpleMLP()
    return model, _adam(model), spmd_compile(DataParallel(mode))(step)


def with_ddp(mode: str, model_fn, opt_fn, step, **dp_kwargs):
    """The same seeded model (on every rank) compiled with ``step`` and as a DDP copy, each with
    its own optimizer: ``(model, opt, compiled step, ddp, ref_opt)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)  # the same initial model on every rank
    model = model_fn()
    ddp = DDP(deepcopy(model))
    opt, ref_opt = opt_fn(model), opt_fn(ddp.module)
    return model, opt, spmd_compile(DataParallel(mode, **dp_kwargs))(step), ddp, ref_opt


def parity_run(rep: Report, mode: str, model_fn, opt_fn, step, batches, *, dp_kwargs=None,
               before_each=None, stop_on_error=False) -> list[int]:
    """Run ``step`` compiled and on a DDP copy with the same batches; compare after every step.
    Returns compile_count after each step. With ``stop_on_error`` a call that raises an SPMDError
    ends the run, recording the error (``facts["raised"]``: step, type, message, whether it is an
    UnsupportedError) and what the failed call changed (``facts["untouched"]``: should be [])."""
    from spmd_compiler import SPMDError
    from spmd_compiler.errors import UnsupportedError

    model, opt, compiled, ddp, ref_opt = with_ddp(mode, model_fn, opt_fn, step, **(dp_kwargs or {}))
    counts = []
    for i, batch in enumerate(batches):
        if before_each is not None:
            before_each(i, model, ddp, opt, ref_opt)
        torch.manual_seed(1000 + i)  # the same random stream (dropout) for both
        before = snapshot(model, [opt]) if stop_on_error else None
        try:
            out = compiled(model, opt, deepcopy(batch))
        except SPMDError as e:
            if not stop_on_error:
                raise
            rep.facts["raised"] = (i, type(e).__name__, str(e), isinstance(e, UnsupportedError))
            rep.facts["untouched"] = diff_snapshots(before, snapshot(model, [opt]))
            break
        torch.manual_seed(1000 + i)
        ref_out = step(ddp, ref_opt, batch)
        counts.append(compiled.compile_count)
        if ref_out is None:
            rep.check(out is None, f"step {i}: returned {out!r}, eager returned None")
        else:
            rep.close(f"step {i}: loss", _loss_of(out), _loss_of(ref_out), atol=LOSS_ATOL)
            for j, (o, r) in enumerate(zip(out[1:], ref_out[1:]) if isinstance(ref_out, tuple) else ()):
                if isinstance(r, torch.Tensor):
                    rep.close(f"step {i}: returned value {j + 1}", o, r)
                else:
                    rep.check(o == r, f"step {i}: returned {o!r}, eager returned {r!r}")
        compare(rep, f"step {i}", model, opt, ddp.module, ref_opt)
    rep.facts["counts"] = counts
    rep.facts.setdefault("raised", None)
    rep.facts["model"], rep.facts["ddp"] = model, ddp  # removed before returning
    rep.facts["compiled"] = compiled
    return counts


def xy(i: int, b: int = BATCH, dtype=None):
    return rank_data(300 + i, (b, 50), (b, 8), dtype=dtype)


def collectives(compiled) -> list[dict] | None:
    """The collectives of the last compiled graph; None on a rank that received the program
    from the rank that built it (shared_compile.py: no graph there; rank 0 always builds)."""
    from spmd_compiler.passes import meta

    gm = compiled.last_compiled.traced.gm
    if gm is None:
        return None
    return [n.meta[meta.COLLECTIVE] for n in gm.graph.nodes if n.meta.get(meta.COLLECTIVE)]


# --------------------------------------------------------------------------------------------------
# The catalogue (worker side). Each case: (report, mode) -> None.
# --------------------------------------------------------------------------------------------------


def case_constants_in_batch(rep, mode):
    """Numbers and strings in the batch are constants of the compiled step: a new value
    recompiles, a value seen before reuses its graph, and the string comes back unchanged."""
    plan = [(2, "sum"), (2, "sum"), (3, "sum"), (3, "mse"), (2, "sum"), (0.5, "mse")]
    batches = [(*xy(i), scale, kind) for i, (scale, kind) in enumerate(plan)]
    parity_run(rep, mode, SimpleMLP, _sgd, constants_step, batches)


def case_unbatched_input(rep, mode):
    """input_batch_dim as a pytree with None for an input that every rank shares."""
    w = torch.linspace(0.5, 1.5, 8)
    batches = [(*xy(i), w) for i in range(3)]
    parity_run(rep, mode, SimpleMLP, _sgd_momentum, weighted_step, batches,
               dp_kwargs=dict(input_batch_dim=(0, 0, None)))


def case_batch_dim_1(rep, mode):
    """A feature-major input, ``input_batch_dim=(1, 0)``, including a short batch."""
    batches = []
    for i, b in enumerate((BATCH, BATCH, 5)):
        x, y = xy(i, b)
        batches.append((x.t().contiguous(), y))
    parity_run(rep, mode, SimpleMLP, _adam, feature_major_step, batches,
               dp_kwargs=dict(input_batch_dim=(1, 0)))


def case_labels_float64(rep, mode):
    """float64 labels with a float32 model: eager promotes the loss to float64; so must we."""
    batches = [(x, y.double()) for x, y in (xy(i) for i in range(3))]
    parity_run(rep, mode, SimpleMLP, _sgd, train_step, batches)


def case_inputs_float64(rep, mode):
    """A float64 batch into a float32 model: eager raises; the compiled step must raise the same
    way (after which a float32 batch still trains exactly like DDP)."""
    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = SimpleMLP()
    opt = _sgd(model)
    x, y = xy(0, dtype=torch.float64)
    try:
        eager_model = deepcopy(model)
        train_step(eager_model, _sgd(eager_model), (x, y))
        eager = None
    except Exception as e:  # noqa: BLE001
        eager = (type(e).__name__, str(e).splitlines()[0])
    compiled = spmd_compile(DataParallel(mode))(train_step)
    try:
        compiled(model, opt, (x, y))
        ours = None
    except Exception as e:  # noqa: BLE001
        ours = (type(e).__name__, str(e))
    rep.facts["eager_error"], rep.facts["compiled_error"] = eager, ours
    dist.barrier()
    # Then float32 batches: the step works and matches DDP.
    batches = [xy(i) for i in range(1, 3)]
    sub = Report()
    parity_run(sub, mode, SimpleMLP, _sgd, train_step, batches)
    rep.problems += sub.problems


def _param_subset_opt(exclude: str):
    def make(m):
        return torch.optim.Adam([p for n, p in m.named_parameters() if not n.startswith(exclude)],
                                lr=0.01)
    return make


def case_param_not_in_optimizer(rep, mode):
    """``extra`` trains (gets gradients) but the optimizer does not hold it: it never changes;
    the others match DDP."""
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in ExtraHead().named_parameters() if n.startswith("extra")}
    parity_run(rep, mode, ExtraHead, _param_subset_opt("extra"), train_step, [xy(i) for i in range(3)])
    model = rep.facts["model"]
    for n, p in model.named_parameters():
        if n in initial:
            rep.check(torch.equal(_full(p), initial[n]), f"{n} changed but the optimizer does not hold it")


def _frozen_extra():
    m = ExtraHead()
    m.extra.requires_grad_(False)
    return m


def _trainable_sgd(m):
    return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def _check_not_reduced(rep, frozen: list[str]) -> None:
    """No gradient collective names a frozen parameter; replicate reduces exactly the trainable
    elements."""
    comp, model = rep.facts["compiled"], rep.facts["model"]
    colls = collectives(comp)
    if colls is None:  # a received program: rank 0, which built it, checks its graph
        rep.check(dist.get_rank() != 0, "rank 0 has no graph")
        return
    for c in colls:
        if c["kind"] in ("all_reduce", "reduce_scatter"):
            rep.check(not set(c["params"]) & set(frozen),
                      f"a {c['kind']} reduces frozen parameter(s) {set(c['params']) & set(frozen)}")
    named = [n for n, _ in model.named_parameters()]
    reduced = {p for c in colls if c["kind"] in ("all_reduce", "reduce_scatter") for p in c["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    rep.check(reduced == trainable, f"reduced gradients of {sorted(reduced)}, trainable {sorted(trainable)}"
              f" (all: {named})")


def case_frozen_param(rep, mode):
    """requires_grad=False on a layer the forward uses (not in the optimizer): it is not
    synchronized and stays as it was; the rest matches DDP."""
    parity_run(rep, mode, _frozen_extra, _trainable_sgd, train_step, [xy(i) for i in range(3)])
    _check_not_reduced(rep, ["extra.weight", "extra.bias"])


def case_frozen_param_in_optimizer(rep, mode):
    """A frozen layer the optimizer still holds (Adam skips parameters without a gradient)."""
    parity_run(rep, mode, _frozen_extra, _adam, train_step, [xy(i) for i in range(3)])
    _check_not_reduced(rep, ["extra.weight", "extra.bias"])


def _make_optimizer_case(make):
    def case(rep, mode):
        parity_run(rep, mode, SimpleMLP, make, train_step, [xy(i) for i in range(3)])
    return case


def _make_item_optimizer_case(make):
    """An optimizer whose CPU step reads ``.item()``: whatever the compiled step does must either
    match DDP or stop with an SPMDError that changes nothing."""
    def case(rep, mode):
        parity_run(rep, mode, SimpleMLP, make, train_step, [xy(i) for i in range(3)],
                   stop_on_error=True)
    return case


def case_flat_grad_norm(rep, mode):
    """The global gradient norm through ``torch.cat`` of flattened gradients (after backward, so
    in the optimizer region): replicate computes DDP's value; fully_shard must either compute it
    or raise an SPMDError naming the user's line, changing nothing."""
    parity_run(rep, mode, SimpleMLP, _sgd_momentum, grad_norm_step, [xy(i) for i in range(3)],
               stop_on_error=True)


def case_batch_of_one_then_larger(rep, mode):
    """A conv net whose first call has a local batch of one (the trace specializes the batch size
    to 1), then batches of 3: must recompile (or generalize) and match DDP."""
    from tests.models import mse_step

    batches = [rank_data(400 + i, (b, 3, 5, 5), (b, 3)) for i, b in enumerate((1, 3, 3))]
    parity_run(rep, mode, SmallConvNet, _sgd, mse_step, batches)


def case_returns_none(rep, mode):
    parity_run(rep, mode, SimpleMLP, _sgd_momentum, returns_none_step, [xy(i) for i in range(3)])


def case_eager_then_compiled(rep, mode):
    """Two eager steps (gradients and Adam state exist as plain tensors), then compiled steps:
    the compiled step takes the state over and continues exactly like DDP."""
    model, opt, compiled, ddp, ref_opt = with_ddp(mode, SimpleMLP, _adam, train_step)
    for i in range(2):
        # The single-device eager step on every rank's own data would diverge the ranks; to stay
        # comparable every rank runs the eager step on rank 0's data, as DDP would see it averaged
        # over identical shards.
        x0, y0 = rank_data(300 + i, (BATCH, 50), (BATCH, 8), rank=0)
        train_step(model, opt, (x0, y0))
        train_step(ddp, ref_opt, (x0, y0))
    compare(rep, "after eager steps", model, opt, ddp.module, ref_opt)
    counts = []
    for i in range(2, 5):
        x, y = xy(i)
        compiled(model, opt, (x.clone(), y.clone()))
        train_step(ddp, ref_opt, (x, y))
        counts.append(compiled.compile_count)
        compare(rep, f"compiled step {i}", model, opt, ddp.module, ref_opt)
    rep.facts["counts"] = counts


def case_compiled_then_eager(rep, mode):
    """After compiled steps the parameters are DTensors; the plain eager step (forward, backward,
    optimizer) still runs, averages its gradients as DDP does and matches DDP, and compiled steps
    go on matching DDP without recompiling."""
    model, opt, compiled, ddp, ref_opt = with_ddp(mode, SimpleMLP, _adam, train_step)
    for i in range(2):
        x, y = xy(i)
        compiled(model, opt, (x.clone(), y.clone()))
        train_step(ddp, ref_opt, (x, y))
    for i in range(2, 4):  # eager steps, each rank on its own data
        train_step(model, opt, xy(i))
        train_step(ddp, ref_opt, xy(i))
        compare(rep, f"eager step {i}", model, opt, ddp.module, ref_opt)
    rep.facts["placements"] = sorted({str(p.placements) for p in model.parameters()})
    for i in range(4, 6):
        x, y = xy(i)
        compiled(model, opt, (x.clone(), y.clone()))
        train_step(ddp, ref_opt, (x, y))
        compare(rep, f"compiled step {i}", model, opt, ddp.module, ref_opt)
    rep.facts["count"] = compiled.compile_count


def case_eval_train_dropout(rep, mode):
    """eval() and train() are different programs (Dropout): a switch recompiles once per mode,
    switching back reuses the graph, and both match DDP (same random stream for the masks)."""
    modes = [False, False, True, True, False, True]

    def before_each(i, model, ddp, opt, ref_opt):
        model.train(modes[i])
        ddp.train(modes[i])

    parity_run(rep, mode, DropoutMLP, _sgd, train_step, [xy(i) for i in range(len(modes))],
               before_each=before_each)


def case_momentum_changed(rep, mode):
    """momentum changed in param_groups between calls: recompiles once, matches DDP."""

    def before_each(i, model, ddp, opt, ref_opt):
        if i == 2:
            for g in opt.param_groups + ref_opt.param_groups:
                g["momentum"] = 0.5

    parity_run(rep, mode, SimpleMLP, _sgd_momentum, train_step, [xy(i) for i in range(4)],
               before_each=before_each)


def case_empty_batch(rep, mode):
    """A batch dim of size 0 on every rank: BatchDimError naming the shape, nothing placed."""
    from spmd_compiler.errors import BatchDimError

    model, opt, compiled = fresh_adam_mlp(mode)
    before = snapshot(model, [opt])
    try:
        compiled(model, opt, (torch.zeros(0, 50), torch.zeros(0, 8)))
        rep.facts["raised"] = None
    except BatchDimError as e:
        rep.facts["raised"] = str(e)
    rep.facts["untouched"] = diff_snapshots(before, snapshot(model, [opt]))
    rep.facts["count"] = compiled.compile_count


BOTH = ("replicate", "fully_shard")
REP, FS = ("replicate",), ("fully_shard",)
# name -> (case, modes it runs in at world size 2). Each compile costs about a second, so cases
# whose interest is mode-independent run in one mode (tests/test_replicate.py already covers a
# momentum change and a float64 batch with replicate).
CATALOGUE = {
    "constants_in_batch": (case_constants_in_batch, BOTH),
    "unbatched_input": (case_unbatched_input, FS),
    "batch_dim_1": (case_batch_dim_1, BOTH),
    "labels_float64": (case_labels_float64, REP),
    "inputs_float64": (case_inputs_float64, BOTH),
    "param_not_in_optimizer": (case_param_not_in_optimizer, BOTH),
    "frozen_param": (case_frozen_param, BOTH),
    "frozen_param_in_optimizer": (case_frozen_param_in_optimizer, REP),
    "returns_none": (case_returns_none, FS),
    "batch_of_one_then_larger": (case_batch_of_one_then_larger, BOTH),
    "flat_grad_norm": (case_flat_grad_norm, BOTH),
    "eager_then_compiled": (case_eager_then_compiled, BOTH),
    "compiled_then_eager": (case_compiled_then_eager, BOTH),
    "eval_train_dropout": (case_eval_train_dropout, BOTH),
    "momentum_changed": (case_momentum_changed, FS),
    "empty_batch": (case_empty_batch, BOTH),
    "optimizer_Adagrad": (_make_optimizer_case(EXTRA_OPTIMIZERS["Adagrad"]), BOTH),
    "optimizer_RMSprop": (_make_optimizer_case(EXTRA_OPTIMIZERS["RMSprop"]), BOTH),
    "optimizer_Adamax": (_make_optimizer_case(EXTRA_OPTIMIZERS["Adamax"]), FS),
    "optimizer_NAdam": (_make_optimizer_case(EXTRA_OPTIMIZERS["NAdam"]), REP),
    "item_optimizer_Rprop": (_make_item_optimizer_case(ITEM_OPTIMIZERS["Rprop"]), BOTH),
    "optimizer_Adadelta": (_make_optimizer_case(EXTRA_OPTIMIZERS["Adadelta"]), REP),
    "optimizer_Adam_amsgrad": (_make_optimizer_case(EXTRA_OPTIMIZERS["Adam_amsgrad"]), FS),
    "item_optimizer_RAdam": (_make_item_optimizer_case(ITEM_OPTIMIZERS["RAdam"]), REP),
    "item_optimizer_ASGD": (_make_item_optimizer_case(ITEM_OPTIMIZERS["ASGD"]), FS),
}
# Cases that also run at world size 3, where the 8-row ``extra`` layer shards unevenly (3, 3, 2).
WS3_CASES = {"param_not_in_optimizer": FS, "frozen_param": FS}


def catalogue_job(cases: list[tuple[str, str]]) -> dict:
    """Run every (name, mode) of ``cases``; a case that raises is reported, not fatal."""
    out = {}
    order = list(CATALOGUE)
    for name, mode in sorted(cases, key=lambda c: (order.index(c[0]), CATALOGUE[c[0]][1].index(c[1]))):
        rep = Report()
        try:
            CATALOGUE[name][0](rep, mode)
        except Exception as e:  # noqa: BLE001 - reported per case
            rep.facts["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            dist.barrier()
        for k in ("model", "ddp", "compiled"):
            if not isinstance(rep.facts.get(k), (str, tuple, type(None))):
                rep.facts.pop(k, None)
        out[(name, mode)] = rep.as_dict()
    return out


# --------------------------------------------------------------------------------------------------
# Snapshots of live state (atomicity)
# --------------------------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).tolist())


def _tensor_record(t) -> tuple:
    """Identity, type, placement and bytes of a tensor (for a DTensor: of its local tensor and of
    the padded buffer the compiled graph binds)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, torch.Tensor):
        return ("value", repr(t))
    rec = [id(t), type(t).__name__, str(t.dtype), tuple(t.shape), t.requires_grad]
    if isinstance(t, DTensor):
        local = t._local_tensor
        rec += [tuple(map(str, t.placements)), id(local), _bytes(local)]
        buf = getattr(t, "_spmd_buffer", None)
        if buf is not None:
            rec += [id(buf), _bytes(buf)]
    else:
        rec.append(_bytes(t))
    return tuple(rec)


def snapshot(model: nn.Module, optimizers: list) -> dict:
    """Everything a failed call must not change, by readable name."""
    snap = {}
    for mod_name, sub in model.named_modules(remove_duplicate=False):
        for name, p in sub._parameters.items():
            key = f"{mod_name}.{name}" if mod_name else name
            snap[f"param {key}"] = None if p is None else _tensor_record(p)
            if p is not None:
                snap[f"grad {key}"] = None if p.grad is None else _tensor_record(p.grad)
                snap[f"param {key} type"] = type(p).__name__
        for name, b in sub._buffers.items():
            snap[f"buffer {mod_name}.{name}"] = None if b is None else _tensor_record(b)
    snap["training"] = tuple(m.training for m in model.modules())
    for oi, opt in enumerate(optimizers):
        snap[f"optim {oi} type"] = type(opt).__name__
        for gi, g in enumerate(opt.param_groups):
            snap[f"optim {oi} group {gi} params"] = tuple(id(p) for p in g["params"])
            snap[f"optim {oi} group {gi} options"] = tuple(
                sorted((k, repr(v)) for k, v in g.items() if k != "params"))
        snap[f"optim {oi} state type"] = type(opt.state).__name__
        snap[f"optim {oi} state keys"] = tuple(id(p) for p in opt.state)
        for pi, (p, st) in enumerate(opt.state.items()):
            for k, v in st.items():
                snap[f"optim {oi} state {pi}.{k}"] = _tensor_record(v)
    return snap


def diff_snapshots(before: dict, after: dict) -> list[str]:
    keys = list(dict.fromkeys(list(before) + list(after)))
    return [k for k in keys if before.get(k, "<missing>") != after.get(k, "<missing>")]


# --------------------------------------------------------------------------------------------------
# Atomicity (worker side)
# --------------------------------------------------------------------------------------------------


def _expect_failure(results: dict, name: str, compiled, model, opts, call, error_types) -> None:
    """Run ``call()`` (which must raise one of ``error_types``); record the snapshot difference."""
    before = snapshot(model, opts)
    count = compiled.compile_count
    try:
        call()
        raised = None
    except error_types as e:
        raised = type(e).__name__
    results[name] = dict(
        raised=raised, changed=diff_snapshots(before, snapshot(model, opts)),
        count_before=count, count_after=compiled.compile_count,
    )


def atomicity_job(mode: str) -> dict:
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import MissingGradientError, TraceError

    results: dict = {}
    dp = DataParallel(mode)

    # 1. Fresh model, fresh Adam (no state yet): data-dependent control flow.
    model, opt, compiled = fresh_adam_mlp(mode, maybe_branch_step)
    _expect_failure(results, "fresh: branch on a tensor", compiled, model, [opt],
                    lambda: compiled(model, opt, xy(0), branch=True), TraceError)

    # 2. Fresh model with gradients and Adam state from two eager steps (same data on every rank).
    for i in range(2):
        train_step(model, opt, rank_data(300 + i, (BATCH, 50), (BATCH, 8), rank=0))
    _expect_failure(results, "eager state: branch on a tensor", compiled, model, [opt],
                    lambda: compiled(model, opt, xy(0), branch=True), TraceError)

    # 3. Fresh model with a parameter the loss does not use.
    torch.manual_seed(0)
    unused = UnusedParamMLP()
    opt_u = torch.optim.SGD(unused.parameters(), lr=0.1, momentum=0.9)
    compiled_u = spmd_compile(dp)(train_step)
    _expect_failure(results, "fresh: parameter without gradient", compiled_u, unused, [opt_u],
                    lambda: compiled_u(unused, opt_u, xy(0)), MissingGradientError)

    # 4. Already compiled (parameters and Adam state placed on the mesh), then a call whose
    #    recompile fails; the DDP reference sees only the successful steps.
    model, opt, compiled, ddp, ref_opt = with_ddp(mode, SimpleMLP, _adam, maybe_branch_step)
    rep = Report()
    step_no = 0

    def good_step():
        nonlocal step_no
        x, y = xy(10 + step_no)
        step_no += 1
        compiled(model, opt, (x.clone(), y.clone()))
        maybe_branch_step(ddp, ref_opt, (x, y))
        compare(rep, f"step {step_no}", model, opt, ddp.module, ref_opt)

    good_step()
    good_step()
    _expect_failure(results, "compiled: recompile branches on a tensor", compiled, model, [opt],
                    lambda: compiled(model, opt, xy(20), branch=True), TraceError)
    good_step()  # the compiled graph still runs and matches DDP
    # 5. A layer added to the compiled model that the loss does not use: the new structure
    #    recompiles and fails; the placed state and the new plain layer are untouched.
    model.unused = nn.Linear(8, 8)
    opt.add_param_group({"params": list(model.unused.parameters())})
    _expect_failure(results, "compiled: new parameter without gradient", compiled, model, [opt],
                    lambda: compiled(model, opt, xy(21)), MissingGradientError)
    results["parity problems"] = rep.problems
    results["placed"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    return results


# --------------------------------------------------------------------------------------------------
# Tests: catalogue
# --------------------------------------------------------------------------------------------------

def _case_of(item) -> tuple[str, str] | None:
    """The (case, mode) a collected catalogue test reads (``runs`` marks it)."""
    mark = item.get_closest_marker("catalogue")
    if mark is None:
        return None
    params = item.callspec.params
    return params.get("case", mark.args[0]), params["mode"]


_REPORTS = SelectedCases(catalogue_job, _case_of, timeout=600)


def _case(pool, name: str, mode: str) -> list[dict]:
    """The per-rank reports of one case, after asserting it raised nothing and has no problems
    (parity with DDP)."""
    reps = [r[(name, mode)] for r in _REPORTS.reports(pool)]
    for rank, rep in enumerate(reps):
        assert "exception" not in rep["facts"], f"{name}/{mode} raised on rank {rank}: {rep['facts']['exception']}"
        assert not rep["problems"], (
            f"{name}/{mode} (world size {pool.world_size}) differs from DDP on rank {rank}:\n  "
            + "\n  ".join(rep["problems"][:20])
        )
    return reps


def runs(*names: str):
    """Parametrize ``pool, mode[, case]`` over where the named catalogue case(s) run."""
    params, ids = [], []
    for name in names:
        for ws, modes in ((2, CATALOGUE[name][1]), (3, WS3_CASES.get(name, ()))):
            for mode in modes:
                params.append((ws, mode, name) if len(names) > 1 else (ws, mode))
                ids.append(f"{name + '-' if len(names) > 1 else ''}{mode}-ws{ws}")
    argnames = "pool, mode, case" if len(names) > 1 else "pool, mode"
    parametrize = pytest.mark.parametrize(argnames, params, indirect=["pool"], ids=ids)
    return lambda test: parametrize(pytest.mark.catalogue(names[0])(test))


# Cases that match DDP and compile exactly when a call is new: the compile count after each call.
COMPILE_COUNTS = {
    # (2,sum) compiles; again: cached; (3,sum), (3,mse): new; (2,sum): cached; (0.5,mse): new.
    "constants_in_batch": [1, 1, 2, 3, 3, 4],
    # a batch with a None batch dim: momentum buffers created, then steady state
    "unbatched_input": [1, 2, 2],
    # Adam: its first-step state made before recording (optimizer_state.py), one program, and
    # no recompile for the short batch
    "batch_dim_1": [1, 1, 1],
    # float64 labels promote like eager: one graph
    "labels_float64": [1, 1, 1],
    # a step returning None
    "returns_none": [1, 2, 2],
    # eager steps first: Adam's state already exists, one compile for the steady state
    "eager_then_compiled": [1, 1, 1],
    # eval, eval, train (new), train, eval (cached), train (cached)
    "eval_train_dropout": [1, 1, 2, 2, 2, 2],
    # momentum state created, steady state, momentum 0.5 (new), again (cached)
    "momentum_changed": [1, 2, 3, 3],
}


@runs(*COMPILE_COUNTS)
def test_compiles_once_per_new_call_and_matches_ddp(pool, mode, case):
    for rep in _case(pool, case, mode):
        assert rep["facts"]["counts"] == COMPILE_COUNTS[case], rep["facts"]["counts"]


# Parity alone: param_not_in_optimizer (and `extra` never changed), frozen_param (and no
# gradient collective for extra.*), frozen_param_in_optimizer, optimizers no other test uses.
@runs("param_not_in_optimizer", "frozen_param", "frozen_param_in_optimizer",
      *[f"optimizer_{name}" for name in EXTRA_OPTIMIZERS])
def test_matches_ddp(pool, mode, case):
    _case(pool, case, mode)


@runs("inputs_float64")
def test_float64_inputs_raise_like_eager(pool, mode):
    for rep in _case(pool, "inputs_float64", mode):
        eager, ours = rep["facts"]["eager_error"], rep["facts"]["compiled_error"]
        assert eager is not None and eager[0] == "RuntimeError" and "dtype" in eager[1], eager
        assert ours is not None, "a float64 batch into a float32 model ran without an error"
        # Either eager's own error or an SPMDError that says what is wrong.
        assert "dtype" in ours[1] and ("Double" in ours[1] or "float64" in ours[1]), ours


@runs(*[f"item_optimizer_{name}" for name in ITEM_OPTIMIZERS])
def test_optimizer_reading_item_matches_or_raises_and_changes_nothing(pool, mode, case):
    """RAdam / ASGD: the first call (which creates the state, the step count still a constant)
    compiles and matches DDP; the second call's recompile hits the ``.item()`` and raises a
    UnsupportedError naming the optimizer. Rprop matches DDP in both modes (its masked update is
    elementwise on shards). Either way a failed call leaves the state as it was."""
    for rep in _case(pool, case, mode):
        raised = rep["facts"]["raised"]
        if raised is None:
            continue  # every step matched DDP (checked by _case)
        step, name, msg, _ = raised
        # Names the line that failed, or the optimizer.
        assert "optim.step()" in msg or case.rsplit("_", 1)[-1] in msg, raised  # names the line that failed
        assert rep["facts"]["untouched"] == [], rep["facts"]["untouched"]


@runs("item_optimizer_RAdam", "item_optimizer_ASGD")
def test_optimizer_reading_item_is_named_unsupported(pool, mode, case):
    """Not the user's control flow: an UnsupportedError naming the optimizer."""
    for rep in _case(pool, case, mode):
        if rep["facts"]["raised"] is None:
            continue  # every step ran and matched DDP: also fixed
        step, name, msg, unsupported = rep["facts"]["raised"]
        assert unsupported, f"{name}: {msg}"
        assert case.rsplit("_", 1)[-1] in msg, msg


def _flat_norm_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(grad_norm_step)
    return start + next(i for i, text in enumerate(lines) if "FLAT-NORM" in text)


@pytest.mark.parametrize("pool, mode", [(2, "replicate")], indirect=["pool"], ids=["replicate-ws2"])
@pytest.mark.catalogue("flat_grad_norm")
def test_flat_grad_norm_matches_ddp(pool, mode):
    for rep in _case(pool, "flat_grad_norm", mode):
        assert rep["facts"]["raised"] is None, rep["facts"]["raised"]


@pytest.mark.parametrize("pool, mode", [(2, "fully_shard")], indirect=["pool"], ids=["fully_shard-ws2"])
@pytest.mark.catalogue("flat_grad_norm")
def test_flat_grad_norm_fully_shard_computes_or_names_the_line(pool, mode):
    for rep in _case(pool, "flat_grad_norm", mode):
        raised = rep["facts"]["raised"]
        if raised is None:
            continue  # computed, and matched DDP (checked by _case)
        step, name, msg, _ = raised
        assert __file__ in msg and f"line {_flat_norm_line()}" in msg, raised
        assert rep["facts"]["untouched"] == [], rep["facts"]["untouched"]


@runs("batch_of_one_then_larger")
def test_batch_of_one_then_larger_batches_match_ddp(pool, mode):
    for rep in _case(pool, "batch_of_one_then_larger", mode):
        # One graph serves every batch size, one included (a recompile would be acceptable too,
        # reusing a graph specialized to 1 is not: parity above catches it).
        assert rep["facts"]["counts"][-1] <= 2, rep["facts"]["counts"]


@runs("compiled_then_eager")
def test_eager_step_after_compiled_steps_matches_ddp(pool, mode):
    for rep in _case(pool, "compiled_then_eager", mode):
        assert not rep["problems"], rep["problems"]
        assert rep["facts"]["placements"] == [
            "(Replicate(),)" if mode == "replicate" else "(Shard(dim=0),)"]
        assert rep["facts"]["count"] == 1  # Adam: one program (optimizer_state.py)


@runs("empty_batch")
def test_empty_batch_raises_and_changes_nothing(pool, mode):
    for rep in _case(pool, "empty_batch", mode):
        msg = rep["facts"]["raised"]
        assert msg is not None and "size 0" in msg and "(0, 50)" in msg, msg
        assert rep["facts"]["untouched"] == [] and rep["facts"]["count"] == 0, rep["facts"]


# --------------------------------------------------------------------------------------------------
# Tests: atomicity
# --------------------------------------------------------------------------------------------------

_ATOMIC: dict[str, list[dict]] = {}

ATOMIC_CASES = [
    ("fresh: branch on a tensor", "TraceError", 0),
    ("eager state: branch on a tensor", "TraceError", 0),
    ("fresh: parameter without gradient", "MissingGradientError", 0),
    # one compile before: Adam's state is made before recording (optimizer_state.py)
    ("compiled: recompile branches on a tensor", "TraceError", 1),
    ("compiled: new parameter without gradient", "MissingGradientError", 1),
]


@pytest.mark.parametrize("mode", BOTH)
@pytest.mark.parametrize("case, error, count", ATOMIC_CASES, ids=[c[0] for c in ATOMIC_CASES])
def test_failed_compile_changes_nothing(pool2, mode, case, error, count):
    if mode not in _ATOMIC:
        _ATOMIC[mode] = pool2.run(atomicity_job, mode, timeout=300)
    for rank, res in enumerate(_ATOMIC[mode]):
        r = res[case]
        assert r["raised"] == error, f"rank {rank}: {case}: raised {r['raised']}, expected {error}"
        assert r["changed"] == [], f"rank {rank}: {case}: the failed call changed {r['changed']}"
        assert r["count_before"] == r["count_after"] == count, r
        assert not res["parity problems"], res["parity problems"][:10]
        # The compiled model's parameters stay placed; the layer added later stays plain.
        assert res["placed"] == {
            "net1.weight": "DTensor", "net1.bias": "DTensor", "net2.weight": "DTensor",
            "net2.bias": "DTensor", "unused.weight": "Parameter", "unused.bias": "Parameter",
        }, res["placed"]


def first_run_failure_job(mode: str) -> dict:
    """A float64 batch into a float32 model compiles (fake tensors do not check matmul dtypes)
    and fails when the graph runs: is the live state still untouched and nothing cached?"""
    model, opt, compiled = fresh_adam_mlp(mode)
    before = snapshot(model, [opt])
    try:
        compiled(model, opt, xy(0, dtype=torch.float64))
        raised = None
    except Exception as e:  # noqa: BLE001
        from spmd_compiler import SPMDError

        raised = (type(e).__name__, str(e), isinstance(e, SPMDError))
    return dict(raised=raised, changed=diff_snapshots(before, snapshot(model, [opt])),
                count=compiled.compile_count)


@pytest.mark.parametrize("mode", BOTH)
def test_float64_batch_fails_before_touching_state(pool2, mode):
    for rank, res in enumerate(pool2.run(first_run_failure_job, mode)):
        assert res["raised"] is not None
        name, msg, is_spmd = res["raised"]
        assert is_spmd and "dtype" in msg, f"rank {rank}: {name}: {msg}"
        assert res["changed"] == [] and res["count"] == 0, f"rank {rank}: {res}"


# --------------------------------------------------------------------------------------------------
# Tests: ranks that disagree
# --------------------------------------------------------------------------------------------------


class WideMLP(SimpleMLP):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 33)
        self.net2 = nn.Linear(33, 8)


def disagreement_job(what: str) -> dict:
    """Rank 1 differs from the others in ``what``; every rank reports what its call did."""
    from spmd_compiler import DataParallel, SPMDError, spmd_compile

    from tests.models import flexible_step

    rank = dist.get_rank()
    odd = rank == 1
    torch.manual_seed(0)
    model = WideMLP() if (what == "model" and odd) else SimpleMLP()
    momentum = 0.5 if (what == "optimizer" and odd) else 0.9
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    compiled = spmd_compile(DataParallel("replicate"))(flexible_step)
    x, y = xy(0)
    results = []
    for i in range(3):
        b = BATCH
        if what == "batch of one" and odd and i == 2:
            b = 1  # one graph serves every batch size: this call just runs
        if what == "empty batch" and odd:
            b = 0
        x, y = xy(i, max(b, 1))
        x, y = x[:b], y[:b]
        if what == "labels dtype" and odd and i == 2:
            y = y.double()  # flexible_step casts it: a new input signature on rank 1 only
        batch = {"x": x, "y": y} if (what == "batch structure" and odd) else (x, y)
        try:
            compiled(model, opt, batch)
            results.append(None)
        except SPMDError as e:
            results.append((type(e).__name__, str(e)))
            break
    params = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]) \
        if not any(r is not None for r in results) else torch.zeros(1)
    everyone = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, params)
    return dict(results=results, same_params=all(torch.equal(t, params) for t in everyone))


DISAGREEMENTS = {
    # what differs on rank 1 -> a word the error must use
    "model": "parameters",
    "optimizer": "optimizer",
    "batch structure": "input structure",
    "labels dtype": "inputs",
}


def _check_disagreement(results: list[dict], what: str, word: str, *, own_error: bool = False) -> None:
    """Every rank raised an SPMDError on the same call; the others name rank 1. ``word`` (what
    differs) must be in every rank's message, or with ``own_error`` (rank 1 raises its own error
    about its input) in rank 1's."""
    for rank, res in enumerate(results):
        failures = [r for r in res["results"] if r is not None]
        assert failures, f"rank {rank}: every call ran although rank 1 differs in {what}"
        name, msg = failures[0]
        if rank != 1:
            assert "rank 1" in msg or "ranks [1]" in msg, (
                f"rank {rank}: the error does not name rank 1: {msg}")
        if rank == 1 or not own_error:
            assert word in msg, f"rank {rank}: the error does not name the {what}: {msg}"
    # Every rank fails on the same call.
    assert len({len(r["results"]) for r in results}) == 1, results


@pytest.mark.parametrize("what", list(DISAGREEMENTS))
def test_rank_that_differs_raises_on_every_rank(pool2, what):
    _check_disagreement(pool2.run(disagreement_job, what, timeout=120), what, DISAGREEMENTS[what])


def test_batch_of_one_on_one_rank_just_runs(pool2):
    """A local batch of one on rank 1 only runs on the same graph as the others' batches of 16:
    no error, and the ranks' parameters stay identical."""
    for rank, res in enumerate(pool2.run(disagreement_job, "batch of one", timeout=120)):
        assert res["results"] == [None, None, None], f"rank {rank}: {res['results']}"
        assert res["same_params"], f"rank {rank}: the ranks' parameters differ"


def test_rank_with_empty_batch_raises_on_every_rank(pool2):
    _check_disagreement(pool2.run(disagreement_job, "empty batch", timeout=60), "empty batch",
                        "size 0", own_error=True)
