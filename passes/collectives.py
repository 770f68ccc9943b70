"""What the expansion passes share: the functional collectives' kinds and the small functions
their traced replacement subgraphs are written with (passes/subgraph.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from . import meta
from .subgraph import insert_traced

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.broadcast.default: "broadcast",
}


def collective_meta(params) -> "Callable":
    """``insert_traced``'s ``collective`` for collectives of ``params``' values: their kind by op."""
    return lambda op: dict(kind=COLLECTIVE_OPS[op], params=list(params))


def waited(op, *args):
    """``op(*args)``'s result once it arrived: the functional collective and its wait."""
    return c10d.wait_tensor.default(op(*args))


def to_dtype(x, dtype: torch.dtype):
    """``x.to(dtype)`` as the tracer records it (``aten._to_copy``)."""
    return aten._to_copy.default(x, dtype=dtype)


def finish_reduction(graph: fx.Graph, reduced: fx.Node, users: list[fx.Node], *,
                     divide_by: int | None = None, dtype: torch.dtype | None = None) -> fx.Node:
    """The ops that follow a gradient's collective (the division by the world size when it comes
    after the sum; the cast back from the reduce dtype), inserted just before the first of
    ``users`` in graph order: later passes may move ``reduced`` (bucketing replaces a
    collective's wait by a slice of the bucket's), never past its original users."""
    if not divide_by and dtype is None:
        return reduced

    def finish(x):
        if divide_by:
            x = aten.div.Tensor(x, divide_by)
        return to_dtype(x, dtype) if dtype is not None else x

    pending = set(users)
    first = next((n for n in graph.nodes if n in pending), None)
    return insert_traced(graph, finish, (reduced,), before=first if first is not None else reduced.next,
                         region=reduced.meta.get(meta.REGION))


def replace_inputs(swaps: dict[fx.Node, dict[fx.Node, fx.Node]]) -> None:
    """Each node of ``swaps`` ({user: {old: new}}) reads ``new`` wherever it read ``old``, its
    arguments rewritten once: one ``replace_input_with`` per gradient would rebuild the fused
    optimizer's argument lists (every parameter's) once per parameter."""
    for user, swap in swaps.items():
        user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), lambda a: swap.get(a, a))


def joined(tensor: torch.Tensor, *waited: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself: a graph node that reads ``waited`` (the waits of collectives writing
    into ``tensor``) so that its users run after all of them."""
    return tensor


# In-place ops through which ``.grad`` carries a gradient on to the next backward (autograd's
# accumulation, ``zero_grad(set_to_none=False)``); everything else that uses a gradient reads it.
_ZEROINGS = {aten.zero_.default, aten._foreach_zero_.default, aten.detach_.default}


def carries_gradient_on(user: fx.Node, grad: fx.Node) -> bool:
    """Does ``user`` carry the gradient ``grad`` on to a later backward (autograd adding the next
    backward's gradient to it, or ``zero_grad(set_to_none=False)`` zeroing it in place) rather
    than read it?"""
    if user.target in (aten.add_.Tensor, aten.add.Tensor):
        return user.args[0] is grad and user.meta.get(meta.REGION) == meta.Region.BACKWARD
    if user.target in _ZEROINGS:
        first = user.args[0]
        return first is grad or (isinstance(first, (list, tuple)) and grad in first)
    return False


def mutates(user: fx.Node, value: fx.Node) -> bool:
    """Does ``user`` (an in-place op) write ``value``, its first argument or in its first list?"""
    schema = getattr(user.target, "_schema", None)
    if not (schema and schema.is_mutable and user.args):
        return False
    first = user.args[0]
    return first is value or (isinstance(first, (list, tuple)) and value in first)
