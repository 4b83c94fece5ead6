"""Attention written by hand, as countless modules do: `softmax(q @ k^T * scale + mask) @ v`, with
a padding mask (1 = token) turned into -inf before the softmax. attnexport recognizes it in the
traced program and exports it with the flavour's fused op.

attnexport export --module examples/handwritten_attention.py:example -o models/handwritten.onnx
"""

import math

import torch
from torch import nn


class HandWrittenAttention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, padding_mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        hidden = padding_mask[:, None, None, :] == 0  # (B, 1, 1, T): True where a key is padding
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, t, -1))


def example():
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0  # the second sequence is 5 tokens long
    return HandWrittenAttention(), (torch.randn(2, 8, 64), mask)
