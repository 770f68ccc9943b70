"""The step's arguments flattened on every call, without rebuilding the same tree spec.

``pytree.tree_flatten`` builds a new ``TreeSpec`` on every call, and the step key prints it
(``spec_text``). A call whose arguments are leaves and plain tuples and lists (the usual
``step(model, optim, (x, y))``) reuses the spec made the first time that shape of arguments
was seen: same leaves, same order, the same spec object, its text printed once.

The optimizers' per-call numbers are read here too: :func:`group_inputs` names the param-group
entries every program takes as inputs (the learning rate, and a momentum a scheduler cycles).
"""

from __future__ import annotations

from typing import Any

from .torch_internals import pytree

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


_CYCLED = ("momentum", "betas")


def group_inputs(group: dict) -> tuple[str, ...]:
    """The param-group entries every program reads as inputs, passed on every call: ``lr``,
    and the momentum a scheduler cycles (OneCycleLR's and CyclicLR's ``cycle_momentum`` mark the
    group with ``max_momentum``): ``momentum`` or ``betas``, unless the group asks for the fused
    kernel, whose momentum is a float argument (then it is guarded: a change recompiles)."""
    if "max_momentum" in group and "base_momentum" in group and not group.get("fused"):
        return ("lr",) + tuple(k for k in _CYCLED if k in group)
    return ("lr",)


def group_input_values(group: dict) -> list[float]:
    """The values of ``group_inputs(group)``, a tuple (``betas``) flattened."""
    out = []
    for key in group_inputs(group):
        v = group[key]
        out.extend(map(float, v) if isinstance(v, tuple) else (float(v),))
    return out
