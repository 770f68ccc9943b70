"""See the compiled step: Graphviz dumps of every stage and a summary table.

``dump_stage`` writes two views of a graph: the full node-by-node view (capped at ``max_nodes``)
and a collapsed view with one box per module path. ``summarize`` reads collectives, buckets,
parameter placements and memory estimates off the graph; ``write_summary`` writes them as text
and Markdown. Everything is read from ``node.meta`` (keys in ``passes/meta.py``); nothing here
changes a graph.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import graphviz
import torch
import torch.fx as fx
from tabulate import tabulate
from torch.fx.experimental.symbolic_shapes import optimization_hint

from spmd_compiler.passes.memory_plan import lifetimes
from spmd_compiler.passes.expand import collective_dim
from spmd_compiler.passes.meta import (
    BUCKET, COLLECTIVE, GATHERED, INPUT_PATH, KEPT_GRADS, MESH_DIMS, MESH_SIZES, NOTES, PARAM_FQN, PARAM_PLAN,
    PLACEMENT,
    PLAN_DIMS, PLAN_PLACEMENT, REGION, ROLE, STATE_KEY, WORKSPACES, Role,
)

from ..torch_internals import _StridedShard

log = logging.getLogger("spmd_compiler")

DEFAULT_MAX_NODES = 400
_ROW = 6  # a region's inputs (state, copies of values made elsewhere) are drawn this many a row
_SCALAR_REACH = 8  # a symbolic scalar read more than this many nodes later is drawn again there
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")
_FONT = "Helvetica"

# Fill colour per placement kind (ColorBrewer pastels, distinguishable without colour via the
# placement text that every node label carries as well).
PLACEMENT_COLORS = {
    "shard": "#9ecae1",
    "replicate": "#c7e9c0",
    "partial": "#fdd0a2",
    "none": "#ffffff",
}
REGION_COLORS = {"forward": "#f4f8fc", "backward": "#fcf6f1", "optimizer": "#f6f3fa"}

# Graphviz node attributes per drawn role.
ROLE_STYLES: dict[str, dict[str, str]] = {
    "param": dict(shape="cylinder", color="#238b45", penwidth="2"),
    "buffer": dict(shape="cylinder", color="#238b45", style="dashed"),
    "opt_state": dict(shape="cylinder", color="#6a51a3", penwidth="2"),
    "hparam": dict(shape="note", color="#6a51a3", fontsize="8"),
    "input": dict(shape="invhouse", color="#08519c", penwidth="2"),
    "grad": dict(shape="box", color="#d94801", penwidth="2", peripheries="2"),
    "saved": dict(shape="box", style="rounded,bold", color="#525252", penwidth="2"),
    "activation": dict(shape="box", style="rounded", color="#969696"),
    "collective": dict(shape="octagon", color="#cb181d", penwidth="3", fontname=f"{_FONT}-Bold"),
    "wait": dict(shape="octagon", color="#cb181d", style="dashed", fontsize="8"),
    "scalar": dict(shape="plain", fontcolor="#737373", fontsize="8"),
    "output": dict(shape="Msquare", color="#252525"),
}
ROLE_DESCRIPTIONS = {
    "param": "parameter",
    "buffer": "buffer",
    "opt_state": "optimizer state",
    "hparam": "hyperparameter",
    "input": "batch input",
    "grad": "parameter gradient",
    "saved": "activation saved for backward",
    "activation": "other tensor op",
    "collective": "collective (kind, bytes)",
    "wait": "wait_tensor",
    "scalar": "symbolic scalar",
    "output": "step output",
}


# ----------------------------------------------------------------------------- node facts


def is_collective(node: fx.Node) -> bool:
    """True for a functional collective that issues communication (not its ``wait_tensor``)."""
    ns = getattr(node.target, "namespace", None)
    return node.op == "call_function" and ns in _COLLECTIVE_NAMESPACES and not _is_wait(node)


def _is_wait(node: fx.Node) -> bool:
    ns = getattr(node.target, "namespace", None)
    return ns in _COLLECTIVE_NAMESPACES and "wait_tensor" in str(node.target)


def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The collective-issuing nodes of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if is_collective(n)]


def collective_kind(node: fx.Node) -> str:
    """``meta[COLLECTIVE]["kind"]`` when the expansion pass wrote it, else the op's name."""
    info = node.meta.get(COLLECTIVE) or {}
    return info.get("kind") or node.target._opname


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _role(node: fx.Node, saved: set[fx.Node]) -> str:
    """The drawn role of a node (a key of ``ROLE_STYLES``)."""
    if node.op == "output":
        return "output"
    if is_collective(node):
        return "collective"
    if _is_wait(node):
        return "wait"
    role = node.meta.get(ROLE)
    if role is not None and role != Role.COLLECTIVE:
        return Role(role).value
    if node.op == "placeholder":
        return "input"
    if not _tensors(node.meta.get("val")):
        return "scalar"
    return "saved" if node in saved else "activation"


def _saved_activations(gm: fx.GraphModule) -> set[fx.Node]:
    """Forward-region nodes read by a backward-region node (what autograd keeps alive)."""
    fwd, bwd = "forward", "backward"
    return {
        n for n in gm.graph.nodes
        if n.op != "placeholder" and _region(n) == fwd and any(_region(u) == bwd for u in n.users)
    }


def _region(node: fx.Node) -> str | None:
    region = node.meta.get(REGION)
    return None if region is None else getattr(region, "value", str(region))


def _assign_regions(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Region per node; nodes a later pass inserted without one take their predecessor's."""
    out, last = {}, None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            out[n] = None
            continue
        last = _region(n) or last
        out[n] = last
    return out


def bucket_numbers(gm: fx.GraphModule, cache: dict | None = None) -> dict[int, int]:
    """The number each bucket is shown with: its place in execution order (the order of the
    bucket's first collective in the graph), from its ``meta[BUCKET]`` id. ``cache``: a dict
    that keeps the answer for the next call."""
    if cache is not None and "buckets" in cache:
        return cache["buckets"]
    order: dict[int, int] = {} if cache is None else cache.setdefault("buckets", {})
    for n in gm.graph.nodes:
        if is_collective(n) and n.meta.get(BUCKET) is not None:
            order.setdefault(int(n.meta[BUCKET]), len(order))
    return order


def _buckets(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Bucket per node, numbered in execution order (``bucket_numbers``), inherited by a wait
    from the collective it waits on."""
    out, numbers = {}, bucket_numbers(gm)
    for n in gm.graph.nodes:
        b = n.meta.get(BUCKET)
        b = numbers.get(int(b), int(b)) if b is not None else None
        if b is None and _is_wait(n) and n.args and isinstance(n.args[0], fx.Node):
            b = out.get(n.args[0])
        if b is not None:
            out[n] = int(b)
    return out


def placement_kind(p: Any) -> str:
    """``shard`` / ``replicate`` / ``partial`` / ``none`` for a placement (or a list: the first)."""
    if isinstance(p, (list, tuple)):
        p = next((q for q in p if q is not None), None)
    if p is None:
        return "none"
    if isinstance(p, _StridedShard):  # an interleaved shard (its is_shard() is False)
        return "shard"
    for kind in ("shard", "replicate", "partial"):
        if getattr(p, f"is_{kind}")():
            return kind
    return "none"


def placement_str(p: Any) -> str:
    """Short placement text: ``S(0)``, ``_S(0, 5)`` (strided: 5 chunks), ``R``, ``P(avg)``;
    lists joined with ``,``."""
    if isinstance(p, (list, tuple)):
        return ",".join(placement_str(q) for q in p)
    if p is None:
        return "-"
    if isinstance(p, _StridedShard):
        return str(p)
    kind = placement_kind(p)
    if kind == "shard":
        return f"S({p.dim})"
    if kind == "replicate":
        return "R"
    if kind == "partial":
        return f"P({p.reduce_op})"
    return str(p)


def dtensor_str(p: Any) -> str:
    """A placement as DTensor spells it: ``Shard(0)``, ``Replicate()``, ``Partial(avg)``,
    ``_StridedShard(dim=0, sf=5)``; ``-`` for none. (A list: see ``placement_counts``.)"""
    if p is None:
        return "-"
    if isinstance(p, _StridedShard):
        return repr(p)
    kind = placement_kind(p)
    if kind == "shard":
        return f"Shard({p.dim})"
    if kind == "replicate":
        return "Replicate()"
    if kind == "partial":
        return f"Partial({p.reduce_op})"
    return str(p)


def placement_counts(p: Any) -> Counter:
    """How many values of each placement (DTensor's spelling) ``p`` holds: one, or one per
    element of a list (a foreach or fused op's results)."""
    items = p if isinstance(p, (list, tuple)) else [p]
    return Counter(dtensor_str(q) for q in items if q is not None)


def _module_path(node: fx.Node) -> tuple[str, str] | None:
    """(path, class name) of the innermost module a node was recorded in, if known."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, type_ = list(stack.values())[-1]
    type_name = type_.__name__ if isinstance(type_, type) else str(type_).rsplit(".", 1)[-1]
    return str(path), type_name


# ----------------------------------------------------------------------------- sizes


class _Sizer:
    """Evaluates symbolic sizes at hint values (overrides by symbol name, else ShapeEnv hints)."""

    def __init__(self, overrides: Mapping[str, int] | None = None):
        self.overrides = dict(overrides or {})
        self.used: dict[str, int] = {}

    def size(self, s: int | torch.SymInt) -> int:
        if not isinstance(s, torch.SymInt):
            return int(s)
        expr, env = s.node.expr, s.node.shape_env
        values = {}
        for sym in expr.free_symbols:
            name = str(sym)
            if name in self.overrides:
                values[sym] = self.overrides[name]
            elif sym in env.backed_var_to_val:
                values[sym] = int(env.backed_var_to_val[sym])
            else:  # unbacked (data-dependent): torch's own estimate
                return optimization_hint(s)
            self.used[name] = int(values[sym])
        return int(expr.xreplace(values))

    def nbytes(self, val: Any) -> tuple[int, bool]:
        """(bytes of every tensor in ``val``, whether any size is symbolic)."""
        total, symbolic = 0, False
        for t in _tensors(val):
            numel = 1
            for s in t.shape:
                numel *= self.size(s)
                symbolic |= isinstance(s, torch.SymInt) and bool(s.node.expr.free_symbols)
            total += numel * t.element_size()
        return total, symbolic


def shape_str(val: Any) -> str:
    """``s0×50`` for one tensor (dtype appended unless float32); ``;``-joined for several."""
    parts = []
    for t in _tensors(val):
        dims = "×".join(str(s).replace("*", "·") for s in t.shape) or "scalar"
        dtype = "" if t.dtype == torch.float32 else " " + str(t.dtype).removeprefix("torch.")
        parts.append(dims + dtype)
    return "; ".join(parts)


def fmt_bytes(n: int | float) -> str:
    """Human-readable bytes (binary units)."""
    units = ["B", "KiB", "MiB", "GiB"]
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"


def collective_bytes(node: fx.Node, sizer: _Sizer | None = None) -> tuple[int, bool]:
    """Bytes a collective moves per step, and whether that depends on a symbolic (batch) size.

    The convention is the full (unsharded) buffer: the tensor for ``all_reduce``, the output for
    ``all_gather``, the input for ``reduce_scatter``; i.e. the larger of input and output.
    """
    sizer = sizer or _Sizer()
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    return max([sizer.nbytes(node.meta.get("val"))] + [sizer.nbytes(v) for v in ins])


# ----------------------------------------------------------------------------- full view


def _node_label(node: fx.Node, role: str, sizer: _Sizer) -> str:
    if role == "collective":
        info = node.meta.get(COLLECTIVE) or {}
        nbytes, symbolic = collective_bytes(node, sizer)
        reduce_op = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else None
        head = collective_kind(node) + (f" ({reduce_op})" if reduce_op else "")
        size = fmt_bytes(nbytes) + (" (batch-dependent)" if symbolic else "")
        lines = [head, size]
        if PLAN_PLACEMENT in node.meta:  # a tensor-parallel plan's: its dim, placement change
            dim, before, after = node.meta[PLAN_PLACEMENT]
            lines.append(f"{dim}: {before} -> {after}")
        if info.get("params"):
            lines.append(_short_list(info["params"]))
        return "\n".join(lines)
    if node.op == "placeholder":
        name = node.meta.get(PARAM_FQN) or node.meta.get(INPUT_PATH) or node.name
        if node.meta.get(STATE_KEY):
            name = f"{name}.{node.meta[STATE_KEY]}"
        shape = shape_str(node.meta.get("val"))
        lines = [name, ROLE_DESCRIPTIONS[role] + (f" · {shape}" if shape else "")]
    elif node.op == "output":
        return "output"
    else:
        op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        lines = [node.name if node.name.startswith(op) else f"{node.name}\n{op}"]
        if role == "grad":
            lines.append(f"grad {node.meta.get(PARAM_FQN, '')}")
    if node.meta.get(PLACEMENT) is not None:
        lines.append(", ".join(p + (f" ×{c}" if c > 1 else "")
                               for p, c in placement_counts(node.meta[PLACEMENT]).items()))
    return "\n".join(lines)


def _short_list(items: Sequence[str], k: int = 3) -> str:
    return ", ".join(items[:k]) + (f" +{len(items) - k}" if len(items) > k else "")


def _node_attrs(node: fx.Node, role: str) -> dict[str, str]:
    attrs = dict(ROLE_STYLES[role])
    if role not in ("scalar", "output"):
        attrs["style"] = ",".join(filter(None, ["filled", attrs.get("style")]))
        attrs["fillcolor"] = PLACEMENT_COLORS[placement_kind(node.meta.get(PLACEMENT))]
    attrs["class"] = role
    return attrs


def _add_legend(g: graphviz.Digraph, roles: Iterable[str], per_row: int = 6) -> None:
    """A legend cluster: one swatch per placement, one sample per role the graph uses, in rows."""
    labels = {"shard": "Shard(d)", "replicate": "Replicate()", "partial": "Partial(op)",
              "none": "no placement"}
    items = [(f"legend_{k}", labels[k], dict(shape="box", style="filled", fillcolor=c))
             for k, c in PLACEMENT_COLORS.items()]
    items += [(f"legend_role_{r}", ROLE_DESCRIPTIONS[r],
               {k: v for k, v in ROLE_STYLES[r].items() if k != "fontsize"}) for r in roles]
    with g.subgraph(name="cluster_legend") as lg:
        lg.attr(label="legend", style="rounded", color="#bdbdbd", fontsize="10")
        rows = [items[i:i + per_row] for i in range(0, len(items), per_row)]
        for r, row in enumerate(rows):
            with lg.subgraph() as rg:
                rg.attr(rank="same")
                for i, (name, text, attrs) in enumerate(row):
                    rg.node(name, text, fontsize="9", **attrs)
                    if i:
                        rg.edge(row[i - 1][0], name, style="invis")
            if r:
                lg.edge(rows[r - 1][0][0], row[0][0], style="invis")


def _new_digraph(title: str) -> graphviz.Digraph:
    g = graphviz.Digraph(strict=False)
    g.attr(rankdir="TB", newrank="true", nodesep="0.25", ranksep="0.4", fontname=_FONT,
           label=title, labelloc="t", fontsize="14", compound="true",
           nslimit="1", nslimit1="1")  # bound network-simplex passes: big graphs lay out in seconds
    g.attr("node", fontname=_FONT, fontsize="10", margin="0.08,0.03", height="0.3")
    g.attr("edge", fontname=_FONT, fontsize="8", fontcolor="#525252", color="#737373",
           arrowsize="0.6")
    return g


def graph_to_dot(gm: fx.GraphModule, title: str = "", *, max_nodes: int = DEFAULT_MAX_NODES,
                 size_hints: Mapping[str, int] | None = None) -> graphviz.Digraph:
    """The full view: every node (up to ``max_nodes``), in region and bucket clusters.

    A placeholder sits in the region of its first reader. A value read in another region than its
    own (state the optimizer updates, activations the backward reads) is drawn again as a dashed
    copy inside the reading region, and a symbolic scalar read far from where it is made gets a
    copy next to its reader. Long edges would otherwise cross the whole graph and make
    Graphviz's layout slow (virtual node chains).
    """
    nodes = list(gm.graph.nodes)
    shown = nodes[:max_nodes]
    shown_set = set(shown)
    sizer = _Sizer(size_hints)
    saved = _saved_activations(gm)
    regions = _assign_regions(gm)
    buckets = _buckets(gm)
    roles = {n: _role(n, saved) for n in shown}
    n_coll = sum(r == "collective" for r in roles.values())
    g = _new_digraph(f"{title}\n{len(nodes)} nodes, {n_coll} collectives" if title else "")

    place, copies = _places_and_copies(shown, regions, roles)
    # cluster key -> nodes; a node sits in its region's cluster and, inside it, its bucket's.
    groups: dict[tuple[str | None, int | None], list[fx.Node]] = defaultdict(list)
    for n in shown:
        groups[(place[n], buckets.get(n))].append(n)
    copy_nodes = {name_region: src for (src, _), name_region in copies.items()}
    for region in dict.fromkeys([regions[n] for n in shown if n.op != "placeholder"]
                                + [r for r, _ in groups]):
        with _cluster(g, region, **_region_attrs(region)) as rg:
            for (name, r), src in copy_nodes.items():
                if r == region:
                    text = _node_label(src, roles[src], sizer).split("\n")[0]
                    rg.node(name, text if src.op == "placeholder" else src.name,
                            **_copy_attrs(src, roles[src]))
            for (r, b), members in groups.items():
                if r != region:
                    continue
                bucket = None if b is None else f"{region}_bucket{b}"
                with _cluster(rg, bucket, label=f"bucket {b}", style="dashed,filled",
                              fillcolor="#fff5f0", color="#cb181d", fontsize="10") as bg:
                    for n in members:
                        bg.node(n.name, _node_label(n, roles[n], sizer), **_node_attrs(n, roles[n]))
    # the regions side by side in step order, as columns with their tops aligned: each
    # region's first node on one rank (reads across regions are drawn as copies, so no edge
    # pulls a region below the one before it)
    firsts = [next(n for n in shown if place[n] == r and n.op != "output")
              for r in dict.fromkeys(place[n] for n in shown if place[n])]
    with g.subgraph() as top:
        top.attr(rank="same")
        for left, right in zip(firsts, firsts[1:]):
            top.edge(left.name, right.name, style="invis")
    for region in dict.fromkeys(place[n] for n in shown if place[n]):  # inputs in rows of 6
        heads = [name for (name, r) in copy_nodes if r == region] + [
            n.name for n in shown if n.op == "placeholder" and place[n] == region]
        for upper, lower in zip(heads, heads[_ROW:]):
            g.edge(upper, lower, style="invis")
    with g.subgraph() as sub:  # the output at the bottom; placeholders sit next to their use
        sub.attr(rank="sink")
        for n in shown:
            if n.op == "output":
                sub.node(n.name)
    for n in shown:
        for inp in n.all_input_nodes:
            if inp in shown_set:
                light = dict(color="#bdbdbd", fontcolor="#969696") if n.op == "output" else {}
                g.edge(copies.get((inp, n), (inp.name,))[0], n.name,
                       label=shape_str(inp.meta.get("val")), **light)
    if len(nodes) > max_nodes:
        g.node("capped", f"capped: showing the first {max_nodes} of {len(nodes)} nodes\n"
                         "see the .collapsed view for the whole step",
               shape="note", style="filled", fillcolor="#fee0d2", color="#cb181d", fontsize="12")
    _add_legend(g, [r for r in ROLE_STYLES if r in set(roles.values())])
    return g


def _places_and_copies(shown: list[fx.Node], regions: Mapping[fx.Node, str | None],
                       roles: Mapping[fx.Node, str]):
    """The region each node is drawn in (a placeholder: its first reader's), and the dashed
    copies: (source, reader) -> (copy's DOT name, region) for reads across regions and far reads
    of symbolic scalars."""
    pos = {n: i for i, n in enumerate(shown)}
    place = dict(regions)
    for n in shown:
        if n.op == "placeholder":
            readers = [u for u in n.users if u.op != "output" and u in pos]
            place[n] = regions[min(readers, key=pos.get)] if readers else None
    copies: dict[tuple[fx.Node, fx.Node], tuple[str, str]] = {}
    for n in shown:
        region = place[n]
        if region is None or n.op == "output":
            continue
        for inp in n.all_input_nodes:
            if inp not in pos:
                continue
            if place[inp] != region:
                copies[(inp, n)] = (f"{inp.name}__{region}", region)
            elif roles[inp] == "scalar" and pos[n] - pos[inp] > _SCALAR_REACH:
                copies[(inp, n)] = (f"{inp.name}__{n.name}", region)
    return place, copies


def _copy_attrs(src: fx.Node, role: str) -> dict[str, str]:
    attrs = _node_attrs(src, role)
    style = "dashed" if role == "scalar" else "dashed,filled"
    attrs.update(style=style, penwidth="1", **{"class": "copy"})
    return attrs


@contextmanager
def _cluster(g: graphviz.Digraph, name: str | None, **attrs: str) -> Iterator[graphviz.Digraph]:
    """``g``'s subgraph ``cluster_<name>`` with ``attrs``, or ``g`` itself when name is None."""
    if name is None:
        yield g
        return
    with g.subgraph(name=f"cluster_{name}") as sub:
        sub.attr(**attrs)
        yield sub


def _region_attrs(region: str | None) -> dict[str, str]:
    return dict(label=(region or "").upper(), style="filled", color="#bdbdbd", fontsize="12",
                labeljust="l", fillcolor=REGION_COLORS.get(region, "#f7f7f7"))


# ----------------------------------------------------------------------------- collapsed view

_PLACEHOLDER_GROUPS = {
    "param": "parameters", "buffer": "buffers", "opt_state": "optimizer state",
    "hparam": "hyperparameters", "input": "batch inputs",
}


def _module_prefix(fqn: str) -> str:
    """The top of a parameter's module path: up to the first numeric part (``blocks.0``), else
    the first part (``net1``)."""
    parts = fqn.split(".")[:-1]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def _modules(gm: fx.GraphModule,
             regions: Mapping[fx.Node, str | None]) -> dict[fx.Node, tuple[str, str, str]]:
    """Module (path, class, pass) per node, for grouping only.

    Forward: the recorded ``nn_module_stack``. A backward tensor op without one takes the module
    that saved the latest forward value it reads: the last forward module reading that value
    (a Linear saves its input, made by the module before it), else the value's own module. A
    backward op reading no forward value takes the module of its latest backward input. Autograd
    runs a module's backward on what that module saved, so this mirrors the forward's modules.
    """
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    out: dict[fx.Node, tuple[str, str, str]] = {}
    saver: dict[fx.Node, fx.Node] = {}  # value -> last forward node with a module reading it
    for n in gm.graph.nodes:
        mod = _module_path(n)
        if mod is not None:
            out[n] = (*mod, "")
            if regions[n] == "forward":
                saver.update((a, n) for a in n.all_input_nodes)
        elif regions[n] == "backward" and n.op == "call_function":
            ins = n.all_input_nodes
            saved = [a for a in ins if regions[a] == "forward"]
            if _tensors(n.meta.get("val")):  # not for size reads such as sym_size(x)
                saved += [a for a in ins if a.op == "placeholder"]
            fwd = [m for m in (saver.get(a, a) for a in saved) if m in out]
            src = max(fwd or [a for a in ins if a in out], key=pos.get, default=None)
            if src is not None:
                out[n] = (*out[src][:2], "backward")
    return out


def _group(node: fx.Node, role: str, bucket: int | None, region: str | None,
           module: tuple[str, str, str] | None) -> tuple[str, str]:
    """(group id, group title) of a node in the collapsed view."""
    if node.op == "placeholder":
        fqn = node.meta.get(PARAM_FQN)
        prefix = _module_prefix(fqn) if fqn and role in ("param", "buffer", "opt_state") else ""
        return f"ph_{role}_{prefix}", f"{_PLACEHOLDER_GROUPS[role]} {prefix}".strip()
    if node.op == "output":
        return "output", "output"
    if role in ("collective", "wait"):
        if bucket is not None:
            return f"bucket_{bucket}", f"bucket {bucket}"
        anchor = node if role == "collective" else node.args[0]
        kind = collective_kind(anchor)
        params = (anchor.meta.get(COLLECTIVE) or {}).get("params") or [""]
        prefix = _module_prefix(params[0])
        return f"coll_{kind}_{region}_{prefix}", prefix or "collectives"
    if module is not None:
        path, type_name, pass_ = module
        gid = f"mod_{path}_{pass_}" if pass_ else f"mod_{path}"
        return gid, f"{path or '(root)'} · {type_name} {pass_}".strip()
    return f"region_{region}", f"{region or 'other'} (no module)"


def collapsed_to_dot(gm: fx.GraphModule, title: str = "", *,
                     size_hints: Mapping[str, int] | None = None) -> graphviz.Digraph:
    """The collapsed view: one box per module path (forward, and backward where it can be told),
    else per region; state per top-level module; collectives per bucket, else per module."""
    sizer = _Sizer(size_hints)
    saved = _saved_activations(gm)
    regions = _assign_regions(gm)
    buckets = _buckets(gm)
    modules = _modules(gm, regions)
    member_of: dict[fx.Node, str] = {}
    groups: dict[str, dict[str, Any]] = {}
    for n in gm.graph.nodes:
        role = _role(n, saved)
        gid, gtitle = _group(n, role, buckets.get(n), regions[n], modules.get(n))
        grp = groups.setdefault(
            gid, dict(title=gtitle, nodes=[], roles=Counter(), regions=Counter()))
        grp["nodes"].append(n)
        grp["roles"][role] += 1
        if regions[n]:
            grp["regions"][regions[n]] += 1
        member_of[n] = gid

    g = _new_digraph(f"{title} (collapsed by module)\n"
                     f"{len(member_of)} nodes in {len(groups)} groups" if title else "")
    by_region: dict[str | None, list[str]] = defaultdict(list)
    for gid, grp in groups.items():
        by_region[grp["regions"].most_common(1)[0][0] if grp["regions"] else None].append(gid)
    for region, gids in by_region.items():
        with _cluster(g, region, **_region_attrs(region)) as rg:
            for gid in gids:
                rg.node(gid, _group_label(groups[gid], sizer), **_group_attrs(groups[gid]))
    edges: dict[tuple[str, str], list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        for inp in n.all_input_nodes:
            a, b = member_of[inp], member_of[n]
            if a != b:
                edges[(a, b)].append(inp)
    for (a, b), values in edges.items():
        g.edge(a, b, label=_edge_label(list(dict.fromkeys(values)), sizer),
               penwidth=str(min(1 + len(values) / 4, 4)))
    drawn_roles = {r for grp in groups.values() for r in grp["roles"]
                   if r in ("collective",) + tuple(_PLACEHOLDER_GROUPS)}
    _add_legend(g, [r for r in ROLE_STYLES if r in drawn_roles])
    return g


def _edge_label(values: list[fx.Node], sizer: _Sizer) -> str:
    """The tensors crossing a collapsed edge: their shapes (two at most) and their total size."""
    shapes = [t for t in dict.fromkeys(shape_str(v.meta.get("val")) for v in values) if t]
    nbytes = sum(sizer.nbytes(v.meta.get("val"))[0] for v in values)
    if not shapes:
        return ""
    return f"{_short_list(shapes, 2)}\n{fmt_bytes(nbytes)}"


def _group_label(grp: dict[str, Any], sizer: _Sizer) -> str:
    nodes = grp["nodes"]
    colls = [n for n in nodes if is_collective(n)]
    if colls:
        kinds = Counter(collective_kind(n) for n in colls)
        nbytes = sum(collective_bytes(n, sizer)[0] for n in colls)
        what = ", ".join(f"{k} ×{c}" for k, c in kinds.items())
        return f"{grp['title']}\n{what}\n{fmt_bytes(nbytes)}"
    if nodes[0].op == "output":
        return grp["title"]
    if nodes[0].op == "placeholder":
        if not any(_tensors(n.meta.get("val")) for n in nodes):
            return f"{grp['title']}\n{len(nodes)} scalars"
        nbytes = sum(sizer.nbytes(n.meta.get("val"))[0] for n in nodes)
        return f"{grp['title']}\n{len(nodes)} tensors · {fmt_bytes(nbytes)}"
    places = sum((placement_counts(n.meta.get(PLACEMENT)) for n in nodes), Counter())
    lines = [grp["title"], f"{len(nodes)} ops"]
    if places:
        lines.append(", ".join(f"{p} ×{c}" for p, c in places.most_common(3)))
    return "\n".join(lines)


def _group_attrs(grp: dict[str, Any]) -> dict[str, str]:
    nodes, roles = grp["nodes"], grp["roles"]
    if roles["collective"]:
        attrs = dict(ROLE_STYLES["collective"])
        attrs.update(style="filled", fillcolor="#fee0d2", **{"class": "collective"})
        return attrs
    if nodes[0].op in ("placeholder", "output"):
        role = roles.most_common(1)[0][0]
        attrs = dict(ROLE_STYLES[role])
        attrs.update(style="filled", fillcolor="#ffffff")
        return attrs
    kinds = Counter(placement_kind(n.meta.get(PLACEMENT)) for n in nodes
                    if _tensors(n.meta.get("val")))
    if len(kinds) <= 1:
        return dict(shape="box", style="filled", color="#525252", penwidth="1.5",
                    fillcolor=PLACEMENT_COLORS[next(iter(kinds), "none")])
    total = sum(kinds.values())
    # fractions rounded down, the last colour takes the rest: Graphviz refuses a total over 1
    shares = [f"{PLACEMENT_COLORS[k]};{int(c / total * 1000) / 1000:.3f}" for k, c in kinds.items()]
    stripes = ":".join(shares[:-1] + [PLACEMENT_COLORS[list(kinds)[-1]]])
    return dict(shape="box", style="striped", fillcolor=stripes, color="#525252", penwidth="1.5")


# ----------------------------------------------------------------------------- dumping

_svg_skip_logged = False


def _next_index(dump_dir: Path) -> int:
    taken = [int(m.group(1)) for p in dump_dir.glob("*.dot") if (m := re.match(r"(\d+)_", p.name))]
    return max(taken, default=-1) + 1


def dump_stage(gm: fx.GraphModule, stage: str, dump_dir: str | Path, *, index: int | None = None,
               max_nodes: int = DEFAULT_MAX_NODES,
               size_hints: Mapping[str, int] | None = None) -> list[Path]:
    """Write ``NN_<stage>.dot`` and ``NN_<stage>.collapsed.dot`` (+ ``.svg`` when ``dot`` exists).

    ``NN`` is ``index`` or, if None, one more than the highest prefix already in ``dump_dir``, so
    stages dumped in pipeline order sort in that order. Returns the paths written.
    """
    global _svg_skip_logged
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    index = _next_index(dump_dir) if index is None else index
    base = dump_dir / f"{index:02d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', stage)}"
    views = {
        base.with_name(base.name + ".dot"): graph_to_dot(gm, stage, max_nodes=max_nodes,
                                                         size_hints=size_hints),
        base.with_name(base.name + ".collapsed.dot"): collapsed_to_dot(gm, stage,
                                                                       size_hints=size_hints),
    }
    written = []
    dot = shutil.which("dot")
    for path, digraph in views.items():
        path.write_text(digraph.source)
        written.append(path)
        if dot:
            svg = path.with_suffix(".svg")
            try:
                subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], check=True,
                               capture_output=True, timeout=120)
                written.append(svg)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                log.warning("graphviz could not render %s: %s", path, e)
    if not dot and not _svg_skip_logged:
        log.info("graphviz `dot` not found on PATH: writing .dot files only, no .svg")
        _svg_skip_logged = True
    return written


# ----------------------------------------------------------------------------- summary


@dataclass
class CollectiveStat:
    kind: str
    count: int
    bytes: int  # per step, at the size hints
    batch_dependent: bool


@dataclass
class BucketStat:
    bucket: int
    kinds: str
    count: int
    bytes: int
    params: list[str]


@dataclass
class GatherStat:
    """One parameter all-gather: what it moves per step (its output), in which dtype, and who
    chose that (the parameter's FSDP2 all-gather extension, or the compiler)."""

    params: str
    dtype: str
    bytes: int
    by: str


@dataclass
class ParamStat:
    fqn: str
    placement: str
    local_shape: tuple[int, ...]
    local_bytes: int
    global_shape: tuple[int, ...] | None = None


@dataclass
class Summary:
    """What a compiled step communicates and holds, read off its final graph."""

    num_nodes: int
    size_hints: dict[str, int]  # the symbol values every byte count below was evaluated at
    collectives: list[CollectiveStat]
    buckets: list[BucketStat]
    params: list[ParamStat]
    persistent_bytes: dict[str, int]  # per rank: params, grads, buffers, optimizer state, total
    peak_bytes: int  # liveness estimate, see estimate_peak_memory
    peak_node: str
    workspace_bytes: int = 0  # the static memory plan's workspace (passes/memory_plan.py)
    # collectives a call issues (the lowered graph's, and the per-call agreement between ranks
    # when the graph awaits it); None without a lowered graph
    issued_per_call: int | None = None
    agreements_per_call: int = 0  # of issued_per_call: the per-call agreement between ranks
    compile_times: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # per pass: what it did
    gathers: list[GatherStat] = field(default_factory=list)
    mesh_shape: tuple[int, ...] = ()  # the data-parallel mesh the program was built for
    # explain without a process group: per figure, how another world size changes it
    at_other_sizes: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(torch.tensor(self.mesh_shape or (1,)).prod())

    def header(self) -> str:
        """``at world size N`` (and the mesh's shape where it has several dims)."""
        mesh = f" (mesh {' x '.join(map(str, self.mesh_shape))})" if len(self.mesh_shape) > 1 else ""
        return f"at world size {self.world_size}{mesh}"

    @property
    def collective_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    def tables(self) -> list[tuple[str, list[str], list[list[Any]]]]:
        """(title, headers, rows) of every section."""
        hints = ", ".join(f"{k}={v}" for k, v in sorted(self.size_hints.items())) or "none"
        out = [("collectives per step", ["kind", "count", "bytes", "size", "depends on batch"],
                [[c.kind, c.count, c.bytes, fmt_bytes(c.bytes),
                  "yes" if c.batch_dependent else "no"] for c in self.collectives]
                + [["total", sum(c.count for c in self.collectives), self.collective_bytes,
                    fmt_bytes(self.collective_bytes), ""]])]
        if self.buckets:
            out.append(("buckets", ["bucket", "collectives", "count", "size", "params"],
                        [[b.bucket, b.kinds, b.count, fmt_bytes(b.bytes), _short_list(b.params, 4)]
                         for b in self.buckets]))
        if self.gathers:
            out.append(("parameter all-gathers", ["parameters", "dtype", "bytes", "size", "by"],
                        [[_short_list(g.params.split(", "), 4), g.dtype, g.bytes,
                          fmt_bytes(g.bytes), g.by] for g in self.gathers]))
        with_global = any(p.global_shape for p in self.params)
        out.append(("parameters", ["parameter", "placement", "local shape", "local size"]
                    + (["global shape"] if with_global else []),
                    [[p.fqn, p.placement, "×".join(map(str, p.local_shape)) or "scalar",
                      fmt_bytes(p.local_bytes)]
                     + (["×".join(map(str, p.global_shape or ()))] if with_global else [])
                     for p in self.params]))
        out.append(("memory per rank (estimate)", ["what", "bytes", "size"],
                    [[k, v, fmt_bytes(v)] for k, v in self.persistent_bytes.items()]
                    + ([["workspace (planned temporaries, kept)", self.workspace_bytes,
                         fmt_bytes(self.workspace_bytes)]] if self.workspace_bytes else [])
                    + [[f"peak (liveness walk, at {self.peak_node})", self.peak_bytes,
                        fmt_bytes(self.peak_bytes)]]))
        if self.compile_times:
            out.append(("compile time", ["stage", "seconds"],
                        [[k, v] for k, v in self.compile_times.items()]
                        + [["total", sum(self.compile_times.values())]]))
        if self.notes:
            out.append(("passes", ["pass", "what it did"], [[k, v] for k, v in self.notes.items()]))
        if self.at_other_sizes:
            out.append(("at another world size (no process group: built on a stand-in group of "
                        f"{self.world_size} ranks, as rank 0 of a gloo run on CPU builds it)",
                        ["figure", "how it changes"],
                        [[k, v] for k, v in self.at_other_sizes.items()]))
        out.insert(0, ("step", ["graph nodes", "sizes evaluated at", "collectives issued per call"],
                       [[self.num_nodes, hints, self.issued_text()]]))
        return out

    def issued_text(self) -> str:
        """The collectives a call issues, split into the step's (the table "collectives per
        step": one per bucket), those the lowering for the backend adds (gloo: an all_gather
        issued as one broadcast per rank) and the per-call agreement between ranks."""
        if self.issued_per_call is None:
            return "-"
        per_step = sum(c.count for c in self.collectives)
        lowering = self.issued_per_call - per_step - self.agreements_per_call
        text = f"{per_step} per step (below)"
        if lowering:
            text += (f" {'+' if lowering > 0 else '-'} {abs(lowering)} from the lowering for gloo"
                     f" (an all_gather issued as one broadcast per rank)")
        if self.agreements_per_call:
            text += f" + {self.agreements_per_call} agreement between ranks"
        if text == f"{per_step} per step (below)":
            return f"{per_step}: the collectives per step below"
        return f"{self.issued_per_call} = {text}"

    def to_text(self) -> str:
        return f"{self.header()}\n\n" + "\n\n".join(f"{title}\n{tabulate(rows, headers, tablefmt='simple', floatfmt='.3f')}"
                           for title, headers, rows in self.tables()) + "\n"

    def to_markdown(self) -> str:
        return f"{self.header()}\n\n" + "\n\n".join(
            f"### {title}\n\n{tabulate(rows, headers, tablefmt='github', floatfmt='.3f')}"
            for title, headers, rows in self.tables()) + "\n"


def estimate_peak_memory(gm: fx.GraphModule, sizer: _Sizer | None = None) -> tuple[int, str]:
    """Peak of live tensor bytes over the graph's node order, and the node where it occurs.

    The liveness model is the static memory planner's (``passes/memory_plan.lifetimes``):
    every placeholder is live for the whole step (state and batch are owned by the caller);
    every other node allocates its result when it runs unless it aliases an input (views,
    in-place and ``out=`` ops, getitem, wait_tensor); an allocation is freed after the last
    use of it or any alias, one given to a collective after that collective's wait, and one
    the graph returns stays to the end, as does the planner's workspace (held between steps).
    Run on the lowered eager graph it counts what actually runs; ignores allocator caching
    and temporaries inside a kernel.
    """
    sizer = sizer or _Sizer()
    nodes = list(gm.graph.nodes)
    roots, last = lifetimes(gm.graph)
    frees: dict[int, list[fx.Node]] = defaultdict(list)
    size: dict[fx.Node, int] = {}
    for n in nodes:
        if roots[n] is n and n.op != "output":
            size[n] = sizer.nbytes(n.meta.get("val"))[0]
            end = len(nodes) if n.op == "placeholder" else last[n]
            frees[end].append(n)
    live = peak = 0
    peak_node = nodes[0].name if nodes else ""
    for i, n in enumerate(nodes):
        live += size.get(n, 0)
        if live > peak:
            peak, peak_node = live, n.name
        live -= sum(size[r] for r in frees.get(i, ()))
    return peak, peak_node


def _param_placement(n: fx.Node, gm: fx.GraphModule, several_dims: bool) -> str:
    """A parameter's placement on the data-parallel dims (the outer dims of a multi-dim mesh
    replicate), then along a plan's dims (tensor, context parallelism)."""
    placement = dtensor_str(n.meta.get(PLACEMENT))
    if several_dims:
        placement = f"({', '.join(['Replicate()'] * (len(gm.meta[MESH_DIMS]) - 1) + [placement])})"
    return placement + "".join(f", {dim}: {p}" for dim, p in n.meta.get(PARAM_PLAN, ()))


def summarize(gm: fx.GraphModule, *, compile_times: Mapping[str, float] | None = None,
              param_info: Mapping[str, Sequence[int]] | None = None,
              size_hints: Mapping[str, int] | None = None,
              notes: Mapping[str, str] | None = None,
              lowered: fx.GraphModule | None = None) -> Summary:
    """Summarize a (compiled) step graph.

    ``param_info`` maps parameter FQN to its global (unsharded) shape, shown next to the local
    one; a parameter whose gradient the step returns (``keep_grads``) counts its local size
    again as persistent gradient memory (every other gradient dies in the step). ``size_hints`` overrides symbol values by name (e.g. ``{"s0": 64}``); by default each
    symbol takes its ShapeEnv hint, i.e. the sizes seen at trace time. ``notes`` are per-pass
    one-liners (what bucketing, overlap, ... did). ``lowered``: the graph that actually runs
    (the eager backend's lowering of ``gm``), for the peak estimate.
    """
    sizer, cache = _Sizer(size_hints), {}
    nodes = list(gm.graph.nodes)
    by_kind: dict[str, CollectiveStat] = {}
    by_bucket: dict[int, BucketStat] = {}  # by number in execution order (bucket_numbers)
    several_dims = len(gm.meta.get(MESH_DIMS) or ()) > 1
    labelled = len(gm.meta.get(MESH_DIMS) or ()) + len(gm.meta.get(PLAN_DIMS) or ()) > 1
    for n in collective_nodes(gm):
        kind = collective_kind(n)
        if labelled:  # on a mesh of several dims: which dim it runs on (a plan's: by name)
            kind = f"{kind} ({collective_dim(gm, n)})"
        nbytes, symbolic = collective_bytes(n, sizer)
        stat = by_kind.setdefault(kind, CollectiveStat(kind, 0, 0, False))
        stat.count += 1
        stat.bytes += nbytes
        stat.batch_dependent |= symbolic
        if n.meta.get(BUCKET) is not None:
            index = bucket_numbers(gm, cache)[int(n.meta[BUCKET])]
            b = by_bucket.setdefault(index, BucketStat(index, "", 0, 0, []))
            b.count += 1
            b.bytes += nbytes
            b.kinds = ", ".join(dict.fromkeys(filter(None, b.kinds.split(", ") + [kind])))
            b.params.extend((n.meta.get(COLLECTIVE) or {}).get("params", []))

    persistent = Counter()
    params = []
    kept_grads = set(gm.meta.get(KEPT_GRADS, ()))  # the step frees every other gradient
    for n in nodes:
        if n.op != "placeholder":
            continue
        role = n.meta.get(ROLE)
        nbytes = sizer.nbytes(n.meta.get("val"))[0]
        if role == Role.PARAM:
            fqn = n.meta.get(PARAM_FQN, n.name)
            val = n.meta.get("val")
            params.append(ParamStat(
                fqn, _param_placement(n, gm, several_dims), tuple(sizer.size(s) for s in val.shape),
                nbytes, tuple(param_info[fqn]) if param_info and fqn in param_info else None))
            persistent["params"] += nbytes
            persistent["grads"] += nbytes if fqn in kept_grads else 0
        elif role == Role.BUFFER:
            persistent["buffers"] += nbytes
        elif role == Role.OPT_STATE:
            persistent["optimizer state"] += nbytes
    persistent_bytes = {k: persistent[k] for k in ("params", "grads", "buffers", "optimizer state")}
    persistent_bytes["total persistent"] = sum(persistent_bytes.values())
    peak, peak_node = estimate_peak_memory(lowered if lowered is not None else gm, sizer)
    workspaces = lowered.meta.get(WORKSPACES, ()) if lowered is not None else ()
    return Summary(
        num_nodes=len(nodes),
        size_hints=dict(sizer.used),
        collectives=sorted(by_kind.values(), key=lambda c: c.kind),
        buckets=[by_bucket[k] for k in sorted(by_bucket)],
        params=params,
        persistent_bytes=persistent_bytes,
        peak_bytes=peak,
        peak_node=peak_node,
        workspace_bytes=sum(nbytes for _, nbytes in workspaces),
        compile_times=dict(compile_times or {}),
        notes={**gm.meta.get(NOTES, {}), **(notes or {})},
        **_per_call(lowered),
        gathers=parameter_gathers(gm, sizer),
        mesh_shape=tuple(gm.meta.get(MESH_SIZES) or ()),
    )


def world_notes(summary: Summary, style: str) -> dict[str, str]:
    """Per figure of ``summary`` (a program built without a process group, at its world size
    N): what a run at another world size changes in it."""
    sharded = style in ("fully_shard", "hybrid_shard")
    shard = (f"this rank's shard, ceil(rows / {summary.mesh_shape[-1]}) rows of each parameter: "
             f"smaller on more ranks" if sharded else "the whole tensor at any world size")
    notes = {"parameters (local shape, size)": shard,
             "params, optimizer state, total persistent": shard,
             "collectives per step": (
                 "the same collectives; an all_gather's output and a reduce_scatter's input are "
                 f"the whole bucket padded to a multiple of {summary.mesh_shape[-1]} rows"
                 if sharded else "the same all_reduces of the whole gradients at any world size"),
             "collectives issued per call": (
                 f"gloo on CPU issues each all_gather as one broadcast per rank of its group "
                 f"({summary.mesh_shape[-1]} here); a "
                 "backend with its own all_gather (NCCL) issues one" if summary.gathers else
                 "the same at any world size"),
             "peak": ("the parameters gathered whole in the step do not change; the shards do"
                      if sharded else "the same at any world size (local batch fixed)")}
    return notes


def parameter_gathers(gm: fx.GraphModule, sizer: _Sizer) -> list[GatherStat]:
    """A GatherStat per parameter all_gather of ``gm``."""
    return [gather_stat(n, sizer) for n in collective_nodes(gm)
            if collective_kind(n).startswith("all_gather")
            and (n.meta.get(COLLECTIVE) or {}).get("params")]


def gather_stat(node: fx.Node, sizer: _Sizer) -> GatherStat:
    """The GatherStat of a parameter all_gather issue node."""
    info = node.meta[COLLECTIVE]
    moved = node.args[0].meta.get("val")
    dtype = info.get("dtype") or str(getattr(moved, "dtype", "?"))
    by = "fsdp_pre_all_gather" if GATHERED in node.meta else "compiler"
    return GatherStat(", ".join(info["params"]), dtype.replace("torch.", ""),
                      collective_bytes(node, sizer)[0], by)


def issued_per_call(lowered: fx.GraphModule) -> int:
    """Collectives one call of the lowered (eager) graph issues: its own (an all_gather lowered
    to one broadcast per rank counts as those broadcasts) plus the per-call agreement between
    ranks (one all_reduce) when the graph awaits it (``passes/rank_check.py``)."""
    from spmd_compiler.runtime.agreement import await_agreement

    return sum(is_collective(n) or n.target is await_agreement for n in lowered.graph.nodes)


def _per_call(lowered: fx.GraphModule | None) -> dict[str, int]:
    """Summary's collectives a call issues, and of them the agreements (none without ``lowered``)."""
    if lowered is None:
        return {}
    return {"issued_per_call": issued_per_call(lowered),
            "agreements_per_call": agreements_per_call(lowered)}


def agreements_per_call(lowered: fx.GraphModule) -> int:
    """Of ``issued_per_call(lowered)``: the per-call agreement between ranks the graph awaits."""
    from spmd_compiler.runtime.agreement import await_agreement

    return sum(n.target is await_agreement for n in lowered.graph.nodes)


def write_summary(summary: Summary, dump_dir: str | Path) -> list[Path]:
    """Write ``summary.txt`` and ``summary.md`` into ``dump_dir``; return their paths."""
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    txt, md = dump_dir / "summary.txt", dump_dir / "summary.md"
    txt.write_text(summary.to_text())
    md.write_text("# Compiled step summary\n\n" + summary.to_markdown())
    return [txt, md]
