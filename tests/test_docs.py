"""Every command and Python snippet of README.md and docs/*.md runs as written, or is listed here
as not run with the reason; every generated page names the commit it was made from.

Blocks are found by their fence (```bash / ```python; other fences are output samples, trees and
diagrams) and named by (file, first line): a new block fails ``test_every_block_is_listed`` until
it is listed below. Shell commands run from the checkout's root with this interpreter for
``python`` and ``torchrun``, and with /tmp/spmd_dump and docs/img/ (outputs) in a temporary folder.
Python snippets run in this process (``LOCAL``) or on 2 gloo ranks, as under torchrun (``RANKS``),
after a preamble defining the names the text around them introduces (``model``, ``optim``,
``batch``, ``loader``, ...); a snippet that defines them itself overrides the preamble.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LANGS = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "python": "python"}


class Block(NamedTuple):
    page: str
    line: int
    kind: str  # "shell" or "python"
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.page, self.text.strip().splitlines()[0].strip()


def blocks() -> list[Block]:
    """The fenced shell and Python blocks of every page."""
    out = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if m.group(1) in LANGS and m.group(2).strip():
                out.append(Block(page, text[:m.start()].count("\n") + 1, LANGS[m.group(1)],
                                 m.group(2)))
    return out


def commands(block: Block) -> list[str]:
    """The shell commands of a block: continuation lines joined, comment lines left out."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


# -- what runs, what does not, and why ------------------------------------------------------------

# (page, start of the command): why it is not run here
SHELL_NOT_RUN = {
    ("README.md", 'pip install -e ".[test]" && python -m spmd_compiler demo'):
        "installs the package (network, a minute); the demo as written runs in tests/test_cli.py",
    ("README.md", "python -m pytest"):
        "runs this suite (inside it, it already runs)",
    ("README.md", "pip install torch==2.13.0 --index-url"): "downloads torch (network)",
    ("README.md", "torchrun --nproc-per-node 2 examples/train.py --mode fully_shard"):
        "300 steps (about a minute); tests/test_examples.py runs the script under torchrun",
    ("README.md", "torchrun --nnodes 2"): "needs a second host (HOST0); tests/test_examples.py "
                                          "runs two agents as two nodes on one host",
    ("README.md", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun"):
        "kills a rank and restarts the job (minutes); tests/test_examples.py does, with 12 steps",
    ("docs/fully_shard.md", "python -m pytest tests/test_fully_shard.py"):
        "runs a test file of this suite (about 2 minutes)",
    ("docs/fully_shard.md", "python -m tests.test_fully_shard"):
        "starts gloo pools of 2 and 3 ranks to print the tables the test file checks (a minute)",
    ("docs/observability.md", "python docs/figures.py"):
        "rewrites docs/img/ in the checkout; test_figures_show_the_current_program checks that "
        "what it wrote is what it would write now",
}

# (page, first line): why the snippet is not run here
PYTHON_NOT_RUN = {
    ("docs/hybrid_shard.md", "from torch.distributed.device_mesh import init_device_mesh"):
        "a CUDA mesh over several nodes; tests/test_hybrid_shard.py runs hybrid_shard on gloo",
    ("docs/user_guide.md", "from spmd_compiler import unsharded"):
        "needs a Hugging Face model (generate) and a prompt; tests/test_eager_use.py covers it",
    ("docs/tensor_parallel.md", "from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict"):  # noqa: E501
        "two programs (saving and loading side, `...` between them); "
        "tests/test_tensor_parallel.py::test_dcp_between_fsdp2_tp_and_compiled runs both",
}

# snippets run in this process, no process group: (page, first line) -> setup of its own, run
# after the preamble
TRACED = """
from spmd_compiler.trace.record import trace_step as _trace
from spmd_compiler.passes.batch_dim import annotate_placements as _annotate
gm = _annotate(_trace(train_step, (model, optim, batch), {}, input_batch_dim=0).gm)
"""
LOCAL = {
    ("docs/batch_dim.md", "from spmd_compiler.trace.record import trace_step"): "",
    ("docs/fully_shard.md", "from spmd_compiler import spmd_compile, DataParallel"): "",
    ("docs/observability.md", 'step = spmd_compile(DataParallel("replicate"), dump_dir="/tmp/spmd_dump")(train_step)'): "",  # noqa: E501
    ("docs/observability.md", "from spmd_compiler.observe import visualize"): TRACED,
    ("docs/user_guide.md", "from spmd_compiler import explain"): "train_step_fn = train_step",
}

# snippets run on 2 gloo ranks: (page, first line) -> (the snippets run before it in the same
# namespace: a page's example continued; setup of its own, run after the preamble)
RANKS = {
    ("README.md", "import torch"): ((), ""),
    ("docs/user_guide.md", "import torch"): ((), ""),
    ("docs/user_guide.md", "import copy"): ((), ""),
    ("docs/user_guide.md", '@spmd_compile(DataParallel("fully_shard"), verify=3, verify_every=100)'):
        ((("docs/user_guide.md", "import torch"),), ""),
    ("docs/fully_shard.md", 'with torch.device("meta"):'): ((), ""),
    ("docs/training_features.md", "from torch.distributed.fsdp import MixedPrecisionPolicy"): ((), ""),
    ("docs/training_features.md", '@spmd_compile(DataParallel("fully_shard"))'): ((), ""),
    ("docs/training_features.md", "for k, batch in enumerate(loader):"):
        ((), 'train_step = spmd_compile(DataParallel("replicate"))(train_step)'),
    ("docs/tensor_parallel.md", "import torch"): ((), ""),
    ("docs/context_parallel.md", "from torch.distributed.device_mesh import init_device_mesh"):
        ((), "from transformers import LlamaConfig, LlamaForCausalLM\n"
             "dp, cp = 1, 2\n"
             "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, "
             "intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, "
             "num_key_value_heads=1))\n"
             "optim = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
             "loader = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(k)) "
             "for k in range(2)]"),
    ("docs/tensor_parallel.md", "from spmd_compiler import DataParallel"):
        ((("docs/tensor_parallel.md", "import torch"),), ""),
}

# snippets that run as written, with no preamble: a reader copies them whole (under torchrun)
WHOLE = {("README.md", "import torch"), ("docs/user_guide.md", "import torch"),
         ("docs/user_guide.md", "import copy")}

# what the text around the snippets introduces
PREAMBLE = '''
import torch
import torch.distributed as dist
from spmd_compiler import DataParallel, spmd_compile

class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1, self.net2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))

def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g).softmax(-1))
            for _ in range(n)]

def train_step(model, optim, batch):
    optim.zero_grad()
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss

torch.manual_seed(0)
model, Transformer, cfg = MyModel(), (lambda cfg: MyModel()), None
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = torch.nn.functional.cross_entropy
rank = dist.get_rank() if dist.is_initialized() else 0
loader = _batches(4, rank)
batch, val_loader, micro_batches, accumulation_steps = loader[0], loader[:1], loader[:2], 2
'''


def _listed(block: Block) -> list[str]:
    """Where ``block`` (or each of its commands) is listed; empty entries are unlisted."""
    if block.kind == "python":
        return [w for w, table in (("not run", PYTHON_NOT_RUN), ("local", LOCAL), ("ranks", RANKS))
                if block.key in table]
    return ["not run" if _shell_not_run(block.page, c) else "run" for c in commands(block)]


def _shell_not_run(page: str, command: str) -> str | None:
    return next((why for (p, start), why in SHELL_NOT_RUN.items()
                 if p == page and command.startswith(start)), None)


def _shell_run(page: str, command: str) -> bool:
    return (page, command) in {(p, c) for p, c in SHELL_RUN}


# shell commands run as written (page, command)
SHELL_RUN = [
    ("docs/observability.md",
     "python -m spmd_compiler demo --steps 1 --modes replicate --dump-dir /tmp/spmd_dump"),
]


def test_every_block_is_listed():
    """Each block is run or listed as not run with a reason; each listing names a block."""
    found = blocks()
    for block in found:
        where = _listed(block)
        if block.kind == "python":
            assert len(where) == 1, f"{block.page}:{block.line} {block.key[1]!r} listed as {where}"
        else:
            for c in commands(block):
                assert _shell_not_run(block.page, c) or _shell_run(block.page, c), (
                    f"{block.page}:{block.line}: command {c!r} is neither run nor listed")
    keys = {b.key for b in found if b.kind == "python"}
    for table in (PYTHON_NOT_RUN, LOCAL, RANKS):
        assert not set(table) - keys, f"listed snippets not in the docs: {set(table) - keys}"
    assert WHOLE <= set(RANKS), WHOLE - set(RANKS)
    shell = [(b.page, c) for b in found if b.kind == "shell" for c in commands(b)]
    for page, start in SHELL_NOT_RUN:
        assert any(p == page and c.startswith(start) for p, c in shell), (page, start)
    for page, command in SHELL_RUN:
        assert (page, command) in shell, (page, command)


# -- shell commands --------------------------------------------------------------------------------

def _as_run_here(command: str, tmp: Path) -> str:
    """``command`` with this interpreter, and its outputs in ``tmp`` instead of /tmp and the
    checkout's docs/img/."""
    command = re.sub(r"(^|&& )python ", rf"\g<1>{shlex.quote(sys.executable)} ", command)
    command = command.replace("torchrun ", f"{shlex.quote(sys.executable)} -m torch.distributed.run ")
    return command.replace("/tmp/spmd_dump", str(tmp / "spmd_dump")).replace(
        "docs/img/", f"{tmp}/img/")


def test_shell_commands_run_as_written(tmp_path):
    """In page order, so a command that reads what an earlier one wrote finds it (the dot
    commands after the demo); each distinct command once."""
    (tmp_path / "img").mkdir()
    for page, command in dict.fromkeys(SHELL_RUN):
        proc = subprocess.run(["bash", "-c", _as_run_here(command, tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, f"{page}: {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert any((tmp_path / "spmd_dump" / "replicate" / "demo_train_step" / "compile_0").glob("*_lowered.dot"))


# -- Python snippets -------------------------------------------------------------------------------

def _snippet(key: tuple[str, str]) -> str:
    return next(b.text for b in blocks() if b.kind == "python" and b.key == key)


def _write(tmp: Path, name: str, source: str) -> str:
    path = tmp / f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}.py"
    path.write_text(source)
    return str(path)


@pytest.mark.parametrize("key", sorted(LOCAL), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_python_snippet_runs_here(key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = _snippet(key).replace("/tmp/spmd_dump", str(tmp_path / "spmd_dump"))
    setup = runpy.run_path(_write(tmp_path, "preamble", PREAMBLE + LOCAL[key]))
    setup["dump_dir"] = str(tmp_path / "dump")
    runpy.run_path(_write(tmp_path, key[0] + key[1][:20], source), init_globals=setup)


def snippet_job(preamble_path: str, paths: list[str]) -> str:
    """Run the snippet files in order in one namespace after the preamble, on this rank; their
    ``dist.init_process_group`` (torchrun's job) is already done here."""
    import torch.distributed as dist

    init = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    try:
        namespace = runpy.run_path(preamble_path)
        for path in paths:
            namespace = runpy.run_path(path, init_globals=namespace)
    finally:
        dist.init_process_group = init
    dist.barrier()
    return "ok"


def test_python_snippets_run_on_two_ranks(pool2, tmp_path):
    for n, (key, (before, setup)) in enumerate(RANKS.items()):
        preamble = _write(tmp_path, f"preamble{n}", ("" if key in WHOLE else PREAMBLE) + setup)
        paths = [_write(tmp_path, f"{k[0]}{k[1][:20]}{n}", _snippet(k)) for k in (*before, key)]
        assert pool2.run(snippet_job, preamble, paths, timeout=300) == ["ok", "ok"], key


# -- generated pages -------------------------------------------------------------------------------

GENERATED = {  # page: what writes it
    "docs/benchmarks.md": "python -m benchmarks.run --write-docs",
    "docs/memory.md": "python -m benchmarks.memory --write-docs",
    "docs/compile_time.md": "python -m benchmarks.compile_time --write-docs",
    "docs/batch_sweep.md": "python -m benchmarks.sweep --write-docs",
    "docs/context_parallel_figures.md": "python -m benchmarks.context_parallel --write-docs",
}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_generated_pages_name_a_commit_of_this_history():
    """A page that says it is generated ("do not edit by hand" at its top) is listed here, and
    names (``commit <hash>``) the commit its figures were measured on, one this checkout's
    history holds."""
    marked = {p for p in PAGES if "do not edit by hand" in "\n".join(
        (ROOT / p).read_text().splitlines()[:6])}
    assert marked == set(GENERATED), marked ^ set(GENERATED)
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("a shallow clone lacks the history the pages name")
    for page, generator in GENERATED.items():
        head = "\n".join((ROOT / page).read_text().splitlines()[:10])
        assert generator in head, f"{page} does not say it is generated by {generator}"
        found = re.search(r"\bcommit ([0-9a-f]{7,40})\b", head)
        assert found, f"{page} does not name the commit it was generated from"
        commit = found.group(1)
        assert _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, (page, commit)
        assert _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, (page, commit)


def test_figures_show_the_current_program():
    """docs/img's pictures and observability.md's summaries are what ``python docs/figures.py``
    makes of the current program: each figure's node and collective counts (figures.json, written
    with the pictures) and the summary tables equal a fresh explain()'s."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    recorded = json.loads((ROOT / "docs" / "img" / "figures.json").read_text())
    assert set(recorded) == set(figures.FIGURES)
    summaries = {name: figures.summary_of(name) for name in figures.FIGURES}
    for name, summary in summaries.items():
        assert figures.counts(summary) == recorded[name], (
            f"{name}: docs/img shows {recorded[name]}, the program now {figures.counts(summary)}: "
            "run python docs/figures.py")
        for view in ("", ".collapsed"):
            assert (ROOT / "docs" / "img" / f"{name}{view}.png").exists()
    page = (ROOT / "docs" / "observability.md").read_text()
    shown = page[page.index(figures.BEGIN) + len(figures.BEGIN):page.index(figures.END)]
    assert shown.strip() == figures.summaries_markdown(summaries).strip()
