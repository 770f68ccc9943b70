"""In place: let the eager backend reduce gradient buckets in the buffer it just built, and
gather parameters into a buffer it allocates (``gather_into_preallocated``).

The expanded graph is functional: ``div`` makes a new tensor and ``all_reduce`` clones its input
before reducing it. For a bucket (``cat`` of gradients, ``div`` by the world size, ``all_reduce``)
that is three full passes over the gradient bytes where DDP does two. Inductor reuses such
buffers itself; this pass does the same for the eager backend's FX graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import meta
from .collectives import aten, c10d

_INPLACE = {
    aten.div.Tensor: aten.div_.Tensor,
    c10d.all_reduce.default: c10d.all_reduce_.default,
}


def reduce_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn ``div`` and ``all_reduce`` into ``div_`` / ``all_reduce_`` where their input is a
    temporary that nothing else reads (e.g. a bucket's ``cat``), so no new buffer is made.

    Reads: node targets, users and op schemas. Writes: the targets of those nodes; recompiles.
    """
    for node in gm.graph.nodes:
        inplace = _INPLACE.get(node.target)
        if inplace is None or not owned_temporary(node.args[0], node):
            continue
        if node.target is aten.div.Tensor and not (
            isinstance(node.args[1], (int, float)) and _same_tensor_type(node, node.args[0])
            and not _overlaps_itself(node.args[0])
        ):
            continue  # dividing by a tensor may broadcast or promote, an expanded view holds one
            # element for several: not in place
        node.target = inplace
    gm.graph.lint()
    gm.recompile()
    return gm


def gather_into_preallocated(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn each ``all_gather_into_tensor(x, n, group)`` into ``all_gather_into_tensor_out`` on
    an ``empty`` output made just before it.

    The functional form reaches gloo through ``allgather_into_tensor_coalesced`` (gloo's
    coalesced all-gather, with its own flat copies); the ``out`` form through ``_allgather_base``,
    the plain all-gather DDP and FSDP use. Same values, same wait.

    Reads: all_gather_into_tensor nodes and their meta["val"]. Writes: one ``empty`` node per
    gather, the gather's target and kwargs; recompiles.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.target is not c10d.all_gather_into_tensor.default or not isinstance(val, torch.Tensor):
            continue
        try:
            shape = [int(d) for d in val.shape]
        except (TypeError, ValueError):
            continue  # a symbolic size: leave the functional form
        with graph.inserting_before(node):
            out = graph.call_function(aten.empty.memory_format, (shape,),
                                      {"dtype": val.dtype, "device": val.device})
        out.meta["val"] = val
        if meta.REGION in node.meta:
            out.meta[meta.REGION] = node.meta[meta.REGION]
        node.target = c10d.all_gather_into_tensor_out.default
        node.kwargs = {"out": out}
    graph.lint()
    gm.recompile()
    return gm


def _same_tensor_type(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.dtype.is_floating_point and list(map(str, va.shape)) == list(map(str, vb.shape)))


def _overlaps_itself(node: fx.Node) -> bool:
    """Does ``node``'s value hold one memory location for several elements (a stride 0 over a
    dim of more than one element, as ``expand`` makes)? An in-place write then fails."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return True
    return any(str(st) == "0" and str(size) != "1" for size, st in zip(val.shape, val.stride()))


def owned_temporary(value, reader: fx.Node) -> bool:
    """Is ``value`` a fresh tensor made in the graph whose only reader is ``reader``, following
    in-place and view ops back to the op that allocated it (each read by the next alone)?"""
    while True:
        if not isinstance(value, fx.Node) or value.op != "call_function" or list(value.users) != [reader]:
            return False
        schema = getattr(value.target, "_schema", None)
        if schema is None or len(schema.returns) != 1 or value.target in (c10d.wait_tensor.default,):
            return False
        if schema.returns[0].alias_info is None:
            return isinstance(value.meta.get("val"), torch.Tensor)
        # an in-place op or a view (e.g. a reduce_scatter bucket's flattening view of its cat)
        # of a tensor that, in turn, nobody else reads
        reader, value = value, value.args[0]
