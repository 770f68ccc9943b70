"""Context parallelism: the sequence sharded over a ``cp`` mesh dim by the compiler, against one
device training each dp group's rows (the rows of every dp group together, every rank), over
several AdamW steps; every parameter, every optimizer state and the returned loss compared."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.multirank import ParityChecker, run_without_problems

pytestmark = pytest.mark.multirank

STEPS = 3
VOCAB, WIDTH, HEADS, LAYERS = 32, 16, 4, 2


class Block(nn.Module):
    """A pre-norm transformer block; attention by SDPA (``attention="sdpa"``), written out with
    a ``tril`` mask buffer (``"written"``), SDPA with grouped keys and rotary positions
    (``"gqa_rotary"``), SDPA with a boolean mask made in the step (``"masked"``) or none
    (``"bidirectional"``)."""

    def __init__(self, attention: str, seq: int):
        super().__init__()
        self.attention = attention
        self.kv_heads = HEADS // 2 if attention == "gqa_rotary" else HEADS
        head = WIDTH // HEADS
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q = nn.Linear(WIDTH, WIDTH)
        # no bias: a key bias has a zero gradient (softmax ignores it), which Adam turns into
        # updates of its round-off
        self.kv = nn.Linear(WIDTH, 2 * self.kv_heads * head, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x, rotary=None):
        B, T, C = x.shape
        head = C // HEADS
        h = self.ln1(x)
        q = self.q(h).view(B, T, HEADS, head).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 2 * self.kv_heads, head).transpose(1, 2).chunk(2, dim=1)
        if rotary is not None:
            q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        if self.attention == "written":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head))
            att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        elif self.attention == "masked":  # a mask the step makes, as a boolean tensor
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        elif self.attention == "bidirectional":
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=self.kv_heads != HEADS)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


def _rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class TinyGPT(nn.Module):
    """nanoGPT's shape: token and learned position embeddings (positions from ``arange``), or
    rotary positions from ``arange`` (``gqa_rotary``)."""

    def __init__(self, attention: str = "sdpa", seq: int = 16):
        super().__init__()
        self.attention = attention
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(seq, WIDTH)
        self.blocks = nn.ModuleList(Block(attention, seq) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        half = WIDTH // HEADS // 2
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(half) / half)))

    def forward(self, ids):
        T = ids.shape[1]
        positions = torch.arange(T, device=ids.device)
        x = self.tok(ids)
        rotary = None
        if self.attention == "gqa_rotary":
            angles = positions[:, None].float() * self.inv_freq[None, :]
            rotary = (angles.cos(), angles.sin())
        else:
            x = x + self.pos(positions)
        for block in self.blocks:
            x = block(x, rotary)
        return self.head(self.ln(x))


def targets_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def shifted_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def targets_step(model, optim, ids, targets):
    """nanoGPT's loss: the targets given, flattened logits."""
    optim.zero_grad()
    loss = targets_loss(model(ids), targets)
    loss.backward()
    optim.step()
    return loss


def shifted_step(model, optim, ids):
    """The shift inside the loss: position i predicts token i + 1."""
    optim.zero_grad()
    loss = shifted_loss(model(ids), ids)
    loss.backward()
    optim.step()
    return loss


def _rows(step: int, dp_rank: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return (torch.randint(0, VOCAB, (batch, seq), generator=g),
            torch.randint(0, VOCAB, (batch, seq), generator=g))


def _parity(attention: str, style: str, mesh_shape: tuple, shifted: bool, seq: int = 16,
            batch: int = 2):
    """Compiled with the sequence sharded over cp against one device on every dp group's rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = TinyGPT(attention, seq)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "cp"))
    dp = mesh["dp"]
    fn = shifted_step if shifted else targets_step
    seq_dims = 1 if shifted else (1, 1)
    step = spmd_compile(DataParallel(style, input_seq_dim=seq_dims), mesh=mesh)(fn)
    chk = ParityChecker(rtol=1e-4, atol=5e-5)  # AdamW at lr 1e-2 turns round-off of near-zero
    # gradients (attention merged over key blocks) into updates of up to ~1e-5
    for i in range(STEPS):
        rows = [_rows(i, r, batch, seq) for r in range(dp.size())]
        ids, targets = rows[dp.get_local_rank()]
        loss = step(model, opt, ids) if shifted else step(model, opt, ids, targets)
        all_ids = torch.cat([r[0] for r in rows])
        all_targets = torch.cat([r[1] for r in rows])
        with torch.no_grad():  # the returned loss is the dp group's own, as DDP's local loss
            own = shifted_loss(ref(ids), ids) if shifted else targets_loss(ref(ids), targets)
        fn(ref, ref_opt, all_ids) if shifted else fn(ref, ref_opt, all_ids, all_targets)
        chk.close("loss", f"step {i} loss", loss.detach(), own)
    _compare(chk, model, opt, ref, ref_opt)
    return {"problems": chk.problems, "max_err": chk.max_err, "compiles": step.compile_count,
            "collectives": _collectives(step)}


def _compare(chk, model, opt, ref, ref_opt):
    from torch.distributed.tensor import DTensor

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        chk.close("param", name, whole(p.detach()), ref_params[name].detach())
        st, ref_st = opt.state[p], ref_opt.state[ref_params[name]]
        for k in ref_st:
            chk.close("state", f"{name} {k}", whole(st[k]), ref_st[k])


@pytest.mark.parametrize("attention,shifted", [("sdpa", False), ("written", False),
                                               ("gqa_rotary", True), ("masked", False),
                                               ("bidirectional", False)])
def test_sequence_sharded_over_two_ranks_trains_as_one_device(pool2, attention, shifted):
    reps = run_without_problems(pool2, _parity, attention, "replicate", (1, 2), shifted)
    assert [r["compiles"] for r in reps] == [1, 1], reps
    # every rank attends as much: under a causal mask the head-and-tail pieces balance it
    work = [r["collectives"].get("attention", 0) for r in reps]
    assert work[0] == work[1] and (work[0] > 0) == (attention != "written"), work


def _collectives(step) -> dict:
    """Collective issue nodes of the last program by kind, and its CPU attention kernels."""
    counts: dict[str, int] = {}
    for n in step.last_compiled.traced.gm.graph.nodes:
        if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            # its work: query rows x keys (half of them under a causal mask)
            rows, keys = n.args[0].meta["val"].shape[2], n.args[1].meta["val"].shape[2]
            causal = len(n.args) > 4 and n.args[4]
            counts["attention"] = counts.get("attention", 0) + rows * keys / (2 if causal else 1)
        if n.op == "call_function" and "c10d" in str(n.target) and "wait" not in str(n.target):
            name = str(n.target).split(".")[-2]
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_dp_by_cp_two_by_two_trains_as_one_device_on_every_dp_groups_rows(pool4, style):
    reps = run_without_problems(pool4, _parity, "sdpa", style, (2, 2), True)
    assert [r["compiles"] for r in reps] == [1] * 4, reps


def llama_step(model, optim, ids):
    optim.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optim.step()
    return loss


def _llama_parity(mesh_shape: tuple, style: str = "replicate", seq: int = 16, batch: int = 2):
    """A Hugging Face Llama (grouped keys, rotary positions, its own shifted loss) with the
    sequence sharded, against one device on every dp group's rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS // 2, max_position_embeddings=4 * seq)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "cp"))
    dp = mesh["dp"]
    step = spmd_compile(DataParallel(style, input_seq_dim=1), mesh=mesh)(llama_step)
    chk = ParityChecker(rtol=1e-4, atol=5e-5)  # AdamW at lr 1e-2 turns round-off of near-zero
    # gradients (attention merged over key blocks) into updates of up to ~1e-5
    for i in range(STEPS):
        rows = [_rows(i, r, batch, seq)[0] for r in range(dp.size())]
        ids = rows[dp.get_local_rank()]
        loss = step(model, opt, ids)
        with torch.no_grad():
            own = ref(ids, labels=ids).loss
        llama_step(ref, ref_opt, torch.cat(rows))
        chk.close("loss", f"step {i} loss", loss.detach(), own)
    _compare(chk, model, opt, ref, ref_opt)
    return {"problems": chk.problems, "max_err": chk.max_err, "compiles": step.compile_count,
            "collectives": _collectives(step)}


def test_hugging_face_llama_with_labels_trains_as_one_device(pool2):
    reps = run_without_problems(pool2, _llama_parity, (1, 2))
    assert [r["compiles"] for r in reps] == [1, 1], reps


def _batch_change_and_eval():
    """Another batch size recompiles (the flattened sequence's split depends on it) and trains
    right, a batch of one row too; the model evaluated outside the step is one device's."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile

    torch.manual_seed(0)
    model = TinyGPT("sdpa")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    step = spmd_compile(DataParallel("replicate", input_seq_dim=(1, 1)), mesh=mesh)(targets_step)
    chk = ParityChecker(rtol=1e-4, atol=5e-5)  # AdamW at lr 1e-2 turns round-off of near-zero
    # gradients (attention merged over key blocks) into updates of up to ~1e-5
    for i, batch in enumerate([2, 2, 3, 1, 2]):
        ids, targets = _rows(i, 0, batch, 16)
        loss = step(model, opt, ids, targets)
        chk.close("loss", f"step {i} loss", loss.detach(), targets_step(ref, ref_opt, ids, targets))
    _compare(chk, model, opt, ref, ref_opt)
    ids = _rows(9, 0, 3, 16)[0]
    with torch.no_grad():
        chk.close("param", "model(ids) outside the step", model(ids), ref(ids))
    return {"problems": chk.problems, "compiles": step.compile_count}


def test_a_new_batch_size_recompiles_and_the_model_evaluates_outside_the_step(pool2):
    reps = run_without_problems(pool2, _batch_change_and_eval)
    assert [r["compiles"] for r in reps] == [3, 3], reps


def test_explain_names_the_exchanged_keys_and_values_on_the_cp_dim():
    """``explain`` on a stand-in (dp, cp) mesh: the keys' and values' all-gathers, their
    gradients' reduce-scatters and the gradients' sum over cp, each on the cp dim; the model
    and optimizer are left as they were."""
    from spmd_compiler import DataParallel, explain

    torch.manual_seed(0)
    model = TinyGPT("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, targets = _rows(0, 0, 2, 16)
    summary = explain(targets_step, model, opt, ids, targets, world_size=(2, 2),
                      parallel_mode=DataParallel("fully_shard", input_seq_dim=(1, 1)))
    text = summary.to_text()
    lines = [line for line in text.splitlines() if "(plan dim cp)" in line]
    counts = {line.split()[0]: int(line.split()[4]) for line in lines if line.split()[3] == "cp)"}
    assert counts.get("all_gather_into_tensor") == 2 * 2 * LAYERS, text  # k, v; forward, backward
    assert counts.get("reduce_scatter_tensor") == 2 * LAYERS, text  # their gradients
    assert "(None)" not in text, text
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert not opt.state


def _verified(break_causal: bool):
    """Every call checked against the eager reference (one device's step on the group's rows);
    a program whose attention lost its causal mask is caught."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import DivergenceError

    def no_causal_mask(gm):
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                n.args = (*n.args[:4], False)
        gm.recompile()
        return gm

    torch.manual_seed(0)
    model = TinyGPT("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    step = spmd_compile(DataParallel("fully_shard", input_seq_dim=(1, 1)), mesh=mesh,
                        verify_every=1,
                        gm_transformation=no_causal_mask if break_causal else None)(targets_step)
    try:
        for i in range(STEPS):
            step(model, opt, *_rows(i, mesh["dp"].get_local_rank(), 2, 16))
    except DivergenceError as e:
        return {"problems": [], "raised": str(e)}
    return {"problems": [], "checked": step.verification.checked}


def test_verify_checks_a_context_parallel_step_against_one_device(pool4):
    reps = run_without_problems(pool4, _verified, False)
    assert [r.get("checked") for r in reps] == [STEPS] * 4, reps
    reps = run_without_problems(pool4, _verified, True)
    assert all("raised" in r and "gm_transformation" in r["raised"] for r in reps), \
        reps[0].get("raised")


def _refusals():
    """What context parallelism cannot run is refused by name, before any state changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module

    from spmd_compiler import DataParallel, spmd_compile
    from spmd_compiler.errors import ContextParallelError

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    out = {}

    def refused(what, call):
        try:
            call()
        except ContextParallelError as e:
            out[what] = str(e)
        else:
            out[what] = None

    torch.manual_seed(0)
    model = TinyGPT("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, targets = _rows(0, 0, 2, 16)
    refused("no cp dim", lambda: spmd_compile(DataParallel("replicate", input_seq_dim=1),
                                              mesh=init_device_mesh("cpu", (2,)))(targets_step))
    refused("no input_seq_dim", lambda: spmd_compile(DataParallel("replicate"), mesh=mesh)(
        targets_step))
    step = spmd_compile(DataParallel("replicate", input_seq_dim=1), mesh=mesh)(targets_step)
    refused("uneven", lambda: step(model, opt, ids[:, :15], targets[:, :15]))
    planned = TinyGPT("sdpa")
    distribute_module(planned, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    refused("plan", lambda: step(planned, torch.optim.AdamW(planned.parameters()), ids, targets))
    out["untouched"] = not any(isinstance(p, torch.distributed.tensor.DTensor)
                               for p in model.parameters())
    return {"problems": [], **out}


def test_what_context_parallelism_cannot_run_is_refused_by_name(pool2):
    rep = run_without_problems(pool2, _refusals)[0]
    assert "mesh dim named 'cp'" in rep["no cp dim"], rep
    assert "input_seq_dim" in rep["no input_seq_dim"], rep
    assert "length 15" in rep["uneven"] and "pad" in rep["uneven"], rep
    assert "tensor-parallel plan" in rep["plan"], rep
    assert rep["untouched"], rep
