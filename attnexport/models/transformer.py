"""Transformer building blocks: sinusoidal positional encoding, encoder and decoder layers."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnexport.models.multi_head import MultiHeadAttention


class PositionalEncoding(nn.Module):
    """X + P with P[t, 2i] = sin(t / 10000^(2i/D)), P[t, 2i+1] = cos(same angle).

    P is computed from the input's length at run time, so there is no maximum length.
    """

    def forward(self, x):
        T, D = x.shape[1], x.shape[2]
        # At least float32: in fp16 an angle of 60 rad carries an error of 0.03.
        dtype = torch.promote_types(x.dtype, torch.float32)
        pos = torch.arange(T, device=x.device).to(dtype)  # (T,)
        col = torch.arange(D, device=x.device)
        pair = torch.div(col, 2, rounding_mode="floor").to(dtype) * 2  # 2i per column
        angle = pos[:, None] * torch.exp(pair * (-math.log(10000.0) / D))  # (T, D)
        P = torch.where(col % 2 == 0, torch.sin(angle), torch.cos(angle))
        return x + P.to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, dim, ffn_dim):
        super().__init__()
        self.dense1 = nn.Linear(dim, ffn_dim)
        self.dense2 = nn.Linear(ffn_dim, dim)

    def forward(self, x):
        return self.dense2(torch.relu(self.dense1(x)))


class EncoderLayer(nn.Module):
    """Post-norm: Y = LN(X + MHA(X)); out = LN(Y + FFN(Y))."""

    def __init__(self, dim, heads, ffn_dim):
        super().__init__()
        self.attn = MultiHeadAttention(dim, heads)
        self.norm1 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        y = self.norm1(x + self.attn.attend(x, x, mask).output)
        return self.norm2(y + self.ffn(y))


class DecoderLayer(nn.Module):
    """Post-norm: causal self-attention, cross-attention on `memory`, feed-forward."""

    def __init__(self, dim, heads, ffn_dim):
        super().__init__()
        self.self_attn = MultiHeadAttention(dim, heads, causal=True)
        self.norm1 = nn.LayerNorm(dim)
        self.cross_attn = MultiHeadAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x, memory, memory_mask=None):
        y = self.norm1(x + self.self_attn.attend(x, x).output)
        z = self.norm2(y + self.cross_attn.attend(y, memory, memory_mask).output)
        return self.norm3(z + self.ffn(z))


class CachedDecoderLayer(DecoderLayer):
    """`decoder --kv-cache`: one decoding step of the same layer, over two caches.

    The self-attention cache holds the keys and values of the earlier target positions. The
    cross-attention cache holds the memory's keys and values: the first step passes the memory
    and an empty cross cache, and every later step an empty memory (length 0) and the cache the
    step before returned. So the memory is projected once, with no control flow in the graph:
    present_cross = past_cross followed by the projection of the memory given now. (One graph
    for every step, rather than a first-step graph and a step graph: a deployment app loads and
    calls one session, and the cross cache is handled exactly as the self-attention one.)
    """

    def forward(self, x, memory, past_key, past_value, past_cross_key, past_cross_value):
        a = self.self_attn.attend(x, x, past_key=past_key, past_value=past_value)
        y = self.norm1(x + a.output)
        c = self.cross_attn.attend(y, memory, past_key=past_cross_key, past_value=past_cross_value,
                                   join_outside=True)
        z = self.norm2(y + c.output)
        return self.norm3(z + self.ffn(z)), a.present_key, a.present_value, c.present_key, c.present_value


class StaticCachedDecoderLayer(DecoderLayer):
    """`decoder --kv-cache static --max-seq S`: the step of CachedDecoderLayer with its
    self-attention cache in static buffers written at write_pos (TensorScatter, nonpad_kv_seqlen);
    the memory's cross cache is as CachedDecoderLayer's (projected once, then passed back)."""

    def forward(self, x, memory, key_cache, value_cache, write_pos, past_cross_key, past_cross_value):
        a, key_cache, value_cache = self.self_attn.attend_static(x, key_cache, value_cache, write_pos)
        y = self.norm1(x + a)
        c = self.cross_attn.attend(y, memory, past_key=past_cross_key, past_value=past_cross_value,
                                   join_outside=True)
        z = self.norm2(y + c.output)
        return self.norm3(z + self.ffn(z)), key_cache, value_cache, c.present_key, c.present_value
