"""Training steps written by a grammar, each checked against the eager oracle (``verify``).

A :class:`Case` is drawn from a seed: a model (Linear/LayerNorm/GELU/ReLU/SiLU/Dropout layers,
Conv+BatchNorm, Embedding with tied weights, MultiheadAttention, LSTM), a loss (mse,
cross-entropy, their sum), an optimizer as users write it (SGD with or without momentum and
nesterov, Adam, AdamW; foreach, fused or default; unusual betas, weight decay, two param groups),
and what else real loops do: a gradient penalty (``autograd.grad(create_graph=True)``), a second
module and optimizer (a GAN whose generator's forward is reused after the critic's step), an EMA
copy (lerp or foreach), clipping, a scheduler stepped inside the step, a frozen layer, autocast
to bfloat16, and a Python value the step reads changed between calls (a global number, a module
attribute, a config object replaced or an argument's field assigned in place, a closure's list,
a global function rebound, a layer unfrozen) or differing across ranks.

:func:`script` writes a case as a standalone script: run directly it spawns two gloo ranks; the
tests import it in their workers (:func:`check_job`). Each call of the compiled step is checked
against the step run eagerly with DDP's semantics (``verify_every=1``): a difference raises
``DivergenceError`` on every rank, any other error is a failure too.

    python -m tests.generated_steps --show SEED        # the script of one case
    python -m tests.generated_steps --hunt N --seed S  # N cases from seed S, both styles
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import random
import sys
import tempfile
import time
import traceback

MODELS = ("mlp", "conv", "tokens", "attention", "rnn")
LOSSES = ("mse", "ce", "both")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
IMPLS = ("default", "foreach", "fused")
EXTRAS = ("penalty", "gan", "ema_lerp", "ema_foreach", "clip", "scheduler", "frozen", "groups",
          "autocast")
CHANGES = (None, "global", "attribute", "config_replaced", "closure", "unfreeze", "per_rank",
           "config_mutated", "function_swapped")
STEPS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    model: str
    loss: str
    optimizer: str
    impl: str
    betas: tuple
    weight_decay: float
    extras: tuple
    change: str | None
    act: str
    world: int = 2
    sequence: bool = False  # the sequence sharded over every rank (context parallelism)

    @staticmethod
    def draw(seed: int) -> "Case":
        r = random.Random(seed)
        model = r.choice(MODELS)
        extras = tuple(sorted(e for e in EXTRAS if r.random() < 0.3))
        if model in ("tokens", "rnn", "attention") and "penalty" in extras:  # no input gradient
            extras = tuple(e for e in extras if e != "penalty")
        if "gan" in extras and model != "mlp":
            extras = tuple(e for e in extras if e != "gan")
        case = Case(seed=seed, model=model, loss=r.choice(LOSSES), optimizer=r.choice(OPTIMIZERS),
                    impl=r.choice(IMPLS),
                    betas=r.choice([(0.9, 0.999), (0.0, 0.9), (0.5, 0.99)]),
                    weight_decay=r.choice([0.0, 0.0, 0.01, 0.1]), extras=extras,
                    change=r.choice(CHANGES), act=r.choice(["GELU", "ReLU", "SiLU", "Tanh"]),
                    world=3 if r.random() < 0.15 else 2)
        if model in ("tokens", "attention") and r.random() < 0.35:
            # every rank passes the same rows; a value that differs per rank has no one-device
            # meaning there
            # (bfloat16 autocast left out: a sum over the sequence's pieces rounds each piece
            # to bfloat16, one ulp from one device's sum, beyond any tolerance that still
            # tells a wrong program)
            case = dataclasses.replace(case, sequence=True, change=(
                "global" if case.change == "per_rank" else case.change),
                extras=tuple(e for e in case.extras if e != "autocast"))
        if case.change == "unfreeze" and case.impl == "fused" and case.optimizer in (
                "momentum", "nesterov"):
            # torch's fused SGD cannot start the momentum of some parameters only: eagerly too
            case = dataclasses.replace(case, impl="foreach")
        return case


def _model_source(c: Case) -> str:
    act = f"nn.{c.act}()"
    if c.model == "mlp":
        drop = "nn.Dropout(0.1), " if c.seed % 3 == 0 else ""
        return f"""
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 16), nn.LayerNorm(16), {act}, {drop}
                                  nn.Linear(16, 16), {act}, nn.Linear(16, 16), {act})
        self.head = nn.Linear(16, OUT)
        self.scale = 1.0

    def forward(self, x):
        return self.head(self.body(x)) * self.scale
"""
    if c.model == "conv":
        return f"""
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), {act},
                                  nn.Conv2d(8, 8, 3, padding=1), {act}, nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(32, OUT)
        self.scale = 1.0

    def forward(self, x):
        return self.head(self.body(x).flatten(1)) * self.scale
"""
    if c.model == "tokens":
        return f"""
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(OUT, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), {act}, nn.LayerNorm(16))
        self.head = nn.Linear(16, OUT, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = 1.0

    def forward(self, x):
        return self.head(self.mid(self.emb(x)).mean(1)) * self.scale
"""
    if c.model == "attention":
        return f"""
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Sequential({act}, nn.Linear(16, OUT))
        self.scale = 1.0

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a).mean(1)) * self.scale
"""
    return f"""
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(IN, 16, batch_first=True)
        self.head = nn.Sequential({act}, nn.Linear(16, OUT))
        self.scale = 1.0

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1]) * self.scale
"""


def _data_source(c: Case) -> str:
    shape = {"mlp": "(B, IN)", "conv": "(B, 3, 8, 8)", "tokens": None,
             "attention": "(B, 6, IN)" if c.sequence else "(B, 5, IN)", "rnn": "(B, 4, IN)"}[c.model]
    x = ("torch.randint(0, OUT, (B, 6), generator=g)" if shape is None
         else f"torch.randn(*{shape}, generator=g)")
    return f"""
def data(i, rank):
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = {x}
    return x, torch.randn(B, OUT, generator=g), torch.randint(0, OUT, (B,), generator=g)
"""


def _optimizer_source(c: Case, params: str) -> str:
    impl = {"default": "", "foreach": ", foreach=True", "fused": ", fused=True"}[c.impl]
    wd = f", weight_decay={c.weight_decay}"
    if c.optimizer == "sgd":
        return f"torch.optim.SGD({params}, lr=0.05{wd}{impl})"
    if c.optimizer in ("momentum", "nesterov"):
        nest = ", nesterov=True" if c.optimizer == "nesterov" else ""
        return f"torch.optim.SGD({params}, lr=0.05, momentum=0.9{nest}{wd}{impl})"
    name = "Adam" if c.optimizer == "adam" else "AdamW"
    return f"torch.optim.{name}({params}, lr=1e-2, betas={c.betas}{wd}{impl})"


def _loss_source(c: Case) -> str:
    mse = "F.mse_loss(out, y)"
    ce = "F.cross_entropy(out, labels)"
    return {"mse": mse, "ce": ce, "both": f"{mse} + 0.5 * {ce}"}[c.loss]


def _tolerance(c: Case) -> tuple | None:
    """verify's tolerance: the default, but under bfloat16 autocast the compiled and the eager
    step round differently; Adam then turns a near-zero gradient's rounding into an update of
    either sign (up to 2 x lr = 2e-2 apart); likewise a gradient of round-off only."""
    if "autocast" in c.extras:
        return (2e-2, 2.5e-2) if c.optimizer in ("adam", "adamw") else (2e-2, 2e-3)
    if c.sequence and c.model == "attention" and c.optimizer in ("adam", "adamw"):
        # the key bias of nn.MultiheadAttention gets a gradient of round-off only (softmax
        # ignores it), which Adam makes updates of; attention over the sequence's pieces rounds
        # otherwise than one kernel over the whole
        return (1e-4, 2e-3)
    return None


def _mode(c: Case) -> str:
    if not c.sequence:
        return "DataParallel(style)"
    seq = "(1, None, None)"  # (x, y, labels); a dataclass argument after the batch has none
    return f"DataParallel(style, input_seq_dim={f'({seq}, None)' if c.change == 'config_mutated' else seq})"


def _mesh(c: Case) -> str:
    """The sequence over every rank: a ("dp", "cp") mesh of one data-parallel group."""
    if not c.sequence:
        return ""
    return (",\n                            mesh=init_device_mesh('cpu', (1, dist.get_world_size()), "
            "mesh_dim_names=('dp', 'cp'))")


def script(c: Case) -> str:
    """The case as a standalone script: ``build()`` and, run directly, two gloo ranks."""
    e = set(c.extras)
    params = ("[{'params': [p for n, p in model.named_parameters() if p.ndim > 1]}, "
              "{'params': [p for n, p in model.named_parameters() if p.ndim <= 1], "
              "'weight_decay': 0.0}]" if "groups" in e else "model.parameters()")
    weight = {None: "1.0", "global": "WEIGHT", "attribute": "model.aux_weight",
              "config_replaced": "CFG.weight", "closure": "scale[0]", "unfreeze": "1.0",
              "per_rank": "WEIGHT", "config_mutated": "cfg.weight",
              "function_swapped": "1.0"}[c.change]
    lines = [
        "    opt.zero_grad()",
        "    x, y, labels = batch",
    ]
    if "penalty" in e:
        lines += ["    x = x.requires_grad_(True)"]
    if "autocast" in e:
        lines += ["    with torch.autocast('cpu', dtype=torch.bfloat16):",
                  "        out = model(x).float()"]
    else:
        lines += ["    out = model(x)"]
    if c.change == "function_swapped":  # a global function rebound between calls
        lines += ["    out = ACT_FN(out)"]
    lines += [f"    loss = {weight} * ({_loss_source(c)})"]
    if "penalty" in e:
        lines += ["    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)",
                  "    loss = loss + 0.1 * ((gx.flatten(1).norm(2, dim=1) - 1) ** 2).mean()"]
    if "gan" in e:  # a critic stepped on the output, then the same forward reused through it
        lines += ["    opt_d.zero_grad()",
                  "    d_loss = F.softplus(-critic(y)).mean() + F.softplus(critic(out.detach())).mean()",
                  "    d_loss.backward()",
                  "    opt_d.step()",
                  "    loss = loss + 0.1 * F.softplus(-critic(out)).mean()"]
    lines += ["    loss.backward()"]
    if "clip" in e:
        lines += ["    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)"]
    lines += ["    opt.step()"]
    if "scheduler" in e:
        lines += ["    sched.step()"]
    if "ema_lerp" in e:
        lines += ["    with torch.no_grad():",
                  "        for a, b in zip(ema.parameters(), model.parameters()):",
                  "            a.lerp_(b, 0.1)"]
    if "ema_foreach" in e:
        lines += ["    with torch.no_grad():",
                  "        s, p = list(ema.parameters()), list(model.parameters())",
                  "        torch._foreach_sub_(s, torch._foreach_sub(s, p), alpha=0.1)"]
    lines += ["    return loss.detach()" + (", d_loss.detach()" if "gan" in e else "")]
    args = ["model", "opt", "batch"] + (["critic", "opt_d"] if "gan" in e else []) + (
        ["ema"] if e & {"ema_lerp", "ema_foreach"} else []) + (
        ["cfg"] if c.change == "config_mutated" else [])
    frozen = "\n    model.head.requires_grad_(False)" if "frozen" in e or c.change == "unfreeze" \
        else ""
    if c.change == "per_rank":  # a value each rank computes for itself, as DDP runs it
        frozen += "\n    global WEIGHT\n    WEIGHT = 1.0 + 0.5 * dist.get_rank()"
    sched = ("\n    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)"
             if "scheduler" in e else "")
    critic = ("\n    critic = nn.Sequential(nn.Linear(OUT, 16), nn.LayerNorm(16), nn.GELU(), "
              "nn.Linear(16, 1))\n    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-2, "
              "betas=(0.0, 0.9))" if "gan" in e else "")
    ema = "\n    ema = copy.deepcopy(model).requires_grad_(False)" if e & {"ema_lerp", "ema_foreach"} \
        else ""
    change = {None: "", "global": "\n        global WEIGHT\n        WEIGHT = 1.0 + i",
              "attribute": "\n        model.aux_weight = 1.0 + 0.5 * i",
              "config_replaced": "\n        global CFG\n        CFG = Config(weight=1.0 + i)",
              "closure": "\n        scale[0] = 1.0 + 0.5 * i",
              "unfreeze": "\n        if i == 1:\n            model.head.requires_grad_(True)",
              "per_rank": "",
              "config_mutated": "\n        cfg.weight = 1.0 + 0.5 * i",
              "function_swapped": "\n        global ACT_FN\n        ACT_FN = (F.silu, F.gelu, torch.tanh)[i % 3]"}[c.change]
    return f'''"""Generated training step: {c}."""
import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

IN, OUT, B = 6, 5, 8
WEIGHT = 1.0
ACT_FN = F.silu


@dataclasses.dataclass
class Config:
    weight: float = 1.0


CFG = Config()
{_model_source(c)}
{_data_source(c)}

def build():
    """(the step, its arguments but the batch, a function changing Python values before call i)."""
    torch.manual_seed({c.seed})
    model = Net()
    model.aux_weight = 1.0{frozen}
    opt = {_optimizer_source(c, params)}{sched}{critic}{ema}
    scale, cfg = [1.0], Config()
    step = make_step({"sched" if "scheduler" in e else "None"}, scale)

    def change(i):{change}
        pass

    return step, ({", ".join(a for a in args if a != "batch")}), change


def make_step(sched, scale):
    def train_step({", ".join(args)}):
{chr(10).join("    " + line for line in lines)}
    return train_step


def run(style, steps={STEPS}):
    """Every call checked against the step run eagerly with DDP's semantics."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    step, objs, change = build()
    compiled = spmd_compile({_mode(c)}, verify_every=1,
                            verify_tolerance={_tolerance(c)}{_mesh(c)})(step)
    for i in range(steps):
        change(i)
        batch = data(i, {"0" if c.sequence else "dist.get_rank()"})
        model, opt, *rest = objs
        compiled(model, opt, batch, *rest)
    return compiled.compile_count


def _rank(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for style in ("replicate", "fully_shard"):
            counts = [None] * world
            dist.all_gather_object(counts, run(style))
            if rank == 0:  # one writer: the ranks' lines do not interleave
                for r, n in enumerate(counts):
                    print(r, style, "compiles", n, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=({c.world}, int(sys.argv[1]) if len(sys.argv) > 1 else 29561),
             nprocs={c.world})
'''


def written(c: Case) -> str:
    """Write the case's script to a file of its own (kept for reproducing); return its path."""
    folder = os.path.join(tempfile.gettempdir(), "spmd_generated_steps")
    os.makedirs(folder, exist_ok=True)
    text = script(c)
    path = os.path.join(folder, f"case_{c.seed}_{hashlib.sha1(text.encode()).hexdigest()[:8]}.py")
    with open(path, "w") as f:
        f.write(text)
    return path


def check_job(path: str, style: str) -> dict:
    """On every rank: import the case's script and run it compiled and checked."""
    name = "generated_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    try:
        return dict(compiles=module.run(style), error=None)
    except Exception as e:  # noqa: BLE001 - reported with the case
        return dict(compiles=None, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def check(pools: dict, c: Case, style: str) -> str | None:
    """None if the case trains as the oracle in ``style``, else what went wrong, with the
    command that reproduces it."""
    from tests import generated_steps  # the importable module, also when run as __main__

    path = written(c)
    results = pools[c.world].run(generated_steps.check_job, path, style, timeout=600)
    errors = [r["error"] for r in results if r["error"]]
    if not errors:
        return None
    return (f"generated case {c.seed} ({style}, world {c.world}) failed: reproduce with "
            f"`python {path}` (or `python -m tests.generated_steps --show {c.seed}`):\n{errors[0]}")


def _hunt(count: int, seed: int) -> int:
    from tests.multirank import WorkerPool

    pools = {2: WorkerPool(2), 3: WorkerPool(3)}
    failures, start = [], time.time()
    try:
        for s in range(seed, seed + count):
            c = Case.draw(s)
            for style in ("replicate", "fully_shard"):
                try:
                    problem = check(pools, c, style)
                except Exception as e:  # noqa: BLE001 - a hang or a dead worker
                    problem = f"generated case {s} ({style}): {type(e).__name__}: {e}"
                status = "ok" if problem is None else "FAILED"
                print(f"[{time.time() - start:7.1f}s] case {s} {style}: {status}  {c}", flush=True)
                if problem:
                    failures.append(problem)
                    print(problem, flush=True)
    finally:
        for p in pools.values():
            p.close()
    print(f"{count} cases ({2 * count} compiled steps of {STEPS} checked calls each): "
          f"{len(failures)} failures", flush=True)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hunt", type=int, default=0, help="check N generated cases")
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed")
    parser.add_argument("--show", type=int, default=None, help="print the script of one case")
    args = parser.parse_args(argv)
    if args.show is not None:
        print(script(Case.draw(args.show)))
        return 0
    return _hunt(args.hunt, args.seed)


if __name__ == "__main__":
    sys.exit(main())
