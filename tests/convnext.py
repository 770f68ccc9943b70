"""Seed 000's DTensor ConvNeXt (torch/distributed/_tensor/examples/convnext_example.py), ported to
CPU: the model, its weight init and its ``distribute_module`` partition function, twice: as the
seed wrote it (``seed_conv_fn``: the recursive ``named_parameters()`` also registers, on every
ancestor, a flattened DTensor copy of each nested parameter that the forward never uses; eager
Adam skips them) and registering each module's own parameters only (``conv_fn``,
``recurse=False``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, distribute_tensor


class LayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-6, data_format=torch.contiguous_format):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = eps
        self.data_format = data_format
        if self.data_format not in [torch.contiguous_format]:
            raise NotImplementedError
        self.normalized_shape = (normalized_shape,)

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        x = self.weight[:, None, None] * x + self.bias[:, None, None]
        return x


class Block(nn.Module):
    def __init__(self, dim, drop_path=0.0, layer_scale_init_value=1e-6):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = LayerNorm(dim, eps=1e-6, data_format=torch.contiguous_format)
        self.pwconv1 = nn.Conv2d(dim, 4 * dim, kernel_size=1, stride=1)
        self.act = nn.GELU()
        self.pwconv2 = nn.Conv2d(4 * dim, dim, kernel_size=1, stride=1)
        self.gamma = (nn.Parameter(layer_scale_init_value * torch.ones((dim, 1, 1)), requires_grad=True)
                      if layer_scale_init_value > 0 else None)
        self.drop_path = nn.Identity()

    def forward(self, x):
        input_x = x
        x = self.dwconv(x)
        x = self.norm(x)
        x = self.pwconv1(x)
        x = self.act(x)
        x = self.pwconv2(x)
        if self.gamma is not None:
            x = self.gamma * self.drop_path(x)
        x = input_x + x
        return x


class DownSampling(nn.Module):
    def __init__(self, dim_in=3, dim_out=2, down_scale=4, norm_first=False):
        super().__init__()
        self.norm_first = norm_first
        if norm_first:
            self.norm = LayerNorm(dim_in, eps=1e-6, data_format=torch.contiguous_format)
            self.conv = nn.Conv2d(dim_in, dim_out, kernel_size=down_scale, stride=down_scale)
        else:
            self.conv = nn.Conv2d(dim_in, dim_out, kernel_size=down_scale, stride=down_scale)
            self.norm = LayerNorm(dim_out, eps=1e-6, data_format=torch.contiguous_format)

    def forward(self, x):
        if self.norm_first:
            return self.conv(self.norm(x))
        return self.norm(self.conv(x))


@torch.no_grad()
def init_weights(m):
    if type(m) == nn.Conv2d or type(m) == nn.Linear:  # noqa: E721 (the seed's test)
        nn.init.ones_(m.weight)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class ConvNeXt(nn.Module):
    def __init__(self, in_chans=3, num_classes=10, depths=(1, 1), dims=(2, 4), drop_path_rate=0.0,
                 layer_scale_init_value=1e-6, head_init_scale=1.0):
        super().__init__()
        self.downsample_layers = nn.ModuleList()
        self.downsample_layers.append(DownSampling(in_chans, dims[0], 4, norm_first=False))
        for i in range(len(dims) - 1):
            self.downsample_layers.append(DownSampling(dims[i], dims[i + 1], 2, norm_first=True))
        self.stages = nn.ModuleList()
        dp_rates = [x.item() for x in torch.linspace(0, drop_path_rate, sum(depths))]
        cur = 0
        for i in range(len(dims)):
            self.stages.append(nn.Sequential(*[
                Block(dim=dims[i], drop_path=dp_rates[cur + j],
                      layer_scale_init_value=layer_scale_init_value) for j in range(depths[i])]))
            cur += depths[i]
        self.head = nn.Linear(dims[-1], num_classes)
        self.apply(init_weights)

    def forward(self, x):
        for i in range(len(self.stages)):
            x = self.downsample_layers[i](x)
            x = self.stages[i](x)
        x = x.mean([-2, -1])
        x = self.head(x)
        return x


def conv_fn(name, module, device_mesh) -> None:
    """The seed's ``_conv_fn``: replicated DTensor parameters with a hook that redistributes
    each gradient to the parameter's placement."""
    for name, param in module.named_parameters(recurse=False):
        dist_spec = [Replicate()]
        dist_param = torch.nn.Parameter(distribute_tensor(param, device_mesh, dist_spec))
        dist_param.register_hook(lambda grad: grad.redistribute(placements=dist_spec))
        name = "_".join(name.split("."))
        module.register_parameter(name, dist_param)


def seed_conv_fn(name, module, device_mesh) -> None:
    """The seed's ``_conv_fn`` exactly as written: ``named_parameters()`` recurses, so each
    module also registers replicated copies of its descendants' parameters under flattened names
    (``stages_0_0_dwconv_weight`` on the root, ...) that the forward never uses."""
    for name, param in module.named_parameters():
        dist_spec = [Replicate()]
        dist_param = torch.nn.Parameter(distribute_tensor(param, device_mesh, dist_spec))
        dist_param.register_hook(lambda grad: grad.redistribute(placements=dist_spec))
        name = "_".join(name.split("."))
        module.register_parameter(name, dist_param)
