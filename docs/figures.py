"""Regenerate every picture of the compiled step in docs/img/ and the summaries in
docs/observability.md, in one command:

    python docs/figures.py

Compiles each figure's step with explain() at world size 2 (no process started; a stand-in group
as a gloo run builds it), renders the lowered graph's full and collapsed views with Graphviz's
``dot`` into docs/img/<figure>.png and <figure>.collapsed.png, copies the step's timeline to
docs/img/<figure>.timeline.svg, writes docs/img/figures.json (each figure's node and collective
counts: tests/test_docs.py checks them against the current program) and rewrites the summary
tables between the ``figures`` markers of docs/observability.md.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from spmd_compiler import DataParallel, explain  # noqa: E402
from spmd_compiler.cli import DemoMLP, demo_train_step  # noqa: E402
from tests.models import BatchDimModel, train_step  # noqa: E402

IMG = ROOT / "docs" / "img"
PAGE = ROOT / "docs" / "observability.md"
BEGIN, END = "<!-- figures: summaries, by docs/figures.py -->", "<!-- /figures -->"
SUMMARIZED = ("batch_dim_model_replicate", "batch_dim_model_fully_shard")  # tables in the page


def _batch_dim(style: str):
    model = BatchDimModel()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return train_step, (model, optim, (torch.randn(16, 50), torch.randn(16, 8))), style


def _demo(style: str):
    model = DemoMLP()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return demo_train_step, (model, optim, (torch.randn(32, 50), torch.rand(32, 8))), style


# figure name -> its step, arguments and style: the acceptance tests' batch-dim model (SGD with
# momentum) and the demo's SimpleMLP step (Adam) as `python -m spmd_compiler demo` compiles it
FIGURES = {
    "batch_dim_model_replicate": lambda: _batch_dim("replicate"),
    "batch_dim_model_fully_shard": lambda: _batch_dim("fully_shard"),
    "simple_mlp_replicate": lambda: _demo("replicate"),
    "simple_mlp_fully_shard": lambda: _demo("fully_shard"),
}


def summary_of(name: str, dump_dir: str | None = None):
    """The explain() summary of figure ``name`` (its dumps in ``dump_dir`` if given)."""
    torch.manual_seed(0)
    fn, args, style = FIGURES[name]()
    return explain(fn, *args, parallel_mode=DataParallel(style), world_size=2, dump_dir=dump_dir)


def counts(summary) -> dict:
    """What figures.json records of a figure: what its pictures show."""
    return {"nodes": summary.num_nodes, "collectives per step": sum(c.count for c in summary.collectives),
            "collectives issued per call": summary.issued_per_call}


def summaries_markdown(summaries: dict) -> str:
    """The page's summary tables (compile times left out: they differ from run to run)."""
    parts = []
    for name in SUMMARIZED:
        summary = summaries[name]
        summary.compile_times = {}
        parts.append(f"### {name.removeprefix('batch_dim_model_')}\n\n{summary.to_markdown()}")
    return "\n".join(parts)


def _render(dump: Path, name: str) -> None:
    folder = next(dump.glob("*/compile_0"))
    for view in ("", ".collapsed"):
        dot = next(folder.glob(f"*_lowered{view}.dot"))
        subprocess.run(["dot", "-Tpng", str(dot), "-o", str(IMG / f"{name}{view}.png")], check=True)
    shutil.copy(folder / "timeline.svg", IMG / f"{name}.timeline.svg")


def main() -> None:
    IMG.mkdir(exist_ok=True)
    summaries, recorded = {}, {}
    for name in FIGURES:
        dump = Path(tempfile.mkdtemp(prefix=f"spmd_{name}_"))
        summaries[name] = summary_of(name, str(dump))
        recorded[name] = counts(summaries[name])
        _render(dump, name)
        shutil.rmtree(dump, ignore_errors=True)
        print(f"{name}: {recorded[name]}")
    (IMG / "figures.json").write_text(json.dumps(recorded, indent=1) + "\n")
    text = PAGE.read_text()
    block = f"{BEGIN}\n\n{summaries_markdown(summaries)}\n{END}"
    PAGE.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text,
                           flags=re.S))
    print(f"wrote {IMG} and the summaries in {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
