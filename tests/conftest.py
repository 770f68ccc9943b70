"""Shared pytest fixtures: multi-rank worker pools (see tests/multirank.py).

- ``pool2`` / ``pool3`` / ``pool4``: session-wide gloo pools of world size 2, 3 and 4. A pool's processes start
  when the first test asks for it and are reused by every later test (restarted only after a
  failure).
- ``pool``: the pool of the world size given by indirect parametrization, the same objects as
  ``pool2``/``pool3``::

      @pytest.mark.parametrize("pool", [2, 3], indirect=True)
      def test_x(pool):
          assert pool.run(_job) == [...]

  Without parametrization it is the world-size-2 pool.

Every test that uses one of these fixtures gets the ``multirank`` marker, so
``pytest -m "not multirank"`` runs only the single-process tests. When the session has any
multi-rank test, the fork server the workers are forked from starts right after collection and
imports torch in the background. At the end of the session a
line per pool reports its start-up times, jobs and restarts.
"""

from __future__ import annotations

import os

import pytest

# Every compile in the tests (worker processes included: they inherit the environment) checks
# the graph and the meta contract after each stage (spmd_compiler/build/pipeline.py).
os.environ.setdefault("SPMD_CHECK_STAGES", "1")

from tests.multirank import SelectedCases, WorkerPool, prestart_forkserver

_POOL_FIXTURES = frozenset({"pool", "pool2", "pool3", "pool4"})

_POOLS: dict[int, WorkerPool] = {}  # world size -> pool, for the whole session


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "multirank: runs on real gloo worker processes (fixtures pool, pool2, pool3; "
        "tests/multirank.py)",
    )
    config.addinivalue_line(
        "markers", "catalogue(name): the catalogue case a test reads (tests/multirank.SelectedCases)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _POOL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multirank)


def pytest_collection_finish(session: pytest.Session) -> None:
    SelectedCases.session_items = list(session.items)  # what the catalogue jobs run
    # If any multi-rank test will run, let the fork server import torch while the tests before
    # it run (two cores: the single-process tests leave one mostly free).
    if any(item.get_closest_marker("multirank") for item in session.items):
        prestart_forkserver()


def _get_pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    pool.start()  # no-op when it is already running
    return pool


@pytest.fixture(scope="session")
def _multirank_pools():
    yield _POOLS
    for pool in _POOLS.values():
        pool.close()


@pytest.fixture(scope="session")
def pool2(_multirank_pools) -> WorkerPool:
    return _get_pool(2)


@pytest.fixture(scope="session")
def pool3(_multirank_pools) -> WorkerPool:
    return _get_pool(3)


@pytest.fixture(scope="session")
def pool4(_multirank_pools) -> WorkerPool:
    return _get_pool(4)


@pytest.fixture(scope="session")
def pool(request: pytest.FixtureRequest, _multirank_pools) -> WorkerPool:
    return _get_pool(getattr(request, "param", 2))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for ws, pool in sorted(_POOLS.items()):
        times = ", ".join(f"{t:.1f}" for t in pool.start_times) or "-"
        waits = ", ".join(f"{t:.1f}" for t in pool.start_waits) or "-"
        line = (
            f"multirank pool ws={ws}: {pool.jobs} jobs, started {pool.starts}x "
            f"(start-up s: {times}; waited s: {waits})"
        )
        if pool.restart_reasons:
            line += f", restarted after: {'; '.join(pool.restart_reasons)}"
        terminalreporter.write_line(line)
