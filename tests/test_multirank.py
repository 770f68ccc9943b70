"""Tests of the multi-rank harness itself (tests/multirank.py, tests/conftest.py).

The functions whose names start with ``_job`` are sent to the worker processes; they must stay at
module level so the workers can import them by name.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import (
    RankError,
    WorkerDied,
    WorkerPool,
    WorkerTimeout,
    assert_close_all,
    rank_data,
)

# ----------------------------------------------------------------------------------------------
# Job functions (run on every rank)
# ----------------------------------------------------------------------------------------------


def _job_all_reduce_sum(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.get_num_threads()


def _job_scaled_tensor(x, *, scale):
    return x * scale + dist.get_rank()


def _job_raise_on_rank1(message):
    if dist.get_rank() == 1:
        _helper_that_raises(message)
    return dist.get_rank()


def _helper_that_raises(message):
    raise ValueError(message)


def _job_raise_on_rank1_before_collective():
    if dist.get_rank() == 1:
        raise KeyError("rank 1 left before the all_reduce")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for rank 1, which never comes
    return t.item()


def _job_hang_in_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


def _job_sleep(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def _job_exit_on_rank1(code):
    if dist.get_rank() == 1:
        os._exit(code)
    dist.barrier()  # rank 0 waits for the dead rank
    return dist.get_rank()


def _job_abort_on_rank1(note):
    if dist.get_rank() == 1:
        print(note, file=sys.stderr, flush=True)
        os.abort()
    dist.barrier()
    return dist.get_rank()


def _job_set_default_dtype_and_threads():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    return torch.get_default_dtype()


def _job_report_defaults():
    return torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled()


def _job_rank_data(seed):
    return rank_data(seed, (3, 4), 5)


def _job_assert_close_across_ranks(perturb_rank):
    expected = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    actual = [t.clone() for t in expected]
    if dist.get_rank() == perturb_rank:
        actual[1][2] += 1e-3
    try:
        assert_close_all(actual, expected, rtol=1e-5, atol=1e-6, what="param")
    except AssertionError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_all_reduce_sum(pool):
    ws = pool.world_size
    results = pool.run(_job_all_reduce_sum, 10)
    expected_sum = float(sum(r + 10 for r in range(ws)))
    assert results == [(r, ws, expected_sum, 1) for r in range(ws)]


def test_fixtures_share_pools(pool2, pool3, request):
    assert (pool2.world_size, pool3.world_size) == (2, 3)
    assert request.getfixturevalue("pool") is pool2  # unparametrized `pool` is world size 2
    assert pool2.healthy and pool3.healthy


def test_args_kwargs_and_tensor_results(pool3):
    x = torch.arange(4.0)
    results = pool3.run(_job_scaled_tensor, x, scale=2.0)
    for r, t in enumerate(results):
        torch.testing.assert_close(t, x * 2.0 + r, rtol=0, atol=0)


def test_exception_on_rank1_is_reported_and_pool_restarts(pool2):
    starts = pool2.starts
    with pytest.raises(RankError) as info:
        pool2.run(_job_raise_on_rank1, "the original message 7f3a")
    text = str(info.value)
    assert "raised on rank 1" in text
    assert "ValueError: the original message 7f3a" in text
    assert "Traceback (most recent call last)" in text
    assert "_helper_that_raises" in text and "_job_raise_on_rank1" in text  # full traceback
    assert set(info.value.failures) == {1}
    assert info.value.failures[1].exc_type == "ValueError"
    assert not pool2.healthy  # killed at once; restarted by the next job
    assert pool2.run(_job_all_reduce_sum, 0) == [(0, 2, 1.0, 1), (1, 2, 1.0, 1)]
    assert pool2.starts == starts + 1


def test_failure_mid_collective_stops_waiting_ranks(pool2, monkeypatch):
    monkeypatch.setattr(pool2, "error_grace", 1.0)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        pool2.run(_job_raise_on_rank1_before_collective, timeout=60)
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "rank 1" in text and "KeyError" in text and "left before the all_reduce" in text
    assert info.value.stopped == [0]
    assert "ranks [0] had not answered 1 s after the first failure" in text
    assert "Python stack of rank 0" in text and "_job_raise_on_rank1_before_collective" in text
    assert elapsed < pool2.error_grace + 10, elapsed  # did not wait for the 60 s timeout
    assert pool2.run(_job_all_reduce_sum, 1)[1][2] == 3.0


def test_hung_collective_times_out_and_pool_restarts(pool2):
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        pool2.run(_job_hang_in_collective, timeout=2)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, TimeoutError)
    text = str(info.value)
    assert "tests.test_multirank._job_hang_in_collective" in text
    assert "did not finish within 2 s" in text and "ranks [0] did not answer" in text
    assert info.value.ranks == [0]
    # the stack dump shows where rank 0 hung
    assert "_job_hang_in_collective" in info.value.stacks[0]
    assert 2 <= elapsed < 10, elapsed
    assert pool2.run(_job_all_reduce_sum, 0)[0][2] == 1.0


def test_sleeping_ranks_time_out(pool3):
    with pytest.raises(TimeoutError) as info:
        pool3.run(_job_sleep, 3600, timeout=2)
    assert info.value.ranks == [0, 1, 2]
    assert "_job_sleep" in str(info.value)
    assert pool3.run(_job_sleep, 0) == [0, 1, 2]


def test_worker_exit_is_reported_with_exit_code(pool2):
    t0 = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        pool2.run(_job_exit_on_rank1, 3, timeout=60)
    text = str(info.value)
    assert "rank 1" in text and "exit code 3" in text
    assert "_job_exit_on_rank1" in text
    assert info.value.exitcodes == {1: 3}
    assert time.monotonic() - t0 < pool2.error_grace + 10
    assert pool2.run(_job_all_reduce_sum, 0)[1][2] == 1.0


def test_worker_abort_reports_its_standard_error_and_stacks(pool2):
    """A rank killed by a fatal signal: what it wrote to its standard error during the job (a C++
    abort's message goes there) and faulthandler's Python stack of the abort are in the error."""
    with pytest.raises(WorkerDied) as info:
        pool2.run(_job_abort_on_rank1, "about to abort: gloo size mismatch", timeout=60)
    text = str(info.value)
    assert "SIGABRT" in text and "about to abort: gloo size mismatch" in text, text
    assert "Fatal Python error: Aborted" in text and "_job_abort_on_rank1" in text, text
    assert pool2.run(_job_all_reduce_sum, 0)[1][2] == 1.0


def test_globals_reset_between_jobs(pool2):
    assert pool2.run(_job_set_default_dtype_and_threads) == [torch.float64] * 2
    assert pool2.run(_job_report_defaults) == [(torch.float32, 1, True)] * 2


def test_rejects_functions_workers_cannot_import(pool2):
    def local_fn():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        pool2.run(local_fn)
    with pytest.raises(ValueError, match="module-level"):
        pool2.run(lambda: 1)
    assert pool2.healthy  # nothing was sent


@pytest.mark.multirank
def test_standalone_pool_context_manager():
    with WorkerPool(2) as p:
        assert p.run(_job_sleep, 0) == [0, 1]
        procs = list(p._procs)
    assert all(not proc.is_alive() for proc in procs)
    assert all(proc.exitcode == 0 for proc in procs)  # clean exit, not killed


def test_rank_data_differs_per_rank_and_is_reproducible(pool3):
    results = pool3.run(_job_rank_data, 5)
    for r, (x, y) in enumerate(results):
        assert x.shape == (3, 4) and y.shape == (5,)
        ex, ey = rank_data(5, (3, 4), 5, rank=r)  # the same data, rebuilt in this process
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert not torch.equal(results[0][0], results[1][0])
    assert not torch.equal(results[1][0], results[2][0])
    assert not torch.equal(rank_data(6, 4, rank=0), rank_data(5, 4, rank=0))
    labels = rank_data(5, 100, rank=1, dtype=torch.long, high=3)
    assert labels.dtype == torch.long and set(labels.tolist()) <= {0, 1, 2}


def test_assert_close_all_reports_name_and_errors():
    a = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    assert_close_all(a, {k: v.clone() for k, v in a.items()}, rtol=1e-5, atol=1e-8)

    e = {k: v.clone() for k, v in a.items()}
    e["w"][1, 2] = 1.5
    with pytest.raises(AssertionError) as info:
        assert_close_all(a, e, rtol=1e-5, atol=1e-8, what="param")
    text = str(info.value)
    assert "params differ; first: 'w'" in text
    assert "max abs err 0.5 at (1, 2)" in text and "max rel err 0.333" in text
    assert "1/6 elements" in text

    with pytest.raises(AssertionError, match=r"tensor\[1\]': shape \(3,\) vs expected \(4,\)"):
        assert_close_all([torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(4)],
                         rtol=0, atol=0)
    with pytest.raises(AssertionError, match="missing \\['b'\\]"):
        assert_close_all({"w": a["w"]}, a, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="'x'"):
        assert_close_all({"x": torch.tensor([float("nan")])}, {"x": torch.tensor([0.0])},
                         rtol=1, atol=1)
    # within tolerance: rtol applies to |expected|
    assert_close_all(torch.tensor([1.0 + 1e-6]), torch.tensor([1.0]), rtol=2e-6, atol=0)


def test_assert_close_all_names_rank(pool2):
    messages = pool2.run(_job_assert_close_across_ranks, 1)
    assert messages[0] is None
    assert "on rank 1" in messages[1] and "first: 'param[1]'" in messages[1]
    assert "max abs err 0.001 at (2,)" in messages[1]


def _job_raise_everywhere():
    raise RuntimeError("same failure on every rank")


def test_identical_failures_are_shown_once(pool3):
    with pytest.raises(RankError) as info:
        pool3.run(_job_raise_everywhere)
    text = str(info.value)
    assert "raised on ranks 0, 1, 2" in text
    assert text.count("Traceback (most recent call last)") == 1
    assert "--- rank 1: the same RuntimeError as rank 0" in text
    assert set(info.value.failures) == {0, 1, 2}
    assert pool3.run(_job_sleep, 0) == [0, 1, 2]


def _job_gloo_peer_address():
    # every rank reports the interface gloo was told to use (an all_gather through gloo itself)
    from spmd_compiler.runtime.agreement import exchange_objects

    return exchange_objects(os.environ.get("GLOO_SOCKET_IFNAME"), None)


def test_gloo_stays_on_loopback(pool2):
    default = "lo" if os.path.exists("/sys/class/net/lo") else None
    expected = os.environ.get("GLOO_SOCKET_IFNAME", default)
    assert pool2.run(_job_gloo_peer_address) == [[expected, expected]] * 2
