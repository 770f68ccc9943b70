"""Generated training steps (tests/generated_steps.py), each compiled in both styles with every
call checked against the step run eagerly with DDP's semantics.

A fixed seeded budget runs here: ``SPMD_GENERATED_STEPS`` cases (default 6) from seed
``SPMD_GENERATED_SEED`` (default 2000). A long hunt: ``python -m tests.generated_steps --hunt N
--seed S``. Two cases also run as users launch them: the generated script itself, two spawned
gloo ranks running the step defined in ``__main__`` (``__mp_main__`` in the workers).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.generated_steps import Case, check, written

BUDGET = int(os.environ.get("SPMD_GENERATED_STEPS", "6"))
FIRST = int(os.environ.get("SPMD_GENERATED_SEED", "2000"))
SEEDS = range(FIRST, FIRST + BUDGET)


@pytest.fixture
def pools(pool2, pool3):
    return {2: pool2, 3: pool3}


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_step_trains_as_the_oracle(pools, seed, style):
    problem = check(pools, Case.draw(seed), style)
    assert problem is None, problem


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("seed", [7, 5])
def test_generated_script_as_launched(seed):
    case = Case.draw(seed)
    out = subprocess.run([sys.executable, written(case), str(_free_port())], capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    ran = re.findall(r"(\d+) (replicate|fully_shard) compiles \d+", out.stdout)
    assert sorted(ran) == sorted(
        (str(r), s) for r in range(case.world) for s in ("replicate", "fully_shard")), out.stdout
