"""Identity views: drop the views that give back their input's own layout from the eager
program (the backward's ``detach`` of every gradient, a linear layer's weight transposed
twice, a bias gradient viewed as its own shape). Each is a call the runnable would make on
every step for nothing."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def skip_identity_views(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``detach(x)``, ``t(t(x))`` (``x`` two-dimensional) and a ``view``/``reshape`` of
    ``x`` to its own static shape by ``x`` where the view is not a graph output; erase views
    left unused.

    Such a view shares ``x``'s storage, sizes, strides and offset, so every reader sees the
    same values, and an in-place op through either writes the same memory; only autograd
    metadata differs, and the eager program runs without autograd. Outputs keep their view (a
    caller may hold it). Run last, on the lowered graph.

    Reads: node targets, meta["val"], users. Writes: node uses; erases nodes; recompiles.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        source = _identity_source(node)
        if source is None or any(u.op == "output" for u in node.users):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node.target in (
                aten.t.default, aten.detach.default, *_RESHAPES):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


_RESHAPES = (aten.view.default, aten.reshape.default)


def _identity_source(node: fx.Node) -> fx.Node | None:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is aten.detach.default:
        return node.args[0]
    if node.target in _RESHAPES and not node.kwargs:
        val, shape = node.args[0].meta.get("val"), list(node.args[1])
        if isinstance(val, torch.Tensor) and all(type(s) is int for s in val.shape) and (
                shape == list(val.shape) or (shape == [-1] and val.dim() == 1)):
            return node.args[0]
    inner = node.args[0] if node.target is aten.t.default else None
    if isinstance(inner, fx.Node) and inner.target is aten.t.default \
            and isinstance(inner.args[0], fx.Node):
        val = inner.args[0].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 2:
            return inner.args[0]
    return None
