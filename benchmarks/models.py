"""Benchmark workloads: each model comes with its loss, batch maker, optimizer and FSDP2 blocks.

Sizes are chosen so that one training step takes roughly 20-500 ms per rank with one CPU thread at
world size 2 (see docs/benchmarks.md for the measured figures).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class OptimConfig:
    """Which optimizer to build; ``impl`` is "default", "foreach" or "fused"."""

    kind: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.0
    impl: str = "default"

    def build(self, params) -> torch.optim.Optimizer:
        flags = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[self.impl]
        if self.kind == "adam":
            return torch.optim.Adam(params, lr=self.lr, **flags)
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, **flags)
        raise ValueError(f"unknown optimizer kind {self.kind!r}")

    def label(self) -> str:
        name = "Adam" if self.kind == "adam" else f"SGD(momentum={self.momentum})"
        return name if self.impl == "default" else f"{name} {self.impl}"


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark workload. ``make_batch(generator, batch_size)`` returns one local batch."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator, int], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: int
    optim: OptimConfig = field(default_factory=OptimConfig)
    blocks: tuple[type | str, ...] = ()  # FSDP2 wraps these (classes, or class names)
    speed: bool = True  # run by default by benchmarks.run (the memory workloads are not)

    def is_block(self, module: nn.Module) -> bool:
        """Whether FSDP2 wraps ``module`` on its own: an instance of a class in ``blocks``, or of a
        class named there (for models from an optional library, imported only when built)."""
        return any(isinstance(module, b) if isinstance(b, type) else type(module).__name__ == b
                   for b in self.blocks)


def make_train_step(loss_fn):
    """The ordinary single-device step every mode runs (eagerly or compiled)."""

    def train_step(model, optim, batch):
        optim.zero_grad()
        inputs, labels = batch
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optim.step()
        return loss

    return train_step


# --- SimpleMLP (shared/seeds/001) -----------------------------------------------------------


class SimpleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(50, 32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, 8)

    def forward(self, x):
        return torch.sigmoid(self.net2(self.relu(self.net1(x))))


def _mlp_batch(gen: torch.Generator, b: int) -> Batch:
    return torch.randn(b, 50, generator=gen), torch.randn(b, 8, generator=gen)


def _sum_loss(out, labels):
    return (out - labels).sum()


# --- ToyModel (shared/seeds/002), widths scaled down ----------------------------------------


class MyModule(nn.Module):
    def __init__(self, a: int, b: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(a, b), nn.ReLU())

    def forward(self, x):
        return self.net(x)


class ToyModel(nn.Module):
    """The seed's Linear/ReLU stack with its 10000/1000 widths replaced by ``wide``/``narrow``."""

    def __init__(self, wide: int = 2048, narrow: int = 1024, depth: int = 7):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(10, wide),
            nn.ReLU(),
            nn.Linear(wide, wide),
            nn.ReLU(),
            MyModule(wide, wide),
            MyModule(wide, narrow),
            *[MyModule(narrow, narrow) for _ in range(depth)],
            nn.Linear(narrow, 5),
        )

    def forward(self, x):
        return self.net(x)


def _toy_batch(gen: torch.Generator, b: int) -> Batch:
    return torch.randn(b, 10, generator=gen), torch.randn(b, 5, generator=gen)


def _mse_loss(out, labels):
    return F.mse_loss(out, labels)


# --- GPT --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 2048
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """Pre-LN block: causal self-attention (``attn``, default :class:`CausalSelfAttention`), then
    a 4x GELU MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig, attn: nn.Module | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg) if attn is None else attn
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-LN causal blocks, head weight tied to the embedding."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), block=GPTBlock):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.Sequential(*[block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight

    def embed(self, idx):
        t = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.embed(idx))))


def _gpt_batch(gen: torch.Generator, b: int, cfg: GPTConfig = GPTConfig()) -> Batch:
    tokens = torch.randint(0, cfg.vocab, (b, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- GPT on nn.MultiheadAttention ------------------------------------------------------------


class MHABlock(GPTBlock):
    """Pre-LN block whose attention is ``nn.MultiheadAttention`` with a causal float mask (the
    module detects it is causal by comparing it with its own causal mask)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg, nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHAGPT(GPT):
    """The GPT above with ``nn.MultiheadAttention`` blocks."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__(cfg, MHABlock)

    def forward(self, idx):
        x = self.embed(idx)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


# --- Hugging Face Llama (transformers, built from a config object) ----------------------------


def hf_llama() -> nn.Module:
    """A Llama of the GPT's size (4 layers, dim 128, 4 heads with 2 key/value heads, vocab 2048)
    from ``transformers.LlamaConfig``: nothing is downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = GPTConfig()
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=4 * cfg.dim,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=2,
        max_position_embeddings=cfg.seq))


def _hf_lm_loss(out, targets):
    return _lm_loss(out.logits, targets)


# --- ConvNeXt (shared/seeds/000) --------------------------------------------------------------


class ChannelsFirstLayerNorm(nn.Module):
    """LayerNorm over dim 1 of an NCHW tensor."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = ChannelsFirstLayerNorm(dim)
        self.pwconv1 = nn.Conv2d(dim, 4 * dim, kernel_size=1)
        self.act = nn.GELU()
        self.pwconv2 = nn.Conv2d(4 * dim, dim, kernel_size=1)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim, 1, 1))

    def forward(self, x):
        y = self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x)))))
        return x + self.gamma * y


class ConvNeXt(nn.Module):
    """Stem conv (stride 4), stages of blocks with norm+conv downsampling, global mean pool."""

    def __init__(self, depths=(2, 2, 2), dims=(32, 64, 128), num_classes: int = 10):
        super().__init__()
        self.downsample = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), ChannelsFirstLayerNorm(dims[0]))]
        )
        for i in range(len(dims) - 1):
            self.downsample.append(
                nn.Sequential(
                    ChannelsFirstLayerNorm(dims[i]), nn.Conv2d(dims[i], dims[i + 1], 2, stride=2)
                )
            )
        self.stages = nn.ModuleList(
            nn.Sequential(*[ConvNeXtBlock(d) for _ in range(n)]) for d, n in zip(dims, depths)
        )
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        for down, stage in zip(self.downsample, self.stages):
            x = stage(down(x))
        return self.head(x.mean([-2, -1]))


def _image_batch(gen: torch.Generator, b: int) -> Batch:
    return torch.randn(b, 3, 64, 64, generator=gen), torch.randint(0, 10, (b,), generator=gen)


class ConvNetBN(nn.Module):
    """A small CNN with BatchNorm: three conv-BatchNorm-ReLU stages, global pooling, a linear head
    (six BatchNorm buffers, which DDP broadcasts every step)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10):
        super().__init__()
        layers, c_in = [], 3
        for i, c in enumerate(widths):
            layers += [nn.Conv2d(c_in, c, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.BatchNorm2d(c), nn.ReLU()]
            c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.head(self.features(x).mean([-2, -1]))


def _small_image_batch(gen: torch.Generator, b: int) -> Batch:
    return torch.randn(b, 3, 32, 32, generator=gen), torch.randint(0, 10, (b,), generator=gen)


# --- memory workloads -----------------------------------------------------------------------


class LinearBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


class StateHeavy(nn.Module):
    """8 x Linear(2048, 2048) + ReLU and a Linear(2048, 8) head: 33.6M parameters whose
    parameters, gradients and Adam state dwarf the activations of a small batch."""

    def __init__(self, width: int = 2048, depth: int = 8, out: int = 8):
        super().__init__()
        self.blocks = nn.Sequential(*[LinearBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, out)

    def forward(self, x):
        return self.head(self.blocks(x))


def _state_heavy_batch(gen: torch.Generator, b: int) -> Batch:
    return torch.randn(b, 2048, generator=gen), torch.randn(b, 8, generator=gen)


DEEP_GPT = GPTConfig(vocab=4096, seq=128, dim=256, heads=4, layers=8)


def checkpointed(model: nn.Module, blocks: tuple[type, ...]) -> nn.Module:
    """``model`` with every block wrapped in a non-reentrant ``checkpoint_wrapper`` (as
    torchtitan and torch's FSDP benchmarks apply activation checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(
            m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, blocks))
    return model


def _deep_gpt_batch(gen: torch.Generator, b: int) -> Batch:
    return _gpt_batch(gen, b, DEEP_GPT)


# --- registry ---------------------------------------------------------------------------------

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "simple_mlp",
            "SimpleMLP 50-32-8 (acceptance tests), sum loss",
            SimpleMLP,
            _mlp_batch,
            _sum_loss,
            batch=65536,
            blocks=(nn.Linear,),
        ),
        ModelSpec(
            "simple_mlp_b32",
            "SimpleMLP as above at batch 32 (latency-bound)",
            SimpleMLP,
            _mlp_batch,
            _sum_loss,
            batch=32,
            blocks=(nn.Linear,),
        ),
        ModelSpec(
            "simple_mlp_b128",
            "SimpleMLP as above at batch 128 (latency-bound)",
            SimpleMLP,
            _mlp_batch,
            _sum_loss,
            batch=128,
            blocks=(nn.Linear,),
        ),
        ModelSpec(
            "convnet_bn",
            "ConvNet conv-BatchNorm-ReLU x3 (16-32-64), 32x32 images, cross-entropy",
            ConvNetBN,
            _small_image_batch,
            F.cross_entropy,
            batch=32,
            blocks=(nn.Conv2d,),
        ),
        ModelSpec(
            "toy",
            "ToyModel Linear/ReLU stack 10-2048-2048-2048-1024x8-5, MSE",
            ToyModel,
            _toy_batch,
            _mse_loss,
            batch=32,
            blocks=(MyModule,),
        ),
        ModelSpec(
            "toy_sgd",
            "ToyModel as above with SGD momentum 0.9",
            ToyModel,
            _toy_batch,
            _mse_loss,
            batch=32,
            optim=OptimConfig(kind="sgd", lr=1e-2, momentum=0.9),
            blocks=(MyModule,),
        ),
        ModelSpec(
            "gpt",
            "GPT 4 layers, dim 128, 4 heads, seq 64, vocab 2048, tied head, cross-entropy",
            GPT,
            _gpt_batch,
            _lm_loss,
            batch=8,
            blocks=(GPTBlock,),
        ),
        ModelSpec(
            "gpt_mha",
            "GPT as above on nn.MultiheadAttention (batch_first, causal float mask)",
            MHAGPT,
            _gpt_batch,
            _lm_loss,
            batch=8,
            blocks=(MHABlock,),
        ),
        ModelSpec(
            "hf_llama",
            "Hugging Face LlamaForCausalLM, GPT's size (4 layers, dim 128, 2 KV heads), SDPA",
            hf_llama,
            _gpt_batch,
            _hf_lm_loss,
            batch=8,
            blocks=("LlamaDecoderLayer",),
        ),
        ModelSpec(
            "convnext",
            "ConvNeXt depths 2-2-2, dims 32-64-128, 64x64 images, cross-entropy",
            ConvNeXt,
            _image_batch,
            F.cross_entropy,
            batch=8,
            blocks=(ConvNeXtBlock,),
        ),
        ModelSpec(
            "state_heavy",
            "8 x Linear(2048, 2048)+ReLU, Linear(2048, 8) head, MSE (memory)",
            StateHeavy,
            _state_heavy_batch,
            _mse_loss,
            batch=4,
            blocks=(LinearBlock,),
            speed=False,
        ),
        ModelSpec(
            "deep_gpt",
            "GPT 8 layers, dim 256, 4 heads, seq 128, vocab 4096, tied head (memory)",
            lambda: GPT(DEEP_GPT),
            _deep_gpt_batch,
            _lm_loss,
            batch=16,
            blocks=(GPTBlock,),
            speed=False,
        ),
        ModelSpec(
            "deep_gpt_ckpt",
            "deep_gpt with every block in a non-reentrant checkpoint_wrapper (memory)",
            lambda: checkpointed(GPT(DEEP_GPT), (GPTBlock,)),
            _deep_gpt_batch,
            _lm_loss,
            batch=16,
            blocks=(GPTBlock,),
            speed=False,
        ),
    )
}


def param_count(model: nn.Module) -> tuple[int, int]:
    """(number of elements, number of tensors) over the distinct trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)
