"""Python statements of the step that change Python state, run again after every call.

The step's Python code runs only while it is recorded (spmd_compiler/trace/side_effects.py). A statement
at the end of the step that changes Python state and uses only what the step is given — its
arguments, closure variables and globals, never a value the step computed — does on every eager
call exactly what it would do after the compiled step's graph has run: ``scheduler.step()``,
``step_count += 1``, ``opt.param_groups[0]["lr"] *= 0.99``. :func:`plan` finds such statements
for the changes the recording saw, checks by running them once (and putting the state back) that
they change nothing else (fewer is fine: a ``StepLR`` changes the learning rate only every
``step_size`` calls), and returns their source; ``run_after``
(spmd_compiler/runtime/replayed.py) runs them after each call of the compiled step, so a scheduler stepped inside the step keeps working as in eager
PyTorch (the learning rate it sets is a graph input, read at the next call).

A change that no such statement explains raises SideEffectError naming it, its line and why:
the statement is not a top-level statement of the step (inside a loop, a branch or a function the
step calls), it reads a value the step computed (``print(loss.item())``, ``log(loss)``), it comes
before the step's tensor work (it would have to run before the graph, which this does not do;
a learning-rate scheduler's step may precede tensor work after the step's last optimizer
``step()``, such as an EMA update or ``return loss.detach()``), or it assigns a variable of an enclosing function.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Callable

import torch

from ..errors import SideEffectError
from .side_effects import Change, message, step_constants, unwrapped, watch
from ..runtime.replayed import run_after

_FRAME = re.compile(r'File "(.*)", line (\d+), in (\w+)')


def plan(fn: Callable, changes: list[Change], gm: torch.fx.GraphModule, sa,
         where: Callable[[], str]) -> tuple[str, ...]:
    """The source of the statements to run after every call for ``changes`` (none: ``()``);
    raise SideEffectError when a change is not explained by such a statement."""
    if not changes:
        return ()
    fn = unwrapped(fn)
    statements, why = _statements(fn, changes, gm)
    if statements is None:
        raise SideEffectError(message(fn, changes, why))
    source = tuple(statements)
    seen: list[Change] = []
    with watch(fn, sa.module, sa.optimizers, step_constants(sa), where, into=seen):
        run_after(fn, source, sa)
    recorded = {p for c in changes for p in c.parts}
    if any(not set(c.parts) <= recorded for c in seen):  # fewer: a StepLR between its steps
        raise SideEffectError(message(fn, changes, (
            f"Run again after the call, the step's statements at those lines change "
            f"{sorted(c.what for c in seen)} instead. ")))
    return source


def _statements(fn: Callable, changes: list[Change], gm) -> tuple[list[str] | None, str]:
    """(sources of the top-level statements that made ``changes``, "") or (None, why not)."""
    code = fn.__code__
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None, "The step's source is not available to run these lines again. "
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body if tree.body and isinstance(
        tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else []
    spans = [(s.lineno + first - 1, s.end_lineno + first - 1, s) for s in body]
    chosen: dict[int, ast.stmt] = {}
    by_statement: dict[int, list[Change]] = {}
    for c in changes:  # a change without a line (an in-place write) is left to the check
        at = c.where
        if at is None:
            continue
        stmt = next((s for a, b, s in spans if at[0] == code.co_filename and a <= at[1] <= b), None)
        if stmt is None:
            return None, (f"It is not made by a top-level statement of the step ({c.what}), so "
                          f"it cannot be run again after each call. ")
        chosen[stmt.lineno + first - 1] = stmt
        by_statement.setdefault(stmt.lineno + first - 1, []).append(c)
    if not chosen:
        return None, "No line of the step could be found for it. "
    locals_ = set(code.co_varnames[code.co_argcount + code.co_kwonlyargcount:])
    last_tensor_line = _last_recorded_line(gm, code)
    declared = set(_global_declarations(tree))
    out = []
    for start, stmt in sorted(chosen.items()):
        names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        if names & locals_:
            return None, (f"The statement at line {start} uses {sorted(names & locals_)}, "
                          f"computed in the step. ")
        if names & set(code.co_freevars) and any(
                isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in code.co_freevars
                for n in ast.walk(stmt)):
            return None, f"The statement at line {start} assigns a variable of an enclosing function. "
        if last_tensor_line is not None and start <= last_tensor_line and not (
                all(c.schedule for c in by_statement[start])
                and start > (_last_recorded_line(gm, code, stepped_only=True) or 0)):
            return None, (f"The statement at line {start} comes before the step's last tensor "
                          f"operation (line {last_tensor_line}); only statements after it can be "
                          f"run again after each call (a learning-rate scheduler's step may come "
                          f"earlier, after the step's last optimizer step). ")
        source = ast.unparse(stmt)
        glob = sorted(names & declared)
        out.append((f"global {', '.join(glob)}\n" if glob else "") + source)
    return out, ""


def _global_declarations(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            yield from node.names


def _last_recorded_line(gm: torch.fx.GraphModule, code, stepped_only: bool = False) -> int | None:
    """The last line of the step itself on whose stack a graph node was recorded (the step's
    tensor work), leaving out in-place writes to the learning rates the graph reads and the nodes
    only they use (a scheduler's ``fill_`` of a tensor learning rate: no later node reads it).
    ``stepped_only``: the last such line up to the end of the step's last optimizer ``step()``."""
    from spmd_compiler.passes import meta

    feeds_lr_only: set[torch.fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        schema = getattr(node.target, "_schema", None)
        writes_lr = bool(schema and schema.is_mutable and node.args and isinstance(
            node.args[0], torch.fx.Node) and node.args[0].meta.get(meta.ROLE) == meta.Role.HPARAM)
        if node.op == "call_function" and (writes_lr or (node.users and all(
                u in feeds_lr_only for u in node.users))):
            feeds_lr_only.add(node)
    last = None
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.stack_trace or node in feeds_lr_only:
            continue
        if stepped_only and not node.meta.get(meta.STEPPED):
            continue
        for file, line, name in _FRAME.findall(node.stack_trace):
            if file == code.co_filename and name == code.co_name:
                last = max(last or 0, int(line))
    return last


def plan_with_assignments(fn: Callable, changes: list[Change], gm: torch.fx.GraphModule, sa,
                          where: Callable[[], str], lifted: list[tuple], symbols: dict,
                          dropped: set) -> tuple[tuple[str, ...], tuple]:
    """(statements to run again, assignments to make) after every call for ``changes``; raise
    SideEffectError when neither explains a change. A change made outside the step's own lines
    (a forward counting its calls: ``self.stats.n += 1``) to a number the program takes as an
    input, whose new value is a function of the inputs, is an assignment (``guards.ValueGuards
    .assign``); the step's own statements are run again (:func:`plan`), or, when they cannot
    be (``self.w += .25`` before the tensor work), their changes are assignments too.
    ``lifted``: (path, (mapping, key)) of each lifted number; ``symbols``: each input's symbol
    -> its index; ``dropped``: symbols of guards ``drop_guards_after_tensor_work`` took out
    (a value computed through them is not a function of the inputs alone)."""
    code = unwrapped(fn).__code__
    own = {line for *_, line in code.co_lines() if line}

    def in_step(c: Change) -> bool:
        at = c.where
        return at is not None and at[0] == code.co_filename and at[1] in own

    outside = [c for c in changes if not in_step(c)]
    assigned, rest = _assignments(outside, lifted, symbols, dropped)
    rest += [c for c in changes if in_step(c)]
    try:
        return plan(fn, rest, gm, sa, where), assigned
    except SideEffectError:
        more, rest = _assignments(rest, lifted, symbols, dropped)
        if not more:
            raise
        return plan(fn, rest, gm, sa, where), assigned + more


def _assignments(changes: list[Change], lifted: list[tuple], symbols: dict,
                 dropped: set) -> tuple[tuple, list[Change]]:
    """((path, Python expression over ``h<index>``), ...) for the changes of ``changes`` that
    set lifted numbers to functions of the inputs, and the other changes."""
    from ..torch_internals import sympy_python as pycode

    out, rest = [], []
    for c in changes:
        targets = [next((p for p, (m, k) in lifted if m is mapping and k == key), None)
                   for mapping, key, _ in c.slots]
        values = [_expression(v, symbols, dropped, pycode) for *_, v in c.slots]
        if not c.slots or None in targets or None in values:
            rest.append(c)
            continue
        out += zip(targets, values)
    return tuple(out), rest


def _expression(value, symbols: dict, dropped: set, pycode) -> str | None:
    """``value`` (a number, or a symbolic one over ``symbols`` only, none of them ``dropped``)
    as Python over ``h<i>``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    if not isinstance(value, (torch.SymInt, torch.SymFloat)):
        return None
    expr = value.node.expr
    if not expr.free_symbols <= symbols.keys() or expr.free_symbols & dropped:
        return None
    import sympy

    return pycode(expr.xreplace({s: sympy.Symbol(f"h{symbols[s]}") for s in expr.free_symbols}))


def drop_guards_after_tensor_work(fn: Callable, gm: torch.fx.GraphModule, shape_env) -> set:
    """Remove from ``shape_env`` the guards the step's own lines made after its last tensor
    operation (``model.kl_w = min(1, model.kl_w + .25)`` on a lifted number compares it): the
    graph was recorded before them and does not depend on them, and the statements that made
    them run again, on real values, after every call. Returns the symbols they held."""
    fn = unwrapped(fn)
    code = getattr(fn, "__code__", None)
    last = _last_recorded_line(gm, code) if code is not None else None
    if last is None:
        return set()

    def after(guard) -> bool:
        loc = guard.sloc.framework_loc
        return (getattr(loc, "filename", None) == code.co_filename and loc.name == code.co_name
                and loc.lineno > last)

    dropped = [g for g in shape_env.guards if after(g)]
    shape_env.guards[:] = [g for g in shape_env.guards if not after(g)]
    return set().union(*(g.expr.free_symbols for g in dropped))
