"""``spmd_compile(..., verify=N)``: the compiled step checked against the step run eagerly with
DDP's semantics (spmd_compiler/verify.py).

- A right program passes every check, in every style: a gradient penalty with dropout,
  LayerNorm and BatchNorm (buffers broadcast as DDP does), and a GAN with two modules, two
  optimizers and a forward reused after a step; ``verify_every`` checks the calls it names,
  ``SPMD_VERIFY`` turns checks on without touching the code; the checked calls train exactly as
  unchecked ones do (same parameters as a run without verify).
- A wrong program is caught at its first checked call, on every rank, naming the first
  differing parameter and where the difference comes from: a ``gm_transformation`` that drops
  the gradients' averaging (each rank then trains on its own gradient: the call agrees without
  it), and a step whose Python value changes unseen between calls (a dataclass argument mutated
  in place) is either compiled again or raises naming the stale program: it never trains on
  silently.
- The oracle itself equals DDP: a GAN step (two modules, two optimizers, a forward reused after
  the critic's step) run by it matches the same step on DDP-wrapped copies, parameters and
  optimizer state, and leaves the real modules and optimizers as they were.
- Bad values of ``verify`` are refused.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.multirank import rank_data
from tests.test_several_modules import gan_step

STEPS = 4


def penalty_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    x = x.requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.mse_loss(out, y) + ((g.norm(2, dim=1) - 1) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


@dataclasses.dataclass
class LossConfig:
    weight: float = 1.0


def weighted_step(model, opt, batch, cfg):
    x, y = batch
    opt.zero_grad()
    loss = cfg.weight * F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _penalty_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Dropout(0.2), nn.Linear(16, 16),
                          nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return penalty_step, (model, opt), lambda i: rank_data(10 + i, (8, 12), (8, 5))


def _gan_case():
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    opts = (torch.optim.Adam(G.parameters(), lr=1e-2, betas=(0.0, 0.9)),
            torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9))
    return gan_step, (G, D, *opts), lambda i: rank_data(20 + i, (8, 8), (8, 4))


CASES = {"penalty": _penalty_case, "gan": _gan_case}


def _params(objs) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for m in objs if isinstance(m, nn.Module) for p in m.parameters()]


def _mesh(style: str):
    if style != "hybrid_shard":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))


def right_program_job(case: str, style: str) -> dict:
    """Every call checked passes, and trains as the same calls without verify."""
    from spmd_compiler import DataParallel, spmd_compile

    step, objs, data = CASES[case]()
    plain_objs = copy.deepcopy(objs)
    mesh = _mesh(style)
    checked = spmd_compile(DataParallel(style), mesh=mesh, verify=2, verify_every=2)(step)
    plain = spmd_compile(DataParallel(style), mesh=mesh)(step)
    for i in range(STEPS + 1):
        torch.manual_seed(1000 + i)  # dropout draws alike in both runs
        checked(*objs, data(i))
        torch.manual_seed(1000 + i)
        plain(*plain_objs, data(i))
    same = max((a - b).abs().max().item() for a, b in zip(_params(objs), _params(plain_objs)))
    return dict(checked=checked.verification.checked, calls=checked.verification.calls,
                compiles=checked.compile_count, same=same)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("case", list(CASES))
def test_right_program_passes_every_check(pool2, case, style):
    for res in pool2.run(right_program_job, case, style):
        # calls 1 and 2, then every second call after them: 4 (of 5)
        assert (res["checked"], res["calls"]) == (3, STEPS + 1), res
        assert res["same"] == 0.0, res
        assert res["compiles"] <= 2, res


def test_right_program_passes_under_hybrid_shard(pool4):
    for res in pool4.run(right_program_job, "gan", "hybrid_shard"):
        assert (res["checked"], res["calls"]) == (3, STEPS + 1), res
        assert res["same"] == 0.0, res


def _drop_gradient_averaging(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A wrong program: every all_reduce's result replaced by its input."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and "all_reduce" in str(node.target) and \
                "wait" not in str(node.target):
            waits = [u for u in node.users if "wait" in str(u.target)]
            for w in waits:
                w.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(w)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def wrong_program_job() -> dict:
    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import DivergenceError

    step, objs, data = CASES["penalty"]()
    compiled = spmd_compile(DataParallel("replicate", overlap=False), verify=1,
                            gm_transformation=_drop_gradient_averaging, check_ranks=False)(step)
    try:
        compiled(*objs, data(0))
    except DivergenceError as e:
        return dict(error=str(e))
    return dict(error=None)


def test_wrong_program_raises_on_every_rank_naming_the_parameter(pool2):
    for res in pool2.run(wrong_program_job):
        assert res["error"] is not None, "a program without gradient averaging passed verify"
        assert "call 1 of penalty_step differs from the step run eagerly" in res["error"], res
        assert "parameter model.0.weight: max abs difference" in res["error"], res["error"]
        assert "on rank(s) [0, 1]" in res["error"], res["error"]
        assert "The call agrees without the gm_transformation" in res["error"], res["error"]


def changed_value_job(style: str) -> dict:
    """The step's dataclass argument mutated in place after two calls: recompiled (then it
    trains as DDP), or caught at the first call after the change; never silently wrong."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import DivergenceError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = DDP(copy.deepcopy(model))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    cfg, ref_cfg = LossConfig(), LossConfig()
    compiled = spmd_compile(DataParallel(style), verify_every=1)(weighted_step)
    for i in range(STEPS):
        if i == 2:
            cfg.weight = ref_cfg.weight = 3.0
        batch = rank_data(30 + i, (6, 6), (6, 3))
        try:
            compiled(model, opt, batch, cfg)
        except DivergenceError as e:
            return dict(caught_at=i, error=str(e), worst=None)
        weighted_step(ref, ref_opt, batch, ref_cfg)
    worst = max((a - b).abs().max().item() for a, b in zip(_params([model]), _params([ref.module])))
    return dict(caught_at=None, worst=worst)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_value_changed_unseen_never_trains_on_silently(pool2, style):
    results = pool2.run(changed_value_job, style)
    assert len({r["caught_at"] for r in results}) == 1, results  # every rank, the same call
    for res in results:
        if res["caught_at"] is not None:
            assert res["caught_at"] == 2, res
            assert "compiled at an earlier call" in res["error"], res["error"]
            assert "the program that ran was stale" in res["error"], res["error"]
        else:
            assert res["worst"] < 1e-5, res


def environment_job() -> dict:
    from spmd_compiler import DataParallel, spmd_compile

    os.environ["SPMD_VERIFY"] = "2"
    try:
        step, objs, data = CASES["penalty"]()
        compiled = spmd_compile(DataParallel("replicate"))(step)
        for i in range(3):
            compiled(*objs, data(i))
        return dict(checked=compiled.verification.checked)
    finally:
        del os.environ["SPMD_VERIFY"]


def test_spmd_verify_turns_checks_on(pool2):
    assert [r["checked"] for r in pool2.run(environment_job)] == [2, 2]


@pytest.mark.parametrize("kw", [dict(verify=-1), dict(verify_every=-2)])
def test_bad_verify_values_are_refused(kw):
    from spmd_compiler import DataParallel, SPMDError, spmd_compile

    with pytest.raises(SPMDError, match="count calls"):
        spmd_compile(DataParallel("replicate"), **kw)(penalty_step)


def oracle_job() -> dict:
    """One call of the GAN step by the oracle, and by DDP on copies of the same state (after a
    first step on both, so that the optimizers have state)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler.runtime.call_args import split_step_args
    from spmd_compiler.verify import _modules, _reference, _state

    step, objs, data = CASES["gan"]()
    wrapped = (DDP(objs[0]), DDP(objs[1]), *objs[2:])
    step(*wrapped, data(0))  # the same first step for both: Adam and momentum state exist
    ref = copy.deepcopy(objs)
    wrapped = (DDP(ref[0]), DDP(ref[1]), *ref[2:])
    before = _state([("module 0", objs[0]), ("module 1", objs[1])], objs[2:])
    sa = split_step_args((*objs, data(1)), {}, 0, None, step)
    expected, _ = _reference(step, sa, _modules(sa), dist.group.WORLD, True)
    step(*wrapped, data(1))
    got = _state([("module 0", ref[0]), ("module 1", ref[1])], ref[2:])
    left = _state([("module 0", objs[0]), ("module 1", objs[1])], objs[2:])
    tensors = [k for k, v in got.items() if isinstance(v, torch.Tensor)]
    return dict(names_agree=sorted(expected) == sorted(got), entries=len(tensors),
                worst=max((expected[k] - got[k]).abs().max().item() for k in tensors),
                moved=max((expected[k] - before[k]).abs().max().item() for k in tensors
                          if k.startswith("parameter")),
                untouched=sorted(left) == sorted(before) and all(
                    torch.equal(left[k], before[k]) for k in tensors))


def test_the_oracle_equals_ddp(pool2):
    for res in pool2.run(oracle_job):
        assert res["names_agree"] and res["entries"] > 8, res
        assert res["worst"] < 1e-6 and res["moved"] > 1e-4, res
        assert res["untouched"], res
