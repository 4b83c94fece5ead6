"""Scaled dot-product attention (`sdpa`), single-head self-attention (`self`) and score scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnexport.models.core import attend, attend_cached

def scale_qk(q, k, scaling: str, temperature: float):
    """Applies a scaling mode to q and k; returns (q, k, static scale for QK^T).

    Every mode is expressed as a change to q and k plus a constant, so that the attention core
    (and with it the fused ONNX ops) still sees plain scaled dot-product attention.

    Args:
        q: (B, H, Tq, d).
        k: (B, H, Tk, d).
    """
    d = q.shape[-1]
    if scaling == "sqrt":
        return q, k, 1.0 / math.sqrt(d)
    if scaling == "none":
        return q, k, 1.0
    if scaling == "norm":
        # ||Q K^T||_F^2 = sum((Q^T Q) * (K^T K)): the score norm without forming the scores.
        gram_k = k.transpose(-1, -2) @ k  # (B, Hkv, d, d)
        if k.shape[1] != q.shape[1]:  # grouped-query: each key head serves several query heads
            gram_k = gram_k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        gram = (q.transpose(-1, -2) @ q) * gram_k  # (B, H, d, d)
        norm = gram.sum(dim=(-2, -1), keepdim=True).sqrt()  # (B, H, 1, 1)
        return q / norm, k, 1.0
    if scaling == "cosine":
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return q, k, 1.0 / temperature
    if scaling == "length":
        # T is read from the input at run time, so the exported graph scales by the real length.
        t = torch.ones_like(k[0, 0, :, 0]).sum()
        return q / t.sqrt(), k, 1.0 / math.sqrt(d)
    raise ValueError(f"unknown scaling {scaling!r}")


class ScaledDotProductAttention(nn.Module):
    """Weight-free attention with the ONNX `Attention` operator's semantics."""

    def __init__(self, causal=False, scale=None, softcap=0.0, weights=False):
        super().__init__()
        self.causal, self.scale, self.softcap, self.weights = causal, scale, softcap, weights

    def forward(self, query, key, value, attn_mask=None):
        out, w = attend(query, key, value, attn_mask, scale=self.scale, is_causal=self.causal,
                        softcap=self.softcap, need_weights=self.weights)
        return (out, w) if self.weights else out


class CachedScaledDotProductAttention(ScaledDotProductAttention):
    """`sdpa --kv-cache`: the operator with its past_key/past_value inputs and present outputs."""

    def forward(self, query, key, value, past_key, past_value):
        return attend_cached(query, key, value, past_key, past_value, scale=self.scale, is_causal=self.causal)


class SelfAttention(nn.Module):
    """Single-head self-attention: Q = X W_q, K = X W_k, V = X W_v with W of shape (D, D)."""

    def __init__(self, dim, scaling="sqrt", temperature=0.1, weights=False):
        super().__init__()
        self.W_q = nn.Parameter(torch.empty(dim, dim))
        self.W_k = nn.Parameter(torch.empty(dim, dim))
        self.W_v = nn.Parameter(torch.empty(dim, dim))
        self.scaling, self.temperature, self.weights = scaling, temperature, weights

    def forward(self, x, mask=None):
        q = (x @ self.W_q).unsqueeze(1)  # (B, 1, T, D)
        k = (x @ self.W_k).unsqueeze(1)
        v = (x @ self.W_v).unsqueeze(1)
        q, k, scale = scale_qk(q, k, self.scaling, self.temperature)
        bias = None if mask is None else mask.unsqueeze(1)  # (B, 1, T, T) additive
        out, w = attend(q, k, v, bias, scale=scale, need_weights=self.weights)
        out = out.squeeze(1)  # (B, T, D)
        return (out, w.squeeze(1)) if self.weights else out
