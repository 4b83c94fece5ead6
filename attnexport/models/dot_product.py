"""Scaled dot-product attention (`sdpa`), single-head self-attention (`self`) and score scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnexport.models.core import attend, attend_static
from attnexport.semantics import NO_WEIGHTS, PLAIN, Core


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
    """Weight-free attention: the ONNX `Attention` operator with the options its variant asks for.

    `inputs` names the forward's inputs in the operator's order (query, key, value, then any of
    attn_mask, past_key and past_value, nonpad_kv_seqlen). With `heads` set (the 3-D layout), the
    query, key and value are (B, T, H * d) and are split into heads here; the cache stays 4-D.
    With `pad_mask`, the mask may be shorter than the keys and is padded to them.
    """

    def __init__(self, core: Core = PLAIN, inputs=("query", "key", "value"), heads=None, kv_heads=None,
                 pad_mask=False):
        super().__init__()
        self.pad_mask = pad_mask
        self.core, self.weights = core, core.weights != NO_WEIGHTS
        self.input_names, self.heads, self.kv_heads = tuple(inputs), heads, kv_heads

    def forward(self, *tensors):
        given = dict(zip(self.input_names, tensors, strict=True))
        q, k, v = given["query"], given["key"], given["value"]
        if self.heads:  # (B, T, H*d) -> (B, H, T, d)
            q, k, v = split_heads(q, self.heads), split_heads(k, self.kv_heads), split_heads(v, self.kv_heads)
        mask = given.get("attn_mask")
        if self.pad_mask:
            # A mask shorter than the keys: the operator pads it to their length with -inf (False).
            past = given.get("past_key")
            total = k.shape[2] + (past.shape[2] if past is not None else 0)
            mask = nn.functional.pad(mask, (0, total - mask.shape[-1]),
                                     value=False if mask.dtype == torch.bool else -math.inf)
        if "key_cache" in given:  # a static cache: the new keys and values written at write_pos
            out, key_cache, value_cache = attend_static(q, k, v, (given["key_cache"], given["value_cache"]),
                                                        given["write_pos"], self.core)
            return out, key_cache, value_cache
        cache = (given["past_key"], given["past_value"]) if "past_key" in given else None
        a = attend(q, k, v, mask, cache=cache, nonpad_kv_seqlen=given.get("nonpad_kv_seqlen"), core=self.core)
        out = merge_heads(a.output) if self.heads else a.output
        return (out,) + ((a.present_key, a.present_value) if a.present_key is not None else ()) + (
            (a.weights,) if self.weights else ())


def split_heads(x, heads):
    B, T, C = x.shape
    return x.view(B, T, heads, C // heads).transpose(1, 2)  # (B, h, T, C/h)


def merge_heads(x):
    B, h, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, h * d)  # (B, T, h*d)


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
        a = attend(q, k, v, bias, core=Core(scale, weights=Core.mode("softmax" if self.weights else None)))
        out = a.output.squeeze(1)  # (B, T, D)
        return (out, a.weights.squeeze(1)) if self.weights else out
