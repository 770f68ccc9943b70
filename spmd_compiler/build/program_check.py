"""Compile-time agreement: after every compile, ranks exchange a description of what they
compiled (or the error they hit) as pickled bytes in one all_reduce: the model, optimizer and
batch structure and the program's sequence of collectives (``describe_program``); any
difference, or any rank's failure, raises a ``RankMismatchError`` on every rank naming the
ranks and the first difference. (The per-call agreement is spmd_compiler/runtime/agreement.py.)
"""

from __future__ import annotations

import re
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from spmd_compiler.passes import meta
from spmd_compiler.passes.expand import collective_dim
from spmd_compiler.passes.rank_check import CARRIER as CARRIER_META

from ..runtime.call_args import StepArgs
from ..runtime.agreement import CARRIER, exchange_objects
from ..errors import RankMismatchError



# A memory address in a repr (a plain object's default one, "<... object at 0x7f...>"): it
# differs on every rank and says nothing about the program.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe_graph(gm: fx.GraphModule, runnable: Any = None) -> dict[str, Any]:
    """The part of ``describe_program`` read off the compiled graph: what it communicates.

    The rest of the graph may differ across ranks. Each rank records the step at its own
    sizes, and a size-dependent branch or a size the trace specializes (a length whose
    shifted targets are one long) gives that rank another computation, as each DDP rank runs its
    own Python; what must not differ is the sequence of collectives, and it does not depend on
    the sizes the program holds as symbols. Each collective, the data-parallel ones and a
    tensor-parallel plan's, is named with the mesh dim it runs on (its group differs from rank
    to rank on a mesh of several dims; its dim must not). With the lowered ``runnable``: the
    all_reduce its per-call check rides in, if any (every rank must join the same one when
    another rank runs no program).
    """
    collectives = [
        (str(n.target), repr(tuple(n.meta["val"].shape)) if hasattr(n.meta.get("val"), "shape") else "()",
         n.meta.get(meta.BUCKET), collective_dim(gm, n))
        for n in gm.graph.nodes if n.meta.get(meta.COLLECTIVE) is not None
        or meta.PLAN_PLACEMENT in n.meta  # a tensor-parallel plan's (issue nodes only)
    ]
    extensions = gm.meta.get(meta.GATHER_EXTENSIONS)
    carrier = getattr(runnable, "meta", {}).get(CARRIER_META)
    return {"collective sequence": collectives, **({CARRIER: carrier} if carrier else {}),
            **({"all-gather extensions (inputs, metadata)": extensions} if extensions else {})}


def describe_program(sa: StepArgs, graph: dict[str, Any],
                     dynamic_dims: dict[int, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """What must be equal across ranks, by name, in the order a difference is reported: the
    step's arguments, then ``graph`` (``describe_graph``). Sizes the program holds as symbols
    (batch dims, ``dynamic_dims``: leaf -> dims) are left out."""
    dynamic_dims = dynamic_dims or {}
    module = sa.module
    optimizers = [
        (type(opt).__name__, [
            sorted((k, repr(v)) for k, v in g.items() if k != "params") + [("params", len(g["params"]))]
            for g in opt.param_groups
        ])
        for opt in sa.optimizers
    ]
    inputs = [
        (tuple(None if j == d or j in dynamic_dims.get(i, ()) else s
               for j, s in enumerate(sa.leaves[i].shape)), d,
         str(sa.leaves[i].dtype), str(sa.leaves[i].device), sa.leaves[i].requires_grad)
        for i, d in zip(sa.input_indices, sa.batch_dims)
    ]
    constants = [
        _ADDRESS.sub("", repr(x)) for j, x in enumerate(sa.leaves)
        if j not in sa.input_indices and j not in sa.module_indices and j not in sa.optimizer_indices
    ]
    return {
        "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in module.named_parameters()],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
        "train/eval mode": [m.training for m in module.modules()],
        "optimizer": optimizers,
        "input structure": str(sa.spec),
        "inputs": inputs,
        "constants": constants,
        **graph,
    }


def agree_on_program(description: dict[str, Any] | Exception, group) -> None:
    """Exchange what each rank compiled (or its compile error); raise on every rank on mismatch."""
    world = dist.get_world_size(group)
    if world == 1:
        if isinstance(description, Exception):
            raise description
        return
    mine = ("error", f"{type(description).__name__}: {description}") \
        if isinstance(description, Exception) else ("ok", description)
    everyone = exchange_objects(mine, group)
    if isinstance(description, Exception):
        raise description
    failed = [(r, msg) for r, (status, msg) in enumerate(everyone) if status == "error"]
    if failed:
        details = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise RankMismatchError(f"compiling the step failed on other ranks: {details}")
    reference = everyone[0][1]
    for r, (_, desc) in enumerate(everyone[1:], start=1):
        for name, value in reference.items():
            if desc.get(name) != value:
                differing = [k for k, (_, d) in enumerate(everyone) if d.get(name) != value]
                raise RankMismatchError(
                    f"ranks disagree on the step's {name}: ranks {differing} differ from rank 0 "
                    f"(rank 0: {_short(value)}; rank {differing[0]}: {_short(desc.get(name))}). "
                    f"Every rank must run the same model, optimizer configuration and batch "
                    f"structure, and take the same Python branches in the step."
                )


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
