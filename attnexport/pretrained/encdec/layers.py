"""The attentions of an encoder-decoder whose attention modules hold `q_proj`, `k_proj`, `v_proj`
and `out_proj` (Whisper's, Marian's and BART's kin), written out over the module's own parameters,
each through attnexport's core: self-attention (causal over a cache, or over static buffers written
at write_pos), the cross-attention's keys and values of the encoder's output (computed once) and
the cross-attention over them; a mask (the encoder's padding) where the inputs are padded."""

from __future__ import annotations

import torch

from attnexport.models.core import attend, attend_static
from attnexport.semantics import Core


def heads(x: torch.Tensor, count: int) -> torch.Tensor:
    """(B, T, H * d) -> (B, H, T, d)."""
    b, t, _ = x.shape
    return x.reshape(b, t, count, -1).transpose(1, 2)


def merged(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) -> (B, T, H * d)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def core(attn, causal: bool) -> Core:
    return Core(attn.head_dim ** -0.5, causal)


def key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An encoder's padding mask (B, S) of 1s and 0s as the core's boolean mask (B, 1, 1, S): True
    where a key is attended."""
    return None if mask is None else (mask != 0)[:, None, None, :]


def self_attention(attn, x, causal: bool, past=None, mask=None):
    """A self-attention through the core: returns (output, the keys, the values), the past's
    positions first where there is one; `mask`: the keys' padding (B, S) or None."""
    q, k, v = (heads(p(x), attn.num_heads) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    a = attend(q, k, v, key_mask(mask), cache=past, core=core(attn, causal))
    if a.present_key is not None and a.present_value is not None:  # the past's positions, then the block's
        k, v = a.present_key, a.present_value
    return attn.out_proj(merged(a.output)), k, v


def self_attention_static(attn, x, buffers, write_pos):
    """A causal self-attention over fixed buffers (key, value) (B, H, max_seq, d): the block's keys
    and values written at write_pos, attention over each sequence's written prefix (attnexport's
    static core). Returns (output, the key buffer, the value buffer)."""
    q, k, v = (heads(p(x), attn.num_heads) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    out, key, value = attend_static(q, k, v, buffers, write_pos, core(attn, True))
    return attn.out_proj(merged(out)), key, value


def cross_kv(attn, states) -> tuple[torch.Tensor, torch.Tensor]:
    """A cross-attention's keys and values of the encoder's output (B, H, S, d): what the first step
    computes once."""
    return heads(attn.k_proj(states), attn.num_heads), heads(attn.v_proj(states), attn.num_heads)


def cross_attention(attn, x, key, value, mask=None):
    """The cross-attention over the encoder's keys and values; `mask`: its padding (B, S) or None."""
    q = heads(attn.q_proj(x), attn.num_heads)
    return attn.out_proj(merged(attend(q, key, value, key_mask(mask), core=core(attn, False)).output))
