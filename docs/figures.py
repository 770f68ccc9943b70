"""Regenerate the figures and the summary in docs/observability.md.

    python docs/figures.py

Compiles the acceptance tests' batch-dim model (tests/models.py: BatchDimModel, the seed's
WrapperModule) with explain() at world size 2 for both parallel styles, without starting any
process, and renders the lowered graphs with Graphviz's ``dot`` into docs/img/.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from spmd_compiler import DataParallel, explain  # noqa: E402
from tests.models import BatchDimModel, train_step  # noqa: E402


def main() -> None:
    img = ROOT / "docs" / "img"
    img.mkdir(exist_ok=True)
    for style in ("replicate", "fully_shard"):
        torch.manual_seed(0)
        model = BatchDimModel()
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batch = (torch.randn(16, 50), torch.randn(16, 8))
        dump = Path(tempfile.mkdtemp(prefix=f"spmd_{style}_"))
        summary = explain(train_step, model, optim, batch, parallel_mode=DataParallel(style),
                          world_size=2, dump_dir=str(dump))
        print(f"### {style}\n\n{summary.to_markdown()}")
        for view in ("", ".collapsed"):
            dot = next(dump.glob(f"train_step/compile_0/*_lowered{view}.dot"))
            out = img / f"batch_dim_model_{style}{view}.png"
            subprocess.run(["dot", "-Tpng", str(dot), "-o", str(out)], check=True)
            print(out)


if __name__ == "__main__":
    main()
