"""Convolution of an activation sharded on its width (``Shard(3)``), with a halo exchange.

On torch 2.13 DTensor's convolution on a ``Shard(3)`` input skips the exchange of the columns
next to each shard's edges and returns a wrong ``Replicate()`` result (pytorch/pytorch#191926: its
single-dim strategy allows only batch sharding, and the convolution handler convolves the local
shard as if it were whole). While the step is recorded, ``halo_convolution()`` puts this module's
handlers in DTensor's place for ``aten.convolution`` and ``aten.convolution_backward`` when the
input is ``Shard(3)`` on a 1-D mesh and the weight (and bias) ``Replicate()``; every other case
goes to DTensor's own handler.

Forward: each rank gathers its neighbours' edge columns (one ``all_gather`` of every rank's two
edges: functional, so recorded in the graph), convolves its shard widened by them with no width
padding (the first and last ranks' outer halos are the zero padding) and keeps ``Shard(3)``.
Backward: the same widened input gives the input gradient of the widened shard; the parts that
belong to the neighbours' columns are exchanged (a second ``all_gather``) and added there. Weight
and bias gradients are ``Partial("sum")``: each rank's sum over its columns.

Supported as DTensor's own exchange supported it: dilation 1 on the width; stride 1 with any
padding, or no padding with the kernel equal to the stride and shard widths divisible by it (no
halo needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..errors import UnsupportedError
from ..torch_internals import dtensor_op_handlers, funcol, local_tensor

aten = torch.ops.aten


def _width_sharded(inp, weight, bias) -> bool:
    return (isinstance(inp, DTensor) and inp.device_mesh.ndim == 1
            and tuple(inp.placements) == (Shard(3),) and inp.dim() == 4
            and all(isinstance(t, DTensor) and tuple(t.placements) == (Replicate(),)
                    for t in (weight, bias) if t is not None))


def _halos(kernel: int, stride: int, padding: int, dilation: int, width: int, where: str):
    """(columns from the left neighbour, from the right one) a shard needs."""
    if dilation != 1:
        raise UnsupportedError(f"{where}: a width-sharded convolution needs dilation 1 on the width")
    if padding == 0 and kernel == stride and width % stride == 0:
        return 0, 0
    if stride != 1:
        raise UnsupportedError(
            f"{where}: a width-sharded convolution needs stride 1 (with padding), or no padding "
            f"with the kernel equal to the stride and a shard width ({width}) divisible by it")
    left, right = padding, kernel - 1 - padding
    if max(left, right) > width:
        raise UnsupportedError(f"{where}: each rank's shard ({width} columns) is narrower than the "
                               f"convolution's halo ({max(left, right)} columns)")
    return left, right


def _exchange(edges_to_left: torch.Tensor, edges_to_right: torch.Tensor, mesh):
    """Send ``edges_to_left`` to the left neighbour and ``edges_to_right`` to the right one (one
    all_gather of both); return (what the left neighbour sent right, what the right one sent
    left), ``None`` at the ends of the row."""
    nl = edges_to_left.shape[-1]
    both = torch.cat([edges_to_left, edges_to_right], dim=-1).unsqueeze(0).contiguous()
    gathered = funcol.all_gather_single(both, 0, (mesh, 0))
    rank, world = mesh.get_local_rank(), mesh.size()
    from_left = gathered[rank - 1][..., nl:] if rank > 0 else None
    from_right = gathered[rank + 1][..., :nl] if rank < world - 1 else None
    return from_left, from_right


def _widened(x: torch.Tensor, left: int, right: int, mesh) -> torch.Tensor:
    """The local shard with ``left`` columns of the left neighbour and ``right`` of the right
    one (zeros beyond the row's ends: the convolution's zero padding)."""
    if left == 0 and right == 0:
        return x
    from_left, from_right = _exchange(x[..., :right], x[..., x.shape[-1] - left:], mesh)
    from_left = from_left if from_left is not None else x.new_zeros(x.shape[:-1] + (left,))
    from_right = from_right if from_right is not None else x.new_zeros(x.shape[:-1] + (right,))
    return torch.cat([from_left, x, from_right], dim=-1)


def _conv_args(args, width: int):
    stride, padding, dilation = (list(a) for a in args[3:6])
    halos = _halos(args[1].shape[-1], stride[-1], padding[-1], dilation[-1], width,
                   "aten.convolution")
    return stride, padding[:-1] + [0], dilation, halos


def _forward(op_call, args, kwargs):
    inp, weight, bias = args[0], args[1], args[2]
    mesh = inp.device_mesh
    x = local_tensor(inp)
    stride, padding, dilation, (left, right) = _conv_args(args, x.shape[-1])
    out = op_call(_widened(x, left, right, mesh), local_tensor(weight),
                  None if bias is None else local_tensor(bias), stride, padding, dilation, *args[6:])
    return DTensor.from_local(out, mesh, [Shard(3)], run_check=False)


def _backward(op_call, args, kwargs):
    grad_out, inp, weight = args[0], args[1], args[2]
    mesh = inp.device_mesh
    x = local_tensor(inp)
    width = x.shape[-1]
    stride, padding, dilation, (left, right) = _conv_args(
        (None, weight) + tuple(args[3:4]) + tuple(args[4:7]), width)
    g = local_tensor(grad_out.redistribute(mesh, [Shard(3)]))
    gi, gw, gb = op_call(g, _widened(x, left, right, mesh), local_tensor(weight), args[3],
                         stride, padding, dilation, *args[7:])
    if gi is not None and (left or right):
        mine = gi[..., left:left + width]
        from_left, from_right = _exchange(gi[..., :left], gi[..., gi.shape[-1] - right:], mesh)
        if from_left is not None:  # the left neighbour's right halo: my first columns
            mine = mine + F.pad(from_left, (0, width - right))
        if from_right is not None:  # the right neighbour's left halo: my last columns
            mine = mine + F.pad(from_right, (width - left, 0))
        gi = mine
    return (None if gi is None else DTensor.from_local(gi, mesh, [Shard(3)], run_check=False),
            None if gw is None else DTensor.from_local(gw, mesh, [Partial()], run_check=False),
            None if gb is None else DTensor.from_local(gb, mesh, [Partial()], run_check=False))


def halo_convolution():
    """While recording: DTensor's convolution handlers replaced for width-sharded inputs."""
    return dtensor_op_handlers({aten.convolution.default: _forward_or_own,
                                aten.convolution_backward.default: _backward_or_own})


def _forward_or_own(op_call, args, kwargs, own):
    if _width_sharded(args[0], args[1], args[2]) and not args[6]:  # (not transposed)
        return _forward(op_call, args, kwargs)
    return own(op_call, args, kwargs)


def _backward_or_own(op_call, args, kwargs, own):
    if _width_sharded(args[1], args[2], None) and not args[7]:
        return _backward(op_call, args, kwargs)
    return own(op_call, args, kwargs)
