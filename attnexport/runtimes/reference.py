"""`onnx-ref`: onnx's ReferenceEvaluator, with the ops attnexport gives it."""

from __future__ import annotations

import math

import numpy as np
import onnx

from attnexport.runtimes import base as R


def reference_ops() -> list:
    """The ops attnexport gives onnx's ReferenceEvaluator: com.microsoft.MultiHeadAttention, which
    it lacks, and GatherElements, which it gets wrong where the gathered axis is longer than the
    numpy.choose it relies on takes (64 choices in numpy 2; onnx 1.23's fallback then reads one
    element per row and fails to reshape: a BertModel's position ids, (1, 512) gathered to
    (1, T), broke the whole model on that runtime). The replacement is the operator's definition
    with numpy.take_along_axis."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        def _run(self, data, indices, axis=None):
            axis = 0 if axis is None else axis
            axis = axis % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices)  # negative: from the end
            # out[i][j] = data[i][indices[i][j]] (axis 1): the other axes as long as the indices'.
            data = data[tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape))]
            return (np.take_along_axis(data, indices.astype(np.int64), axis=axis),)
    return [mha_reference_op(), gqa_reference_op(), GatherElements, *fused_reference_ops()]


def _rotate_half(x64: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding in its rotate-half form on (..., d) in float64: the first 2 * half of d
    rotated by cos and sin (..., half), the rest as it is."""
    half = cos.shape[-1]
    a, b, rest = x64[..., :half], x64[..., half:2 * half], x64[..., 2 * half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


def fused_reference_ops() -> list:
    """The ops ONNX Runtime's fusions put in an ort-flavour whole model (`attnexport.pretrained.fusions`),
    for onnx's ReferenceEvaluator, from their contracts: com.microsoft.SkipSimplifiedLayerNormalization
    (an RMS norm over the last axis of input + skip, scaled, which it also returns),
    com.microsoft.RotaryEmbedding (rotate-half: the cos and sin tables gathered at the position
    ids), and an encoder's: com.microsoft.SkipLayerNormalization (a layer norm of input + skip +
    bias, which it also returns), com.microsoft.BiasGelu (the exact, erf GELU of input + bias) and
    com.microsoft.Attention (its projections packed in one matrix; the subset attnexport emits); and
    the integer int8 form's com.microsoft.DynamicQuantizeMatMul (`attnexport.pretrained.precision`:
    ONNX's DynamicQuantizeLinear of the input, its integer product with the int8 weight, times
    both scales) and com.microsoft.QAttention (an input quantized so, its packed projections
    likewise, then Attention's)."""
    from onnx.reference.op_run import OpRun

    class SkipSimplifiedLayerNormalization(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, skip, gamma, bias=None, epsilon=1e-5):
            total = x + skip + (bias if bias is not None else 0)
            t64 = total.astype(np.float64)
            inv = 1.0 / np.sqrt((t64 * t64).mean(-1, keepdims=True) + epsilon)
            return (t64 * inv * gamma).astype(x.dtype), np.zeros_like(inv, np.float32), inv.astype(np.float32), total

    class RotaryEmbedding(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, position_ids, cos_cache, sin_cache, interleaved=0, num_heads=0, rotary_embedding_dim=0,
                 is_packed_batching=0, scale=1.0):
            if interleaved:
                raise NotImplementedError("interleaved rotary embeddings (attnexport's exports use rotate-half)")
            four = x.ndim == 4  # (B, N, S, d); else (B, S, N * d)
            y = x if four else x.reshape(x.shape[0], x.shape[1], num_heads, -1).transpose(0, 2, 1, 3)
            cos = cos_cache[position_ids][:, None].astype(np.float64)  # (B, 1, S, half)
            sin = sin_cache[position_ids][:, None].astype(np.float64)
            out = _rotate_half(y.astype(np.float64), cos, sin).astype(x.dtype)
            return (out if four else out.transpose(0, 2, 1, 3).reshape(x.shape),)

    erf = np.vectorize(math.erf, otypes=[np.float64])

    class SkipLayerNormalization(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, skip, gamma, beta=None, bias=None, epsilon=1e-12):
            total = x + skip + (bias if bias is not None else 0)
            t64 = total.astype(np.float64)
            mean = t64.mean(-1, keepdims=True)
            inv = 1.0 / np.sqrt(((t64 - mean) ** 2).mean(-1, keepdims=True) + epsilon)
            out = (t64 - mean) * inv * gamma + (beta if beta is not None else 0)
            return out.astype(x.dtype), mean.astype(np.float32), inv.astype(np.float32), total

    class BiasGelu(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, bias):
            y = x.astype(np.float64) + bias
            return ((0.5 * y * (1.0 + erf(y / np.sqrt(2.0)))).astype(x.dtype),)

    class Attention(OpRun):
        op_domain = "com.microsoft"
        op_schema = None  # not ONNX's own Attention (opset 23), whose attributes the evaluator would read by name

        def _run(self, x, weights, bias=None, mask_index=None, past=None, attention_bias=None, *unused,
                 num_heads=None, scale=None, unidirectional=0, mask_filter_value=-10000.0, qkv_hidden_sizes=None,
                 do_rotary=0, past_present_share_buffer=0, rotary_embedding_dim=0):
            if past is not None or unidirectional or do_rotary or qkv_hidden_sizes:
                raise NotImplementedError("Attention with a cache, a causal mask, rotary or uneven q/k/v "
                                          "(attnexport's exports have none)")
            qkv = x @ weights + (bias if bias is not None else 0)
            q, k, v = np.split(qkv, 3, axis=-1)
            out = _attend(q, k, v, num_heads, scale, mask_index, attention_bias, mask_filter_value)
            return (out.astype(x.dtype),)

    class DynamicQuantizeMatMul(OpRun):
        op_domain = "com.microsoft"

        def _run(self, a, b, b_scale, b_zero_point=None, bias=None):
            x = a.astype(np.float64)
            lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            scale = np.float32((hi - lo) / 255)
            if scale == 0:
                y = np.zeros((*a.shape[:-1], b.shape[-1]), np.float64)
            else:
                zero = np.clip(np.rint(-lo / scale), 0, 255)
                q = np.clip(np.rint(a / scale) + zero, 0, 255) - zero  # half to even, as ONNX rounds
                wq = b.astype(np.float64) - (b_zero_point.astype(np.float64) if b_zero_point is not None else 0)
                # integers in float64: every sum of K products of at most 255 x 255 is exact below 2^53
                y = (q.astype(np.float64) @ wq) * float(scale) * b_scale.astype(np.float64)
            return ((y + (bias if bias is not None else 0)).astype(a.dtype),)

    class QAttention(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, weight, bias, input_scale, weight_scale, mask_index=None, input_zero_point=None,
                 weight_zero_point=None, past=None, num_heads=None, unidirectional=0, **unused):
            if past is not None or unidirectional:
                raise NotImplementedError("QAttention with a cache or a causal mask (attnexport's exports have none)")
            xz = input_zero_point.astype(np.float64) if input_zero_point is not None else 0.0
            wz = weight_zero_point.astype(np.float64) if weight_zero_point is not None else 0.0
            # the integer product in float64 (exact), then both scales, then the float attention
            qkv = ((x.astype(np.float64) - xz) @ (weight.astype(np.float64) - wz)) * \
                float(input_scale) * weight_scale.astype(np.float64) + bias
            q, k, v = np.split(qkv, 3, axis=-1)
            out = _attend(q, k, v, num_heads, None, mask_index, None, -10000.0)
            return (out.astype(np.float32),)

    return [SkipSimplifiedLayerNormalization, RotaryEmbedding, SkipLayerNormalization, BiasGelu, Attention,
            DynamicQuantizeMatMul, QAttention]


def _attend(q, k, v, heads: int, scale, key_padding_mask, attention_bias, mask_filter_value) -> np.ndarray:
    """Attention over (B, S, heads * d) queries and (B, L, heads * d) keys and values in float64: a key
    whose (B, L) padding mask is 0 gets mask_filter_value added to its score, as ONNX Runtime's
    kernels do; returns (B, S, heads * dv)."""
    B, S, D = q.shape
    L = k.shape[1]
    q4 = q.reshape(B, S, heads, -1).transpose(0, 2, 1, 3).astype(np.float64)
    k4 = k.reshape(B, L, heads, -1).transpose(0, 2, 1, 3).astype(np.float64)
    v4 = v.reshape(B, L, heads, -1).transpose(0, 2, 1, 3).astype(np.float64)
    s = (q4 @ k4.transpose(0, 1, 3, 2)) * (scale if scale else 1.0 / np.sqrt(D // heads))
    if attention_bias is not None:
        s = s + attention_bias
    if key_padding_mask is not None:
        if key_padding_mask.shape != (B, L):
            raise NotImplementedError("a padding mask other than (batch, keys) of 1 and 0 (attnexport's exports "
                                      "have none)")
        s = s + np.where(key_padding_mask[:, None, None, :] == 0, mask_filter_value, 0.0)
    e = np.exp(s - s.max(-1, keepdims=True))
    return ((e / e.sum(-1, keepdims=True)) @ v4).transpose(0, 2, 1, 3).reshape(B, S, -1)


def gqa_reference_op():
    """com.microsoft.GroupQueryAttention for onnx's ReferenceEvaluator, from its contract (the
    subset attnexport emits: no rotary, no packed QKV): the new keys and values are written into
    the past buffers at seqlens_k[b] + 1 - S .. seqlens_k[b], and query i of sequence b attends
    the keys at positions up to seqlens_k[b] + 1 - S + i (causal), grouped heads reading their
    key/value head; a softcap caps the scaled scores (softcap * tanh(scores / softcap)); with do_rotary
    the queries and keys are first rotated (rotate-half) at their positions from the cos and sin
    tables; a query input with no key and value is the three packed side by side."""
    from onnx.reference.op_run import OpRun

    class GroupQueryAttention(OpRun):
        op_domain = "com.microsoft"

        def _run(self, query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache=None,
                 sin_cache=None, *unused, num_heads=None, kv_num_heads=None, scale=None, softcap=None, do_rotary=0,
                 rotary_interleaved=0, local_window_size=-1):
            B, S, _ = query.shape
            d = past_key.shape[-1]
            if key is None:  # packed: queries, keys and values side by side
                query, key, value = np.split(query, [num_heads * d, (num_heads + kv_num_heads) * d], axis=-1)
            q = query.reshape(B, S, num_heads, d).transpose(0, 2, 1, 3).astype(np.float64)
            if do_rotary:  # queries and keys rotated at their positions, end - S + i
                if rotary_interleaved:
                    raise NotImplementedError("interleaved rotary embeddings (attnexport's exports use rotate-half)")
                at = np.array([int(seqlens_k[b]) + 1 - S + np.arange(S) for b in range(B)])  # (B, S)
                cos, sin = cos_cache[at][:, None].astype(np.float64), sin_cache[at][:, None].astype(np.float64)
                q = _rotate_half(q, cos, sin)
                k4 = key.reshape(B, S, kv_num_heads, d).transpose(0, 2, 1, 3).astype(np.float64)
                key = _rotate_half(k4, cos, sin).astype(key.dtype).transpose(0, 2, 1, 3).reshape(B, S, -1)
            present_key, present_value = past_key.copy(), past_value.copy()
            out = np.zeros((B, num_heads, S, d))
            for b in range(B):
                end = int(seqlens_k[b]) + 1
                present_key[b, :, end - S:end] = key[b].reshape(S, kv_num_heads, d).transpose(1, 0, 2)
                present_value[b, :, end - S:end] = value[b].reshape(S, kv_num_heads, d).transpose(1, 0, 2)
                k = np.repeat(present_key[b, :, :end].astype(np.float64), num_heads // kv_num_heads, axis=0)
                v = np.repeat(present_value[b, :, :end].astype(np.float64), num_heads // kv_num_heads, axis=0)
                s = (q[b] @ k.transpose(0, 2, 1)) * (scale if scale else 1.0 / np.sqrt(d))
                if softcap:  # before the causal mask, so that -inf stays -inf
                    s = softcap * np.tanh(s / softcap)
                rows = end - S + np.arange(S)[:, None]
                s = np.where(np.arange(end)[None, :] <= rows, s, -np.inf)
                e = np.exp(s - s.max(-1, keepdims=True))
                out[b] = (e / e.sum(-1, keepdims=True)) @ v
            out = out.transpose(0, 2, 1, 3).reshape(B, S, num_heads * d).astype(query.dtype)
            return out, present_key, present_value

    return GroupQueryAttention


def mha_reference_op():
    """com.microsoft.MultiHeadAttention for onnx's ReferenceEvaluator (the subset attnexport emits)."""
    from onnx.reference.op_run import OpRun

    class MultiHeadAttention(OpRun):
        op_domain = "com.microsoft"

        def _run(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                 past_key=None, past_value=None, *unused, num_heads=None, scale=None, unidirectional=None,
                 mask_filter_value=None):
            if key_padding_mask is not None and past_key is None and not unidirectional:
                # an encoder's (`attnexport.pretrained.fusions.encoder`): q, k, v with their bias, the (B, L) mask
                if bias is not None:
                    query, key, value = (t + b for t, b in zip((query, key, value), np.split(bias, 3), strict=True))
                filler = -10000.0 if mask_filter_value is None else mask_filter_value
                return (_attend(query, key, value, num_heads, scale, key_padding_mask, attention_bias,
                                filler).astype(query.dtype),)
            if bias is not None or key_padding_mask is not None:
                raise NotImplementedError("MultiHeadAttention's bias or key padding mask with a cache or a causal "
                                          "mask (attnexport's exports have none)")
            B, S, D = query.shape
            L, N = key.shape[1], num_heads
            q = query.reshape(B, S, N, D // N).transpose(0, 2, 1, 3)
            k = key.reshape(B, L, N, -1).transpose(0, 2, 1, 3)
            v = value.reshape(B, L, N, -1).transpose(0, 2, 1, 3)
            P = 0
            if past_key is not None:  # the cache: past keys/values first; causal offset by their number
                P = past_key.shape[2]
                k, v = np.concatenate([past_key, k], axis=2), np.concatenate([past_value, v], axis=2)
            s = (q @ k.transpose(0, 1, 3, 2)) * (scale if scale else 1.0 / np.sqrt(D // N))
            if attention_bias is not None:
                s = s + attention_bias
            if unidirectional:
                s = s + np.where(np.tril(np.ones((S, P + L), bool), k=P), 0, -np.inf).astype(s.dtype)
            with np.errstate(invalid="ignore"):
                e = np.exp(s - s.max(-1, keepdims=True))
                p = (e / e.sum(-1, keepdims=True)).astype(query.dtype)
            out = (p @ v).transpose(0, 2, 1, 3).reshape(B, S, -1)
            if past_key is not None:
                return out.astype(query.dtype), k.astype(query.dtype), v.astype(query.dtype)
            return (out.astype(query.dtype),)

    return MultiHeadAttention


def status(name: str) -> R.Status:
    return R.Status(name, True, "onnx.reference.ReferenceEvaluator")


def prepare(name: str, model: onnx.ModelProto, optimize: bool = True, threads: int | None = None,
            prepack: bool = True) -> R.Prepared:
    """The reference evaluator on `model`, run by output name (it has no graph optimizations or
    threads to set)."""
    from onnx.reference import ReferenceEvaluator
    ev = ReferenceEvaluator(model, new_ops=reference_ops())
    names = list(ev.output_names)

    def run(feed: dict) -> dict:
        with np.errstate(all="ignore"):  # fully masked rows make NaN before the guard selects 0
            return {n: np.asarray(o) for n, o in zip(names, ev.run(None, feed), strict=True)}
    return R.Prepared(name, run, ["ReferenceEvaluator"])


def missing_ops(model: onnx.ModelProto) -> list[str]:
    """The contrib ops of `model` the reference evaluator has no implementation of: it knows the
    standard ops and the com.microsoft ones attnexport gives it (`reference_ops`)."""
    known = {(getattr(op, "op_domain", ""), op.__name__) for op in reference_ops()}
    return sorted({f"{n.domain}.{n.op_type}" for n in R.all_nodes(model.graph)
                   if n.domain not in ("", "ai.onnx") and (n.domain, n.op_type) not in known})
