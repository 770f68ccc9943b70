"""The code's shape the design asks for: passes/ imports only torch, sympy and itself, without an
import circle (imports inside functions count); no function over 80 lines in spmd_compiler/ or
passes/; CompiledStep at most 150 lines; docs/architecture.md lists the pipeline's stages as
spmd_compiler/pipeline.py declares them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from spmd_compiler.pipeline import STAGES

ROOT = Path(__file__).resolve().parent.parent


def _trees(folder: str):
    for path in sorted((ROOT / folder).glob("*.py")):
        yield path, ast.parse(path.read_text())


def _imports_of_passes() -> dict[str, set[str]]:
    """passes/ module -> the passes/ modules it imports, anywhere in the file."""
    graph = {}
    for path, tree in _trees("passes"):
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spmd_compiler.passes."):
                deps.add(node.module.split(".")[2])
        graph[path.stem] = deps - {path.stem}
    return graph


def test_passes_import_only_torch_sympy_and_themselves():
    allowed = {"torch", "sympy", "__future__"} | set(sys.stdlib_module_names)
    for path, tree in _trees("passes"):
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_no_import_circle_in_passes():
    graph = _imports_of_passes()
    done, path = set(), []

    def visit(m):
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        path.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_no_function_over_80_lines():
    long = [f"{path.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for folder in ("spmd_compiler", "passes") for path, tree in _trees(folder)
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


def test_compiled_step_at_most_150_lines():
    (cls,) = [n for _, tree in _trees("spmd_compiler") for n in tree.body
              if isinstance(n, ast.ClassDef) and n.name == "CompiledStep"]
    assert cls.end_lineno - cls.lineno + 1 <= 150


def stage_list() -> str:
    """The stage list of docs/architecture.md, as pipeline.STAGES gives it."""
    return "\n".join(f"{i}. `{s.name}`{' (optional)' if s.optional else ''}: {s.does}; "
                     f"runs: {s.when}" for i, s in enumerate(STAGES, 1))


def test_architecture_lists_the_stages():
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("<!-- stages: generated from spmd_compiler.pipeline.STAGES -->\n")
    block = text[start:text.index("\n<!-- end of stages -->")].split("\n", 1)[1]
    assert block == stage_list(), "regenerate with: python -c 'from tests.test_structure " \
                                  "import stage_list; print(stage_list())'"
