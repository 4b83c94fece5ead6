"""Multi-head attention: projected (`mha`), tied per-head projections (`mha-tied`), cross (`cross`)."""

from __future__ import annotations

import math

from torch import nn

from attnexport.models.core import attend, attend_cached
from attnexport.models.dot_product import scale_qk


def split_heads(x, heads):
    B, T, C = x.shape
    return x.view(B, T, heads, C // heads).transpose(1, 2)  # (B, h, T, C/h)


def merge_heads(x):
    B, h, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, h * d)  # (B, T, h*d)


class MultiHeadAttention(nn.Module):
    """Projected multi-head attention with optional grouped key/value heads and output projection.

    Keys and values come from `kv` (self-attention when it is the query input itself).
    """

    def __init__(self, dim, heads, kv_heads=None, kv_dim=None, causal=False, scaling="sqrt",
                 temperature=0.1, weights=False):
        super().__init__()
        kv_heads = kv_heads or heads
        kv_dim = kv_dim or dim
        self.head_dim = dim // heads
        self.heads, self.kv_heads = heads, kv_heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim)
        self.k_proj = nn.Linear(kv_dim, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(kv_dim, kv_heads * self.head_dim)
        self.out_proj = nn.Linear(heads * self.head_dim, dim)
        self.causal, self.scaling, self.temperature = causal, scaling, temperature
        self.weights = weights

    def attend(self, x, kv, key_padding=None):
        """Returns (output (B, Tq, D), weights (B, h, Tq, Tk) or None).

        Args:
            key_padding: (B, Tk) bool, True = a real key.
        """
        q = split_heads(self.q_proj(x), self.heads)  # (B, h, Tq, hd)
        k = split_heads(self.k_proj(kv), self.kv_heads)  # (B, hkv, Tk, hd)
        v = split_heads(self.v_proj(kv), self.kv_heads)
        q, k, scale = scale_qk(q, k, self.scaling, self.temperature)
        mask = None if key_padding is None else key_padding[:, None, None, :]  # (B, 1, 1, Tk)
        out, w = attend(q, k, v, mask, scale=scale, is_causal=self.causal,
                        need_weights=self.weights)
        return self.out_proj(merge_heads(out)), w

    def forward(self, x, mask=None):
        out, w = self.attend(x, x, mask)
        return (out, w) if self.weights else out


class CachedSelfAttention(MultiHeadAttention):
    """`mha --kv-cache`: the same block, one decoding step at a time over a key/value cache."""

    def forward(self, x, past_key, past_value):
        """One decoding step over a cache; returns (output, present_key, present_value).

        Args:
            x: (B, T, D), the new block (T = 1 for one token, or a chunk, or the prompt).
            past_key, past_value: (B, Hkv, P, hd), keys and values of the P earlier positions
                (after scaling, as attention reads them); P may be 0.
        """
        q = split_heads(self.q_proj(x), self.heads)  # (B, h, T, hd)
        k = split_heads(self.k_proj(x), self.kv_heads)  # (B, hkv, T, hd)
        v = split_heads(self.v_proj(x), self.kv_heads)
        q, k, scale = scale_qk(q, k, self.scaling, self.temperature)
        out, present_key, present_value = attend_cached(q, k, v, past_key, past_value, scale=scale,
                                                        is_causal=self.causal)
        return self.out_proj(merge_heads(out)), present_key, present_value  # (B, T, D), (B, hkv, P+T, hd) x2


class CrossAttention(MultiHeadAttention):
    """Queries from one sequence, keys and values from another (`memory`)."""

    def forward(self, query, memory, memory_mask=None):
        out, w = self.attend(query, memory, memory_mask)
        return (out, w) if self.weights else out


class TiedMultiHeadAttention(nn.Module):
    """Heads share one (head_dim -> head_dim) projection each for Q, K and V; scores / sqrt(E)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.values = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.keys = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.queries = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.fc_out = nn.Linear(heads * self.head_dim, dim)
        self.scale = 1.0 / math.sqrt(dim)  # the embed size, not the head size

    def forward(self, values, keys, query, mask=None):
        v = self.values(split_heads(values, self.heads))  # (B, h, Tk, hd)
        k = self.keys(split_heads(keys, self.heads))
        q = self.queries(split_heads(query, self.heads))  # (B, h, Tq, hd)
        bias = None if mask is None else mask.unsqueeze(1)  # (B, 1, Tq, Tk) bool
        out, _ = attend(q, k, v, bias, scale=self.scale)
        return self.fc_out(merge_heads(out))
