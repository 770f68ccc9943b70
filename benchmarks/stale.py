"""List the generated pages older than the last change to the code they measure.

    python -m benchmarks.stale            # exit status 1 when a page is stale

Each generated page (``PAGES``) names the commit it was measured at (``commit <hash>``, written
by its generator next to the machine's load). A page is stale when a commit after that one
changed the measured code (``MEASURED``: benchmarks/ but its results, passes/, spmd_compiler/), when it was
measured with uncommitted changes to that code, or when its commit cannot be read. Regenerate
stale pages on a quiet machine (each page's first lines name its command).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/benchmarks.md", "docs/memory.md", "docs/batch_sweep.md", "docs/compile_time.md",
         "docs/context_parallel_figures.md")
MEASURED = ("benchmarks", "passes", "spmd_compiler")
# the pathspecs of the measured code: this listing is not what the pages measure (the
# generators' results live beside the pages, in docs/results/)
_CODE = (*MEASURED, ":(exclude)benchmarks/stale.py")
_COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})\b( with uncommitted changes)?")


@dataclass
class PageAge:
    page: str
    commit: str | None  # the commit the page names (None: none found or unknown to git)
    changes_since: int  # commits since then that changed the measured code
    behind: int  # commits since then, of any kind
    dirty: bool  # measured with uncommitted changes to the measured code

    @property
    def stale(self) -> bool:
        return self.commit is None or self.dirty or self.changes_since > 0

    def line(self) -> str:
        if self.commit is None:
            return f"{self.page}: stale: names no commit this repository knows"
        state = "stale" if self.stale else "current"
        why = " (measured with uncommitted changes)" if self.dirty else ""
        return (f"{self.page}: {state}: measured at {self.commit}{why}, {self.behind} commits behind "
                f"HEAD, {self.changes_since} of them changed {', '.join(m + '/' for m in MEASURED)}")


def source_revision(root: Path = ROOT) -> dict:
    """The commit a generator measures, and whether the measured code differed from it."""
    dirty = _git(root, "status", "--porcelain", "--", *_CODE)
    return {"commit": _git(root, "rev-parse", "--short", "HEAD") or "unknown",
            "compiler_sources_modified": bool(dirty)}


def measured_at(source: dict) -> str:
    """A page's ``commit <hash>`` (and whether the code was changed), as ``page_age`` reads it."""
    return f"commit {source['commit']}" + (
        " with uncommitted changes to " + ", ".join(m + "/" for m in MEASURED)
        if source.get("compiler_sources_modified") else "")


def _git(root: Path, *args: str) -> str | None:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def page_age(root: Path, page: str) -> PageAge:
    """How far behind the code ``page`` (relative to ``root``, a git checkout) is."""
    text = (root / page).read_text() if (root / page).exists() else ""
    found = _COMMIT.search(text)
    commit = found.group(1) if found else None
    if commit is None or _git(root, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        return PageAge(page, None, 0, 0, False)
    since = int(_git(root, "rev-list", "--count", f"{commit}..HEAD", "--", *_CODE) or 0)
    behind = int(_git(root, "rev-list", "--count", f"{commit}..HEAD") or 0)
    return PageAge(page, commit, since, behind, bool(found.group(2)))


def stale_pages(root: Path = ROOT, pages=PAGES) -> list[PageAge]:
    """Every page's age; ``.stale`` says which need regenerating."""
    return [page_age(root, page) for page in pages]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also list the pages that are current")
    args = parser.parse_args(argv)
    ages = stale_pages()
    for age in ages:
        if age.stale or args.all:
            print(age.line())
    if not any(a.stale for a in ages):
        print("every generated page is newer than the last change to the code it measures")
    return 1 if any(a.stale for a in ages) else 0


if __name__ == "__main__":
    sys.exit(main())
