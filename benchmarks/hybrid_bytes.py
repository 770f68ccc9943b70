"""Bytes each rank communicates per step under replicate, fully_shard and hybrid_shard on the
same model, per collective kind and mesh dim, for docs/hybrid_shard.md.

    python -m benchmarks.hybrid_bytes [--model gpt] [--nodes 2] [--per-node 2]

The step is compiled for each style without running it (``spmd_compiler.explain``: no process
group needed); the payloads are read off the compiled graph, so they are exact: the tensor of an
``all_reduce``, the gathered output of an ``all_gather``, the full input of a
``reduce_scatter`` (visualize.collective_bytes). "Sent" is what each rank puts on the wire with
the usual ring algorithms over a group of n ranks: (n-1)/n of the payload for all_gather and
reduce_scatter, 2(n-1)/n for all_reduce. The 1-D styles run every collective over all
nodes x per_node ranks; hybrid_shard runs its shard dim (mesh dim 1) inside a node and only its
replicate dim (mesh dim 0) across nodes.
"""

from __future__ import annotations

import argparse
import re

import torch
from tabulate import tabulate

from benchmarks.models import MODELS, make_train_step
from spmd_compiler import DataParallel, explain


def payloads(spec, style: str, world) -> list[tuple[str, int | None, int]]:
    """(kind, mesh dim or None, payload bytes per step) of the compiled step."""
    torch.manual_seed(0)
    model = spec.build()
    opt = spec.optim.build(model.parameters())
    batch = spec.make_batch(torch.Generator().manual_seed(0), spec.batch)
    summary = explain(make_train_step(spec.loss_fn), model, opt, batch,
                      parallel_mode=DataParallel(style), world_size=world)
    out = []
    for c in summary.collectives:
        m = re.fullmatch(r"(\w+)(?: \(mesh dim (\d)\))?", c.kind)
        out.append((m.group(1), int(m.group(2)) if m.group(2) else None, c.bytes))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    args = p.parse_args(argv)
    spec = MODELS[args.model]
    world = args.nodes * args.per_node
    rows = []
    for style in ("replicate", "fully_shard", "hybrid_shard"):
        shape = (args.nodes, args.per_node) if style == "hybrid_shard" else world
        for kind, dim, nbytes in payloads(spec, style, shape):
            if style == "hybrid_shard":
                n = args.per_node if dim == 1 else args.nodes
                where = "within a node" if dim == 1 else "across nodes"
            else:
                n, where = world, "across nodes"
            factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
            rows.append([style, kind, "-" if dim is None else dim, n, where,
                         f"{nbytes / 2**20:.2f}", f"{factor * nbytes / 2**20:.2f}"])
    print(f"{spec.description}; {args.nodes} nodes x {args.per_node} ranks, local batch {spec.batch}")
    print(tabulate(rows, headers=["style", "collective", "mesh dim", "group", "group spans",
                                  "payload MiB/step", "sent per rank MiB/step"]))


if __name__ == "__main__":
    main()
