"""Graph hygiene: remove profiler markers and dead code."""

import torch
import torch.fx as fx

_PROFILER_OPS = (
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def remove_profiler_nodes(gm: fx.GraphModule) -> fx.GraphModule:
    """Delete the ``record_function`` enter/exit nodes that ``optimizer.step`` and
    ``zero_grad`` leave in a traced graph, then dead code.

    Reads: node targets. Writes: removes nodes; recompiles ``gm``.
    """
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in _PROFILER_OPS:
            for user in list(node.users):
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    return eliminate_dead_code(gm)


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove nodes whose results are unused and that have no side effects (in-place ops and
    collectives are kept: FX treats mutable-schema ops as impure).

    Reads: the graph. Writes: removes nodes; recompiles ``gm``.
    """
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
