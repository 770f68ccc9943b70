"""Cross-rank agreement: ranks that would run different programs all raise, none hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spmd_compiler import DataParallel, spmd_compile
from spmd_compiler.errors import RankMismatchError
from tests.models import BatchNormMLP, SimpleMLP, train_step

# (style, model): where the carried agreement rides: the gradient bucket, the first gathered
# parameter bucket, the buffers' bytes (replicate and fully_shard)
STYLES = [("replicate", SimpleMLP), ("fully_shard", SimpleMLP), ("replicate", BatchNormMLP),
          ("fully_shard", BatchNormMLP)]
STYLE_IDS = [f"{mode}-{build.__name__}" for mode, build in STYLES]


def _batch(b: int):
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(b, 50, generator=g), torch.randn(b, 8, generator=g)


def _outcome(fn):
    """Run ``fn``; return ("ok", None) or (error type name, message) so the pool stays up."""
    try:
        fn()
        return ("ok", None)
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return (type(e).__name__, " ".join([str(e), *getattr(e, "__notes__", [])]))


def _compiled(mode: str, step_fn=train_step, edit_model=None, build=SimpleMLP, **sgd):
    """The seeded ``build()`` model (changed by ``edit_model`` first, if given), its SGD (lr 0.1
    and ``sgd``) and ``step_fn`` compiled for ``mode``."""
    torch.manual_seed(0)
    model = build()
    if edit_model is not None:
        edit_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, **sgd)
    return model, opt, spmd_compile(DataParallel(mode))(step_fn)


def _no_net2_bias(model):
    model.net2 = torch.nn.Linear(32, 8, bias=False)


def _different_model_on_rank1():
    model, opt, step = _compiled("replicate", edit_model=_no_net2_bias if dist.get_rank() == 1 else None)
    return _outcome(lambda: step(model, opt, _batch(8)))


def _different_optimizer_config_on_last_rank():
    last = dist.get_rank() == dist.get_world_size() - 1
    model, opt, step = _compiled("fully_shard", momentum=0.5 if last else 0.9)
    return _outcome(lambda: step(model, opt, _batch(8)))


def _failing_compile_on_rank0():
    def step_fn(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        loss = (model(x) - y).sum()
        if dist.get_rank() == 0 and loss > 0:  # data-dependent branch on rank 0 only
            loss = loss * 2
        loss.backward()
        optim.step()
        return loss

    model, opt, step = _compiled("replicate", step_fn)
    return _outcome(lambda: step(model, opt, _batch(8)))


def _input_change_on_rank1(mode="replicate", build=SimpleMLP):
    model, opt, step = _compiled(mode, build=build)
    for b in (8, 8):  # compile the state-creating and the steady graph on every rank
        step(model, opt, _batch(b))
    # Only rank 1 passes an input that requires grad: a new compile there, the cached graph
    # elsewhere.
    x, y = _batch(8)
    return _outcome(lambda: step(model, opt, (x.requires_grad_(dist.get_rank() == 1), y)))



@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("job, words", [
    (_different_model_on_rank1, ["parameters", "ranks [1]"]),
    (_different_optimizer_config_on_last_rank, ["optimizer"]),
    (_input_change_on_rank1, ["ranks [1]", "inputs"]),
])
def test_mismatch_raises_on_every_rank(pool, job, words):
    results = pool.run(job, timeout=120)
    for rank, (kind, message) in enumerate(results):
        assert kind == RankMismatchError.__name__, f"rank {rank}: {kind}: {message}"
        for w in words:
            assert w in message, f"rank {rank}: {w!r} not in {message!r}"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_compile_error_on_one_rank_reaches_all(pool):
    results = pool.run(_failing_compile_on_rank0, timeout=120)
    assert results[0][0] == "TraceError", results[0]
    for rank, (kind, message) in enumerate(results[1:], start=1):
        # rank 0 compiles the program for every rank (shared_compile.py): its error is raised
        # on each, as rank 0 raised it, with a note naming rank 0
        assert kind == "TraceError", f"rank {rank}: {kind}: {message}"
        assert "raised while compiling on rank 0" in message and "loss > 0" in message, message


# ---------------------------------------------------------------------------------------------
# The agreement carried in the first gradient all_reduce


def _bad_arguments_on_rank1_after_compiling(mode="replicate", build=SimpleMLP):
    """Rank 1 passes a batch whose inputs disagree on the batch size (rejected before any
    program runs) while rank 0 runs its cached program, whose check rides in its first
    collective; then both run a good step: nothing was changed by the stopped one."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = spmd_compile(DataParallel(mode))(train_step)
    for _ in range(2):
        step(model, opt, _batch(8))
    carrier = step._carrier
    before = [t.detach().clone() for t in model.state_dict().values()]
    x, y = _batch(8)
    bad = (x, y[:5]) if dist.get_rank() == 1 else (x, y)
    outcome = _outcome(lambda: step(model, opt, bad))
    unchanged = all(torch.equal(a, t.detach()) for a, t in zip(before, model.state_dict().values()))
    after = _outcome(lambda: step(model, opt, _batch(8)))
    return carrier, outcome, unchanged, after, step.compile_count


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_rank_rejecting_its_arguments_stops_the_carried_check(pool):
    results = pool.run(_bad_arguments_on_rank1_after_compiling, timeout=120)
    for rank, (carrier, outcome, unchanged, after, compiles) in enumerate(results):
        # the gradient bucket + header
        assert carrier == (("all_reduce", 1914, "torch.float32", -1, True),), (rank, carrier)
        _assert_stopped(rank, outcome, unchanged, after, compiles)


def _assert_stopped(rank, outcome, unchanged, after, compiles):
    if rank == 1:
        assert outcome[0] != "ok" and outcome[0] != RankMismatchError.__name__, outcome
    else:
        assert outcome[0] == RankMismatchError.__name__, (rank, outcome)
        assert "rejected their step arguments" in outcome[1]
    assert unchanged, f"rank {rank}: the stopped step changed parameters or buffers"
    assert after == ("ok", None) and compiles == 2, (rank, after, compiles)


@pytest.mark.parametrize("mode, build", STYLES, ids=STYLE_IDS)
def test_every_style_carries_the_agreement_and_stops_on_a_rejecting_rank(pool2, mode, build):
    results = pool2.run(_bad_arguments_on_rank1_after_compiling, mode, build, timeout=180)
    for rank, (carrier, outcome, unchanged, after, compiles) in enumerate(results):
        assert carrier is not None and carrier[-1][-1], (rank, carrier)  # no collective of its own
        _assert_stopped(rank, outcome, unchanged, after, compiles)


@pytest.mark.parametrize("mode, build", STYLES[1:], ids=STYLE_IDS[1:])
def test_every_style_raises_on_every_rank_for_a_changed_input(pool2, mode, build):
    for rank, (kind, message) in enumerate(pool2.run(_input_change_on_rank1, mode, build,
                                                     timeout=180)):
        assert kind == RankMismatchError.__name__, f"rank {rank}: {kind}: {message}"
        assert "ranks [1]" in message and "inputs" in message, message
