"""The attention core every dot-product variant calls: one torch custom op, exported per flavour.

The modules never call a fused torch kernel directly. They call `attention`, a custom op whose
eager implementation below defines the semantics (those of the ONNX `Attention` operator, opsets
23 and 24: masks, a key/value cache, per-batch valid key counts, softcap, the four kinds of
score output), and whose ONNX translation is chosen at export time (see `attnexport.export`):
MatMul+Softmax for `primitives`, the standard `Attention` op for `attention`, and ONNX Runtime's
`com.microsoft.MultiHeadAttention` for `ort`. One op, three graphs, one function.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attnexport.semantics import NO_WEIGHTS, PLAIN, Core

# torch's own kernel, bound at import: `attnexport.modules.routed` replaces the public name with
# this core while a user's module is exported or verified, and the core must not call itself.
torch_sdpa = torch.nn.functional.scaled_dot_product_attention
# softmax_precision: the ONNX element types the operator allows, as torch dtypes.
SOFTMAX_PRECISIONS = {1: torch.float32, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


def _bias(attn_mask, is_causal, past, nonpad_kv_seqlen, tq, tk, like):
    """The additive bias (0 or -inf, plus a float mask), broadcastable to (B, Hq, Tq, Tk).

    Returns (bias or None, causal_only): causal_only when the bias is the top-left causal mask
    alone, which torch's fused kernels take as is_causal=True.
    """
    dev, dtype = like.device, like.dtype
    if attn_mask is None and nonpad_kv_seqlen is None and past is None:
        # Nothing, or the top-left causal mask alone: torch's fused kernels have that one built in.
        return None, is_causal
    terms = []
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            terms.append(torch.zeros(attn_mask.shape, dtype=dtype, device=dev).masked_fill(~attn_mask, -math.inf))
        else:
            terms.append(attn_mask.to(dtype))
    cols = torch.arange(tk, device=dev)
    if nonpad_kv_seqlen is not None:
        valid = nonpad_kv_seqlen.reshape(-1, 1, 1, 1)  # (B, 1, 1, 1)
        terms.append(torch.zeros((), dtype=dtype, device=dev).masked_fill(cols >= valid, -math.inf))
    if is_causal:
        # Offset-aligned: query i attends keys j <= i + offset, the offset being the count of
        # keys before the block (the past length with a cache, however many keys are new;
        # nonpad - Tq per batch; else 0).
        rows = torch.arange(tq, device=dev)[:, None]
        if past is not None:
            rows = rows + past
        elif nonpad_kv_seqlen is not None:
            rows = rows + (nonpad_kv_seqlen.reshape(-1, 1, 1, 1) - tq)
        terms.append(torch.zeros((), dtype=dtype, device=dev).masked_fill(cols > rows, -math.inf))
    if not terms:  # a cache without a mask: every key is visible
        return None, False
    bias = terms[0]
    for t in terms[1:]:
        bias = bias + t
    return bias, False


def _attention_impl(query, key, value, attn_mask, cache, nonpad_kv_seqlen, core: Core):
    """The op's eager semantics; `cache`: None or (past_key, past_value)."""
    scale, is_causal, softcap, weights, softmax_precision = core.attributes()
    past = None
    if cache is not None:
        past_key, past_value = cache
        past = past_key.shape[2]
        key, value = torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)
        present = (key, value)
    else:
        present = (query.new_empty(0), query.new_empty(0))
    if nonpad_kv_seqlen is not None and weights == NO_WEIGHTS and attn_mask is None and key.device.type == "cpu":
        # Keys at or past every sequence's valid count are padding for all of them (a static
        # cache's unwritten positions): attend over the valid prefix only. On the CPU only: on a
        # GPU reading the count back would synchronize every call and break CUDA graph capture.
        used = max(int(nonpad_kv_seqlen.max()), 1)
        key, value = key[:, :, :used], value[:, :, :used]
    tq, tk = query.shape[2], key.shape[2]
    bias, causal_only = _bias(attn_mask, is_causal, past, nonpad_kv_seqlen, tq, tk, query)
    if weights == NO_WEIGHTS and softcap <= 0:  # torch's fused kernels have no softcap or score output
        out = torch_sdpa(
            query, key, value, attn_mask=bias, is_causal=causal_only, scale=scale,
            enable_gqa=query.shape[1] != key.shape[1])
        if bias is not None:
            # torch leaves NaN in a row with nothing to attend to; the semantics say zeros.
            out = out.masked_fill(torch.isneginf(bias.amax(dim=-1, keepdim=True)), 0.0)
        return out, *present, query.new_empty(0)
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        # Grouped-query attention: each key/value head serves hq // hkv consecutive query heads.
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    raw = (query @ key.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    # Softcap before the bias, so that a -inf bias stays -inf.
    capped = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    if causal_only:
        bias = torch.zeros((tq, tk), dtype=query.dtype, device=query.device).masked_fill(
            torch.ones((tq, tk), dtype=torch.bool, device=query.device).triu(1), -math.inf)
    scores = capped if bias is None else capped + bias
    precision = SOFTMAX_PRECISIONS.get(softmax_precision, scores.dtype)
    probs = torch.softmax(scores.to(precision), dim=-1).to(scores.dtype)
    if bias is not None:
        # A row whose bias is -inf everywhere attends to nothing: zeros, decided on the bias
        # (not on the scores), exactly as the operator's definition does.
        probs = probs.masked_fill(torch.isneginf(bias.amax(dim=-1, keepdim=True)), 0.0)
    shown = query.new_empty(0)
    if weights != NO_WEIGHTS:
        shown = torch.broadcast_to((raw, capped, scores, probs)[weights], probs.shape).clone()
    return probs @ value, *present, shown


@torch.library.custom_op("attnexport::attention", mutates_args=())
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    past_key: torch.Tensor | None,
    past_value: torch.Tensor | None,
    nonpad_kv_seqlen: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    softcap: float,
    weights: int,
    softmax_precision: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention over [B, H, T, d] tensors with the ONNX `Attention` operator's semantics.

    The op's schema lists the operator's inputs and attributes one by one (torch.library makes
    the schema from this signature, and torch.onnx passes them so to each flavour's
    translation); code calls it through `attend`, with the attributes as one `Core`.

    Args:
        query: (B, Hq, Tq, d).
        key: (B, Hkv, Tk, d); Hq must be a multiple of Hkv.
        value: (B, Hkv, Tk, dv).
        attn_mask: None, bool (True = attend) or additive float, broadcastable to
            (B, Hq, Tq, P + Tk).
        past_key, past_value: None, or the cache (B, Hkv, P, d) and (B, Hkv, P, dv); P may be 0.
        nonpad_kv_seqlen: None, or (B,) int64: keys at or past it are padding (opset 24).
        scale: multiplies QK^T; None means 1/sqrt(d).
        is_causal: offset-aligned causal mask: query i attends keys j <= i + offset, the offset
            being P with a cache, nonpad_kv_seqlen - Tq with valid counts, else 0 (top-left).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the mask.
        weights: -1, or the operator's qk_matmul_output_mode (see attnexport.semantics).
        softmax_precision: None, or the ONNX element type the softmax is computed in.

    Returns:
        output (B, Hq, Tq, dv); present_key and present_value (past followed by the new keys and
        values; empty without a cache); the score output (B, Hq, Tq, P + Tk; empty without weights).
    """
    cache = None if past_key is None else (past_key, past_value)
    return _attention_impl(query, key, value, attn_mask, cache, nonpad_kv_seqlen,
                           Core(scale, is_causal, softcap, weights, softmax_precision))


@attention.register_fake
def _(query, key, value, attn_mask, past_key, past_value, nonpad_kv_seqlen, scale, is_causal, softcap, weights,
      softmax_precision):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    if past_key is not None:
        present = (torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2))
    else:
        present = (query.new_empty(0), query.new_empty(0))
    tk = key.shape[2] + (past_key.shape[2] if past_key is not None else 0)
    shown = query.new_empty((*query.shape[:-1], tk)) if weights != NO_WEIGHTS else query.new_empty(0)
    return out, *present, shown


class Attended(NamedTuple):
    output: torch.Tensor
    weights: torch.Tensor | None
    present_key: torch.Tensor | None
    present_value: torch.Tensor | None


def attend(query, key, value, attn_mask=None, *, cache=None, nonpad_kv_seqlen=None, core: Core = PLAIN) -> Attended:
    """Calls the core op with `core`'s attributes; `cache`: None or (past_key, past_value)."""
    past_key, past_value = cache if cache is not None else (None, None)
    out, present_key, present_value, shown = attention(
        query, key, value, attn_mask, past_key, past_value, nonpad_kv_seqlen, *core.attributes())
    cached = cache is not None
    return Attended(out, shown if core.weights != NO_WEIGHTS else None, present_key if cached else None,
                    present_value if cached else None)


def valid_keys(write_pos: torch.Tensor, new: int) -> torch.Tensor:
    """Each sequence's valid cache positions after a static cache's write of `new` (>= 1)
    positions at write_pos: write_pos + new, (B,).

    Computed as the position after each sequence's last new one, from the positions arange(new)
    on the device: ONNX Runtime's CUDA provider places a node on the CPU when every input is a
    graph input or a value computed from shapes, which write_pos + T is (and then the key mask
    and the causal offset that use it), and a CUDA graph can neither hold a CPU node nor copy a
    host value to the device. Range reads its bounds on the host and writes on the device."""
    positions = write_pos.reshape(-1, 1) + torch.arange(new, device=write_pos.device)
    return positions[:, -1] + 1


@torch.library.custom_op("attnexport::cache_write", mutates_args=())
def cache_write(cache: torch.Tensor, update: torch.Tensor, write_pos: torch.Tensor) -> torch.Tensor:
    """A static key/value cache with the new positions written in: the ONNX `TensorScatter`
    operator (opset 24, linear mode, axis -2).

    Args:
        cache: (B, H, S, d), the buffer of S = max_seq positions.
        update: (B, H, T, d), the new keys or values.
        write_pos: (B,) int64: sequence b's new positions go to write_pos[b] .. write_pos[b]+T-1
            (each at most S - T).

    Returns:
        the buffer with the update written in (B, H, S, d); every other position as it was.
    """
    b, h, t, d = update.shape
    index = (write_pos.reshape(-1, 1) + torch.arange(t, device=update.device)).reshape(b, 1, t, 1)
    return cache.scatter(2, index.expand(b, h, t, d), update)


@cache_write.register_fake
def _(cache, update, write_pos):
    return torch.empty_like(cache)


@torch.library.custom_op("attnexport::static_attention", mutates_args=())
def static_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    write_pos: torch.Tensor,
    valid: torch.Tensor,
    scale: float | None,
    is_causal: bool,
    softcap: float,
    softmax_precision: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step over static buffers: the new keys and values written at write_pos (`cache_write`),
    then attention over each sequence's valid prefix (`attention` with `nonpad_kv_seqlen` =
    `valid`, which is write_pos + the new positions, see `valid_keys`). One op, so that a flavour
    can translate the step whole (the ort flavour: GroupQueryAttention, which writes the buffers in
    place); its schema is the operator's inputs and attributes one by one, as for `attention`.

    Returns (output (B, Hq, T, dv), key_cache_out, value_cache_out)."""
    key_cache = cache_write(key_cache, key, write_pos)
    value_cache = cache_write(value_cache, value, write_pos)
    out = _attention_impl(query, key_cache, value_cache, None, None, valid,
                          Core(scale, is_causal, softcap, NO_WEIGHTS, softmax_precision))[0]
    return out, key_cache, value_cache


@static_attention.register_fake
def _(query, key, value, key_cache, value_cache, write_pos, valid, scale, is_causal, softcap, softmax_precision):
    return query.new_empty((*query.shape[:-1], value.shape[-1])), torch.empty_like(key_cache), \
        torch.empty_like(value_cache)


def attend_static(query, key, value, caches: tuple, write_pos, core: Core = PLAIN):
    """A static-cache step through the core (`static_attention`): `caches` the (key, value)
    buffers; returns (output, key_cache_out, value_cache_out)."""
    valid = valid_keys(write_pos, key.shape[2])
    return static_attention(query, key, value, *caches, write_pos, valid, core.scale, core.is_causal, core.softcap,
                            core.softmax_precision)


def ring_positions(write_pos: torch.Tensor, window: int, written: int) -> torch.Tensor:
    """The position each slot of a ring of `window` slots holds once positions up to
    write_pos + written - 1 are written (each position p at slot p % window, the newest kept):
    (B, window), negative where a slot holds none yet."""
    last = write_pos.reshape(-1, 1) + (written - 1)
    slots = torch.arange(window, device=write_pos.device)
    return last - torch.remainder(last - slots, window)


def attend_ring(query, key, value, ring: tuple, write_pos, window: int, core: Core = PLAIN):
    """A static-cache step of a sliding-window layer, whose buffers are a ring of `window` slots
    (position p at slot p % window) rather than --max-seq positions: a query at position q sees
    the keys at q - window + 1 .. q, as the window's causal mask does.

    The block's queries attend over the ring as it was and the block's own keys (window + T keys,
    each masked by the position it holds), so that a block longer than the room left before the
    ring wraps still sees what it overwrites; the ring returned holds, at each slot, the newest of
    the old and the new positions (a gather, so a block longer than the window writes each slot
    once). `ring`: the (key, value) rings, (B, Hkv, window, d); returns (output (B, Hq, T, dv),
    key ring, value ring)."""
    batch, heads, block, width = key.shape
    start = write_pos.reshape(-1, 1)
    queries = start + torch.arange(block, device=key.device)  # (B, T) the block's positions
    held = torch.cat([ring_positions(write_pos, window, 0), queries], dim=1)  # (B, window + T)
    seen = held[:, None, :]
    at = queries[:, :, None]
    mask = (seen >= 0) & (seen <= at) & (seen > at - window)  # (B, T, window + T)
    a = attend(query, key, value, mask[:, None], cache=ring,
               core=Core(core.scale, False, core.softcap, NO_WEIGHTS, core.softmax_precision))
    newest = ring_positions(write_pos, window, block)  # (B, window)
    slots = torch.arange(window, device=key.device)
    taken = torch.where(newest >= start, window + newest - start, slots)  # in (old ring, block)
    index = taken[:, None, :, None]
    assert a.present_key is not None and a.present_value is not None  # a cache was given: (old ring, block)
    keys = torch.gather(a.present_key, 2, index.expand(batch, heads, window, width))
    values = torch.gather(a.present_value, 2, index.expand(batch, heads, window, value.shape[-1]))
    return a.output, keys, values
