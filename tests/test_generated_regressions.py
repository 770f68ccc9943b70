"""Cases the step generator found (tests/generated_steps.py), kept as plain regression tests once
fixed, each in one style: an LSTM recorded with mkldnn picked the recurrent layer's inference
kernel when its input needed no gradient, whose backward then failed (found by seed 2001); a
layer unfrozen after the others trained gave momentum SGD a group where only some parameters
have a momentum buffer, which the fused SGD kernel the compiler chose cannot start (seed 2001
of a later grammar)."""

from __future__ import annotations

import pytest

from tests.generated_steps import Case, check

FOUND = [
    (Case(seed=2001, model="rnn", loss="both", optimizer="adamw", impl="default",
          betas=(0.9, 0.999), weight_decay=0.01, extras=("clip",), change=None, act="ReLU"),
     "replicate"),
    (Case(seed=8, model="rnn", loss="mse", optimizer="momentum", impl="foreach",
          betas=(0.9, 0.999), weight_decay=0.0, extras=("scheduler",), change="global",
          act="Tanh"), "fully_shard"),
    (Case(seed=2001, model="mlp", loss="mse", optimizer="nesterov", impl="foreach",
          betas=(0.9, 0.999), weight_decay=0.0, extras=(), change="unfreeze", act="Tanh"),
     "replicate"),
]


@pytest.fixture
def pools(pool2, pool3):
    return {2: pool2, 3: pool3}


@pytest.mark.parametrize("case,style", FOUND, ids=[f"{c.seed}-{c.model}-{s}" for c, s in FOUND])
def test_found_case_trains_as_the_oracle(pools, case, style):
    problem = check(pools, case, style)
    assert problem is None, problem
