"""Steps holding several modules and optimizers, several backward calls and double backward,
checked against real torch on real gloo groups.

References: DDP on each trainable module (``DDP(G)``, ``DDP(D)``) with the same step function,
frozen, EMA and target copies left plain as DDP users leave them (a layer shared by two modules:
one process on the concatenated global batch; bf16: FSDP2 on each module). Every case runs
several steps with different data per rank and compares, on every rank, every module's
parameters and buffers (the EMA / teacher / target copies included; a sharded parameter by its
``full_tensor()``), every optimizer's state and the returned losses; then checks the placements,
calls each module outside the step, saves every module and optimizer, loads them into fresh
ones and trains on against the same references. replicate and fully_shard at 2 ranks,
hybrid_shard on a 2 x 2 mesh at 4.

Tolerances (float32 round-off): ``|actual - expected| <= ATOL + RTOL * |expected|``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.multirank import ParityChecker, SelectedCases, rank_data

RTOL = 1e-5
ATOL = 1e-6
STEPS = 4
RESUMED = 2  # steps after saving and loading into fresh modules and optimizers
BATCH = 8


# ------------------------------------------------------------------------------------------------
# Models and steps, written as their libraries write them


def _mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class GAN(nn.Module):
    """A generator and a discriminator in one parent module (the wrapping users were told to do)."""

    def __init__(self):
        super().__init__()
        self.G = _mlp(4, 16, 8)
        self.D = _mlp(8, 16, 1)

    def forward(self, z):
        return self.D(self.G(z))


def gan_parent_step(gan, opt_g, opt_d, batch):
    """Two optimizers, two backward calls in one parent module."""
    return gan_step(gan.G, gan.D, opt_g, opt_d, batch)


def gan_step(G, D, opt_g, opt_d, batch):
    """The discriminator's step, then the generator's: two backward calls; ``D``'s gradients
    from the generator's backward are left in ``.grad`` and never used."""
    real, z = batch
    opt_d.zero_grad()
    fake = G(z)
    d_loss = (F.softplus(-D(real)) + F.softplus(D(fake.detach()))).mean()
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = F.softplus(-D(fake)).mean()
    g_loss.backward()
    opt_g.step()
    return d_loss.detach(), g_loss.detach()


def gan_clip_step(G, D, opt_g, opt_d, batch):
    """The GAN with the discriminator's gradients clipped in place before its step (the
    generator's backward then adds to the clipped ones, which nothing reads)."""
    real, z = batch
    opt_d.zero_grad()
    fake = G(z)
    d_loss = (F.softplus(-D(real)) + F.softplus(D(fake.detach()))).mean()
    d_loss.backward()
    torch.nn.utils.clip_grad_norm_(D.parameters(), 0.05)
    opt_d.step()
    opt_g.zero_grad()
    g_loss = F.softplus(-D(fake)).mean()
    g_loss.backward()
    opt_g.step()
    return d_loss.detach(), g_loss.detach()


def gan_dict_step(nets, opts, batch):
    """The GAN with its modules in a dict and its optimizers in a tuple."""
    return gan_step(nets["G"], nets["D"], opts[0], opts[1], batch)


def wgan_gp_step(G, D, opt_g, opt_d, batch, lam=10.0):
    """WGAN-GP: a gradient penalty by ``autograd.grad(create_graph=True)``, a double backward."""
    real, z, eps = batch
    opt_d.zero_grad()
    fake = G(z).detach()
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grads,) = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
    penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    d_loss = D(fake).mean() - D(real).mean() + lam * penalty
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = -D(G(z)).mean()
    g_loss.backward()
    opt_g.step()
    return d_loss.detach(), g_loss.detach()


def wgan_gp_reused_step(G, D, opt_g, opt_d, batch, lam=10.0):
    """WGAN-GP as commonly written: one forward of ``G``, detached for the critic's loss and its
    penalty, then reused for the generator's loss after the critic's ``step()``."""
    real, z, eps = batch
    fake = G(z)
    opt_d.zero_grad()
    x_hat = (eps * real + (1 - eps) * fake.detach()).requires_grad_(True)
    (grads,) = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
    penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    d_loss = D(fake.detach()).mean() - D(real).mean() + lam * penalty
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = -D(fake).mean()
    g_loss.backward()
    opt_g.step()
    return d_loss.detach(), g_loss.detach()


def input_gradient_penalty_step(model, opt, batch, lam=1.0):
    """One model, a penalty on its input gradient's norm (a double backward through every layer)."""
    x, y = batch
    opt.zero_grad()
    x = x.requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.mse_loss(out, y) + lam * ((g.norm(2, dim=1) - 1) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def ema_lerp_step(model, ema, opt, batch, decay=0.9):
    """timm's ModelEmaV3 update: ``lerp_`` of every EMA parameter towards the model's."""
    x, y = batch
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1.0 - decay)
    return loss.detach()


def ema_foreach_step(model, ema, opt, batch, decay=0.9):
    """diffusers' EMAModel update: ``s -= (1 - decay) * (s - p)`` over all parameters at once."""
    x, y = batch
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        shadow, params = list(ema.parameters()), list(model.parameters())
        torch._foreach_sub_(shadow, torch._foreach_sub(shadow, params), alpha=1.0 - decay)
    return loss.detach()


def distill_step(student, teacher, opt, batch, temperature=2.0):
    """Knowledge distillation from a frozen teacher in eval mode."""
    x, y = batch
    opt.zero_grad()
    with torch.no_grad():
        soft = F.softmax(teacher(x) / temperature, dim=-1)
    logits = student(x)
    kd = F.kl_div(F.log_softmax(logits / temperature, dim=-1), soft, reduction="batchmean")
    loss = F.cross_entropy(logits, y) + kd
    loss.backward()
    opt.step()
    return loss.detach()


@dataclasses.dataclass
class Distillation:
    """What a distillation step needs besides its student: a dataclass argument."""

    teacher: nn.Module
    temperature: float = 2.0


def distill_dataclass_step(student, opt, batch, kd):
    """Distillation with the frozen teacher in a dataclass argument."""
    return distill_step(student, kd.teacher, opt, batch, kd.temperature)


def autoencoder_step(encoder, decoder, opt, x):
    """An encoder and a decoder passed separately, one optimizer over both."""
    opt.zero_grad()
    loss = F.mse_loss(decoder(encoder(x)), x)
    loss.backward()
    opt.step()
    return loss.detach()


def actor_critic_step(actor, critic, opt_a, opt_c, batch):
    """A critic's step, then an actor's on the critic's detached advantage."""
    obs, action, ret = batch
    opt_c.zero_grad()
    value = critic(obs).squeeze(-1)
    critic_loss = F.mse_loss(value, ret)
    critic_loss.backward()
    opt_c.step()
    opt_a.zero_grad()
    advantage = ret - value.detach()
    logp = F.log_softmax(actor(obs), dim=-1).gather(1, action[:, None]).squeeze(1)
    actor_loss = -(logp * advantage).mean()
    actor_loss.backward()
    opt_a.step()
    return critic_loss.detach(), actor_loss.detach()


def target_network_step(online, target, opt, batch, tau=0.1):
    """BYOL / soft DQN: regress on a target network's output, then move the target towards the
    online network (``mul_`` + ``add_``)."""
    x, x2 = batch
    opt.zero_grad()
    with torch.no_grad():
        goal = target(x2)
    loss = F.mse_loss(online(x), goal)
    loss.backward()
    opt.step()
    with torch.no_grad():
        for t, o in zip(target.parameters(), online.parameters()):
            t.mul_(1.0 - tau).add_(o, alpha=tau)
    return loss.detach()


class _Pair:
    def __init__(self, G, D):
        self.G, self.D = G, D


def _ddp(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module)


def _frozen(module: nn.Module) -> nn.Module:
    """A copy nothing trains (an EMA copy, a teacher, a target network)."""
    copy_ = copy.deepcopy(module)
    for p in copy_.parameters():
        p.requires_grad_(False)
    return copy_


def _adam(*modules: nn.Module, **kw) -> torch.optim.Optimizer:
    params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    return torch.optim.Adam(params, **{"lr": 1e-2, "betas": (0.5, 0.9), **kw})


def _gan_parts():
    torch.manual_seed(0)
    ours = {"G": _mlp(4, 16, 8), "D": _mlp(8, 16, 1)}
    ref = copy.deepcopy(ours)
    return ours, ref


def _gan_data(i, eps=False):
    real, z = rank_data(10 + i, (BATCH, 8), (BATCH, 4))
    return (real, z, rank_data(50 + i, (BATCH, 1)).abs().clamp(max=1.0)) if eps else (real, z)


def _gan_parent(style: str) -> dict:
    torch.manual_seed(0)
    gan = GAN()
    ref = copy.deepcopy(gan)
    ref_pair = _Pair(_ddp(ref.G), _ddp(ref.D))
    opts = [_adam(gan.G), _adam(gan.D)]
    ref_opts = [_adam(ref.G), _adam(ref.D)]
    return dict(step=gan_parent_step, args=lambda b: (gan, *opts, b),
                ref_args=lambda b: (ref_pair, *ref_opts, b), data=_gan_data,
                modules={"gan": (gan, ref)}, optimizers=list(zip(opts, ref_opts)))


def _two_optimizer_gan(step, eps=False):
    def build(style: str) -> dict:
        ours, ref = _gan_parts()
        G, D = ours["G"], ours["D"]
        opts, ref_opts = [_adam(G), _adam(D)], [_adam(ref["G"]), _adam(ref["D"])]
        wrapped = (_ddp(ref["G"]), _ddp(ref["D"]))
        return dict(step=step, args=lambda b: (G, D, *opts, b),
                    ref_args=lambda b: (*wrapped, *ref_opts, b),
                    data=lambda i: _gan_data(i, eps),
                    modules={k: (ours[k], ref[k]) for k in ours},
                    optimizers=list(zip(opts, ref_opts)))
    return build


def _wgan_gp_reused(style: str) -> dict:
    """A critic ``Linear -> LayerNorm -> GELU -> Linear`` with Adam(betas=(0.0, 0.9)); the
    generator's first layer is shaped like the critic's (one block in two modules)."""
    torch.manual_seed(0)
    ours = {"G": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)),
            "D": nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))}
    ref = copy.deepcopy(ours)
    G, D = ours["G"], ours["D"]
    opts = [_adam(G, betas=(0.0, 0.9)), _adam(D, betas=(0.0, 0.9))]
    ref_opts = [_adam(ref["G"], betas=(0.0, 0.9)), _adam(ref["D"], betas=(0.0, 0.9))]
    wrapped = (_ddp(ref["G"]), _ddp(ref["D"]))
    return dict(step=wgan_gp_reused_step, args=lambda b: (G, D, *opts, b),
                ref_args=lambda b: (*wrapped, *ref_opts, b), data=lambda i: _gan_data(i, True),
                modules={k: (ours[k], ref[k]) for k in ours}, optimizers=list(zip(opts, ref_opts)))


def _input_gradient_penalty(style: str) -> dict:
    """Bias-free layers 12 -> 16 -> 16 -> 16 -> 5 (two alike: repeated blocks), plain SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in
                            [(12, 16), (16, 16), (16, 16), (16, 5)]))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    wrapped = _ddp(ref)
    return dict(step=input_gradient_penalty_step, args=lambda b: (model, opt, b),
                ref_args=lambda b: (wrapped, ref_opt, b),
                data=lambda i: rank_data(90 + i, (BATCH, 12), (BATCH, 5)),
                modules={"model": (model, ref)}, optimizers=[(opt, ref_opt)])


def _gan_dict(style: str) -> dict:
    ours, ref = _gan_parts()
    opts, ref_opts = (_adam(ours["G"]), _adam(ours["D"])), (_adam(ref["G"]), _adam(ref["D"]))
    wrapped = {"G": _ddp(ref["G"]), "D": _ddp(ref["D"])}
    return dict(step=gan_dict_step, args=lambda b: (ours, opts, b),
                ref_args=lambda b: (wrapped, ref_opts, b), data=_gan_data,
                modules={k: (ours[k], ref[k]) for k in ours},
                optimizers=list(zip(opts, ref_opts)))


def _with_copy(step, make_copy, model_sizes, data):
    """A trained model and a copy of it nothing trains (EMA, teacher, target)."""
    def build(style: str) -> dict:
        torch.manual_seed(0)
        model = _mlp(*model_sizes)
        other = make_copy(model)
        ref, ref_other = copy.deepcopy(model), copy.deepcopy(other)
        opt, ref_opt = _adam(model), _adam(ref)
        wrapped = _ddp(ref)
        names = list(inspect.signature(step).parameters)[:2]
        return dict(step=step, args=lambda b: (model, other, opt, b),
                    ref_args=lambda b: (wrapped, ref_other, ref_opt, b), data=data,
                    modules={names[0]: (model, ref), names[1]: (other, ref_other)},
                    optimizers=[(opt, ref_opt)])
    return build


def _teacher(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    teacher = _frozen(_mlp(8, 32, 5)).eval()
    return teacher


def _regression_data(i):
    return rank_data(20 + i, (BATCH, 8), (BATCH, 4))


def _class_data(i):
    return rank_data(30 + i, (BATCH, 8)), rank_data(31 + i, BATCH, dtype=torch.int64, high=5)


def _pair_data(i):
    return rank_data(40 + i, (BATCH, 8), (BATCH, 8))


def _distill_dataclass(style: str) -> dict:
    torch.manual_seed(0)
    student = _mlp(8, 16, 5)
    teacher = _teacher(student)
    ref, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    opt, ref_opt = _adam(student), _adam(ref)
    kd, ref_kd = Distillation(teacher), Distillation(ref_teacher)
    wrapped = _ddp(ref)
    return dict(step=distill_dataclass_step, args=lambda b: (student, opt, b, kd),
                ref_args=lambda b: (wrapped, ref_opt, b, ref_kd), data=_class_data,
                modules={"student": (student, ref), "kd.teacher": (teacher, ref_teacher)},
                optimizers=[(opt, ref_opt)])


def _autoencoder(style: str) -> dict:
    torch.manual_seed(0)
    enc, dec = _mlp(8, 16, 3), _mlp(3, 16, 8)
    ref_enc, ref_dec = copy.deepcopy(enc), copy.deepcopy(dec)
    opt, ref_opt = _adam(enc, dec), _adam(ref_enc, ref_dec)
    wrapped = (_ddp(ref_enc), _ddp(ref_dec))
    return dict(step=autoencoder_step, args=lambda b: (enc, dec, opt, b),
                ref_args=lambda b: (*wrapped, ref_opt, b),
                data=lambda i: rank_data(60 + i, (BATCH, 8)),
                modules={"encoder": (enc, ref_enc), "decoder": (dec, ref_dec)},
                optimizers=[(opt, ref_opt)])


class _Half(nn.Module):
    """One half of an autoencoder: its own layer around a layer shared with the other half."""

    def __init__(self, width_in: int, shared: nn.Linear, width_out: int):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(width_in, 16), shared, nn.Linear(16, width_out)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.inp(x)))))


def _tied_autoencoder(style: str) -> dict:
    """An encoder and a decoder sharing one layer (one parameter of two modules), against one
    process on the concatenated global batch (the mean loss over it is the mean of the ranks'
    mean losses)."""
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    enc, dec = _Half(8, shared, 3), _Half(3, shared, 8)
    ref_enc = copy.deepcopy(enc)
    ref_dec = _Half(3, ref_enc.shared, 8)
    ref_dec.load_state_dict(dec.state_dict())
    opt, ref_opt = _adam(enc, dec), _adam(ref_enc, ref_dec)
    data = lambda i, rank=None: rank_data(80 + i, (BATCH, 8), rank=rank)  # noqa: E731
    return dict(step=autoencoder_step, args=lambda b: (enc, dec, opt, b),
                ref_args=lambda b: (ref_enc, ref_dec, ref_opt, b), data=data,
                global_data=lambda i: torch.cat([data(i, r) for r in range(dist.get_world_size())]),
                modules={"encoder": (enc, ref_enc), "decoder": (dec, ref_dec)},
                optimizers=[(opt, ref_opt)])


def _actor_critic(style: str) -> dict:
    torch.manual_seed(0)
    actor, critic = _mlp(6, 16, 3), _mlp(6, 16, 1)
    ref_actor, ref_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    opts = [_adam(actor), torch.optim.SGD(critic.parameters(), lr=0.05, momentum=0.9)]
    ref_opts = [_adam(ref_actor), torch.optim.SGD(ref_critic.parameters(), lr=0.05, momentum=0.9)]
    wrapped = (_ddp(ref_actor), _ddp(ref_critic))

    def data(i):
        obs, ret = rank_data(70 + i, (BATCH, 6), BATCH)
        return obs, rank_data(71 + i, BATCH, dtype=torch.int64, high=3), ret

    return dict(step=actor_critic_step, args=lambda b: (actor, critic, *opts, b),
                ref_args=lambda b: (*wrapped, *ref_opts, b), data=data,
                modules={"actor": (actor, ref_actor), "critic": (critic, ref_critic)},
                optimizers=list(zip(opts, ref_opts)))


CASES = {
    "gan_parent": _gan_parent,
    "gan": _two_optimizer_gan(gan_step),
    "gan_dict": _gan_dict,
    "gan_clip": _two_optimizer_gan(gan_clip_step),
    "wgan_gp": _two_optimizer_gan(wgan_gp_step, eps=True),
    "wgan_gp_reused": _wgan_gp_reused,
    "input_gradient_penalty": _input_gradient_penalty,
    "ema_lerp": _with_copy(ema_lerp_step, _frozen, (8, 16, 4), _regression_data),
    "ema_foreach": _with_copy(ema_foreach_step, _frozen, (8, 16, 4), _regression_data),
    "distill": _with_copy(distill_step, _teacher, (8, 16, 5), _class_data),
    "distill_dataclass": _distill_dataclass,
    "target_network": _with_copy(target_network_step, _frozen, (8, 16, 8), _pair_data),
    "autoencoder": _autoencoder,
    "tied_autoencoder": _tied_autoencoder,
    "actor_critic": _actor_critic,
}


# ------------------------------------------------------------------------------------------------
# Worker side


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(chk: ParityChecker, step: int, case: dict) -> None:
    """Every module's parameters and buffers, every optimizer's state (by parameter name)."""
    names = {}
    for mname, (ours, ref) in case["modules"].items():
        params, ref_params = dict(ours.named_parameters()), dict(ref.named_parameters())
        chk.check(list(params) == list(ref_params), f"step {step}: {mname} parameter names")
        for n, p in params.items():
            chk.close("param", f"step {step}: {mname}.{n}", _full(p), _full(ref_params[n]))
            names[id(p)] = f"{mname}.{n}"
        ref_buffers = dict(ref.named_buffers())
        for n, b in ours.named_buffers():
            chk.close("buffer", f"step {step}: buffer {mname}.{n}", _full(b), _full(ref_buffers[n]))
    for k, (opt, ref_opt) in enumerate(case["optimizers"]):
        ours = [p for g in opt.param_groups for p in g["params"]]
        theirs = [p for g in ref_opt.param_groups for p in g["params"]]
        for p, q in zip(ours, theirs):
            st, ref_st = opt.state.get(p, {}), ref_opt.state.get(q, {})
            where = f"step {step}: optimizer {k} state of {names.get(id(p), '?')}"
            chk.check(sorted(st) == sorted(ref_st), f"{where}: keys {sorted(st)} vs {sorted(ref_st)}")
            for key in ref_st:
                if key in st:
                    chk.close("state", f"{where}.{key}", _full(st[key]), _full(ref_st[key]))


def _placements_ok(chk: ParityChecker, case: dict, style: str) -> None:
    """Every module's parameters (trained or not) are DTensors placed by the style."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    expected = {"replicate": (Replicate(),), "fully_shard": (Shard(0),),
                "hybrid_shard": (Replicate(), Shard(0))}[style]
    for mname, (ours, _) in case["modules"].items():
        for n, p in ours.named_parameters():
            placed = tuple(p.placements) if isinstance(p, DTensor) else None
            chk.check(placed == expected, f"{mname}.{n}: placements {placed}, expected {expected}")


def _probe(module: nn.Module) -> torch.Tensor:
    """The same input on every rank, as wide as the module's first layer."""
    width = next(m for m in module.modules() if isinstance(m, nn.Linear)).in_features
    return torch.randn(3, width, generator=torch.Generator().manual_seed(7))


def _used_outside(chk: ParityChecker, case: dict) -> None:
    """Each module called outside the step (every rank, as FSDP2 asks) gives its reference's
    output."""
    for mname, (ours, ref) in case["modules"].items():
        x = _probe(ref)
        with torch.no_grad():
            chk.close("param", f"{mname}(x) outside the step", ours(x), ref(x))


def _plain_state(module: nn.Module) -> dict:
    """The module's state dict as its eager counterpart saves it in full: plain under
    replicate; torch's full state dict of the DTensors otherwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    sd = module.state_dict()
    if any(isinstance(v, DTensor) for v in sd.values()):
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return sd


def _resumed(case: dict, name: str, style: str) -> dict:
    """A fresh copy of the case's modules and optimizers loaded from the trained ones' state
    dicts (torch.save / torch.load round trip), paired with the same references."""
    import io

    fresh = CASES[name](style)
    for mname, (ours, _) in case["modules"].items():
        buffer = io.BytesIO()
        torch.save(_plain_state(ours), buffer)
        buffer.seek(0)
        sd = torch.load(buffer)
        fresh["modules"][mname][0].load_state_dict(sd)
    for (opt, _), (new, _) in zip(case["optimizers"], fresh["optimizers"]):
        new.load_state_dict(opt.state_dict())
    fresh["ref_args"] = case["ref_args"]
    fresh["modules"] = {k: (fresh["modules"][k][0], ref) for k, (_, ref) in case["modules"].items()}
    fresh["optimizers"] = [(new, ref) for (new, _), (_, ref) in
                           zip(fresh["optimizers"], case["optimizers"])]
    return fresh


def _train(chk: ParityChecker, case: dict, style: str, steps: range) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    mesh = None
    if style == "hybrid_shard":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard"))
    compiled = spmd_compile(DataParallel(style), mesh=mesh)(case["step"])
    for i in steps:
        batch = case["data"](i)
        out = compiled(*case["args"](batch))
        if "global_data" in case:  # one process on every rank's batch: its loss is the global one
            case["step"](*case["ref_args"](case["global_data"](i)))
        else:
            ref_out = case["step"](*case["ref_args"](batch))
            for k, (a, e) in enumerate(zip(torch.utils._pytree.tree_leaves(out),
                                           torch.utils._pytree.tree_leaves(ref_out))):
                chk.close("loss", f"step {i}: output {k}", a, e.detach())
        _compare(chk, i, case)
    return compiled.compile_count


def _run_case(name: str, style: str) -> dict:
    """STEPS compiled steps against the reference, each module used outside the step, then
    saved, loaded into fresh modules and optimizers and trained on for RESUMED steps."""
    case = CASES[name](style)
    chk = ParityChecker(RTOL, ATOL)
    compiles = _train(chk, case, style, range(STEPS))
    _placements_ok(chk, case, style)
    _used_outside(chk, case)
    _train(chk, _resumed(case, name, style), style, range(STEPS, STEPS + RESUMED))
    return dict(max_err=chk.max_err, problems=chk.problems, compiles=compiles)


def parity_job(keys: list[tuple[str, str]]) -> dict:
    out = {}
    for name, style in keys:
        try:
            out[(name, style)] = _run_case(name, style)
        except Exception as e:  # noqa: BLE001 - reported per case
            out[(name, style)] = dict(exception=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            dist.barrier()
    return out


# ------------------------------------------------------------------------------------------------
# Tests


STYLES = ["replicate", "fully_shard"]
HYBRID_CASES = ["gan", "wgan_gp", "ema_lerp", "distill"]


def _case_of(item):
    params = getattr(item, "callspec", None)
    if params is None or "case" not in params.params:
        return None
    return (params.params["case"], params.params["style"])


_REPORTS = SelectedCases(parity_job, _case_of, timeout=2400)


def _assert_report(pool, case: str, style: str) -> None:
    for rank, reports in enumerate(_REPORTS.reports(pool)):
        rep = reports[(case, style)]
        assert "exception" not in rep, f"{case}/{style} raised on rank {rank}: {rep['exception']}"
        print(f"{case}/{style} rank {rank}: max abs err "
              + ", ".join(f"{k} {v:.2g}" for k, v in rep["max_err"].items()))
        assert not rep["problems"], rep["problems"][:8]
        assert rep["compiles"] <= 2, rep["compiles"]


@pytest.mark.parametrize("pool", [2], indirect=True, ids=["ws2"])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", list(CASES))
def test_several_modules_match_ddp(pool, case, style):
    _assert_report(pool, case, style)


@pytest.mark.parametrize("pool", [4], indirect=True, ids=["ws4"])
@pytest.mark.parametrize("style", ["hybrid_shard"])
@pytest.mark.parametrize("case", HYBRID_CASES)
def test_several_modules_hybrid_shard_match_ddp(pool, case, style):
    _assert_report(pool, case, style)


def test_explain_names_each_module_by_its_argument():
    """The summary's parameter table names every parameter by the argument its module was passed
    as: ``G.``/``D.`` for separate arguments, ``nets.G.`` for a dict, the EMA copy's as ``ema.``
    (one process, no process group: explain at world size 2)."""
    from spmd_compiler import DataParallel
    from spmd_compiler.api import explain

    ours, _ = _gan_parts()
    G, D = ours["G"], ours["D"]
    batch = (torch.randn(BATCH, 8), torch.randn(BATCH, 4))
    text = explain(gan_step, G, D, _adam(G), _adam(D), batch,
                   parallel_mode=DataParallel("fully_shard")).to_text()
    assert "G.0.weight" in text and "D.2.bias" in text, text
    text = explain(gan_dict_step, ours, (_adam(G), _adam(D)), batch).to_text()
    assert "nets.G.0.weight" in text and "nets.D.0.weight" in text, text
    torch.manual_seed(0)
    model = _mlp(8, 16, 4)
    text = explain(ema_lerp_step, model, _frozen(model), _adam(model),
                   (torch.randn(BATCH, 8), torch.randn(BATCH, 4))).to_text()
    assert "model.0.weight" in text and "ema.0.weight" in text, text
    student = _mlp(8, 16, 5)
    text = explain(distill_dataclass_step, student, _adam(student), _class_data(0),
                   Distillation(_teacher(student))).to_text()
    assert "student.0.weight" in text and "kd.teacher.0.weight" in text, text


CALLS_PER_UPDATE = 3


def no_sync_job(style: str) -> dict:
    """An encoder and a decoder with one optimizer: ``CALLS_PER_UPDATE - 1`` calls inside
    ``step.no_sync()`` then one outside, against ``DDP(encoder)``, ``DDP(decoder)`` running the
    same forward/backwards inside both modules' ``no_sync()`` and one optimizer step."""
    import contextlib

    from spmd_compiler import DataParallel, spmd_compile

    case = _autoencoder(style)
    (enc, ref_enc), (dec, ref_dec) = case["modules"]["encoder"], case["modules"]["decoder"]
    (opt, ref_opt), = case["optimizers"]
    wrapped = case["ref_args"](None)[:2]
    compiled = spmd_compile(DataParallel(style))(autoencoder_step)
    chk = ParityChecker(RTOL, ATOL)
    for i in range(STEPS):
        ref_opt.zero_grad()
        for k in range(CALLS_PER_UPDATE):
            x = rank_data(90 + 10 * i + k, (BATCH, 8))
            skip = k < CALLS_PER_UPDATE - 1
            with compiled.no_sync() if skip else contextlib.nullcontext():
                loss = compiled(enc, dec, opt, x.clone())
            with contextlib.ExitStack() as stack:
                if skip:
                    for m in wrapped:
                        stack.enter_context(m.no_sync())
                ref_loss = F.mse_loss(wrapped[1](wrapped[0](x)), x)
                ref_loss.backward()
            chk.close("loss", f"update {i} call {k}: loss", loss, ref_loss.detach())
        ref_opt.step()
        _compare(chk, i, case)
    return dict(max_err=chk.max_err, problems=chk.problems)


@pytest.mark.parametrize("style", STYLES)
def test_no_sync_with_two_modules(pool2, style):
    for rank, rep in enumerate(pool2.run(no_sync_job, style, timeout=600)):
        assert not rep["problems"], f"rank {rank}: {rep['problems'][:8]}"


def mixed_precision_gan_job() -> dict:
    """The GAN under fully_shard with FSDP2's policy (bf16 parameters and compute, fp32
    reduction) against FSDP2 applied to each module with the same policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from spmd_compiler import DataParallel, spmd_compile

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  cast_forward_inputs=True)
    ours, ref = _gan_parts()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in ref.values():
        fully_shard(m, mesh=mesh, mp_policy=policy)
    opts = [_adam(ours["G"]), _adam(ours["D"])]
    ref_opts = [_adam(ref["G"]), _adam(ref["D"])]
    case = dict(modules={k: (ours[k], ref[k]) for k in ours}, optimizers=list(zip(opts, ref_opts)))
    compiled = spmd_compile(DataParallel("fully_shard", mp_policy=policy,
                                         divide_gradients="after"))(gan_step)
    # Observed: G within 1e-5 of FSDP2, D (called twice before one backward) ~1e-4 off; most
    # likely FSDP2 sums the two calls' gradients in its one bf16 unsharded parameter where the
    # compiled step casts per call and sums in fp32 (not verified further)
    chk = ParityChecker(1e-3, 5e-4)
    for i in range(STEPS):
        batch = _gan_data(i)
        out = compiled(ours["G"], ours["D"], *opts, batch)
        ref_out = gan_step(ref["G"], ref["D"], *ref_opts, batch)
        for k, (a, e) in enumerate(zip(out, ref_out)):
            chk.close("loss", f"step {i}: output {k}", a, e)
        _compare(chk, i, case)
    return dict(max_err=chk.max_err, problems=chk.problems)


def test_mixed_precision_gan_matches_fsdp2(pool2):
    for rank, rep in enumerate(pool2.run(mixed_precision_gan_job, timeout=600)):
        assert not rep["problems"], f"rank {rank}: {rep['problems'][:8]}"
