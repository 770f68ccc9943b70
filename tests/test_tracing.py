"""The whole-step tracer (spmd_compiler/trace/record.py), single process, no process group.

What the later stages rely on: placeholders in the documented order (params, buffers, optimizer
states, lifted hyperparameters, batch leaves) with their roles, one GRAD node per parameter,
forward/backward/optimizer regions in order, no profiler nodes, a symbolic batch dim with static
weights, ``lr`` lifted as an input, fused Adam as one node, and a live model/optimizer left as
they were.
"""

from __future__ import annotations

import math

import pytest
import sympy

import torch
import torch.nn as nn

from spmd_compiler.passes import meta
from spmd_compiler.passes.meta import Region, Role
from spmd_compiler.trace.record import trace_step
from tests.models import BatchNormMLP, SimpleMLP, TiedMLP, TransposedMLP, mse_step, train_step

aten = torch.ops.aten
REGION_ORDER = [Region.FORWARD, Region.BACKWARD, Region.OPTIMIZER]


def batch(b=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 50, generator=g), torch.randn(b, 8, generator=g)


def warmed_up(model, opt, step=train_step):
    """Run one eager step so the optimizer has its state (the steady-state trace)."""
    step(model, opt, batch(seed=1))
    return model, opt


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def role_counts_in_order(gm):
    """Placeholder roles, run-length encoded: [(Role.PARAM, 4), (Role.OPT_STATE, 4), ...]."""
    out = []
    for n in placeholders(gm):
        r = n.meta.get(meta.ROLE)
        if out and out[-1][0] == r:
            out[-1][1] += 1
        else:
            out.append([r, 1])
    return [tuple(x) for x in out]


def is_symbolic(size) -> bool:
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


# --------------------------------------------------------------------------------------------------
# Placeholders


def test_placeholders_in_documented_order_with_roles():
    torch.manual_seed(0)
    model = SimpleMLP()
    model, opt = warmed_up(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    tr = trace_step(train_step, (model, opt, batch()))
    gm = tr.gm

    assert role_counts_in_order(gm) == [
        (Role.PARAM, 4), (Role.OPT_STATE, 4), (Role.HPARAM, 1), (Role.INPUT, 2)
    ]
    ph = placeholders(gm)
    names = [n for n, _ in model.named_parameters()]
    assert [n.meta[meta.PARAM_FQN] for n in ph[:4]] == names == tr.param_fqns
    for n, p in zip(ph[:4], model.parameters()):
        assert tuple(n.meta["val"].shape) == tuple(p.shape)
    assert [(n.meta[meta.PARAM_FQN], n.meta[meta.STATE_KEY]) for n in ph[4:8]] == [
        (name, "momentum_buffer") for name in names
    ] == tr.state_keys
    assert tr.num_hparams == 1 and tr.new_state_keys == []
    assert [n.meta[meta.INPUT_BATCH_DIM] for n in ph[9:]] == [0, 0]


def test_fresh_optimizer_state_is_created_in_graph():
    """Without state yet, no OPT_STATE placeholders; the created state tensors are trailing
    outputs, named in new_state_keys."""
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tr = trace_step(train_step, (model, opt, batch()))
    assert role_counts_in_order(tr.gm) == [(Role.PARAM, 4), (Role.HPARAM, 1), (Role.INPUT, 2)]
    assert tr.new_state_keys == [(n, "momentum_buffer") for n, _ in model.named_parameters()]
    (out,) = [n for n in tr.gm.graph.nodes if n.op == "output"]
    assert len(out.args[0]) == tr.num_tensor_outputs + len(tr.new_state_keys)
    assert opt.state == {}, "tracing must not create state in the live optimizer"


def test_buffers_come_after_params_and_before_states():
    torch.manual_seed(0)
    model = BatchNormMLP()
    model, opt = warmed_up(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           step=mse_step)
    tr = trace_step(mse_step, (model, opt, batch()))
    assert role_counts_in_order(tr.gm) == [
        (Role.PARAM, 6), (Role.BUFFER, 3), (Role.OPT_STATE, 6), (Role.HPARAM, 1), (Role.INPUT, 2)
    ]
    ph = placeholders(tr.gm)
    assert [n.meta[meta.PARAM_FQN] for n in ph[6:9]] == [n for n, _ in model.named_buffers()]
    assert tr.buffer_fqns == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def test_tied_weight_is_one_placeholder_with_one_grad():
    torch.manual_seed(0)
    model = TiedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = trace_step(train_step, (model, opt, batch()))
    unique = [n for n, _ in model.named_parameters()]  # remove_duplicate=True: tied weight once
    assert len(unique) == 7
    assert tr.param_fqns == unique
    params = [n for n in placeholders(tr.gm) if n.meta.get(meta.ROLE) == Role.PARAM]
    assert [n.meta[meta.PARAM_FQN] for n in params] == unique
    grads = [n for n in tr.gm.graph.nodes if n.meta.get(meta.ROLE) == Role.GRAD]
    assert sorted(n.meta[meta.PARAM_FQN] for n in grads) == sorted(unique)


# --------------------------------------------------------------------------------------------------
# Gradients and regions


@pytest.mark.parametrize("opt_kind", ["sgd", "sgd_momentum", "adam_fused"])
def test_one_grad_node_per_parameter(opt_kind):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    }[opt_kind](model.parameters())
    gm = trace_step(train_step, (model, opt, batch())).gm
    grads = [n for n in gm.graph.nodes if n.meta.get(meta.ROLE) == Role.GRAD]
    params = dict(model.named_parameters())
    assert sorted(n.meta[meta.PARAM_FQN] for n in grads) == sorted(params)
    for n in grads:
        assert tuple(n.meta["val"].shape) == tuple(params[n.meta[meta.PARAM_FQN]].shape)
        assert n.meta[meta.REGION] == Region.BACKWARD
        # The optimizer reads the gradient.
        assert any(u.meta.get(meta.REGION) == Region.OPTIMIZER for u in n.users), n.format_node()


def test_regions_forward_backward_optimizer_in_order():
    torch.manual_seed(0)
    model = SimpleMLP()
    model, opt = warmed_up(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    gm = trace_step(train_step, (model, opt, batch())).gm
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    regions = [n.meta[meta.REGION] for n in ops]
    assert set(regions) == set(REGION_ORDER)
    idx = [REGION_ORDER.index(r) for r in regions]
    assert idx == sorted(idx), "regions are not forward, then backward, then optimizer"
    # The loss (sum) is forward; addmm of the forward too; in-place updates are optimizer.
    assert all(n.meta[meta.REGION] == Region.FORWARD for n in ops if n.target == aten.addmm.default)
    assert all(n.meta[meta.REGION] == Region.OPTIMIZER for n in ops if n.target == aten.add_.Tensor)


def test_no_profiler_nodes():
    torch.manual_seed(0)
    model = SimpleMLP()
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(model.parameters(), lr=0.1, fused=True)):
        gm = trace_step(train_step, (model, opt, batch())).gm
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if "profiler" in t or "record_function" in t], targets


# --------------------------------------------------------------------------------------------------
# Symbolic batch, lifted hyperparameters


@pytest.mark.parametrize("b", [16, 5])
def test_batch_dim_symbolic_weights_static(b):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = trace_step(train_step, (model, opt, batch(b)))
    ph = placeholders(tr.gm)
    inputs = [n for n in ph if n.meta.get(meta.ROLE) == Role.INPUT]
    assert len(inputs) == 2
    syms = set()
    for n in inputs:
        shape = n.meta["val"].shape
        assert is_symbolic(shape[0]), f"{n.name}: batch dim {shape[0]!r} is not symbolic"
        assert isinstance(shape[0].node.expr, sympy.Symbol)
        assert all(isinstance(s, int) for s in shape[1:]), shape
        syms.add(shape[0].node.expr)
    assert len(syms) == 1, f"x and y batch dims are not unified: {syms}"
    for n in ph:
        if n.meta.get(meta.ROLE) == Role.PARAM:
            assert all(type(s) is int for s in n.meta["val"].shape), n.meta["val"].shape
    for n in tr.gm.graph.nodes:
        if n.meta.get(meta.ROLE) == Role.GRAD:
            assert all(type(s) is int for s in n.meta["val"].shape), n.meta["val"].shape
    # The batch symbol does not get specialized to the example's size.
    assert (f"Eq({syms.pop()}, {b})") not in [str(g.expr) for g in tr.shape_env.guards]


def test_batch_dim_1_is_the_symbolic_dim():
    torch.manual_seed(0)
    model = TransposedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(16)
    tr = trace_step(train_step, (model, opt, (x.t(), y.t())), input_batch_dim=1)
    for n in placeholders(tr.gm):
        if n.meta.get(meta.ROLE) == Role.INPUT:
            shape = n.meta["val"].shape
            assert isinstance(shape[0], int) and is_symbolic(shape[1]), shape
            assert n.meta[meta.INPUT_BATCH_DIM] == 1


def test_lr_is_a_placeholder_not_a_constant():
    torch.manual_seed(0)
    model = SimpleMLP()
    codes = []
    for lr in (0.1, 0.25):
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        tr = trace_step(train_step, (model, opt, batch()))
        (hp,) = [n for n in placeholders(tr.gm) if n.meta.get(meta.ROLE) == Role.HPARAM]
        assert isinstance(hp.meta["val"], torch.SymFloat)
        assert hp.users, "the lr placeholder is not used"
        codes.append(tr.gm.code)
        assert repr(lr) not in tr.gm.code
    assert codes[0] == codes[1], "the graph depends on the lr value"


def test_two_param_groups_lift_two_lrs():
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(
        [{"params": model.net1.parameters(), "lr": 0.1}, {"params": model.net2.parameters()}],
        lr=0.01,
    )
    tr = trace_step(train_step, (model, opt, batch()))
    hps = [n for n in placeholders(tr.gm) if n.meta.get(meta.ROLE) == Role.HPARAM]
    assert tr.num_hparams == 2 and len(hps) == 2
    assert all(n.users for n in hps)
    assert [float(n.meta["val"].node.hint) for n in hps] == [0.1, 0.01]


def test_fused_adam_is_one_node():
    torch.manual_seed(0)
    model = SimpleMLP()
    model, opt = warmed_up(model, torch.optim.Adam(model.parameters(), lr=0.1, fused=True))
    tr = trace_step(train_step, (model, opt, batch()))
    gm = tr.gm
    fused = [n for n in gm.graph.nodes if n.target == aten._fused_adam_.tensor_lr]
    assert len(fused) == 1
    params_arg = fused[0].args[0]
    assert [p.meta[meta.ROLE] for p in params_arg] == [Role.PARAM] * 4
    assert not [n for n in gm.graph.nodes if n.target == aten._local_scalar_dense.default]
    # the learning rate is a float64 0-d tensor input, not a constant baked into the graph
    lr = fused[0].kwargs["lr"]
    assert lr.op == "placeholder" and lr.meta[meta.ROLE] == Role.HPARAM
    assert lr.meta["val"].dtype == torch.float64 and tr.hparam_tensors == [True]
    assert tr.specialized_hparams == []


@pytest.mark.parametrize("opt_cls, kwargs, target", [
    (torch.optim.Adam, {}, aten._fused_adam_.tensor_lr),
    (torch.optim.Adam, {"foreach": True}, aten._fused_adam_.tensor_lr),
    (torch.optim.AdamW, {"weight_decay": 0.1}, aten._fused_adamw_.tensor_lr),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, aten._fused_sgd_.tensor_lr),
])
def test_fuse_optimizer_records_the_fused_kernel(opt_cls, kwargs, target):
    """``fuse_optimizer`` records one fused kernel for a default or foreach optimizer, with the
    learning rate as an input, and leaves the live optimizer's settings alone."""
    torch.manual_seed(0)
    model = SimpleMLP()
    model, opt = warmed_up(model, opt_cls(model.parameters(), lr=0.1, **kwargs))
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    tr = trace_step(train_step, (model, opt, batch()), fuse_optimizer=True)
    assert len([n for n in tr.gm.graph.nodes if n.target == target]) == 1
    assert not [n for n in tr.gm.graph.nodes if "_foreach_" in str(n.target) and "add_" not in str(n.target)]
    assert tr.hparam_tensors == [True] and tr.specialized_hparams == []
    assert before == [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]


@pytest.mark.parametrize("lr", [0.1, 1 / 3])
def test_a_float_learning_rate_baked_in_is_a_guard(lr):
    """An op that takes the learning rate as a plain float bakes its value into the graph; the
    trace reports it (a per-call condition on the lifted number) so the runtime recompiles for
    another value instead of using a stale one, and keeps the program for the same value (1/3:
    the condition holds the exact double, not sympy's 15 digits)."""
    torch.manual_seed(0)
    model = SimpleMLP()
    model, opt = warmed_up(model, torch.optim.SGD(model.parameters(), lr=lr))

    def step(model, optim, batch):
        optim.zero_grad()
        x, y = batch
        loss = (model(x) - y).sum()
        loss.backward()
        lr = optim.param_groups[0]["lr"]
        with torch.no_grad():
            torch._fused_sgd_(list(model.parameters()), [p.grad for p in model.parameters()], [],
                              weight_decay=0.0, momentum=0.0, lr=lr, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=False)
        return loss

    tr = trace_step(step, (model, opt, batch()))

    def fits(value):
        return (all(value == v for i, v in tr.specialized_hparams if i == 0) and
                all(eval(c, {"math": math}, {"h0": value}) for c in tr.hparam_conditions))

    assert tr.specialized_hparams or tr.hparam_conditions
    assert fits(lr) and not fits(lr * 1.01)


def test_foreach_adam_reads_step_from_state():
    """Foreach Adam on CPU reads ``step`` with ``.item()``: the value must come from the step
    state placeholder at run time, not be baked into the graph as a constant."""
    torch.manual_seed(0)
    model = SimpleMLP()
    model, opt = warmed_up(model, torch.optim.Adam(model.parameters(), lr=0.1, foreach=True))
    gm = trace_step(train_step, (model, opt, batch())).gm
    reads = [n for n in gm.graph.nodes if n.target == aten._local_scalar_dense.default]
    assert reads

    def ancestors(node):
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append(a)
        return seen

    for r in reads:
        steps = [a for a in ancestors(r) if a.meta.get(meta.STATE_KEY) == "step"]
        assert steps, f"{r.name} does not read a step state placeholder"


# --------------------------------------------------------------------------------------------------
# Tracing leaves the live state alone


@pytest.mark.parametrize(
    "opt_kind", ["sgd_momentum", "batchnorm_sgd_momentum", "adam_fused", "adam_foreach_fresh"]
)
def test_tracing_does_not_modify_model_or_optimizer(opt_kind):
    torch.manual_seed(0)
    model = BatchNormMLP() if opt_kind.startswith("batchnorm") else SimpleMLP()
    step = mse_step if opt_kind.startswith("batchnorm") else train_step
    if "sgd_momentum" in opt_kind:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif opt_kind == "adam_fused":
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)
    if opt_kind != "adam_foreach_fresh":
        warmed_up(model, opt, step)

    params = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    buffers = [(n, b, b.detach().clone()) for n, b in model.named_buffers()]
    grads = [p.grad for _, p, _ in params]
    state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
             for p, st in opt.state.items()}
    state_ids = {p: {k: id(v) for k, v in st.items()} for p, st in opt.state.items()}
    groups = [
        {k: (list(v) if k == "params" else v) for k, v in g.items()} for g in opt.param_groups
    ]
    training = [m.training for m in model.modules()]

    trace_step(step, (model, opt, batch()))

    assert [(n, p) for n, p in model.named_parameters()] == [(n, p) for n, p, _ in params]
    for (n, p, before), g in zip(params, grads):
        assert type(p) is nn.Parameter, n
        assert torch.equal(p, before), n
        assert p.grad is g, n
    for (n, b, before), (n2, b2) in zip(buffers, model.named_buffers()):
        assert b2 is b and torch.equal(b, before), n
    assert list(opt.state) == list(state)
    for p, st in opt.state.items():
        assert {k: id(v) for k, v in st.items()} == state_ids[p]
        for k, v in st.items():
            assert (torch.equal(v, state[p][k]) if torch.is_tensor(v) else v == state[p][k]), k
    assert len(opt.param_groups) == len(groups)
    for g, before in zip(opt.param_groups, groups):
        assert set(g) == set(before)
        for k, v in before.items():
            if k == "params":
                assert len(g[k]) == len(v) and all(a is b for a, b in zip(g[k], v))
            else:
                assert g[k] == v and type(g[k]) is type(v), k
    assert [m.training for m in model.modules()] == training
