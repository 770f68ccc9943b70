"""Keep gradients: return every parameter's averaged gradient from the step, so the runtime can
leave it in ``p.grad`` as DDP and FSDP2 do (``DataParallel(keep_grads=True)``)."""

from __future__ import annotations

import torch.fx as fx

from . import meta


def output_gradients(gm: fx.GraphModule) -> fx.GraphModule:
    """Append each parameter's gradient, averaged over ranks, to the graph's outputs.

    Run right after expansion. Reads: SYNCED_GRAD (written by the expansion passes). Writes: the
    output node (the gradients after the step's own outputs, in graph order) and
    ``gm.meta[KEPT_GRADS]``, the parameters they belong to. In-place updates of a gradient later
    in the step (``clip_grad_norm_``) show in the returned value, as in ``p.grad`` under DDP.
    Later passes that replace a gradient node (bucketing) update the output with it.
    """
    graph = gm.graph
    synced = [n for n in graph.nodes if meta.SYNCED_GRAD in n.meta]
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    (values,) = output.args
    output.args = (type(values)(list(values) + synced) if isinstance(values, (list, tuple))
                   else [values, *synced],)
    gm.meta[meta.KEPT_GRADS] = [n.meta[meta.SYNCED_GRAD] for n in synced]
    gm.recompile()
    return gm
