"""Saving and loading a placed model and optimizer as with their eager counterparts.

replicate: DDP's module hands out plain tensors, so users save ``model.state_dict()`` and
``optimizer.state_dict()`` with ``torch.save`` on rank 0 and load them into a fresh, plain model
and optimizer (nanoGPT's checkpoint flow). :func:`attach` gives a replicate model's modules and
its optimizers state-dict post-hooks that hand out each ``Replicate()`` DTensor's local tensor
(the whole value, the storage the compiled step updates: a ``dcp.load`` into it loads the model).

fully_shard / hybrid_shard: the state dicts hold DTensors, as FSDP2's do; torch's
``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True`` give plain
full tensors.

Loading: plain parameters go through ``eager._load_plain_tensors``. Optimizer state that arrives
plain while the parameters are placed (a DDP or single-device checkpoint loaded with
``optimizer.load_state_dict``) is placed like its parameter before the next compiled call
(``runtime.placed_state``); DTensor state of parameters that are plain again (a fresh model given
an old optimizer's state) is made whole before it is placed anew (``runtime.whole_states``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .placement import is_sharded


def attach(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], sharded: bool) -> None:
    """Under replicate (not ``sharded``): plain tensors from ``module.state_dict()`` (of any of
    its submodules) and from each optimizer's ``state_dict()``. Idempotent."""
    if sharded:
        return
    for m in module.modules():
        if not m.__dict__.get("_spmd_plain_state_dict"):
            m.register_state_dict_post_hook(_plain_module_state)
            m.__dict__["_spmd_plain_state_dict"] = True
    for opt in optimizers:
        if not opt.__dict__.get("_spmd_plain_state_dict"):
            opt.register_state_dict_post_hook(_plain_optimizer_state)
            opt.__dict__["_spmd_plain_state_dict"] = True


def _local(v: Any) -> Any:
    """A replicated DTensor's local tensor (the whole value); anything else as it is."""
    if isinstance(v, DTensor) and not is_sharded(v):
        local = v._local_tensor
        return local if not isinstance(v, torch.nn.Parameter) else torch.nn.Parameter(
            local, requires_grad=v.requires_grad)
    return v


def _plain_module_state(module, state_dict, prefix, local_metadata) -> None:
    for name in (*module._parameters, *module._buffers):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _local(state_dict[key])


def _plain_optimizer_state(optimizer, state_dict):
    for st in state_dict.get("state", {}).values():
        for k, v in st.items():
            st[k] = _local(v)
    return state_dict
