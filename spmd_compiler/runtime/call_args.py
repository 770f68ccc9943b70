"""One call's arguments: the module, the optimizers, the batch leaves (``StepArgs``,
``split_step_args``), the lifted learning rates (and a momentum a scheduler cycles:
``group_inputs``), flattened cheaply on every call.

``pytree.tree_flatten`` builds a new ``TreeSpec`` on every call, and the step key prints it
(``spec_text``). A call whose arguments are leaves and plain tuples and lists (the usual
``step(model, optim, (x, y))``) reuses the spec made the first time that shape of arguments
was seen: same leaves, same order, the same spec object, its text printed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import BatchDimError, StepSignatureError
from ..torch_internals import marked_dynamic_dims, pytree
from .step_modules import argument_names, held_state, step_root

_SPECS: dict[tuple, Any] = {}  # the shape of the arguments (``_shape``) -> its TreeSpec
_TEXTS: dict[int, tuple[Any, str]] = {}  # id(spec) -> (spec, str(spec)), the spec kept alive
_LEAF: dict[type, bool] = {}  # is a value of this type a pytree leaf?
_LIMIT = 256  # entries kept before the caches start over


def flatten_step_args(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """``pytree.tree_flatten((args, kwargs))``, with the spec reused when it can be."""
    leaves: list = []
    shape = None if kwargs else _shape(args, leaves)
    spec = _SPECS.get(shape) if shape is not None else None
    if spec is not None:
        return leaves, spec
    full, spec = pytree.tree_flatten((args, kwargs))
    if shape is not None and len(full) == len(leaves) and all(a is b for a, b in zip(full, leaves)):
        if len(_SPECS) >= _LIMIT:
            _SPECS.clear()
        _SPECS[shape] = spec
    return full, spec


def spec_text(spec: Any) -> str:
    """``str(spec)``, printed once per spec object."""
    known = _TEXTS.get(id(spec))
    if known is not None and known[0] is spec:
        return known[1]
    if len(_TEXTS) >= _LIMIT:
        _TEXTS.clear()
    text = str(spec)
    _TEXTS[id(spec)] = (spec, text)
    return text


def _shape(x: Any, leaves: list) -> tuple | int | None:
    """Append ``x``'s leaves to ``leaves``; return the shape of its plain tuples and lists (0
    for a leaf), or None when it holds another container."""
    kind = type(x)
    if kind is tuple or kind is list:
        parts = []
        for child in x:
            part = _shape(child, leaves)
            if part is None:
                return None
            parts.append(part)
        return (kind, tuple(parts))
    leaf = _LEAF.get(kind)
    if leaf is None:
        leaf = _LEAF[kind] = pytree.tree_is_leaf(x)
    if not leaf:
        return None
    leaves.append(x)
    return 0


LIFTED_HPARAMS = ("lr",)


@dataclass
class StepArgs:
    """The step's arguments, split into what the compiler treats differently."""

    # the step's module, or the root holding its several modules by argument name
    # (runtime/step_modules.py)
    module: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    leaves: list[Any]  # flat leaves of (args, kwargs)
    spec: pytree.TreeSpec
    module_indices: list[int]
    optimizer_indices: list[int]
    input_indices: list[int]  # positions in `leaves` of tensor inputs
    batch_dims: list[int | None]  # one per input
    # input leaf -> dims declared dynamic (DataParallel(dynamic_dims=...), mark_dynamic)
    dynamic_dims: dict[int, tuple[int, ...]] = field(default_factory=dict)
    seq_dims: list[int | None] = field(default_factory=list)  # one per input (context parallel)

    def leaf_name(self, i: int) -> str:
        """How the user would name argument leaf ``i`` (``argument 2[0]``, ``keyword argument 'x'``)."""
        paths = [p for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(
            list(range(len(self.leaves))), self.spec))[0]]
        path = paths[i]
        head = f"argument {path[1].idx}" if path[0].idx == 0 else f"keyword argument {path[1].key!r}"
        return head + pytree.keystr(path[2:])


def split_step_args(args: tuple, kwargs: dict, input_batch_dim: Any,
                    dynamic_dims: Any = None, fn: Callable | None = None,
                    input_seq_dim: Any = None) -> StepArgs:
    """Find the module(s), the optimizer(s) and the batch leaves among the step's arguments.
    Several modules (also inside tuples, lists and dicts) are held by one root, each named by
    its argument in ``fn``'s signature (runtime/step_modules.py).

    ``dynamic_dims`` (an int, or a pytree of ints/None over the batch arguments) names a
    non-batch dim per input to trace as a symbolic size; so does ``torch._dynamo.mark_dynamic``
    on an input tensor."""
    leaves, spec = flatten_step_args(args, kwargs)
    modules = [i for i, x in enumerate(leaves) if isinstance(x, torch.nn.Module)]
    optimizers = [i for i, x in enumerate(leaves) if isinstance(x, torch.optim.Optimizer)]
    held, holders = held_state(leaves)  # inside dataclass arguments
    held_modules = [(j, path, m) for j, path, m in held if isinstance(m, torch.nn.Module)]
    if not modules and not held_modules:
        raise StepSignatureError(
            "the step must receive its torch.nn.Module(s) among its arguments (none found); the "
            "compiled step places and records every module it receives.")
    if len(modules) + len(held_modules) == 1:
        root = leaves[modules[0]] if modules else held_modules[0][2]
    else:
        names = argument_names(fn, args, kwargs)
        root = step_root([(names[i], leaves[i]) for i in modules]
                         + [(f"{names[j]}.{path}", m) for j, path, m in held_modules])
    optimizer_objects = [leaves[i] for i in optimizers] + [
        o for _, _, o in held if isinstance(o, torch.optim.Optimizer)]
    if not optimizer_objects:
        raise StepSignatureError(
            "the step must receive its torch.optim.Optimizer as an argument (none found); the "
            "compiled step records optimizer.step() together with forward and backward."
        )
    inputs = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    batch_dims = _batch_dims_for_inputs(args, kwargs, leaves, inputs, input_batch_dim)
    return StepArgs(
        module=root,
        optimizers=optimizer_objects,
        leaves=leaves,
        spec=spec,
        module_indices=sorted(modules + holders),  # (a dataclass holding state is no constant)
        optimizer_indices=optimizers,
        input_indices=inputs,
        batch_dims=batch_dims,
        dynamic_dims=_declared_dynamic_dims(args, kwargs, leaves, inputs, dynamic_dims),
        seq_dims=_seq_dims(args, kwargs, leaves, inputs, input_seq_dim),
    )


def _per_input(args, kwargs, leaves, inputs, value, name: str) -> dict[int, Any]:
    """Broadcast ``value`` (an int or None, or a pytree of them over the batch arguments) to
    each input leaf."""
    if value is None or isinstance(value, int):
        return {i: value for i in inputs}

    def is_state(x):
        return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))

    batch_args = tuple(a for a in args if not is_state(a))
    batch_kwargs = {k: v for k, v in kwargs.items() if not is_state(v)}
    target = batch_args[0] if len(batch_args) == 1 and not batch_kwargs else (
        (batch_args, batch_kwargs) if batch_kwargs else batch_args
    )
    target_leaves, target_spec = pytree.tree_flatten(target)
    flat = pytree._broadcast_to_and_flatten(value, target_spec)
    if flat is None:
        raise BatchDimError(
            f"{name} {value!r} does not match the structure of the batch arguments "
            f"({target_spec}); give an int, or a pytree of ints/None shaped like the batch."
        )
    by_id = {id(leaf): d for leaf, d in zip(target_leaves, flat)}
    return {i: by_id.get(id(leaves[i])) for i in inputs}


def _declared_dynamic_dims(args, kwargs, leaves, inputs, dynamic_dims) -> dict[int, tuple[int, ...]]:
    """Per input leaf, the dims declared dynamic by ``dynamic_dims`` or ``mark_dynamic``."""
    given = _per_input(args, kwargs, leaves, inputs, dynamic_dims, "dynamic_dims")
    out = {}
    for i in inputs:
        t = leaves[i]
        dims = marked_dynamic_dims(t)  # torch._dynamo.mark_dynamic
        if given[i] is not None:
            d = given[i]
            if not -t.dim() <= d < t.dim():
                raise BatchDimError(
                    f"dynamic_dims={d} is out of range for an input of shape {tuple(t.shape)} "
                    f"(argument leaf {i}); give a pytree with None for inputs without that dim."
                )
            dims.add(d % t.dim())
        if dims:
            out[i] = tuple(sorted(dims))
    return out


def _seq_dims(args, kwargs, leaves, inputs, input_seq_dim) -> list[int | None]:
    """Per input, its sequence dim (``input_seq_dim`` broadcast; None: none, or not asked)."""
    if input_seq_dim is None:
        return []
    given = _per_input(args, kwargs, leaves, inputs, input_seq_dim, "input_seq_dim")
    out = []
    for i in inputs:
        d, t = given[i], leaves[i]
        if d is not None and not -t.dim() <= d < t.dim():
            raise BatchDimError(
                f"input_seq_dim={d} is out of range for an input of shape {tuple(t.shape)} "
                f"(argument leaf {i}); give a pytree with None for inputs without a sequence dim.")
        out.append(None if d is None else d % t.dim())
    return out


def _batch_dims_for_inputs(args, kwargs, leaves, inputs, input_batch_dim) -> list[int | None]:
    """Broadcast ``input_batch_dim`` (an int, or a pytree over the batch arguments) to each input."""
    dims = _per_input(args, kwargs, leaves, inputs, input_batch_dim, "input_batch_dim")
    out = []
    for i in inputs:
        d, t = dims[i], leaves[i]
        if d is not None:
            if not -t.dim() <= d < max(t.dim(), 1) or t.dim() == 0:
                raise BatchDimError(
                    f"input_batch_dim={d} is out of range for an input of shape "
                    f"{tuple(t.shape)} (argument leaf {i}); pass input_batch_dim=None for "
                    f"inputs that are not batched."
                )
            d = d % t.dim()
            if t.shape[d] == 0:
                raise BatchDimError(
                    f"an input of shape {tuple(t.shape)} has batch dim {d} of size 0; every "
                    f"rank needs at least one sample."
                )
        out.append(d)
    sizes = {leaves[i].shape[d] for i, d in zip(inputs, out) if d is not None}
    if len(sizes) > 1:
        shapes = [
            f"{tuple(leaves[i].shape)} (batch dim {d})" for i, d in zip(inputs, out) if d is not None
        ]
        raise BatchDimError(
            f"the inputs' batch dims disagree in size: {', '.join(shapes)}. Every batched input "
            f"must have the same local batch size along its input_batch_dim."
        )
    return out


def lifted_hparams(sa: StepArgs) -> list[float]:
    """The values of the lifted hyperparameters (``lr`` of every param group, and a momentum a
    scheduler cycles: ``group_inputs``), placeholder order."""
    return [v for opt in sa.optimizers for g in opt.param_groups
            for v in ((float(g["lr"]),) if "max_momentum" not in g else group_input_values(g))]


_CYCLED = ("momentum", "betas")


def group_inputs(group: dict) -> tuple[str, ...]:
    """The param-group entries every program reads as inputs, passed on every call: ``lr``,
    and the momentum a scheduler cycles (OneCycleLR's and CyclicLR's ``cycle_momentum`` mark the
    group with ``max_momentum``): ``momentum`` or ``betas``, unless the group asks for the fused
    kernel, whose momentum is a float argument (then it is guarded: a change recompiles)."""
    if "max_momentum" in group and "base_momentum" in group and not group.get("fused"):
        return LIFTED_HPARAMS + tuple(k for k in _CYCLED if k in group)
    return LIFTED_HPARAMS


def group_input_values(group: dict) -> list[float]:
    """The values of ``group_inputs(group)``, a tuple (``betas``) flattened."""
    out = []
    for key in group_inputs(group):
        v = group[key]
        out.extend(map(float, v) if isinstance(v, tuple) else (float(v),))
    return out
