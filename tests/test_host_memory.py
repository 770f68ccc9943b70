"""``retain_host_memory``: freed step memory stays in the process for the next step.

Run in a fresh interpreter so the malloc settings of the test process are not involved: a 24 MiB
tensor filled and freed gives its pages back to the OS by default (resident memory drops), and is
kept after ``retain_host_memory()`` (resident memory stays, the next step reuses the pages).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multirank import REPO_ROOT

_PROBE = r"""
import json, os, torch
from spmd_compiler.runtime.program import retain_host_memory

PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def dropped_after_free(numel):
    t = torch.ones(numel)  # touched: resident
    before = rss()
    del t
    return before - rss()

out = {"default": dropped_after_free(6 * 2**20)}  # 24 MiB
out["retained"] = retain_host_memory()
out["after"] = dropped_after_free(6 * 2**20 + 4096)
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_retain_host_memory_keeps_freed_step_memory():
    result = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, check=True)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert out["default"] > 16 * mib, out  # glibc's default: the freed block went back to the OS
    assert out["retained"] is True, out
    assert out["after"] < 1 * mib, out  # kept: nothing returned to the OS
