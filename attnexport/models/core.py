"""The attention core every dot-product variant calls: one torch custom op, exported per flavour.

The modules never call a fused torch kernel directly. They call `attention`, a custom op whose
eager implementation below defines the semantics (those of the ONNX `Attention` operator,
opset 23), and whose ONNX translation is chosen at export time (see `attnexport.export`):
MatMul+Softmax for `primitives`, the standard `Attention` op for `attention`, and ONNX
Runtime's `com.microsoft.MultiHeadAttention` for `ort`. One op, three graphs, one function.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _attention_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    is_causal: bool,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        # Grouped-query attention: each key/value head serves hq // hkv consecutive query heads.
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = (query @ key.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    if softcap > 0:
        # Softcap before the bias, so that a -inf bias stays -inf.
        scores = softcap * torch.tanh(scores / softcap)
    tq, tk = scores.shape[-2:]
    bias = torch.zeros((tq, tk), dtype=scores.dtype, device=scores.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            bias = bias + attn_mask.to(scores.dtype)
    if is_causal:
        # Top-left aligned: query i sees keys 0..i, as ONNX Attention without a cache.
        allowed = torch.ones((tq, tk), dtype=torch.bool, device=scores.device).tril()
        bias = bias.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores + bias, dim=-1)
    # A row whose bias is -inf everywhere attends to nothing: zeros, decided on the bias
    # (not on the scores), exactly as the ONNX operator's reference does.
    fully_masked = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    probs = probs.masked_fill(fully_masked, 0.0)
    return probs @ value, probs  # (B, Hq, Tq, Dv), (B, Hq, Tq, Tk)


def _fused_impl(query, key, value, attn_mask, scale, is_causal):
    """The same function through torch's fused scaled_dot_product_attention kernels."""
    F = torch.nn.functional
    tq, tk = query.shape[-2], key.shape[-2]
    mask = attn_mask
    if mask is not None and is_causal:
        # torch takes a mask or is_causal, not both: fold the (top-left) causal mask in.
        allowed = torch.ones((tq, tk), dtype=torch.bool, device=query.device).tril()
        if mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.to(query.dtype).masked_fill(~allowed, float("-inf"))
        is_causal = False
    elif mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    if attn_mask is not None:
        # torch leaves NaN in a row with nothing to attend to; the semantics say zeros.
        bias_max = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
        dead = ~bias_max.any(dim=-1, keepdim=True)  # (..., Tq, 1)
        out = out.masked_fill(dead, 0.0)
    return out


@torch.library.custom_op("attnexport::attention", mutates_args=())
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    is_causal: bool,
    softcap: float,
) -> torch.Tensor:
    """Attention over [B, H, T, d] tensors with ONNX `Attention` (opset 23) semantics.

    Args:
        query: (B, Hq, Tq, d).
        key: (B, Hkv, Tk, d); Hq must be a multiple of Hkv.
        value: (B, Hkv, Tk, dv).
        attn_mask: None, bool (True = attend) or additive float, broadcastable to
            (B, Hq, Tq, Tk).
        scale: multiplies QK^T; None means 1/sqrt(d).
        is_causal: top-left causal mask (query i attends keys j <= i).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the mask.
    """
    if softcap > 0:  # torch's fused kernels have no softcap
        return _attention_impl(query, key, value, attn_mask, scale, is_causal, softcap)[0]
    return _fused_impl(query, key, value, attn_mask, scale, is_causal)


@attention.register_fake
def _(query, key, value, attn_mask, scale, is_causal, softcap):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op("attnexport::attention_weights", mutates_args=())
def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    scale: Optional[float],
    is_causal: bool,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `attention`, also returning the softmax weights (B, Hq, Tq, Tk)."""
    out, probs = _attention_impl(query, key, value, attn_mask, scale, is_causal, softcap)
    return out, probs.clone()


@attention_weights.register_fake
def _(query, key, value, attn_mask, scale, is_causal, softcap):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, query.new_empty((*query.shape[:-1], key.shape[-2]))


def attend(query, key, value, attn_mask=None, *, scale=None, is_causal=False, softcap=0.0,
           need_weights=False):
    """Calls the core op; returns (output, weights or None)."""
    if need_weights:
        return attention_weights(query, key, value, attn_mask, scale, is_causal, softcap)
    return attention(query, key, value, attn_mask, scale, is_causal, softcap), None


# --- with a key/value cache ---------------------------------------------------------------------

@torch.library.custom_op("attnexport::attention_cached", mutates_args=())
def attention_cached(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    scale: Optional[float],
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of a new block over a key/value cache, as the ONNX `Attention` op with past inputs.

    Args:
        query: (B, Hq, T, d), the new block's queries.
        key, value: (B, Hkv, T, d) and (B, Hkv, T, dv), the new block's keys and values.
        past_key, past_value: (B, Hkv, P, d) and (B, Hkv, P, dv); P may be 0.
        is_causal: offset-aligned: query i of the block attends keys j <= P + i.

    Returns:
        output (B, Hq, T, dv), present_key (B, Hkv, P + T, d), present_value (B, Hkv, P + T, dv).
    """
    present_key = torch.cat([past_key, key], dim=2)
    present_value = torch.cat([past_value, value], dim=2)
    mask = None
    if is_causal:
        tq, tk = query.shape[2], present_key.shape[2]
        rows = torch.arange(tq, device=query.device)[:, None] + (tk - tq)
        mask = torch.arange(tk, device=query.device)[None, :] <= rows  # (T, P + T), True = attend
    out = _fused_impl(query, present_key, present_value, mask, scale, False)
    return out, present_key.clone(), present_value.clone()


@attention_cached.register_fake
def _(query, key, value, past_key, past_value, scale, is_causal):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)


def attend_cached(query, key, value, past_key, past_value, *, scale=None, is_causal=False):
    """Calls the cached core op; returns (output, present_key, present_value)."""
    return attention_cached(query, key, value, past_key, past_value, scale, is_causal)
