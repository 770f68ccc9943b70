"""Every stage's graph of a few models in every data-parallel style, as comparable text.

    python -m benchmarks.stage_dumps OUT_DIR [--ranks 2]

Runs on ``--ranks`` gloo ranks on loopback (one thread each): SimpleMLP (the demo model) and
three zoo models (tests/zoo.py: a GPT, the BatchNorm ConvNet, an LSTM) under replicate,
fully_shard and hybrid_shard (a 2-D mesh, ``(1, ranks)``), three calls each (the first compile
creates the optimizer state, the second is the steady-state program, the third runs it cached).
Rank 0 writes one text file per compile and stage, ``<model>.<style>/compile_<n>/<NN>_<stage>.txt``,
plus the runnable the eager backend lowered to (``runnable.txt``). Each line is one node: name,
op, target, arguments (nodes by name), the ``spmd_*`` meta keys and the value's shape and dtype,
so two dumps compare node for node with ``diff -r``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("simple_mlp", "mha_gpt_batch_first", "conv1d_batchnorm", "lstm_batch_first")
STYLES = ("replicate", "fully_shard", "hybrid_shard")
CALLS = 3


def _fmt(x) -> str:
    if isinstance(x, torch.fx.Node):
        return "%" + x.name
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in x.items()) + "}"
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}:{x.dtype}"
    return repr(x)


def _val(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)}:{v.dtype}:{v.device.type}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_val(x) for x in v) + "]"
    return type(v).__name__ if v is not None else "None"


def graph_text(gm: torch.fx.GraphModule) -> str:
    """One line per node (see the module docstring), then the graph's own spmd_* meta."""
    lines = []
    for n in gm.graph.nodes:
        keys = {k: n.meta[k] for k in sorted(n.meta) if k.startswith("spmd_")}
        lines.append(f"{n.name} = {n.op} {_target(n)} ({_fmt(n.args)}, {_fmt(n.kwargs)}) "
                     f"meta={_fmt(keys)} val={_val(n.meta.get('val'))}")
    for k in sorted(gm.meta):
        if k.startswith("spmd_"):
            lines.append(f"graph.{k} = {_fmt(gm.meta[k])}")
    return "\n".join(lines) + "\n"


def _target(n: torch.fx.Node) -> str:
    t = n.target
    if isinstance(t, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}"


def _case(name: str, rank: int):
    sys.path.insert(0, str(ROOT))
    from tests import models, zoo

    torch.manual_seed(0)
    if name == "simple_mlp":
        model = models.SimpleMLP()
        gen = torch.Generator().manual_seed(7 + rank)
        batch = lambda b: (torch.randn(b, models.IN_FEATURES, generator=gen),  # noqa: E731
                           torch.randn(b, models.OUT_FEATURES, generator=gen))
        return model, models.train_step, batch, 0
    case = zoo.CASES[name]
    gen = zoo._gen(3, rank)
    return case.build(), case.step, lambda b: case.make_batch(gen, b), case.input_batch_dim


def _run(rank: int, world: int, port: int, out: str, models: tuple[str, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.observe import visualize

    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    written: dict[str, int] = {}
    where = {"dir": None}

    def dump_stage(gm, stage, dump_dir, *, index=None, **_):
        path = Path(where["dir"]) / Path(dump_dir).name / f"{index:02d}_{stage}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(graph_text(gm))
        return [path]

    visualize.dump_stage = dump_stage
    visualize.write_summary = lambda *a, **k: None
    for name in models:
        for style in STYLES:
            model, step_fn, batch, batch_dim = _case(name, rank)
            optim = torch.optim.Adam(model.parameters(), lr=1e-3)
            where["dir"] = os.path.join(out, f"{name}.{style}")
            step = spmd_compile(DataParallel(style, input_batch_dim=batch_dim),
                                dump_dir=os.path.join(out, "_unused"),
                                mesh=mesh_2d if style == "hybrid_shard" else None)(step_fn)
            for call in range(CALLS):
                step(model, optim, batch(4))
                if rank == 0 and step.compile_count > written.get(where["dir"], 0):
                    written[where["dir"]] = step.compile_count
                    run = step.last_compiled.run
                    if isinstance(run, torch.fx.GraphModule):
                        path = Path(where["dir"]) / f"compile_{step.compile_count - 1}" / "runnable.txt"
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(graph_text(run))
            if rank == 0:
                print(f"{name}.{style}: {step.compile_count} compiles", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS))
    a = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(a.ranks, port, a.out, tuple(a.models.split(","))), nprocs=a.ranks)


if __name__ == "__main__":
    main()
