"""Nadaraya-Watson kernel regression written as attention over scalar keys."""

from __future__ import annotations

import torch
from torch import nn


class KernelRegression(nn.Module):
    """Weights softmax(-((x_q - x_k) * w)^2 / 2); w = 1 unless the bandwidth is learnable."""

    def __init__(self, learnable_bandwidth=False, weights=False):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1)) if learnable_bandwidth else None
        self.weights = weights

    def forward(self, queries, keys, values):
        diff = queries[:, :, None] - keys[:, None, :]  # (B, Tq, Tk)
        if self.w is not None:
            diff = diff * self.w
        w = torch.softmax(-(diff * diff) / 2, dim=-1)
        out = (w @ values[:, :, None]).squeeze(-1)  # (B, Tq)
        return (out, w) if self.weights else out
