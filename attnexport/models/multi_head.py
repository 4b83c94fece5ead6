"""Multi-head attention: projected (`mha`), tied per-head projections (`mha-tied`), cross (`cross`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnexport.models.core import Attended, attend, attend_static
from attnexport.models.dot_product import merge_heads, scale_qk, split_heads
from attnexport.semantics import Core


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

    def attend(self, x, kv, key_padding=None, past_key=None, past_value=None, join_outside=False):
        """Returns the core's result with its output projected to (B, Tq, D).

        Args:
            key_padding: (B, Tk) bool, True = a real key.
            past_key, past_value: a cache (B, Hkv, P, hd) of the keys and values before `kv`
                (after scaling, as attention reads them), or None.
            join_outside: join the cache and the new keys here, and call the core without a
                cache. For a cache that may get no new keys (the decoder's memory after the
                first step): ONNX Runtime's Attention kernel refuses a step with none
                ("kv_sequence_length > 0", onnxruntime 1.31.1).
        """
        q = split_heads(self.q_proj(x), self.heads)  # (B, h, Tq, hd)
        k = split_heads(self.k_proj(kv), self.kv_heads)  # (B, hkv, Tk, hd)
        v = split_heads(self.v_proj(kv), self.kv_heads)
        q, k, scale = scale_qk(q, k, self.scaling, self.temperature)
        mask = None if key_padding is None else key_padding[:, None, None, :]  # (B, 1, 1, Tk)
        if join_outside and past_key is not None:
            k, v = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)
            past_key = past_value = None
        cache = None if past_key is None else (past_key, past_value)
        a = attend(q, k, v, mask, cache=cache,
                   core=Core(scale, self.causal, weights=Core.mode("softmax" if self.weights else None)))
        present = (k, v) if join_outside else (a.present_key, a.present_value)
        # A new Attended, not a._replace: torch 2.6's tracer cannot step into namedtuple._replace.
        return Attended(self.out_proj(merge_heads(a.output)), a.weights, *present)

    def attend_static(self, x, key_cache, value_cache, write_pos):
        """Self-attention over static buffers (see StaticCachedSelfAttention): (output projected to
        (B, T, D), key_cache, value_cache with the block written at write_pos)."""
        q = split_heads(self.q_proj(x), self.heads)
        k = split_heads(self.k_proj(x), self.kv_heads)
        v = split_heads(self.v_proj(x), self.kv_heads)
        q, k, scale = scale_qk(q, k, self.scaling, self.temperature)
        out, key_cache, value_cache = attend_static(q, k, v, (key_cache, value_cache), write_pos,
                                                    Core(scale, self.causal))
        return self.out_proj(merge_heads(out)), key_cache, value_cache

    def forward(self, x, mask=None):
        a = self.attend(x, x, mask)
        return (a.output, a.weights) if self.weights else a.output


class CachedSelfAttention(MultiHeadAttention):
    """`mha --kv-cache`: the same block, one decoding step at a time over a key/value cache."""

    def forward(self, x, past_key, past_value):
        """One decoding step over a cache; returns (output, present_key, present_value).

        Args:
            x: (B, T, D), the new block (T = 1 for one token, or a chunk, or the prompt).
            past_key, past_value: (B, Hkv, P, hd), keys and values of the P earlier positions
                (after scaling, as attention reads them); P may be 0.
        """
        a = self.attend(x, x, past_key=past_key, past_value=past_value)
        return a.output, a.present_key, a.present_value  # (B, T, D), (B, hkv, P+T, hd) x2


class StaticCachedSelfAttention(MultiHeadAttention):
    """`mha --kv-cache static --max-seq S`: one decoding step over key/value buffers of a fixed
    size, the new keys and values written in at each sequence's position (TensorScatter), and
    attention reading each sequence's valid prefix only (nonpad_kv_seqlen)."""

    def forward(self, x, key_cache, value_cache, write_pos):
        """One decoding step; returns (output, key_cache_out, value_cache_out).

        Args:
            x: (B, T, D), the new block (T = 1 for one token, or a chunk, or the prompt).
            key_cache, value_cache: (B, Hkv, S, hd), the buffers; sequence b's first write_pos[b]
                positions hold its earlier keys and values (after scaling, as attention reads
                them), the rest is ignored.
            write_pos: (B,) int64, each sequence's count of cached positions: its block is
                written there, and its query i attends positions up to write_pos[b] + i.
        """
        return self.attend_static(x, key_cache, value_cache, write_pos)


class CrossAttention(MultiHeadAttention):
    """Queries from one sequence, keys and values from another (`memory`)."""

    def forward(self, query, memory, memory_mask=None):
        a = self.attend(query, memory, memory_mask)
        return (a.output, a.weights) if self.weights else a.output


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
        return self.fc_out(merge_heads(attend(q, k, v, bias, core=Core(self.scale)).output))
