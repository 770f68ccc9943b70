"""Replacement subgraphs traced, not hand-built: a pass writes what it inserts as a plain Python
function of tensors, and ``insert_traced`` records it with ``make_fx`` on the argument nodes'
fake values (in the graph's own fake mode and ShapeEnv) and inlines the recorded ops before a
node, as Inductor's bucketing does (torch/_inductor/fx_passes/bucketing.py). The recording is
pre-dispatch: each op as the function calls it (a ``reshape`` is not decomposed into the view
or copy it does; the memory planner knows it as an alias of its input). Every inserted
node's ``val`` is what its op computed; the pass gives the meta only it knows (REGION, the
collectives' ROLE and COLLECTIVE, a bucket index).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.torch_internals import FakeTensor, FakeTensorMode

from . import meta

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def insert_traced(graph: fx.Graph, fn: Callable[..., Any], args: tuple, *, before: fx.Node,
                  region=None, collective: dict | Callable[[Any], dict] | None = None,
                  **extra) -> Any:
    """Record ``fn(*args)`` and insert its ops before ``before``; its result with each tensor
    replaced by the node computing it (an argument node when ``fn`` returns it unchanged).

    ``args`` may nest nodes (tensor-valued: their ``val`` is what ``fn`` sees) and constants in
    tuples, lists and dicts. Every inserted node gets ``REGION = region``; every functional
    collective and its ``wait_tensor`` ``ROLE = COLLECTIVE`` and the ``extra`` meta; every
    collective that issues communication also ``COLLECTIVE``: ``collective`` (or
    ``collective(op)``) with ``bytes``, the bytes of its result, after ``kind``.

    Reads: the argument nodes' ``val``. Writes: the inserted nodes.
    """
    nodes: list[fx.Node] = []
    fx.node.map_arg(args, nodes.append)
    nodes = list(dict.fromkeys(nodes))
    vals = [n.meta["val"] for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        raise TypeError(f"insert_traced: arguments {[n.name for n in nodes]} must be tensors")

    def traced(*tensors):
        env = dict(zip(nodes, tensors))
        return fn(*fx.node.map_arg(args, env.__getitem__))

    fake_mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if fake_mode is None:  # real values (a hand-written graph): traced on fake copies
        fake_mode = FakeTensorMode()
        vals = [fake_mode.from_tensor(v) for v in vals]
    with fake_mode:
        # pre-dispatch: ops as called (``reshape`` stays one node, as the graph's own do)
        sub = make_fx(traced, pre_dispatch=True)(*vals)
    env: dict[fx.Node, Any] = dict(zip(sub.graph.find_nodes(op="placeholder"), nodes))
    result = None
    with graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
            elif n.op == "call_function" and n.target is torch.ops.aten.detach.default:
                env[n] = env[n.args[0]]
            elif n.op == "call_function":
                env[n] = new = graph.node_copy(n, env.__getitem__)
                new.meta = {"val": n.meta["val"]}
                _tag(new, region, collective, extra)
            elif n.op != "placeholder":
                raise TypeError(f"insert_traced: {fn} recorded a {n.op} node ({n.target})")
    return result


def _tag(node: fx.Node, region, collective: dict | None, extra: dict) -> None:
    if region is not None:
        node.meta[meta.REGION] = region
    if getattr(node.target, "namespace", None) != "_c10d_functional":
        return
    node.meta[meta.ROLE] = meta.Role.COLLECTIVE
    node.meta.update(extra)
    if collective is not None and node.target is not _WAIT:
        info = dict(collective(node.target) if callable(collective) else collective)
        node.meta[meta.COLLECTIVE] = {"kind": info.pop("kind", None),
                                      "bytes": tensor_bytes(node.meta["val"]), **info}


def tensor_bytes(val) -> int | None:
    """Bytes of a (fake) tensor, or None when its size is symbolic."""
    try:
        return int(val.numel()) * val.element_size()
    except (TypeError, ValueError, RuntimeError):
        return None
