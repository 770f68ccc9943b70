"""``python -m benchmarks.stale``: the generated pages older than the code they measure."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.stale import PAGES, measured_at, stale_pages


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                          check=True, capture_output=True, text=True).stdout.strip()


def _commit(root: Path, path: str, text: str) -> str:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
    _git(root, "add", path)
    _git(root, "commit", "-qm", path)
    return _git(root, "rev-parse", "--short", "HEAD")


def test_a_page_is_stale_once_the_measured_code_changes_after_its_commit(tmp_path):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, "passes/a.py", "x = 1\n")
    source = {"commit": measured, "compiler_sources_modified": False}
    _commit(tmp_path, "docs/benchmarks.md", f"# B\n\n- Date (UTC): now; {measured_at(source)}\n")
    _commit(tmp_path, "docs/memory.md", f"- Date: now; {measured_at({**source, 'compiler_sources_modified': True})}\n")
    _commit(tmp_path, "README.md", "docs only\n")  # not measured code
    ages = {a.page: a for a in stale_pages(tmp_path, ("docs/benchmarks.md", "docs/memory.md",
                                                      "docs/batch_sweep.md"))}
    assert not ages["docs/benchmarks.md"].stale and ages["docs/benchmarks.md"].behind == 3
    assert ages["docs/memory.md"].stale and ages["docs/memory.md"].dirty  # measured with changes
    assert ages["docs/batch_sweep.md"].stale and ages["docs/batch_sweep.md"].commit is None  # no page
    _commit(tmp_path, "spmd_compiler/api.py", "y = 2\n")
    age = stale_pages(tmp_path, ("docs/benchmarks.md",))[0]
    assert age.stale and age.changes_since == 1
    assert "stale: measured at" in age.line()


def test_every_generator_writes_its_commit_and_the_load():
    """Each generator's page (rendered from its stored results) names the commit it measured,
    as benchmarks.stale reads it, and the machine's load during the run."""
    import json

    from benchmarks import compile_time, memory, report, sweep
    from benchmarks.stale import _COMMIT

    root = Path(__file__).resolve().parents[1]

    def stored(name):
        return json.loads((root / "docs" / "results" / name).read_text())

    times = stored("compile_time.json")
    pages = [report.markdown(stored("results.json"), None, None),
             memory.markdown(stored("memory_results.json")), sweep.markdown(stored("sweep.json")),
             compile_time.markdown(times["results"], times["config"])]
    for text in pages:
        assert _COMMIT.search(text) and "load average" in text, text[:400]
