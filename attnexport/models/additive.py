"""Additive (Bahdanau) attention and the masked softmax over valid lengths it uses."""

from __future__ import annotations

import torch
from torch import nn


def masked_softmax(scores, valid_lens):
    """Softmax over the last axis ignoring positions >= valid_lens; a length of 0 gives zeros.

    Args:
        scores: (B, Tq, Tk).
        valid_lens: (B,) int64.
    """
    positions = torch.arange(scores.shape[-1], device=scores.device)  # (Tk,)
    keep = positions[None, None, :] < valid_lens[:, None, None]  # (B, 1, Tk)
    # -inf (not -1e6) so fp16 cannot overflow; the all-masked row is zeroed explicitly.
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    return probs.masked_fill((valid_lens <= 0)[:, None, None], 0.0)  # length 0: nothing to attend


class MaskedSoftmax(nn.Module):
    def forward(self, scores, valid_lens):
        return masked_softmax(scores, valid_lens)


class AdditiveAttention(nn.Module):
    """w_v^T tanh(W_q q + W_k k), masked softmax, weighted sum of values (dropout is identity)."""

    def __init__(self, query_size, key_size, hidden, weights=False):
        super().__init__()
        self.W_q = nn.Linear(query_size, hidden, bias=False)
        self.W_k = nn.Linear(key_size, hidden, bias=False)
        self.w_v = nn.Linear(hidden, 1, bias=False)
        self.weights = weights

    def forward(self, query, key, value, valid_lens):
        features = torch.tanh(self.W_q(query)[:, :, None] + self.W_k(key)[:, None])  # (B, Tq, Tk, h)
        scores = self.w_v(features).squeeze(-1)  # (B, Tq, Tk)
        w = masked_softmax(scores, valid_lens)
        out = w @ value  # (B, Tq, Dv)
        return (out, w) if self.weights else out
