"""Tensor-subclass parameters and FSDP2's all-gather extensions inside the recorded step.

A parameter may be a traceable tensor subclass (``__tensor_flatten__`` /
``__tensor_unflatten__``: ``TwoTensor``, torchao's float8 training weights). The graph holds
plain tensors only: such a parameter (and each optimizer state of its type) is one placeholder
per inner tensor, and the step is recorded with the subclass rebuilt around them, so its own
``__torch_dispatch__`` decides the ops recorded on the inner tensors (compute and optimizer).
The compiler honours subclasses whose inner tensors are plain and of the outer tensor's shape
(a dim-0 shard of the outer tensor is then the dim-0 shard of every inner one); any other raises
an ``UnsupportedError`` at the first call.

FSDP2's all-gather extensions (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): a parameter
(its class, or the instance) defining both ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``
is, under the sharded styles, unsharded inside the recorded step as FSDP2 unshards it:

- the pre hook runs on this rank's local shard (the unpadded rows; the 1-argument form
  ``(mesh)`` or the 5-argument form ``(mesh, outer_size, outer_stride, module, mp_policy)``) and
  returns the all-gather inputs and metadata;
- each input is all-gathered over the shard dim (functional collectives, as bytes where the
  backend cannot move its dtype) and viewed as ``(world * rows, ...)``, padding included;
- the post hook rebuilds the weight from the gathered outputs (``param_dtype`` is the policy's,
  else the parameter's dtype), narrowed to the parameter's size with ``as_strided``;
- the result is a new leaf: the forward computes with it (its own dispatch), and its gradient,
  copied into a plain tensor of the parameter's dtype (FSDP2 copies it into its reduce-scatter
  buffer) is the parameter's gradient that the expansion reduce-scatters.

Every op of the hooks is recorded once, when compiling, and runs in every step. The recorded
gather nodes are marked (``GATHERED`` on the placeholders, ``LOCAL_SHARD`` on the slices that
take this rank's rows) so the expansion shards the placeholders and leaves these gathers be
(passes/fully_shard.py). The ``out=`` form of the post hook is not called: the recorded step
computes the re-gathered weight afresh where FSDP2 refills its buffer with the same values.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from spmd_compiler.passes import meta

from ..errors import UnsupportedError
from .per_call_parameters import parameters_replaced_per_call
from ..torch_internals import is_traceable_wrapper_subclass, pytree

HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")
_GLOO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                torch.int8, torch.int32, torch.int64, torch.bool)


@dataclass(frozen=True)
class Flat:
    """How a subclass tensor flattens into plain inner tensors (and is rebuilt from them)."""

    cls: type
    names: tuple[str, ...]
    ctx: Any

    def build(self, inners, size=None, stride=None) -> torch.Tensor:
        first = inners[0]
        size = tuple(first.shape) if size is None else size
        stride = first.stride() if stride is None else stride
        return self.cls.__tensor_unflatten__(dict(zip(self.names, inners)), self.ctx, size, stride)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def flat_of(t: torch.Tensor) -> Flat | None:
    """The flattening of a subclass tensor (a DTensor's local tensor), None for a plain one."""
    t = _local(t)
    if not is_traceable_wrapper_subclass(t):
        return None
    names, ctx = t.__tensor_flatten__()
    return Flat(type(t), tuple(names), ctx)


def inner_tensors(t: Any) -> list:
    """The plain tensors the graph binds for ``t`` (its inner tensors for a subclass)."""
    if not isinstance(t, torch.Tensor) or not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def check_honourable(fqn: str, t: torch.Tensor) -> None:
    """Raise an UnsupportedError for a subclass parameter the compiler cannot honour."""
    local = _local(t)
    if getattr(type(local), "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__:
        return  # no dispatch of its own: recorded as the plain tensor it behaves as
    if not is_traceable_wrapper_subclass(local):
        raise UnsupportedError(
            f"parameter {fqn!r} is a {type(local).__name__}, a tensor subclass without "
            f"__tensor_flatten__/__tensor_unflatten__: the compiled step records plain tensors "
            f"and cannot record it")
    if local.is_meta:
        raise UnsupportedError(
            f"parameter {fqn!r} is a {type(local).__name__} on the meta device: the compiled "
            f"step's meta-device initialization makes plain tensors; materialize it first "
            f"(module.to_empty(device=...) and your initialization, as with FSDP2)")
    names, _ = local.__tensor_flatten__()
    for n in names:
        inner = getattr(local, n)
        if is_traceable_wrapper_subclass(inner) or tuple(inner.shape) != tuple(local.shape):
            raise UnsupportedError(
                f"parameter {fqn!r} ({type(local).__name__}): its inner tensor {n!r} is a "
                f"{type(inner).__name__} of shape {tuple(inner.shape)}; the compiled step "
                f"honours subclasses whose inner tensors are plain and of the parameter's shape "
                f"{tuple(local.shape)}")


def hooks_of(fqn: str, t: torch.Tensor) -> tuple[Callable, Callable] | None:
    """FSDP2's (pre, post) all-gather hooks of a parameter as functions of the tensor they run
    on (``fn(tensor, *args)``), None without hooks. One hook without the other raises."""
    local = _local(t)
    found = [hasattr(local, h) for h in HOOKS]
    if not any(found):
        return None
    if not all(found):
        have, lack = (HOOKS[0], HOOKS[1]) if found[0] else (HOOKS[1], HOOKS[0])
        raise UnsupportedError(
            f"parameter {fqn!r} ({type(local).__name__}) defines {have} but not {lack}: FSDP2's "
            f"all-gather extensions need both")
    return tuple(_unbound(local, h) for h in HOOKS)


def _unbound(t: torch.Tensor, name: str) -> Callable:
    attr = t.__dict__.get(name)
    if attr is None:  # the class's method
        return getattr(type(t), name)
    if isinstance(attr, types.MethodType):  # bound to the live tensor: rebind to another
        return attr.__func__
    return lambda _tensor, *args, **kwargs: attr(*args, **kwargs)  # as FSDP2 calls it


def copy_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Carry hooks set on a parameter instance over to the tensor that replaces it."""
    for h in HOOKS:
        attr = _local(old).__dict__.get(h)
        if attr is not None:
            setattr(_local(new), h, attr)


# ---------------------------------------------------------------------------------------------
# Tracing


@dataclass
class Unflattened:
    """The graph's view of the step's tensors: how many placeholders each takes and how to
    rebuild the subclass ones (filled while fakes are made, read inside the recorded step)."""

    flats: list[Flat | None] = field(default_factory=list)

    def fakes(self, t: torch.Tensor, fake_plain: Callable[[torch.Tensor], torch.Tensor],
              shape=None) -> list[torch.Tensor]:
        """Fakes for ``t`` (its inner tensors at the global shape for a subclass); remembers its
        flattening."""
        flat = flat_of(t)
        self.flats.append(flat)
        if flat is None:
            return [fake_plain(t)]
        local = _local(t)
        shape = tuple(t.shape) if shape is None else shape
        return [fake_plain(_meta_like(getattr(local, n), shape)) for n in flat.names]

    def rebuild(self, flat_values: list, start: int, count: int) -> list:
        """The ``count`` tensors from index ``start`` of ``self.flats`` out of the placeholders
        ``flat_values`` (consumed in order)."""
        out, it = [], iter(flat_values)
        for flat in self.flats[start:start + count]:
            if flat is None:
                out.append(next(it))
            else:
                out.append(flat.build([next(it) for _ in flat.names]))
        return out


def _meta_like(inner: torch.Tensor, shape) -> torch.Tensor:
    return torch.empty(shape, dtype=inner.dtype, device="meta")


def flatten_outputs(values: list) -> tuple[list, list[Flat | None]]:
    """Plain tensors for the graph's outputs, and the flattening of each value."""
    out, flats = [], []
    for v in values:
        flat = flat_of(v) if isinstance(v, torch.Tensor) else None
        flats.append(flat)
        out.extend(inner_tensors(v) if flat is not None else [v])
    return out, flats


def unflatten_outputs(values: list, flats: list[Flat | None]) -> list:
    """The inverse of ``flatten_outputs`` on the live outputs."""
    out, it = [], iter(values)
    for flat in flats:
        out.append(next(it) if flat is None else flat.build([next(it) for _ in flat.names]))
    return out


@dataclass(frozen=True)
class ShardContext:
    """Where this rank's shard lies: the shard dim's size, this rank's index on it, its process
    group's name, and the 1-D DeviceMesh handed to pre hooks (None when explaining without a
    process group)."""

    rank: int
    world: int
    group_name: str
    mesh: Any = None


@dataclass(frozen=True)
class Hooks:
    pre: Callable
    post: Callable
    pre_args: int  # 1: (mesh), 5: (mesh, outer_size, outer_stride, module, mp_policy)


def hooks_for(fqn: str, t: torch.Tensor) -> Hooks | None:
    """``hooks_of`` with the pre hook's form checked as FSDP2 checks it."""
    found = hooks_of(fqn, t)
    if found is None:
        return None
    bound = getattr(_local(t), HOOKS[0])
    n = len(inspect.signature(bound).parameters)
    if n not in (1, 5):
        raise UnsupportedError(
            f"parameter {fqn!r}: fsdp_pre_all_gather{inspect.signature(bound)} takes {n} "
            f"arguments; FSDP2's contract is (mesh) or (mesh, outer_size, outer_stride, module, "
            f"mp_policy)")
    return Hooks(found[0], found[1], n)


def _node(t: torch.Tensor):
    return get_proxy_slot(t, get_proxy_mode().tracer).proxy.node


def _local_shard(outer: torch.Tensor, shard: ShardContext) -> tuple[torch.Tensor, int]:
    """This rank's unpadded rows of ``outer`` (of each inner tensor, rebuilt), the slices marked
    LOCAL_SHARD; and the padded row count."""
    n = outer.shape[0]
    rows = -(-n // shard.world)
    start = min(shard.rank * rows, n)
    valid = max(0, min(rows, n - start))
    flat = flat_of(outer)
    plain = [outer] if flat is None else inner_tensors(outer)
    pieces = [torch.ops.aten.slice.Tensor(x, 0, start, start + valid) for x in plain]
    if flat is None:
        return pieces[0], rows
    return flat.build(pieces, (valid,) + tuple(outer.shape[1:]), pieces[0].stride()), rows


def _gather(t: torch.Tensor, shard: ShardContext, fqn: str) -> torch.Tensor:
    """All-gather ``t`` over the shard dim as FSDP2 does (flattened; a one-byte float dtype as
    bytes: gloo moves no float8); the result viewed as ``(world * rows, ...)``."""
    c10d = torch.ops._c10d_functional
    x = t.contiguous().view(-1)
    moved = x.view(torch.uint8) if x.dtype.is_floating_point and x.element_size() == 1 else x
    issued = c10d.all_gather_into_tensor(moved, shard.world, shard.group_name)
    node = _node(issued)
    out = c10d.wait_tensor(issued)
    node.meta.update({meta.ROLE: meta.Role.COLLECTIVE, meta.GATHERED: fqn,
                      meta.COLLECTIVE: dict(kind="all_gather", bytes=out.numel() * out.element_size(),
                                            params=[fqn], dtype=str(x.dtype))})
    _node(out).meta[meta.ROLE] = meta.Role.COLLECTIVE
    return out.view(x.dtype).view(-1, *t.shape[1:])


def unshard(fqn: str, outer: torch.Tensor, hooks: Hooks, shard: ShardContext, module, policy,
            described: list) -> torch.Tensor:
    """Record FSDP2's unshard of ``outer`` (a parameter at its global shape) through its
    all-gather extensions; return the unsharded weight (not yet a leaf). Appends what must agree
    across ranks (the gathered inputs' shapes and dtypes, the metadata's) to ``described``."""
    graph = get_proxy_mode().tracer.graph
    before = list(graph.nodes)[-1]
    local, rows = _local_shard(outer, shard)
    if hooks.pre_args == 1:
        inputs, metadata = hooks.pre(local, shard.mesh)
    else:
        stride = torch.empty(outer.shape, device="meta").stride()
        inputs, metadata = hooks.pre(local, shard.mesh, torch.Size(outer.shape), stride, module,
                                     policy or MixedPrecisionPolicy())  # FSDP2's default
    padded = torch.Size((rows,) + tuple(outer.shape[1:]))
    if local.shape != padded and any(t.shape != padded for t in inputs):
        raise UnsupportedError(
            f"parameter {fqn!r} is unevenly sharded (size {tuple(outer.shape)} over "
            f"{shard.world} ranks): fsdp_pre_all_gather must return all-gather inputs of the "
            f"padded shard size {tuple(padded)}, got {[tuple(t.shape) for t in inputs]}")
    described.append((fqn, [(tuple(t.shape), str(t.dtype)) for t in inputs],
                      _describe_metadata(metadata)))
    outputs = tuple(_gather(t, shard, fqn) for t in inputs)
    node = before.next
    while node is not graph._root:  # what ran on this rank's shard (and the gathers' views)
        node.meta[meta.LOCAL_SHARD] = local.shape[0]
        node = node.next
    param_dtype = policy.param_dtype if policy is not None and policy.param_dtype else outer.dtype
    result = hooks.post(local, outputs, metadata, param_dtype)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UnsupportedError(
            f"parameter {fqn!r}: fsdp_post_all_gather must return (unsharded tensor, tensors to "
            f"free) when called without out=, got {type(result).__name__}")
    full = result[0]
    if full.shape != outer.shape:  # the padding rows go, as FSDP2's as_strided drops them
        stride = torch.empty(outer.shape, device="meta").stride()
        full = torch.as_strided(full, outer.shape, stride, 0)
    return full


def _describe_metadata(metadata) -> str:
    """The metadata as ranks must agree on it: tensors by shape and dtype, the rest by repr."""
    leaves, spec = pytree.tree_flatten(metadata)
    return str(spec) + repr([(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor)
                             else repr(x) for x in leaves])


def _to_param_grad(param: torch.Tensor, fqn: str, grad_nodes: dict) -> Callable:
    """A post-accumulate-grad hook for an unsharded leaf: its gradient, as a plain tensor of the
    parameter's dtype (a subclass gradient copied into one by its own dispatch, as FSDP2 copies
    it into its reduce-scatter buffer), becomes ``param.grad``."""

    def hook(leaf: torch.Tensor) -> None:
        g = leaf.grad
        if flat_of(g) is not None or g.dtype != param.dtype:
            plain = torch.empty(g.shape, dtype=param.dtype, device=g.device)
            plain.copy_(g)
        else:
            plain = g.detach()
        param.grad = plain if param.grad is None else param.grad + plain
        grad_nodes.setdefault(fqn, []).append(_node(param.grad))

    return hook


@contextlib.contextmanager
def gathered_forward(module: torch.nn.Module, hooked: dict[str, Hooks],
                     fakes: dict[str, torch.Tensor], shard: ShardContext | None, policy,
                     grad_nodes: dict, described: list):
    """While active, each outermost call of ``module`` runs with every parameter in ``hooked``
    (fqn -> hooks; ``fakes``: fqn -> its recorded parameter) replaced by the leaf ``unshard``
    records for it (the slots hold the parameters again after the call, also when it raises)."""
    if not hooked or shard is None:
        yield
        return
    by_id = {id(fakes[f]): f for f in hooked}

    def leaf_of(owner, p):
        fqn = by_id.get(id(p))
        if fqn is None:
            return None
        with torch.no_grad():
            full = unshard(fqn, p, hooked[fqn], shard, owner, policy, described)
        leaf = full.detach().requires_grad_(p.requires_grad)
        leaf._spmd_unsharded = True  # mixed precision leaves it as the hook made it
        if p.requires_grad:
            leaf.register_post_accumulate_grad_hook(_to_param_grad(p, fqn, grad_nodes))
        return leaf

    with parameters_replaced_per_call(module, leaf_of):
        yield


def hooked_parameters(named: dict[str, torch.Tensor], sharded: bool) -> dict[str, Hooks]:
    """fqn -> hooks of the parameters whose unshard the step records (sharded styles); every
    subclass parameter checked first. A subclass parameter without hooks cannot be sharded."""
    hooked = {}
    for fqn, p in named.items():
        check_honourable(fqn, p)
        hooks = hooks_for(fqn, p)
        if hooks is not None and sharded:
            hooked[fqn] = hooks
        elif sharded and flat_of(p) is not None:
            raise UnsupportedError(
                f"parameter {fqn!r} is a {type(_local(p)).__name__} without FSDP2's all-gather "
                f"extensions (fsdp_pre_all_gather / fsdp_post_all_gather): a sharded step "
                f"gathers a subclass parameter only as its hooks say; define them, or use "
                f"DataParallel('replicate')")
    return hooked


def plain_grad(param: torch.Tensor) -> torch.Tensor:
    """Replace a subclass ``param.grad`` by a plain copy of the parameter's dtype (what DDP's and
    FSDP2's flat buffers receive from it); return the gradient."""
    g = param.grad
    if flat_of(g) is not None:
        plain = torch.empty(g.shape, dtype=param.dtype, device=g.device)
        plain.copy_(g)
        param.grad = plain
    return param.grad


def placeholders_of(it, flat: Flat | None) -> list:
    """The next placeholders of ``it`` that hold one tensor (one per inner tensor of a subclass)."""
    return [next(it) for _ in (flat.names if flat is not None else (None,))]


def mark_gathered(gm: torch.fx.GraphModule, hooked: dict[str, Hooks], described: list) -> None:
    """GATHERED on the PARAM placeholders of the parameters whose unshard was recorded;
    ``gm.meta[GATHER_EXTENSIONS]``: what the ranks must agree on."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get(meta.ROLE) == meta.Role.PARAM and (
                node.meta.get(meta.PARAM_FQN) in hooked):
            node.meta[meta.GATHERED] = node.meta[meta.PARAM_FQN]
    if described:
        gm.meta[meta.GATHER_EXTENSIONS] = described
    for node in gm.graph.nodes:  # the hooks' own collectives (torchao's amax all-reduce)
        if getattr(node.target, "namespace", None) == "_c10d_functional" and (
                meta.ROLE not in node.meta):
            node.meta[meta.ROLE] = meta.Role.COLLECTIVE
            kind = node.target.__name__.split(".")[0]
            if kind != "wait_tensor":
                val = node.meta.get("val")
                node.meta[meta.COLLECTIVE] = dict(
                    kind=kind, params=[],
                    bytes=val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0)


def shard_context(mode, mesh=None, dims=None) -> ShardContext | None:
    """This rank's ShardContext under a sharded style (None otherwise): from ``mesh`` (its
    innermost dim, its group called as in ``dims``: the names the program holds), else from
    ``dims`` ((group name, size) per mesh dim; rank 0, no mesh: what ``explain`` shows without
    a process group)."""
    if mode.parallel_style not in ("fully_shard", "hybrid_shard"):
        return None
    if mesh is None:
        name, size = dims[-1]
        return ShardContext(0, size, name)
    d = mesh.ndim - 1
    shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[d]]
    name = dims[-1][0] if dims else mesh.get_group(d).group_name
    return ShardContext(mesh.get_local_rank(d), mesh.size(d), name, shard_mesh)


def extension_key(module: torch.nn.Module, named: list | None = None) -> tuple:
    """The parameters that carry an all-gather hook (a step key component: hooks set on a
    parameter after a compile make another program); ``named``: ``module``'s
    ``named_parameters()``, if at hand."""
    return tuple(name for name, p in (module.named_parameters() if named is None else named)
                 if any(hasattr(_local(p), h) for h in HOOKS))


@dataclass
class Recording:
    """What one recording of the step needs for subclass parameters and all-gather extensions:
    the flattenings, the hooked parameters, this rank's shard, what the ranks must agree on."""

    unflat: Unflattened
    hooked: dict[str, Hooks]
    shard: ShardContext | None
    described: list = field(default_factory=list)
    out_flats: tuple = ()
    new_state_flats: tuple = ()

    @staticmethod
    def of(named: dict[str, torch.Tensor], states: list, fake_plain, shard,
           leaf=lambda p: p.requires_grad) -> tuple:
        """The Recording and the fakes of ``named`` parameters (placeholder order) and of the
        ``states`` tensors (one list per tensor, a fake per inner tensor). ``leaf(p)``: whether a
        plain parameter's placeholder is the leaf that requires grad."""
        rec = Recording(Unflattened(), hooked_parameters(named, shard is not None), shard)
        fake_params = []
        for p in named.values():
            fakes = rec.unflat.fakes(p, fake_plain)
            if rec.unflat.flats[-1] is None:  # a subclass's requires_grad goes on the rebuilt one
                fakes[0].requires_grad_(leaf(p))
            fake_params += fakes
        fake_states = [f for v in states for f in rec.unflat.fakes(v, fake_plain)]
        return rec, fake_params, fake_states

    def rebuild(self, params: list, live_params: list, states: list) -> tuple[list, list]:
        """The recorded parameters and states rebuilt from their placeholders."""
        n = len(live_params)
        params = self.unflat.rebuild(params, 0, n)
        for p, fp, f in zip(live_params, params, self.unflat.flats):
            if f is not None:
                fp.requires_grad_(p.requires_grad)
        return params, self.unflat.rebuild(states, n, len(self.unflat.flats) - n)

    def flatten(self, traced_out: list, new_states: list) -> list:
        """The graph's plain outputs for the step's tensor outputs and created states."""
        out, self.out_flats = flatten_outputs(traced_out)
        states, self.new_state_flats = flatten_outputs(new_states)
        return out + states

    def signature_fields(self, num_params: int) -> dict:
        flats = self.unflat.flats
        return dict(param_flats=tuple(flats[:num_params]), state_flats=tuple(flats[num_params:]),
                    user_flats=tuple(self.out_flats), new_state_flats=tuple(self.new_state_flats))


def per_placeholder(names, flats) -> list:
    """``names`` repeated once per graph input of each (its inner tensors for a subclass)."""
    if not flats:
        return list(names)
    return [n for n, f in zip(names, flats) for _ in (f.names if f is not None else (None,))]
