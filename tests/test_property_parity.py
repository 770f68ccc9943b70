"""Property: any small model, batch size, world size, supported optimizer and mode matches DDP.

Hypothesis draws an example in the test process as plain data (a model spec: MLP widths, depth,
activation and biases, or a small conv net; the local batch size of each of 3 steps; an
optimizer configuration from the supported set: SGD plain / momentum / nesterov with or without
weight decay, Adam, AdamW, foreach or not; the mode; a seed) and sends it to the worker pool of
world size 2 or 3. Every rank builds the same model, a DDP reference with the same optimizer, runs
3 compiled steps with different data per rank and compares every parameter and optimizer state
tensor (``full_tensor()`` of the DTensors) with DDP's after every step:
``|a - e| <= ATOL + RTOL * |e|`` (the tolerances of tests/test_replicate.py).

Adam and AdamW run with ``eps=1e-3``: with the default 1e-8 a gradient element that is round-off
small (say 1e-9, its sign decided by summation order) becomes a full ``lr``-sized step in either
direction, which is not a difference in what the compiler computes.

Examples are not shrunk (each costs a few compiles); a failure prints the drawn example.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.models import mse_step
from tests.multirank import rank_data
from tests.test_replicate import ATOL, RTOL

STEPS = 3
MAX_EXAMPLES = 8  # per world size


# --------------------------------------------------------------------------------------------------
# Examples (test process)
# --------------------------------------------------------------------------------------------------

mlp_specs = st.fixed_dictionaries({
    "kind": st.just("mlp"),
    "in_features": st.integers(1, 12),
    # Hidden widths from 2: a width-1 hidden layer with a local batch of one is a known failure
    # (test_width_one_hidden_layer_with_batch_of_one below).
    "widths": st.lists(st.integers(2, 17), min_size=0, max_size=3),
    "out_features": st.integers(1, 6),
    "activation": st.sampled_from(["tanh", "relu", "sigmoid"]),
    "bias": st.booleans(),
})
conv_specs = st.fixed_dictionaries({
    "kind": st.just("conv"),
    "in_channels": st.integers(1, 3),
    "channels": st.integers(1, 5),
    "padding": st.integers(0, 1),
    "size": st.integers(3, 6),
    "out_features": st.integers(1, 4),
})
sgd = st.fixed_dictionaries({
    "lr": st.sampled_from([0.01, 0.05]),
    "momentum": st.sampled_from([0.0, 0.9]),
    "weight_decay": st.sampled_from([0.0, 0.01]),
    "foreach": st.booleans(),
}).map(lambda kw: ("SGD", kw))
sgd_nesterov = st.fixed_dictionaries({
    "lr": st.sampled_from([0.01, 0.05]),
    "momentum": st.just(0.9),
    "nesterov": st.just(True),
    "weight_decay": st.sampled_from([0.0, 0.01]),
}).map(lambda kw: ("SGD", kw))
adams = st.tuples(
    st.sampled_from(["Adam", "AdamW"]),
    st.fixed_dictionaries({
        "lr": st.sampled_from([1e-3, 1e-2]),
        "weight_decay": st.sampled_from([0.0, 0.01]),
        "foreach": st.booleans(),
        "eps": st.just(1e-3),
    }),
)
examples = st.fixed_dictionaries({
    "model": st.one_of(mlp_specs, mlp_specs, conv_specs),
    "batches": st.lists(st.integers(1, 9), min_size=STEPS, max_size=STEPS),
    "optimizer": st.one_of(sgd, sgd_nesterov, adams),
    "mode": st.sampled_from(["replicate", "fully_shard"]),
    "seed": st.integers(0, 2**16),
})


# --------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def build_model(spec: dict) -> nn.Module:
    if spec["kind"] == "mlp":
        layers, width = [], spec["in_features"]
        for w in spec["widths"]:
            layers += [nn.Linear(width, w, bias=spec["bias"]), _ACTIVATIONS[spec["activation"]]()]
            width = w
        layers.append(nn.Linear(width, spec["out_features"], bias=spec["bias"]))
        return nn.Sequential(*layers)
    side = spec["size"] - 2 + 2 * spec["padding"]
    return nn.Sequential(
        nn.Conv2d(spec["in_channels"], spec["channels"], 3, padding=spec["padding"]),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(spec["channels"] * side * side, spec["out_features"]),
    )


def input_shape(spec: dict, b: int) -> tuple[int, ...]:
    if spec["kind"] == "mlp":
        return (b, spec["in_features"])
    return (b, spec["in_channels"], spec["size"], spec["size"])


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def parity_example(example: dict) -> dict:
    """Run one drawn example; return the tolerance violations and the largest difference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_compiler import DataParallel, spmd_compile

    spec = example["model"]
    torch.manual_seed(example["seed"])  # the same initial model on every rank
    model = build_model(spec)
    ddp = DDP(deepcopy(model))
    name, kwargs = example["optimizer"]
    cls = getattr(torch.optim, name)
    opt, ref_opt = cls(model.parameters(), **kwargs), cls(ddp.parameters(), **kwargs)
    compiled = spmd_compile(DataParallel(example["mode"]))(mse_step)
    problems, max_err = [], 0.0

    def close(where, actual, expected):
        nonlocal max_err
        a, e = _full(actual).double(), expected.detach().double()
        if a.shape != e.shape:
            problems.append(f"{where}: shape {tuple(a.shape)} vs DDP {tuple(e.shape)}")
            return
        err = float((a - e).abs().max()) if a.numel() else 0.0
        max_err = max(max_err, err)
        if not bool(torch.isclose(a, e, rtol=RTOL, atol=ATOL).all()):
            problems.append(f"{where}: max abs err {err:.3g}")

    for i, b in enumerate(example["batches"]):
        x, y = rank_data(example["seed"] + i, input_shape(spec, b), (b, spec["out_features"]))
        loss = compiled(model, opt, (x.clone(), y.clone()))
        ref_loss = mse_step(ddp, ref_opt, (x, y))
        close(f"step {i}: loss", loss, ref_loss)
        for (n, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            close(f"step {i}: {n}", p, q)
            ref_state = ref_opt.state.get(q, {})
            state = opt.state.get(p, {})
            if sorted(state) != sorted(ref_state):
                problems.append(f"step {i}: state keys of {n}: {sorted(state)} vs {sorted(ref_state)}")
                continue
            for k, v in ref_state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    close(f"step {i}: {n}.{k}", state[k], v)
    return dict(problems=problems, max_err=max_err, compiles=compiled.compile_count)


# --------------------------------------------------------------------------------------------------
# Test
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=["ws2", "ws3"])
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(example=examples)
def test_random_models_match_ddp(pool, example):
    results = pool.run(parity_example, example, timeout=300)
    for rank, res in enumerate(results):
        assert not res["problems"], (
            f"rank {rank} (world size {pool.world_size}) differs from DDP for {example}:\n  "
            + "\n  ".join(res["problems"][:20])
        )


WIDTH_ONE = {
    "model": {"kind": "mlp", "in_features": 7, "widths": [1], "out_features": 6,
              "activation": "relu", "bias": False},
    "batches": [6, 6, 1],
    "optimizer": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "seed": 218,
}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_width_one_hidden_layer_with_batch_of_one(pool2, mode):
    for rank, res in enumerate(pool2.run(parity_example, dict(WIDTH_ONE, mode=mode))):
        assert not res["problems"], f"rank {rank}: {res['problems'][:10]}"
