"""Small models and training steps shared by the tests.

Every model but TransposedMLP and TwoLayerMLP takes a ``(batch, 50)`` input and returns
``(batch, 8)``, so any of them fits
:func:`tests.steps.train_step` with a ``(x, y)`` batch of shapes ``(b, 50)`` and ``(b, 8)``.

- :class:`SimpleMLP`: the seed's two-layer MLP.
- :class:`BatchDimModel`: the seed's ``WrapperModule`` of ``test_data_parallel_batch_dim_analysis``
  (view(-1), squeeze/unsqueeze, ``arange``/``ones``/``zeros(...).repeat(b, 1)`` in the forward).
- :class:`BatchNormMLP`: an MLP with a ``BatchNorm1d`` (running-stat buffers updated every step).
- :class:`TiedMLP`: an MLP in which two layers share one weight ``nn.Parameter``.
- :class:`TransposedMLP`: the seed's non-0 batch dim model (``(50, batch)`` in, ``(8, batch)`` out).
- :class:`TwoLayerMLP`: ``n_in -> hidden -> n_out``, sizes of the test's choosing.
- :class:`UnusedParamMLP`: a SimpleMLP beside a Linear the forward never uses.

The training steps are in tests/steps.py (``train_step``, ``mse_step`` and ``flexible_step`` are
also importable from here).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.steps import flexible_step, mse_step, train_step  # noqa: F401 (the steps tests import from here)

IN_FEATURES = 50
OUT_FEATURES = 8


class SimpleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(IN_FEATURES, 32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, OUT_FEATURES)

    def forward(self, x):
        return torch.sigmoid(self.net2(self.relu(self.net1(x))))

    def reset_parameters(self, *args, **kwargs):
        self.net1.reset_parameters()
        self.net2.reset_parameters()


class BatchDimModel(nn.Module):
    """The seed's WrapperModule: ops that move the batch dim around in non-trivial ways."""

    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()

    def forward(self, x):
        output = self.mlp(x)
        new_output = output.clone().view(-1)
        squeezed_out = new_output.squeeze()
        unsqueezed_out = squeezed_out.unsqueeze(0)
        output = output + 0.1 * unsqueezed_out.view(output.shape[0], -1)

        arange = torch.arange(output.shape[1], device=output.device)
        ones = torch.ones(output.shape, device=output.device)
        added_arange = arange.unsqueeze(0) + ones

        zeros = torch.zeros(output.shape[1], device=output.device)
        repeated_zeros = zeros.unsqueeze(0).repeat(output.shape[0], 1)
        return output + added_arange + repeated_zeros


class TransposedMLP(nn.Module):
    """The seed's non-0 batch dim model: inputs are ``(50, batch)``, outputs ``(8, batch)``."""

    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()

    def forward(self, x):
        return self.mlp(x.t().contiguous()).t()


class TwoLayerMLP(nn.Module):
    """``n_in -> hidden -> n_out`` with a ReLU between (and a sigmoid after, if asked): the sizes
    choose how the layers shard (uneven shards, fewer rows than ranks)."""

    def __init__(self, n_in: int, hidden: int, n_out: int, sigmoid: bool = False):
        super().__init__()
        self.net1 = nn.Linear(n_in, hidden)
        self.net2 = nn.Linear(hidden, n_out)
        self.sigmoid = sigmoid

    def forward(self, x):
        out = self.net2(torch.relu(self.net1(x)))
        return torch.sigmoid(out) if self.sigmoid else out


class BatchNormMLP(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear: buffers (running_mean/var, num_batches_tracked)."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(IN_FEATURES, 32)
        self.bn = nn.BatchNorm1d(32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, OUT_FEATURES)

    def forward(self, x):
        return torch.sigmoid(self.net2(self.relu(self.bn(self.net1(x)))))


class TiedMLP(nn.Module):
    """Two hidden layers share one weight Parameter (``hidden_b.weight is hidden_a.weight``)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 16)
        self.hidden_a = nn.Linear(16, 16)
        self.hidden_b = nn.Linear(16, 16)
        self.hidden_b.weight = self.hidden_a.weight
        self.out = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden_a(h))
        h = torch.tanh(self.hidden_b(h))
        return self.out(h)


class UnusedParamMLP(nn.Module):
    """A SimpleMLP beside a Linear the forward never uses (parameters that get no gradient)."""

    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.mlp(x)


MODELS = {
    "SimpleMLP": SimpleMLP,
    "BatchDimModel": BatchDimModel,
    "BatchNormMLP": BatchNormMLP,
    "TiedMLP": TiedMLP,
}
