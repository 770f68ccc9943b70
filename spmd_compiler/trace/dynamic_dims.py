"""Which input dims a compile traces as symbolic sizes (docs/architecture.md, "Dynamic sizes").

A dim is dynamic when the user declared it (``DataParallel(dynamic_dims=...)``,
``torch._dynamo.mark_dynamic``), when it was dynamic in an earlier compile of the step, when its
size changed since the last compile (``automatic_dynamic``, as dynamo's automatic dynamic
shapes), or when it differs across ranks in this call. The ranks exchange their view, so all of
them trace the same dims as dynamic.
"""

from __future__ import annotations

import torch.distributed as dist

from ..runtime.agreement import exchange_objects
from ..runtime.call_args import StepArgs
from ..runtime.signature import TracedStep


class InputShapeHistory:
    """Per (input structure, leaf): the shape at the last compile and the dims traced dynamic."""

    def __init__(self, automatic: bool, exchange: bool):
        self.automatic = automatic  # a size that changed since the last compile becomes dynamic
        self.exchange = exchange  # agree with the other ranks (the step checks ranks)
        self._seen: dict[tuple[str, int], tuple[int, ...]] = {}
        self._dynamic: dict[tuple[str, int], set[int]] = {}

    def dims_to_trace(self, sa: StepArgs, group) -> tuple[dict[int, tuple[int, ...]], list[str]]:
        """Per input leaf, the non-batch dims to trace as symbolic sizes, and why (for the log)."""
        rank = f" on rank {dist.get_rank(group)}" if dist.get_world_size(group) > 1 else ""
        mine = {i: self._my_view(sa, i, b, rank) for i, b in zip(sa.input_indices, sa.batch_dims)}
        everyone = [mine]
        if self.exchange and dist.get_world_size(group) > 1:
            everyone = exchange_objects(mine, group)
        dynamic, why = {}, []
        for i, b in zip(sa.input_indices, sa.batch_dims):
            views = [r[i] for r in everyone if i in r]
            dims = set().union(*(set(v[1]) for v in views))
            why += [w for w in dict.fromkeys(w for v in views for w in v[2]) if w not in why]
            shapes = [v[0] for v in views]
            if len({len(s) for s in shapes}) == 1:
                differ = {d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1}
                differ -= dims | {b}
                why += [f"{sa.leaf_name(i)} dim {d}: sizes differ across ranks "
                        f"({', '.join(str(s[d]) for s in shapes)})" for d in sorted(differ)]
                dims |= differ
            dynamic[i] = tuple(sorted(dims - {b}))
        return dynamic, why

    def _my_view(self, sa: StepArgs, i: int, b: int | None, rank: str):
        """(shape, dims this rank would trace as dynamic, why) of input leaf ``i``."""
        shape = tuple(sa.leaves[i].shape)
        declared = set(sa.dynamic_dims.get(i, ()))
        dims = declared | self._dynamic.get((str(sa.spec), i), set())
        why = [f"{sa.leaf_name(i)} dim {d}: declared dynamic" for d in sorted(declared)]
        seen = self._seen.get((str(sa.spec), i))
        if self.automatic and seen is not None and len(seen) == len(shape):
            for d, (before, now) in enumerate(zip(seen, shape)):
                if before != now and d != b and d not in dims:
                    dims.add(d)
                    why.append(f"{sa.leaf_name(i)} dim {d}: size changed {before} -> {now}{rank}")
        return shape, sorted(dims - {b}), why

    def remember(self, sa: StepArgs, traced: TracedStep) -> None:
        """Record this compile's input shapes and dynamic dims, for the next compile's
        automatic dynamic dims."""
        structure = str(sa.spec)
        for i in sa.input_indices:
            self._seen[(structure, i)] = tuple(sa.leaves[i].shape)
            self._dynamic.setdefault((structure, i), set()).update(traced.dynamic_dims.get(i, ()))
