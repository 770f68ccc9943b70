"""The ``node.meta`` keys that the stages share.

Every stage reads and writes the graph only through these keys; nothing else is
passed between passes. Each constant is the key string; its comment says who
writes it and what the value is.
"""

from enum import Enum


class Role(str, Enum):
    """What a node is in the training step (``node.meta[ROLE]``)."""

    PARAM = "param"  # placeholder: a model parameter (local tensor)
    BUFFER = "buffer"  # placeholder: a model buffer
    OPT_STATE = "opt_state"  # placeholder: one optimizer state tensor
    HPARAM = "hparam"  # placeholder: a lifted optimizer hyperparameter (float)
    INPUT = "input"  # placeholder: a leaf of the user's batch / other args
    # a parameter's gradient as a reader sees it: the final accumulated one, and one per
    # earlier backward whose gradient something reads before a later backward adds to it
    GRAD = "grad"
    COLLECTIVE = "collective"  # a functional collective or its wait


class Region(str, Enum):
    """Which part of the step a node was recorded in (``node.meta[REGION]``)."""

    FORWARD = "forward"  # zero_grad, forward and loss
    BACKWARD = "backward"  # inside loss.backward()
    OPTIMIZER = "optimizer"  # after backward: grad clipping, optim.step() (each, with several)


# Written by the tracer.
ROLE = "spmd_role"  # Role
REGION = "spmd_region"  # Region
STEPPED = "spmd_stepped"  # True on nodes recorded up to the end of the step's last optimizer step()
PARAM_FQN = "spmd_param_fqn"  # str: the parameter a PARAM / OPT_STATE / GRAD node belongs to
STATE_KEY = "spmd_state_key"  # str: optimizer state name ("exp_avg", "momentum_buffer", ...)
INPUT_PATH = "spmd_input_path"  # str: pytree path of an INPUT leaf in the step's arguments
INPUT_BATCH_DIM = "spmd_input_batch_dim"  # int | None: the batch dim of an INPUT leaf
# tuple[int, ...]: the other dims of an INPUT leaf traced as symbolic sizes (a sequence length);
# their symbols, unlike the batch dim's, mark no sharding
INPUT_DYNAMIC_DIMS = "spmd_input_dynamic_dims"

# Written by the tracer: str, the process group of a collective the step itself issues (DTensor's,
# over a tensor-parallel group). Over the data-parallel dims every rank runs it on its own data.
MODEL_PARALLEL = "spmd_model_parallel"
# Written by the tracer on the issue node of such a collective: (mesh dim name, placement before,
# placement after) along the plan's mesh dim, e.g. ("tp", "P(sum)", "R") for an all_reduce.
PLAN_PLACEMENT = "spmd_plan_placement"
# Written by the tracer on the PARAM placeholder of a parameter a plan placed (tensor or context
# parallelism): tuple of (mesh dim name, placement) along the plan's dims, for the summary.
PARAM_PLAN = "spmd_param_plan"

# Written by passes/batch_dim.py (placement propagation).
# Placement for a tensor; list[Placement | None] for a multi-output node or a void foreach/fused
# in-place op (one per list index); None for non-tensors. Shard(d) | Replicate() | Partial("avg");
# over fully_shard parameter shards also Partial("sum"/"max"/"min") / _NormPartial(p).
PLACEMENT = "spmd_placement"
# GraphModule.meta: dict[node, tuple], what each node's PLACEMENT was derived from (its op,
# arguments, value and inputs' placements); a later analysis reuses the placements it still fits.
# The pipeline drops it after the expansion's analysis.
PLACEMENT_INPUTS = "spmd_placement_inputs"

# Written by the expansion passes (replicate / fully_shard) and the optimizers of collectives.
# tuple[int, ...]: a parameter shard's unsharded shape, on shard nodes while the expansion runs
# (passes/fully_shard.py, expand.py); removed when the expansion ends.
LOGICAL_SHAPE = "spmd_fully_shard_logical_shape"
COLLECTIVE = "spmd_collective"  # dict(kind=str, bytes=int, params=list[str]) on the issuing node
# str: the parameter whose gradient, averaged over ranks, this node holds (the wait of its
# all_reduce; in fully_shard of its reduce_scatter: the padded local shard). Expansion only.
SYNCED_GRAD = "spmd_synced_grad"
BUCKET = "spmd_bucket"  # int: bucket index of a collective node
# int: on a gradient reduce-scatter of one micro-batch (fully_shard, per-micro-batch reduction);
# bucketing merges only collectives of the same micro-batch
MICRO_BATCH = "spmd_micro_batch"

# GraphModule.meta keys (on the graph, not a node).
# list[str]: the parameters whose averaged gradients passes/grad_outputs.py appended, in order,
# to the end of the graph's outputs.
KEPT_GRADS = "spmd_kept_grads"
# dict[str, str]: per pass, a one-line note on a choice it made (shown in the summary)
NOTES = "spmd_notes"
# list[(device, bytes)]: the workspace inputs passes/memory_plan.py added (the last placeholders
# but the rank check's), in order; the runtime passes a buffer of at least that size for each.
WORKSPACES = "spmd_workspaces"
# list[str]: the process group name of each mesh dim, outermost first (passes/expand.py), so a
# collective's group names the mesh dim it runs on.
MESH_DIMS = "spmd_mesh_dims"
# list[int]: the size of each of those mesh dims (passes/expand.py), for the summary's world size.
MESH_SIZES = "spmd_mesh_sizes"
# dict[str, str]: the process group name -> mesh dim name of each dim a tensor-parallel plan uses
# (written by the tracer), so a plan's collective names the dim it runs on.
PLAN_DIMS = "spmd_plan_dims"

# Written by the tracer for parameters whose unshard it records (FSDP2's all-gather extensions,
# spmd_compiler/features/subclass_params.py). str: the parameter's fqn, on its PARAM placeholders (the
# expansion shards them and inserts no gather of its own) and on the all_gather issue nodes the
# hooks asked for (bucketing leaves them alone: their inputs are computed by the hooks).
GATHERED = "spmd_gathered"
# int: on the nodes the tracer recorded from a GATHERED placeholder up to its gathers (the slice
# taking this rank's rows at the global shape, the pre hook's ops on them): the number of valid
# rows. Once the placeholder is a shard, that slice takes its rows [0, this) instead.
LOCAL_SHARD = "spmd_local_shard"
# GraphModule.meta: list of (fqn, [(shape, dtype) of each all-gather input], metadata
# description) of the all-gather extensions the tracer recorded; ranks must agree on them.
GATHER_EXTENSIONS = "spmd_gather_extensions"


class MetaContractError(AssertionError):
    """A stage left the graph without a ``node.meta`` key the contract promises."""


def check(gm, stage: str) -> None:
    """The meta contract after ``stage``: REGION on every node but the output, a ``val`` on
    every placeholder and call (but ops that return nothing),
    and ROLE == COLLECTIVE on every functional collective and wait. Raises MetaContractError
    naming the stage and the first nodes that break it."""
    problems = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if REGION not in node.meta:
            problems.append(f"{node.name}: no {REGION}")
        schema = getattr(node.target, "_schema", None)
        void = schema is not None and not schema.returns
        if node.op in ("placeholder", "call_function") and "val" not in node.meta and not void:
            problems.append(f"{node.name}: no val")
        namespace = getattr(node.target, "namespace", None)
        if namespace == "_c10d_functional" and node.meta.get(ROLE) != Role.COLLECTIVE:
            problems.append(f"{node.name}: a collective without {ROLE}={Role.COLLECTIVE.value}")
    if problems:
        raise MetaContractError(f"after stage {stage!r}: " + "; ".join(problems[:8])
                                + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))
