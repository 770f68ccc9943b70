"""The code's shape the design asks for: passes/ imports only torch, sympy, itself and the
torch-internals fence, without an import circle (imports inside functions count); no function over 80 lines in spmd_compiler/ or
passes/; CompiledStep at most 150 lines; docs/architecture.md lists the pipeline's stages as
spmd_compiler/pipeline.py declares them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from spmd_compiler.pipeline import STAGES

ROOT = Path(__file__).resolve().parent.parent
FENCE = "torch_internals"  # spmd_compiler/torch_internals.py: torch's private names


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


def test_passes_import_only_torch_sympy_themselves_and_the_fence():
    """passes/ imports torch, sympy, the standard library, its own modules and, for torch's
    private names, spmd_compiler/torch_internals.py: nothing else of spmd_compiler."""
    allowed = {"torch", "sympy", "__future__"} | set(sys.stdlib_module_names)
    for path, tree in _trees("passes"):
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert (name.split(".")[0] in allowed or name == f"spmd_compiler.{FENCE}"
                        or name.startswith("spmd_compiler.passes")), f"{path.name} imports {name}"


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



def _private_torch_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every private torch name a module takes: an import of ``torch...._x`` or
    of ``_x`` from torch, and an attribute chain ``torch...._x`` (also through a name ``import
    torch.x as y`` binds; ``torch.ops`` excepted: its attributes are operator names,
    ``aten._to_copy``, not Python API)."""
    found = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    roots = {"torch": "torch"}  # and the names ``import torch.x as y`` binds
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("torch.")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "torch" and _private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".")
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if _private(parts + [a.name])]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:  # a whole chain
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in roots:
                chain = roots[value.id].split(".")[1:] + chain
                if chain[0] != "ops" and _private(chain):
                    found.append((node.lineno, "torch." + ".".join(chain)))
    return found


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def test_private_torch_names_only_in_the_fence():
    """Every private torch name (a module, class or function whose name starts with ``_``) is
    taken through spmd_compiler/torch_internals.py, in spmd_compiler/ and in passes/ alike."""
    outside = [f"{path.relative_to(ROOT)}:{line} {name}"
               for folder in ("spmd_compiler", "passes") for path, tree in _trees(folder)
               if path.stem != FENCE for line, name in _private_torch_uses(tree)]
    assert not outside, outside


def test_the_fence_is_a_leaf():
    """torch_internals.py imports only torch and the standard library, so passes/ can import it
    without a circle."""
    path = ROOT / "spmd_compiler" / f"{FENCE}.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else
                 ["." + (node.module or "")] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            assert name.split(".")[0] in {"torch", "__future__"} | set(sys.stdlib_module_names), name
