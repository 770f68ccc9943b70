"""In place: let the eager backend reduce gradient buckets in the buffer it just built, build
that buffer without copies (``produce_into_buckets``: each gradient written into its slice), and
gather parameters into a buffer it allocates (``gather_into_preallocated``).

The expanded graph is functional: ``div`` makes a new tensor and ``all_reduce`` clones its input
before reducing it. For a bucket (``cat`` of gradients, ``div`` by the world size, ``all_reduce``)
that is three full passes over the gradient bytes where DDP does two. Inductor reuses such
buffers itself; this pass does the same for the eager backend's FX graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_compiler.torch_internals import get_out_arg_names

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


def produce_into_buckets(gm: fx.GraphModule, out_variant) -> fx.GraphModule:
    """Let each gradient bucket's members be produced straight into their slice of it (DDP's
    ``gradient_as_bucket_view``): for a bucket ``cat([g.view(-1), ...])`` (1-D, dim 0, of a
    static size) an ``empty`` buffer made before its first member's op, which writes into its
    slice through its ``out=`` variant (``out_variant(node)``, None: it has none); a member
    made otherwise (or read by anything else) is copied into its slice where the ``cat`` was.
    The ``cat`` then is the buffer: bucketing copies nothing for the members made in place.

    Reads: cat nodes, their inputs' producers and users, meta["val"]. Writes: the buffer and
    slice nodes, the producers' targets and ``out`` arguments, the copies; recompiles.
    """
    changed = False
    for cat in list(gm.graph.nodes):
        if cat.target is aten.cat.default and _flat_bucket(cat):
            changed |= _build_in_place(gm.graph, cat, out_variant)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _flat_bucket(cat: fx.Node) -> bool:
    """A 1-D ``cat`` along dim 0 of a static size whose result is reduced in place."""
    val = cat.meta.get("val")
    return (cat.args[1:] in ((), (0,)) and isinstance(val, torch.Tensor) and val.dim() == 1
            and isinstance(val.numel(), int) and len(cat.users) == 1
            and next(iter(cat.users)).target in (aten.div_.Tensor, c10d.all_reduce_.default))


_VIEWS = (aten.detach.default, aten.alias.default, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.permute.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default)


def _contiguous(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _producer(member: fx.Node, out_variant, dtype: torch.dtype):
    """(the op whose contiguous result ``member`` flattens, through contiguous views of it,
    its out= variant) when nothing else reads any of them; else None."""
    if member.target not in (aten.view.default, aten.reshape.default) or len(member.users) != 1:
        return None
    made = member.args[0]
    if not isinstance(made, fx.Node) or not _contiguous(made):
        return None
    # views that keep the storage offset: a contiguous one over a contiguous base of as many
    # elements holds them in the base's order (t(t(mm)) does; t(mm) alone does not)
    while made.target in _VIEWS and len(made.users) == 1 and isinstance(made.args[0], fx.Node):
        made = made.args[0]
    val = made.meta.get("val") if isinstance(made, fx.Node) else None
    if not isinstance(val, torch.Tensor) or len(made.users) != 1 or made.op != "call_function" \
            or not val.is_contiguous() or val.dtype != dtype or made.target is aten.empty.memory_format:
        return None
    out_op = out_variant(made)
    return (made, out_op) if out_op is not None else None


def _build_in_place(graph: fx.Graph, cat: fx.Node, out_variant) -> bool:
    """Rewrite one bucket ``cat`` (see ``produce_into_buckets``); False when no member's op can
    write into it."""
    val = cat.meta["val"]
    members = list(cat.args[0])
    made = [_producer(m, out_variant, val.dtype) for m in members]
    if not any(made):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((p for p, _ in filter(None, made)), key=order.__getitem__)
    with graph.inserting_before(first):
        buf = graph.call_function(aten.empty.memory_format, ([val.numel()],),
                                  {"dtype": val.dtype, "device": val.device})
    buf.meta.update({"val": val.new_empty(val.numel()), meta.REGION: first.meta.get(meta.REGION)})
    offset = 0
    for member, producer in zip(members, made):
        size = member.meta["val"].numel()
        before = producer[0] if producer else cat
        with graph.inserting_before(before):
            part = graph.call_function(aten.slice.Tensor, (buf, 0, offset, offset + size))
            part.meta["val"] = val.new_empty(size)
            if producer:
                node, out_op = producer
                shaped = graph.call_function(aten.view.default, (part, list(node.meta["val"].shape)))
                shaped.meta["val"] = node.meta["val"]
                node.target, node.kwargs = out_op, {**node.kwargs, get_out_arg_names(out_op)[0]: shaped}
            else:
                copied = graph.call_function(aten.copy_.default, (part, member))
                copied.meta["val"] = part.meta["val"]
        for n in (part, *([shaped] if producer else [])):
            n.meta[meta.REGION] = before.meta.get(meta.REGION)
        offset += size
    cat.replace_all_uses_with(buf)
    graph.erase_node(cat)
    for member, producer in zip(members, made):
        while producer and member is not producer[0] and not member.users:
            member, _ = member.args[0], graph.erase_node(member)
    return True
