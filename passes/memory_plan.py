"""Static memory plan: the large fixed-size temporaries of a step live at offsets in one reused
workspace instead of coming from malloc every step.

A training step allocates and frees the same large tensors every call: gathered parameters,
weight gradients, gradient buckets, reduced shards. Served by the C library's heap, their mixed
sizes and lifetimes fragment it (the heap of a fully_shard step grew to twice the step's live
bytes), and returned to the operating system they page-fault back in every step. The compiler
knows every such tensor's size and lifetime from the graph, so it packs them into one workspace
once, as compilers for accelerators do: each gets an offset where no tensor that is alive at the
same time overlaps it, and the op writes there through its ``out=`` variant.

The workspace is an input of the graph (one ``workspace`` placeholder per device, named in
``gm.meta[WORKSPACES]``): the graph reads no state of its own. The runtime owns the buffers and
passes them in (spmd_compiler/state/placement.py, ``Workspaces``; the step signature's ``workspaces``).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from spmd_compiler.torch_internals import get_out_arg_names, has_kernel, to_out_variant

from . import meta
from .collectives import aten, c10d, joined

ALIGN = 64
# Functional ops whose out variant is not an overload of the same packet.
_OUT_VARIANTS = {
    c10d.reduce_scatter_tensor.default: c10d.reduce_scatter_tensor_out.default,
    c10d.all_gather_into_tensor.default: c10d.all_gather_into_tensor_out.default,
}
_COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default,
                c10d.reduce_scatter_tensor.default, c10d.reduce_scatter_tensor_out.default,
                c10d.all_reduce.default, c10d.all_reduce_.default, c10d.broadcast_.default,
                c10d.all_to_all_single.default)


def alias_source(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s result is (views, in-place and out= ops, getitem,
    wait_tensor), or None when the node allocates its result."""
    if node.op != "call_function":
        return None
    if node.target in (operator.getitem, c10d.wait_tensor.default, joined):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    alias = schema.returns[0].alias_info.before_set
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    for arg in schema.arguments:
        if arg.alias_info is None:
            continue
        # a list of views (split, unbind, chunk): ``Tensor(a -> *) self``, the list's own
        # alias set empty
        if arg.alias_info.before_set == alias or (not alias and "*" in arg.alias_info.after_set):
            value = values.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def lifetimes(graph: fx.Graph) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """(alias root of every node, last position at which each root's storage is used).

    A storage is used until the last use of any node aliasing it; one given to a collective
    until that collective's wait; one that reaches the graph's output, to the end (position
    ``len(nodes)``).
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    last: dict[fx.Node, int] = {}
    for n in nodes:
        source = alias_source(n)
        root[n] = root[source] if source is not None else n
    for n in nodes:
        r = root[n]
        end = pos[n]
        for u in n.users:
            end = max(end, len(nodes) if u.op == "output" else pos[u])
            if u.target in _COLLECTIVES:
                end = max(end, *(pos[w] for w in u.users))
        last[r] = max(last.get(r, 0), end)
    return root, last


def _static_bytes(val) -> int | None:
    """Bytes of a contiguous tensor of fixed shape (a symbolic size is left to malloc)."""
    if (not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape)
            or not val.is_contiguous()):
        return None
    return val.numel() * val.element_size()


def out_variant(node: fx.Node):
    """The op that writes ``node``'s result into a given tensor (its ``out=`` variant with a
    kernel of its own on the device; ``empty`` itself), or None."""
    if node.target is aten.empty.memory_format:
        return aten.empty.memory_format  # replaced by the workspace view itself
    if node.target in _OUT_VARIANTS:
        return _OUT_VARIANTS[node.target]
    schema = getattr(node.target, "_schema", None)
    if (schema is None or len(schema.returns) != 1 or schema.returns[0].alias_info is not None
            or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)):
        return None
    try:
        out_op = to_out_variant(node.target)
    except RuntimeError:
        return None
    # Only a kernel of the device's own writes into ``out``; the generated fallback
    # (CompositeExplicitAutograd) computes a new tensor and copies it over.
    device = node.meta["val"].device.type.upper()
    if out_op is None or not has_kernel(out_op.name(), device):
        return None
    return out_op


def plan_static_memory(gm: fx.GraphModule, *, min_bytes: int = 2**20) -> fx.GraphModule:
    """Place every fixed-size tensor of at least ``min_bytes`` that the step allocates and does
    not return (a result it returns outlives the step) in the workspace; ops write there
    through their ``out=`` variant, ``empty`` buffers become views of it.

    Offsets: largest first, each at the lowest offset (64-byte aligned) that no tensor alive at
    the same time occupies. Reads: node.meta["val"], op schemas, users. Writes: one workspace
    placeholder per device after the last input (a uint8 buffer of at least the plan's size;
    ``gm.meta[WORKSPACES]``: (device, bytes) of each, in order), a view of it per planned tensor
    (each node's ``val`` computed by its op on the graph's fake values), the planned ops' targets
    and ``out`` arguments; recompiles.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root, last = lifetimes(graph)
    planned: list[tuple[fx.Node, int, object]] = []
    for n in nodes:
        if n.op != "call_function" or root[n] is not n or last[n] >= len(nodes):
            continue
        nbytes = _static_bytes(n.meta.get("val"))
        if nbytes is None or nbytes < min_bytes:
            continue
        out_op = out_variant(n)
        if out_op is not None:
            planned.append((n, nbytes, out_op))
    if not planned:
        return gm
    first = next(n for n in nodes if n.op != "placeholder")
    inputs = [n for n in nodes if n.op == "placeholder"]
    gm.meta[meta.WORKSPACES] = []
    for device in dict.fromkeys(n.meta["val"].device for n, _, _ in planned):
        here = [(n, nbytes, out_op) for n, nbytes, out_op in planned if n.meta["val"].device == device]
        offsets, total = _pack([(pos[n], last[n], -(-nbytes // ALIGN) * ALIGN) for n, nbytes, _ in here])
        mode = getattr(here[0][0].meta["val"], "fake_mode", None) or contextlib.nullcontext()
        with graph.inserting_after(inputs[-1]) if inputs else graph.inserting_before(first):
            ws = graph.placeholder("workspace")
        inputs.append(ws)
        with mode:  # the values the ops give, on the graph's fake tensors
            ws.meta["val"] = torch.empty(total, dtype=torch.uint8, device=device)
        ws.meta[meta.REGION] = meta.Region.FORWARD  # an input, as the step's state is
        gm.meta[meta.WORKSPACES].append((str(device), total))
        for (n, nbytes, out_op), offset in zip(here, offsets):
            val = n.meta["val"]
            with graph.inserting_before(n):
                flat = graph.call_function(aten.slice.Tensor, (ws, 0, offset, offset + nbytes))
                typed = graph.call_function(aten.view.dtype, (flat, val.dtype))
                buf = graph.call_function(aten.view.default, (typed, list(val.shape)))
            for view in (flat, typed, buf):
                with mode:
                    view.meta["val"] = view.target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                                     for a in view.args])
                view.meta[meta.REGION] = n.meta.get(meta.REGION)
            if out_op is aten.empty.memory_format:
                n.replace_all_uses_with(buf)
                graph.erase_node(n)
            else:
                n.target = out_op
                n.kwargs = {**n.kwargs, get_out_arg_names(out_op)[0]: buf}
    graph.lint()
    gm.recompile()
    return gm


def _pack(intervals: list[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Offsets for (start, end, size) intervals so that no two alive at once overlap: largest
    first, each at the lowest free offset; returns the offsets and the total size."""
    order = sorted(range(len(intervals)), key=lambda i: (-intervals[i][2], intervals[i][0]))
    offsets = [0] * len(intervals)
    placed: list[int] = []
    total = 0
    for i in order:
        start, end, size = intervals[i]
        busy = sorted((offsets[j], offsets[j] + intervals[j][2]) for j in placed
                      if intervals[j][0] <= end and start <= intervals[j][1])
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        offsets[i] = offset
        placed.append(i)
        total = max(total, offset + size)
    return offsets, total
