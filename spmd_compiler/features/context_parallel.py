"""Context parallelism: the sequence sharded over a mesh dim named ``cp``, for any attention.

``DataParallel(style, input_seq_dim=1)`` on a mesh with a ``cp`` dim (``("dp", "cp")``): every
rank of a cp group passes the same full-length rows; each keeps its contiguous piece of the
sequence (``Shard(seq)`` on ``cp``). The step is recorded through DTensor as a tensor-parallel
plan is (features/tensor_parallel.py): every parameter is a DTensor ``Replicate()`` on ``cp``
(the plan this module makes), every input with a sequence dim a DTensor ``Shard(seq)``, and
DTensor's own sharding rules decide what crosses the pieces. Plain tensors the step makes
(``arange`` positions, ``tril`` masks, rotary tables) are replicated implicitly and cut to each
rank's rows where they meet the sharded activations, so positions are global. Reductions over the
sequence (the loss) are ``Partial`` and reduced; a parameter's gradient is the sum over ``cp``
(one device's), averaged over ``dp`` as data parallelism's.

DTensor has no rule for CPU's attention kernel (``_scaled_dot_product_flash_attention_for_cpu``);
this module's handlers take its place while recording: keys and values are all-gathered over
``cp``, each rank attends with its own queries (under a causal mask exchanged first into torch's
head-and-tail pieces, so every rank attends as many keys; each piece attends the keys before it
whole and its own block causally, merged by log-sum-exp), and the backward reduce-scatters the
keys' and values' gradients back to their pieces. Attention written out (``q @ k.transpose``,
``masked_fill``, ``softmax``) goes through DTensor's rules for those ops. Where DTensor's rule is
missing or wrong the handlers here replace it too: a mean cross-entropy over sharded pieces,
``torch.cat`` with an empty 1-D tensor.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ..errors import ContextParallelError
from ..torch_internals import (dtensor_op_handlers, funcol, guarded_split_factors,
                               implicit_replication, is_dim_shard, local_tensor)

aten = torch.ops.aten

CP = "cp"  # the mesh dim the sequence is sharded over


def cp_mesh(mesh) -> Any:
    """The ``cp`` dim of ``mesh`` (a 1-D mesh), or None."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh[CP] if CP in names else None


def check(mode, mesh) -> None:
    """Raise a ContextParallelError unless ``input_seq_dim`` and a ``cp`` mesh dim come together."""
    asked = mode.input_seq_dim is not None
    has = mesh is not None and cp_mesh(mesh) is not None
    if asked and not has:
        raise ContextParallelError(
            f"DataParallel(input_seq_dim={mode.input_seq_dim!r}) shards the sequence over a mesh "
            f"dim named 'cp'; give spmd_compile(mesh=init_device_mesh('cpu', (dp, cp), "
            f"mesh_dim_names=('dp', 'cp'))), got mesh={mesh}")
    if has and not asked:
        raise ContextParallelError(
            f"the step's mesh {mesh} has a dim named 'cp' but DataParallel has no input_seq_dim: "
            f"say which dim of each input is the sequence, e.g. DataParallel(style, "
            f"input_seq_dim=1)")


# ---------------------------------------------------------------------------------------------
# The call: parameters replicated over cp once, inputs cut to this rank's rows every call


def place_parameters(module: torch.nn.Module, optimizers: list, mesh) -> None:
    """Make every plain parameter (and its optimizer state) a DTensor ``Replicate()`` on the cp
    dim of ``mesh``, the values of the cp group's first rank; parameters already placed are left."""
    cp = cp_mesh(mesh)
    seen: dict[int, torch.nn.Parameter] = {}
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and not _made_here(p):
            raise ContextParallelError(
                f"parameter {name!r} is a DTensor of a tensor-parallel plan ({p.placements} on "
                f"{p.device_mesh}); context parallelism does not compose with a plan yet: "
                f"compile the model without parallelize_module, or without input_seq_dim")
        if isinstance(p, DTensor) or id(p) in seen:
            continue
        dt = distribute_tensor(p.detach(), cp, [Replicate()])
        new = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
        new._spmd_context = True
        seen[id(p)] = new
    if not seen:
        return
    for _, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is not None and id(p) in seen:
                sub._parameters[name] = seen[id(p)]
    for opt in optimizers:
        for g in opt.param_groups:
            g["params"] = [seen.get(id(p), p) for p in g["params"]]
        state = defaultdict(dict)
        for p, st in opt.state.items():
            np_ = seen.get(id(p), p)
            state[np_] = {k: (distribute_tensor(v, cp, [Replicate()])
                              if isinstance(v, torch.Tensor) and v.dim() > 0 and np_ is not p else v)
                          for k, v in st.items()}
        opt.state = state


def _made_here(p: DTensor) -> bool:
    plan = getattr(p, "_spmd_plan", None)
    return getattr(p, "_spmd_context", False) or (plan is not None and plan.context)


def shard_inputs(leaves: list, input_indices: list[int], seq_dims: list, mesh) -> list:
    """``leaves`` with every input that has a sequence dim replaced by a DTensor ``Shard(seq)``
    on the cp dim around this rank's contiguous piece of it, every other input by a DTensor
    ``Replicate()`` (a plain tensor of a symbolic batch size cannot meet a DTensor)."""
    cp = cp_mesh(mesh)
    rank, size = cp.get_local_rank(), cp.size()
    out = list(leaves)
    for i, d in zip(input_indices, seq_dims):
        t = leaves[i]
        if isinstance(t, DTensor):
            continue
        if d is None:  # the same on every rank of the group (a DTensor, as the step's others)
            out[i] = DTensor.from_local(t, cp, [Replicate()], run_check=False)
            continue
        n = t.shape[d]
        if n % size:
            raise ContextParallelError(
                f"an input of shape {tuple(t.shape)} has sequence dim {d} of length {n}, which "
                f"the {size} ranks of the cp dim cannot split evenly; pad the sequence to a "
                f"multiple of {size}")
        piece = n // size
        out[i] = DTensor.from_local(t.narrow(d, rank * piece, piece).contiguous(), cp, [Shard(d)],
                                    run_check=False, shape=t.shape, stride=t.stride())
    return out


# ---------------------------------------------------------------------------------------------
# Recording


@contextlib.contextmanager
def recording(inputs: list):
    """While the step is recorded with cp-sharded ``inputs``: plain tensors the step makes are
    replicated implicitly, and CPU attention goes through this module's handlers."""
    if not any(isinstance(t, DTensor) and _cp_dim(t) is not None for t in inputs):
        yield
        return
    with implicit_replication(), guarded_split_factors(), dtensor_op_handlers({
            aten._scaled_dot_product_flash_attention_for_cpu.default: _attention,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _attention_backward,
            aten.cat.default: _cat, aten.nll_loss_forward.default: _nll_loss,
            aten.nll_loss_backward.default: _nll_loss_backward}):
        yield


def output_value(v: Any) -> Any:
    """A step output as the step returns it: a DTensor on a cp mesh whole (a ``Partial`` loss
    reduced, a sequence-sharded output gathered), anything else as is."""
    if isinstance(v, DTensor) and _cp_dim(v) is not None:
        return v.redistribute(v.device_mesh, [Replicate()] * v.device_mesh.ndim)
    return v


def _cp_dim(t: DTensor) -> int | None:
    names = t.device_mesh.mesh_dim_names or ()
    return names.index(CP) if CP in names else None


def _seq_sharded(t: Any, d: int, seq: int) -> bool:
    return isinstance(t, DTensor) and _shard_dim(t.placements[d]) == seq


def _shard_dim(p) -> int | None:
    """The dim ``p`` shards in contiguous pieces: ``Shard(d)``, or ``_StridedShard(d)`` of
    split factor 1 (the same layout; DTensor's view rule makes it for a batch of one)."""
    return p.dim if is_dim_shard(p) and getattr(p, "split_factor", 1) == 1 else None


def _whole_keys(t: DTensor, d: int, seq: int) -> torch.Tensor:
    """The keys (or values) of every rank of the cp group, this rank's other dims' pieces."""
    if _shard_dim(t.placements[d]) == seq:
        return funcol.all_gather_single(local_tensor(t).contiguous(), seq, (t.device_mesh, d))
    if t.placements[d] == Replicate():
        return local_tensor(t)
    return local_tensor(t.redistribute(t.device_mesh, _with(t.placements, d, Replicate())))


def _with(placements, d: int, p) -> tuple:
    return tuple(p if i == d else q for i, q in enumerate(placements))


def _blocks(first: int, rows: int, keys: int, is_causal: bool, mask) -> list:
    """The key blocks the query rows ``first .. first + rows`` attend, as (first key, end,
    causal, mask): under a causal mask the keys before the rows whole and the rows' own block
    causally (a square block: SDPA's ``is_causal`` is right there), the keys after them not at
    all; else every key (under a mask the step gave, cut to the rows)."""
    if mask is not None or not is_causal:
        return [(0, keys, False, mask)]
    return ([(0, first, False, None)] if first else []) + [(first, first + rows, True, None)]


def _query_pieces(q: DTensor, attn_mask, is_causal: bool, d: int, seq: int) -> list:
    """(offset in the local rows, rows, first global row, mask) of each piece of this rank's
    queries. Under a causal mask without one of the step's the queries are first exchanged into
    head-and-tail pieces (:func:`_balanced`): rank r of n holds the sequence's pieces r and
    2n - 1 - r of 2n, so every rank attends as many keys. Else its contiguous piece."""
    rows = local_tensor(q).shape[seq]
    rank = q.device_mesh.get_local_rank(d)
    if _balances(q, attn_mask, is_causal, d, seq):
        half, n = rows // 2, q.device_mesh.size(d)
        return [(0, half, rank * half, None), (half, half, (2 * n - 1 - rank) * half, None)]
    mask = attn_mask
    if mask is not None:
        if isinstance(mask, DTensor):
            mask = local_tensor(_whole(mask))
        if mask.shape[-2] != 1:
            mask = mask.narrow(-2, rank * rows, rows)
    return [(0, rows, rank * rows, mask)]


def _balances(q: DTensor, attn_mask, is_causal: bool, d: int, seq: int) -> bool:
    return (is_causal and attn_mask is None and q.device_mesh.size(d) > 1
            and local_tensor(q).shape[seq] % 2 == 0)


def _holder(j: int, n: int, balanced: bool) -> int:
    """The cp rank holding piece ``j`` of the sequence's 2n: contiguous (rank r: pieces 2r and
    2r + 1) or head-and-tail (rank r: pieces r and 2n - 1 - r)."""
    return (j if j < n else 2 * n - 1 - j) if balanced else j // 2


def _balanced(x: torch.Tensor, seq: int, mesh, d: int, to_balanced: bool) -> torch.Tensor:
    """This rank's rows of ``x`` (sharded on ``seq``) moved between the contiguous and the
    head-and-tail layouts, each rank's two pieces in sequence order: one all_to_all."""
    n, me = mesh.size(d), mesh.get_local_rank(d)
    src, dst = (lambda j: _holder(j, n, not to_balanced)), (lambda j: _holder(j, n, to_balanced))
    have = [j for j in range(2 * n) if src(j) == me]
    pieces = dict(zip(have, x.chunk(2, dim=seq)))
    rows = pieces[have[0]].shape[seq]
    send = sorted(have, key=lambda j: (dst(j), j))
    given = torch.cat([pieces[j].movedim(seq, 0) for j in send]).contiguous()
    get = [j for r in range(n) for j in range(2 * n) if src(j) == r and dst(j) == me]
    got = funcol.all_to_all_single(
        given, [rows * sum(1 for j in get if src(j) == r) for r in range(n)],
        [rows * sum(1 for j in send if dst(j) == r) for r in range(n)], (mesh, d))
    got = dict(zip(get, got.chunk(2, dim=0)))
    return torch.cat([got[j] for j in sorted(got)]).movedim(0, seq)


def _merged(parts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention's (output, logsumexp) from those of its key blocks (in float32, as
    torch's ring attention merges them)."""
    out, lse = parts[0]
    dtype = out.dtype
    out, lse = out.float(), lse.float()
    for o, l in parts[1:]:
        o, l = o.float(), l.float()
        out = out - torch.sigmoid(l - lse).unsqueeze(-1) * (out - o)
        lse = lse - torch.nn.functional.logsigmoid(lse - l)
    return out.to(dtype), lse


def _cat(op, args, kwargs, own):
    """``torch.cat`` skips 1-D empty tensors among others of more dims (a legacy rule Hugging
    Face's key-value cache relies on: it starts from ``torch.tensor([])``); DTensor's rule does
    not."""
    tensors = args[0]
    kept = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    if kept and len(kept) < len(tensors) and any(t.dim() > 1 for t in kept):
        if len(kept) == 1:
            return kept[0].clone()
        args = (kept, *args[1:])
    return own(op, args, kwargs)


_MEAN, _SUM = 1, 2  # torch's reduction enum


def _nll_loss(op, args, kwargs, own):
    """A mean loss over a sharded target is the sum of every piece's losses over the sum of
    their weights (DTensor's rule averages the pieces' means, wrong where ``ignore_index``
    leaves the pieces different counts: the shifted labels' last position)."""
    inp, target, weight, reduction, ignore_index = args
    if reduction != _MEAN or not (_sharded(inp) or _sharded(target)):
        return own(op, args, kwargs)
    total, weights = own(op, (inp, target, weight, _SUM, ignore_index), {})
    total, weights = _whole(total), _whole(weights)
    return total / weights, weights


def _nll_loss_backward(op, args, kwargs, own):
    grad, inp, target, weight, reduction, ignore_index, weights = args
    if reduction != _MEAN or not (_sharded(inp) or _sharded(target)):
        return own(op, args, kwargs)
    return own(op, (grad / weights, inp, target, weight, _SUM, ignore_index, weights), {})


def _sharded(t) -> bool:
    return isinstance(t, DTensor) and any(is_dim_shard(p) for p in t.placements)


def _whole(t: DTensor) -> DTensor:
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)


def _attention(op, args, kwargs, own):
    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    attn_mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    d, seq = _cp_dim(q), q.dim() - 2
    if not _seq_sharded(q, d, seq):
        q = q.redistribute(q.device_mesh, _with(q.placements, d, Shard(seq)))
    _no_dropout(dropout_p)
    kk, vv = _whole_keys(k, d, seq), _whole_keys(v, d, seq)
    balanced = _balances(q, attn_mask, is_causal, d, seq)
    ql = _balanced(local_tensor(q), seq, q.device_mesh, d, True) if balanced else local_tensor(q)
    outs, lses = [], []
    for at, rows, first, mask in _query_pieces(q, attn_mask, is_causal, d, seq):
        piece = ql.narrow(seq, at, rows)
        out, lse = _merged([op(piece, kk[..., a:b, :], vv[..., a:b, :], 0.0, causal,
                               attn_mask=m, scale=scale)
                            for a, b, causal, m in _blocks(first, rows, kk.shape[seq], is_causal,
                                                           mask)])
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=seq), torch.cat(lses, dim=seq)
    if balanced:
        out = _balanced(out, seq, q.device_mesh, d, False)
        lse = _balanced(lse, seq, q.device_mesh, d, False)
    shape = (*q.shape[:-1], v.shape[-1])
    # (contiguous: the DTensor says so, and DTensor decides views by the strides it says)
    out, lse = out.contiguous(), lse.contiguous()
    return (DTensor.from_local(out, q.device_mesh, q.placements, run_check=False,
                               shape=torch.Size(shape), stride=_contiguous(shape)),
            DTensor.from_local(lse, q.device_mesh, q.placements, run_check=False,
                               shape=q.shape[:-1], stride=_contiguous(q.shape[:-1])))


def _attention_backward(op, args, kwargs, own):
    """Each key block's gradients from the merged output and logsumexp (what flash attention's
    backward reads: the block's share of every row's softmax follows from them)."""
    grad_out, q, k, v, out, lse = args[:6]
    dropout_p, is_causal = args[6], args[7]
    attn_mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    d, seq = _cp_dim(q), q.dim() - 2
    _no_dropout(dropout_p)
    mesh, placements = q.device_mesh, q.placements
    grad_out = grad_out.redistribute(mesh, placements)
    kk, vv = _whole_keys(k, d, seq), _whole_keys(v, d, seq)
    total = kk.shape[seq]
    balanced = _balances(q, attn_mask, is_causal, d, seq)
    mine = [local_tensor(t) for t in (grad_out, q, out, lse)]
    if balanced:
        mine = [_balanced(t, seq, mesh, d, True) for t in mine]
    gqs, gk, gv = [], None, None
    for at, rows, first, mask in _query_pieces(q, attn_mask, is_causal, d, seq):
        g, qp, o, l = (t.narrow(seq, at, rows) for t in mine)
        parts = [op(g, qp, kk[..., a:b, :], vv[..., a:b, :], o, l.contiguous(), 0.0, causal,
                    attn_mask=m, scale=scale)
                 for a, b, causal, m in _blocks(first, rows, total, is_causal, mask)]
        gq = parts[0][0]
        for p in parts[1:]:
            gq = gq + p[0]
        gqs.append(gq)
        pk = _padded(torch.cat([p[1] for p in parts], dim=seq), total, seq)
        pv = _padded(torch.cat([p[2] for p in parts], dim=seq), total, seq)
        gk, gv = (pk, pv) if gk is None else (gk + pk, gv + pv)
    gq = torch.cat(gqs, dim=seq)
    if balanced:
        gq = _balanced(gq, seq, mesh, d, False)
    return (DTensor.from_local(gq.contiguous(), mesh, placements, run_check=False, shape=q.shape,
                               stride=_contiguous(q.shape)),
            _key_grad(gk, k, total, d, seq), _key_grad(gv, v, total, d, seq))


def _padded(g: torch.Tensor, total: int, seq: int) -> torch.Tensor:
    """``g`` (gradients of the first keys) with zeros for the keys after them, to ``total``."""
    if g.shape[seq] == total:
        return g
    return torch.nn.functional.pad(g, [0, 0] * (g.dim() - 1 - seq) + [0, total - g.shape[seq]])


def _key_grad(g: torch.Tensor, like: DTensor, total: int, d: int, seq: int) -> DTensor:
    """This rank's part of the gradient of every key, summed over the cp group into each rank's
    piece (a reduce-scatter), or left ``Partial`` for keys replicated over cp."""
    mesh = like.device_mesh
    if _shard_dim(like.placements[d]) == seq:
        g = funcol.reduce_scatter_single(g.contiguous(), "sum", seq, (mesh, d))
        placements = like.placements
    else:
        placements = _with(like.placements, d, Partial())
    return DTensor.from_local(g, mesh, placements, run_check=False, shape=like.shape,
                              stride=_contiguous(like.shape))


def _no_dropout(p: float) -> None:
    if p:
        raise ContextParallelError(
            f"scaled_dot_product_attention with dropout_p={p} under context parallelism: the "
            f"dropout of keys gathered from other ranks would not be one device's; use "
            f"dropout_p=0 in the attention (dropout elsewhere in the model is fine)")


def _contiguous(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc = acc * s
    return tuple(reversed(stride))
