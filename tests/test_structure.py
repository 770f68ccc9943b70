"""The code's shape the design asks for: spmd_compiler/ in rooms by phase whose imports follow
one layer order (``LAYERS``), with no import circle anywhere in spmd_compiler/ or passes/ (imports
inside functions count); passes/ imports only torch, sympy, itself and the torch-internals
fence; no function over 80 lines; CompiledStep at most 150 lines; docs/architecture.md lists the
pipeline's stages as spmd_compiler/build/pipeline.py declares them and the rooms as the tree has
them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from spmd_compiler.build.pipeline import STAGES

ROOT = Path(__file__).resolve().parent.parent
FENCE = "torch_internals"  # spmd_compiler/torch_internals.py: torch's private names


# The layers, top to bottom: a module may import its own layer's modules and any layer below,
# never one above. Each entry is a room of spmd_compiler/: a subpackage (its folder) or a
# top-level module; passes/ installs as spmd_compiler.passes.
LAYERS = (
    ("__init__", "__main__", "cli", "memory"),  # the face: entry points and re-exports
    ("api", "verify"),  # the decorator and CompiledStep, the only room that sees every phase; its oracle
    ("build",),  # a recording turned into a program, once per compile
    ("trace", "observe"),  # recording the step; looking at programs (neither imports the other)
    ("runtime",),  # what runs on every call
    ("state",),  # live state on the mesh
    ("features",),  # tensor parallelism, mixed precision, extensions, accumulation
    ("passes",),  # pure graph passes
    ("parallel_mode", "errors", "torch_internals"),  # the user's options, errors, the fence
)
MAX_TOP_LEVEL_MODULES = 8  # beside __init__ and __main__


def _trees(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":
        parts.insert(0, "spmd_compiler")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    """The room of a module: its subpackage under spmd_compiler, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(room: str) -> int:
    (layer,) = [i for i, rooms in enumerate(LAYERS) if room in rooms]
    return layer


def import_graph() -> dict[str, dict[str, int]]:
    """spmd_compiler module -> {imported spmd_compiler module: line}, imports anywhere in the
    file (inside functions too); ``from pkg import name`` counts as an import of ``pkg.name``
    where that is a module, else of ``pkg``."""
    paths = {_module_name(p): p for folder in ("spmd_compiler", "passes")
             for p in (ROOT / folder).rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        edges = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in paths:
                    t = t.rpartition(".")[0]
                if t and t != module and not paths[t].name == "__init__.py":
                    edges.setdefault(t, node.lineno)
        graph[module] = edges
    return graph


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


def test_no_import_circle_anywhere():
    """No import circle in spmd_compiler/ or passes/, imports inside functions included."""
    graph = import_graph()
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


def test_imports_follow_the_layer_order():
    """Every import runs down ``LAYERS`` (or stays in its layer); trace and observe, which share
    a layer, do not import each other."""
    against = [f"{m} (layer {_room(m)}) imports {t} (layer {_room(t)}), line {line}"
               for m, edges in import_graph().items() for t, line in edges.items()
               if _layer(_room(t)) < _layer(_room(m))
               or (_room(m) != _room(t) and {_room(m), _room(t)} == {"trace", "observe"})]
    assert not against, against


def test_rooms_by_phase():
    """Few modules at the top level; every subpackage and top-level module has a layer and a
    docstring saying what belongs there."""
    top = sorted(p.stem for p in (ROOT / "spmd_compiler").glob("*.py")
                 if p.stem not in ("__init__", "__main__"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    packages = sorted(p.parent.name for p in (ROOT / "spmd_compiler").glob("*/__init__.py"))
    assert len(packages) >= 4, packages
    for room in top + packages + ["passes"]:
        _layer(room)  # every room is placed in exactly one layer
    for name in packages:
        assert ast.get_docstring(ast.parse((ROOT / "spmd_compiler" / name / "__init__.py").read_text())), name


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


def test_architecture_lists_the_rooms_as_the_tree_has_them():
    """docs/architecture.md's room list names every subpackage with each of its modules in the
    layer ``LAYERS`` gives it, and every top-level module, in layer order."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("<!-- rooms: checked against spmd_compiler/ by tests/test_structure.py -->\n")
    block = text[start:text.index("<!-- end of rooms -->")].split("\n", 1)[1]
    items = re.split(r"^\d+\. ", block, flags=re.M)[1:]
    names = [re.findall(r"`([\w/]+)`", item) for item in items]
    assert len(items) == len(LAYERS)
    for layer, (rooms, named) in enumerate(zip(LAYERS, names)):
        for room in rooms:
            folder = ROOT / "spmd_compiler" / room
            assert (f"{room}/" if folder.is_dir() or room == "passes" else room) in named, (layer, room)
            if folder.is_dir():
                modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
                assert modules <= set(named), (room, modules - set(named))
    top = {p.stem for p in (ROOT / "spmd_compiler").glob("*.py")}
    packages = {p.parent.name for p in (ROOT / "spmd_compiler").glob("*/__init__.py")}
    assert top <= {n for ns in names for n in ns}
    assert {f"{p}/" for p in packages} <= {n for ns in names for n in ns}


def test_public_names_stay_where_users_import_them():
    """The names users import keep their places across the rooms' moves."""
    import importlib

    public = {
        "spmd_compiler": ("spmd_compile", "compile", "explain", "unsharded", "DataParallel", "SPMDError"),
        "spmd_compiler.api": ("compile", "spmd_compile", "explain", "summary_text"),
        "spmd_compiler.parallel_mode": ("DataParallel",),
        "spmd_compiler.memory": ("measure_step_memory", "live_state_bytes", "rss_peak_bytes", "StepMemory"),
        "spmd_compiler.errors": ("SPMDError", "RankMismatchError", "SideEffectError", "MixedPrecisionError",
                                 "TraceError", "BatchDimError", "StepSignatureError"),
    }
    missing = [f"{m}.{n}" for m, names in public.items() for n in names
               if not hasattr(importlib.import_module(m), n)]
    assert not missing, missing
