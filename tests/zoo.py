"""A zoo of models nobody on this project wrote: torch.nn's attention, recurrent, convolution and
embedding modules, and Hugging Face ``transformers`` models at tiny configs built from config
objects (no downloads).

Each :class:`ZooCase` builds a model, makes one rank's batch for a step (different on every rank),
and names the training step (module-level functions below) and the step's ``input_batch_dim``.
tests/test_zoo.py runs every case compiled in both modes against eager DDP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.steps import lm_step, step_with

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 61
CLASSES = 5


def _gen(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + 7919 * rank + 1)


def _tokens(gen, *shape) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=gen)


# --------------------------------------------------------------------------------------------------
# Training steps
# --------------------------------------------------------------------------------------------------


def classify(model, batch):
    """Cross-entropy picked per sample with ``logits[torch.arange(b), labels]``."""
    x, labels = batch
    logp = model(x).log_softmax(-1)
    return -logp[torch.arange(labels.shape[0]), labels].mean()


def time_major(model, batch):
    """A sequence model fed ``(T, B, ...)`` tokens (batch dim 1) with ``(B, T)`` targets."""
    tokens, targets = batch
    logits = model(tokens)  # (T, B, V)
    return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), targets.reshape(-1))


def masked_token(model, batch):
    """Loss on the tokens whose target is not -100 only (a boolean mask: data-dependent size)."""
    tokens, targets = batch
    logits = model(tokens)
    keep = targets != -100
    return F.cross_entropy(logits[keep], targets[keep])


def hf(model, batch):
    """A Hugging Face model computing its own loss from ``labels`` in the batch dict."""
    return model(**batch).loss


classify_step = step_with(classify)
time_major_step = step_with(time_major)
masked_token_step = step_with(masked_token)
hf_step = step_with(hf)


# --------------------------------------------------------------------------------------------------
# torch.nn models
# --------------------------------------------------------------------------------------------------


def causal_mask(t: int) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(t)


class MHAGPT(nn.Module):
    """A GPT built on ``nn.MultiheadAttention`` (pre-norm blocks, causal float mask, tied head)."""

    def __init__(self, dim=32, heads=4, layers=2, batch_first=True, dropout=0.0, seq=16):
        super().__init__()
        self.batch_first = batch_first
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(_MHABlock(dim, heads, batch_first, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens):  # (B, T)
        t = tokens.shape[1]
        h = self.drop(self.tok(tokens) + self.pos[:t])
        if not self.batch_first:
            h = h.transpose(0, 1)
        mask = causal_mask(t)
        for block in self.blocks:
            h = block(h, mask)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.norm(h) @ self.tok.weight.t()


class _MHABlock(nn.Module):
    def __init__(self, dim, heads, batch_first, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=batch_first)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, h, mask):
        x = self.ln1(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class Seq2SeqTransformer(nn.Module):
    """``nn.Transformer`` (encoder-decoder) with a causal ``tgt_mask`` made in the forward."""

    def __init__(self, dim=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.t = nn.Transformer(dim, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        mask = self.t.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.t(h, h, tgt_mask=mask))


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` (time-major, ``batch_first=False``) with a key padding mask made
    from the tokens, mean-pooled into classes."""

    def __init__(self, dim=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=False,
                                           norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, tokens):  # (B, T), token 0 is padding
        pad = tokens == 0
        h = self.enc(self.emb(tokens).transpose(0, 1), src_key_padding_mask=pad)
        keep = (~pad).transpose(0, 1).unsqueeze(-1).float()
        return self.head((h * keep).sum(0) / keep.sum(0).clamp(min=1))


class DecoderLM(nn.Module):
    """``nn.TransformerDecoder`` (batch-first) over a memory from a small encoder MLP, with a
    causal ``tgt_mask``."""

    def __init__(self, dim=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.memory = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        layer = nn.TransformerDecoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 1)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        mask = causal_mask(tokens.shape[1])
        return self.head(self.dec(h, self.memory(h), tgt_mask=mask, tgt_is_causal=True))


class RecurrentLM(nn.Module):
    """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, two bidirectional layers, either layout (the zoo
    covers both layouts over the three modules: every position is unrolled into the graph)."""

    def __init__(self, kind: str, batch_first: bool, dim=16):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, dim)
        self.rnn = getattr(nn, kind)(dim, dim, num_layers=2, batch_first=batch_first,
                                     bidirectional=True)
        self.head = nn.Linear(2 * dim, VOCAB)

    def forward(self, tokens):  # (B, T) if batch_first else (T, B)
        return self.head(self.rnn(self.emb(tokens))[0])


class ConvNorm(nn.Module):
    """Conv{1,2,3}d with BatchNorm / GroupNorm / LayerNorm, pooled into classes."""

    def __init__(self, dims: int, norm: str):
        super().__init__()
        conv = getattr(nn, f"Conv{dims}d")
        self.conv1 = conv(3, 8, 3, padding=1)
        self.conv2 = conv(8, 8, 3, stride=2, padding=1)
        self.norm1, self.norm2 = (self._norm(norm, dims, 8, 4), self._norm(norm, dims, 8, 2))
        self.dims = dims
        self.head = nn.Linear(8, CLASSES)

    @staticmethod
    def _norm(norm, dims, channels, size):
        if norm == "batch":
            return getattr(nn, f"BatchNorm{dims}d")(channels)
        if norm == "group":
            return nn.GroupNorm(2, channels)
        return nn.LayerNorm([channels] + [size] * dims)  # over channels and positions

    def forward(self, x):  # (B, 3, 4, ..., 4)
        h = F.relu(self.norm1(self.conv1(x)))
        h = F.relu(self.norm2(self.conv2(h)))
        return self.head(h.flatten(2).mean(-1))


class BagClassifier(nn.Module):
    """``nn.EmbeddingBag`` (mean over each sample's tokens, per-sample weights) and a linear head."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 16, mode="sum")
        self.head = nn.Linear(16, CLASSES)

    def forward(self, tokens):  # (B, T)
        weights = torch.linspace(1.0, 0.5, tokens.shape[1]).expand(tokens.shape).contiguous()
        return self.head(self.bag(tokens, per_sample_weights=weights))


class RoutedMoE(nn.Module):
    """A top-1 mixture of experts that routes tokens with ``torch.where`` (data-dependent sizes)
    and combines them with ``index_add``."""

    def __init__(self, dim=16, experts=3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
            for _ in range(experts))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        flat = h.reshape(-1, h.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            (idx,) = torch.where(choice == e)
            out = out.index_add(0, idx, expert(flat[idx]) * weight[idx, None])
        return self.head(h + out.reshape(h.shape))


# --------------------------------------------------------------------------------------------------
# Hugging Face models (tiny configs, built from config objects)
# --------------------------------------------------------------------------------------------------


def _hf(model_cls: str, config_cls: str, **config) -> Callable[[], nn.Module]:
    def build():
        import transformers

        transformers.logging.set_verbosity_error()  # its notes on tiny configs are noise here
        cfg = getattr(transformers, config_cls)(**config)
        return getattr(transformers, model_cls)(cfg)

    build.__name__ = model_cls
    return build


_HF_TEXT = dict(vocab_size=VOCAB, max_position_embeddings=32)


def _lm_batch(gen, b, t=12):
    ids = _tokens(gen, b, t)
    return {"input_ids": ids, "labels": ids}


def _padded(gen, b, t):
    """Token ids and an attention mask with a different number of padding tokens per sample."""
    ids = _tokens(gen, b, t)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def _bert_batch(gen, b, t=12):
    ids, mask = _padded(gen, b, t)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, CLASSES, (b,), generator=gen)}


def _t5_batch(gen, b, t=10):
    ids, mask = _padded(gen, b, t)
    return {"input_ids": ids, "attention_mask": mask, "labels": _tokens(gen, b, 7)}


def _clip_batch(gen, b):
    return {"input_ids": _tokens(gen, b, 8), "pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
            "return_loss": True}


def _vit_batch(gen, b):
    return {"pixel_values": torch.randn(b, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, CLASSES, (b,), generator=gen)}


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooCase:
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator, int], Any]  # (generator, local batch size) -> batch
    step: Callable
    input_batch_dim: Any = 0
    lr: float = 1e-3
    dropout: bool = False  # draws random numbers in the step
    # Eager DDP runs oneDNN's fused recurrent kernels, the compiled step their traced
    # decomposition: another summation order, which Adam's normalization carries into the weights
    # (2.2e-6 on an LSTM's head after one step on an AVX-512 machine).
    atol: float = 1e-6


def _seq_batch(gen, b, t=10):
    tokens = _tokens(gen, b, t + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _short_seq_batch(gen, b, t=3):  # recurrent models unroll every position: keep them short
    return _seq_batch(gen, b, t)


def _time_major_batch(gen, b, t=3):
    tokens, targets = _seq_batch(gen, b, t)
    return tokens.t().contiguous(), targets


def _class_batch(gen, b, t=8):
    return _tokens(gen, b, t), torch.randint(0, CLASSES, (b,), generator=gen)


def _image_batch(dims):
    def make(gen, b):
        return (torch.randn(b, 3, *[4] * dims, generator=gen),
                torch.randint(0, CLASSES, (b,), generator=gen))
    return make


def _masked_batch(gen, b, t=8):
    tokens, targets = _seq_batch(gen, b, t)
    drop = torch.rand(targets.shape, generator=gen) < 0.3
    return tokens, targets.masked_fill(drop, -100)


CASES: dict[str, ZooCase] = {
    # torch.nn attention
    "mha_gpt_batch_first": ZooCase(lambda: MHAGPT(batch_first=True), _seq_batch, lm_step),
    "mha_gpt_time_major": ZooCase(lambda: MHAGPT(batch_first=False, layers=1), _seq_batch,
                                  lm_step),
    "mha_gpt_dropout": ZooCase(lambda: MHAGPT(dropout=0.2, layers=1), _seq_batch, lm_step,
                               dropout=True),
    "transformer_causal": ZooCase(Seq2SeqTransformer, _seq_batch, lm_step),
    "transformer_encoder_padding": ZooCase(EncoderClassifier, _class_batch, classify_step),
    "transformer_decoder": ZooCase(DecoderLM, _seq_batch, lm_step),
    # torch.nn recurrent
    "lstm_batch_first": ZooCase(lambda: RecurrentLM("LSTM", True), _short_seq_batch, lm_step, atol=5e-6),
    "lstm_time_major": ZooCase(lambda: RecurrentLM("LSTM", False), _time_major_batch,
                               time_major_step, input_batch_dim=(1, 0), atol=5e-6),
    "gru_time_major": ZooCase(lambda: RecurrentLM("GRU", False), _time_major_batch,
                              time_major_step, input_batch_dim=(1, 0), atol=5e-6),
    "rnn_batch_first": ZooCase(lambda: RecurrentLM("RNN", True), _short_seq_batch, lm_step, atol=5e-6),
    # torch.nn convolution, normalization, embedding bags, per-sample indexing, routing
    "conv1d_batchnorm": ZooCase(lambda: ConvNorm(1, "batch"), _image_batch(1), classify_step),
    "conv2d_groupnorm": ZooCase(lambda: ConvNorm(2, "group"), _image_batch(2), classify_step),
    "conv3d_layernorm": ZooCase(lambda: ConvNorm(3, "layer"), _image_batch(3), classify_step),
    "embedding_bag": ZooCase(BagClassifier, _class_batch, classify_step),
    "routed_moe_masked_loss": ZooCase(RoutedMoE, _masked_batch, masked_token_step),
    # Hugging Face transformers
    "hf_gpt2": ZooCase(_hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=32,
                           n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                       _lm_batch, hf_step),
    "hf_llama": ZooCase(_hf("LlamaForCausalLM", "LlamaConfig", **_HF_TEXT, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2), _lm_batch, hf_step),
    # BERT keeps its default dropout (0.1, in the attention too)
    "hf_bert_classifier": ZooCase(_hf("BertForSequenceClassification", "BertConfig", **_HF_TEXT,
                                      hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, num_labels=CLASSES),
                                  _bert_batch, hf_step, dropout=True),
    "hf_t5": ZooCase(_hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32,
                         d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                         dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
                     _t5_batch, hf_step),
    "hf_vit": ZooCase(_hf("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4,
                          hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, num_labels=CLASSES, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0), _vit_batch, hf_step),
    "hf_swin": ZooCase(_hf("SwinForImageClassification", "SwinConfig", image_size=16, patch_size=2,
                           embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                           num_labels=CLASSES), _vit_batch, hf_step),
    # contrastive: a (batch x batch) similarity matrix of each rank's own pairs
    "hf_clip": ZooCase(_hf("CLIPModel", "CLIPConfig", projection_dim=16,
                           text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=64,
                                            max_position_embeddings=32, bos_token_id=0,
                                            eos_token_id=1, pad_token_id=2),
                           vision_config=dict(hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=64,
                                              image_size=16, patch_size=4)),
                       _clip_batch, hf_step),
    "hf_mixtral_moe": ZooCase(_hf("MixtralForCausalLM", "MixtralConfig", **_HF_TEXT,
                                  hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2),
                              _lm_batch, hf_step),
}


def make_batch(name: str, seed: int, b: int, rank: int):
    return CASES[name].make_batch(_gen(seed, rank), b)
