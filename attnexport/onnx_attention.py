"""ONNX translations of the attention core (`attnexport::attention`), one per export flavour.

Each translation is an onnxscript function the torch exporter calls in place of the custom op.
All three compute the same function as the op's eager implementation, edge cases included:
grouped-query heads, top-left causal masks with different query and key lengths, softcap, bool
or additive masks, and fully masked rows, which give zeros.
"""

from __future__ import annotations

import math

import onnx
from onnx.defs import OpSchema
from onnxscript import ir, opset18 as op, opset23 as op23
from onnxscript.values import Op, Opset

from attnexport.errors import UnsupportedByFlavor


def _msft_mha(cached: bool = False) -> Op:
    """com.microsoft.MultiHeadAttention as onnxscript can call it.

    The onnx package holds no schemas of ONNX Runtime's contrib ops, so the exporter is given
    one that declares the inputs, outputs and attributes this project uses: without a cache
    (one output), or with `past_key`/`past_value` inputs and `present_key`/`present_value` outputs.
    """
    P, A = OpSchema.FormalParameter, OpSchema.Attribute
    single, opt = OpSchema.FormalParameterOption.Single, OpSchema.FormalParameterOption.Optional
    names = ("query", "key", "value", "bias", "key_padding_mask", "attention_bias")
    names += ("past_key", "past_value") if cached else ()
    outputs = [P("output", "T")] + ([P("present_key", "T", param_option=opt), P("present_value", "T", param_option=opt)]
                                    if cached else [])
    schema = OpSchema(
        "MultiHeadAttention", "com.microsoft", 1,
        inputs=[P(n, "M" if n == "key_padding_mask" else "T", param_option=single if i == 0 else opt)
                for i, n in enumerate(names)],
        outputs=outputs,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[A("num_heads", onnx.AttributeProto.INT, "", required=True),
                    A("scale", onnx.AttributeProto.FLOAT, "", required=False),
                    A("unidirectional", onnx.AttributeProto.INT, "", required=False),
                    A("mask_filter_value", onnx.AttributeProto.FLOAT, "", required=False)])
    return Op(Opset("com.microsoft", 1), "MultiHeadAttention", schema)


_MultiHeadAttention = _msft_mha()
_MultiHeadAttentionCached = _msft_mha(cached=True)

# --- helpers (opset 18) --------------------------------------------------------------------


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def _const(value, like):
    return op.CastLike(op.Constant(value_float=float(value)), like)


def _shape(x, start, end=None):
    return op.Shape(x, start=start) if end is None else op.Shape(x, start=start, end=end)


def _bias(attn_mask, is_causal, query, key, like):
    """The additive bias, float, broadcastable to (B, Hq, Tq, Tk); None if there is none."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == ir.DataType.BOOL:
            bias = op.Where(attn_mask, _const(0.0, like), _const(-math.inf, like))
        else:
            bias = op.CastLike(attn_mask, like)
    if is_causal:
        causal = _causal_bias(query, key, like)
        bias = causal if bias is None else op.Add(bias, causal)
    return bias


def _causal_bias(query, key, like, offset: bool = False):
    """0 where query i may attend key j, -inf elsewhere: j <= i, or with `offset` (a cache, whose
    past keys come first) j <= P + i, P = (keys) - (queries)."""
    tq = op.Squeeze(_shape(query, -2, -1))
    tk = op.Squeeze(_shape(key, -2, -1))
    rows = op.Range(op.Constant(value_int=0), tq, op.Constant(value_int=1))
    if offset:
        rows = op.Add(rows, op.Sub(tk, tq))
    cols = op.Range(op.Constant(value_int=0), tk, op.Constant(value_int=1))
    return op.Where(op.LessOrEqual(cols, op.Unsqueeze(rows, [-1])), _const(0.0, like), _const(-math.inf, like))


def _dead_rows(bias):
    """True where a row's bias is -inf everywhere: that query attends to nothing."""
    # Counts the keys a row may attend to. ReduceSum (not ReduceMax) keeps the graph the same in
    # opsets 13-18, and Equal (not IsInf) works on fp16 before opset 20.
    visible = op.Cast(op.Not(op.Equal(bias, _const(-math.inf, bias))), to=ir.DataType.FLOAT)
    return op.Equal(op.ReduceSum(visible, [-1], keepdims=1), op.Constant(value_float=0.0))


def _needs_guard(attn_mask) -> bool:
    # A causal mask alone never empties a row (key 0 is always visible); any explicit mask can.
    return attn_mask is not None


def _repeat_kv(x, groups_known, query):
    """(B, Hkv, T, d) -> (B, Hq, T, d), each key/value head repeated for its query-head group."""
    if groups_known == 1:
        return x
    hq = _shape(query, 1, 2)
    hkv = _shape(x, 1, 2)
    g = op.Div(hq, hkv)
    x5 = op.Unsqueeze(x, [2])  # (B, Hkv, 1, T, d)
    target = op.Concat(_shape(x, 0, 2), g, _shape(x, 2), axis=0)
    expanded = op.Expand(x5, target)  # (B, Hkv, G, T, d)
    return op.Reshape(expanded, op.Concat(_shape(x, 0, 1), hq, _shape(x, 2), axis=0))


def _groups(query, key) -> int | None:
    hq, hkv = _static(query.shape[1]), _static(key.shape[1])
    return hq // hkv if hq is not None and hkv is not None else None


def _scaled_scores(query, key, scale):
    """scale * Q K^T. The scale multiplies the product, not the query: ONNX Runtime's CUDA
    provider put `query / sqrt(d)` on the CPU in fp32 (both inputs are in host memory when the
    query is a graph input and d comes from its shape), a fallback `--strict-placement` caught;
    the product is made on the device, so the scaling stays there."""
    scores = op.MatMul(query, op.Transpose(key, perm=[0, 1, 3, 2]))
    if scale is None:  # 1/sqrt(head size) read at run time: sdpa's head size is symbolic
        return op.Div(scores, op.Sqrt(op.CastLike(_shape(query, -1), scores)))
    return op.Mul(scores, _const(scale, scores))


# --- primitives: MatMul + Softmax, opset 18 --------------------------------------------------

def _primitives(query, key, value, attn_mask, scale, is_causal, softcap):
    groups = _groups(query, key)
    key, value = _repeat_kv(key, groups, query), _repeat_kv(value, groups, query)
    scores = _scaled_scores(query, key, scale)
    if softcap and softcap > 0:
        scores = op.Mul(op.Tanh(op.Div(scores, _const(softcap, scores))), _const(softcap, scores))
    bias = _bias(attn_mask, is_causal, query, key, scores)
    if bias is not None:
        scores = op.Add(scores, bias)
    probs = op.Softmax(scores, axis=-1)
    if _needs_guard(attn_mask):
        # Softmax of an all -inf row is NaN (the mean of V in some kernels): select zeros.
        probs = op.Where(_dead_rows(bias), _const(0.0, probs), probs)
    return op.MatMul(probs, value), probs


def primitives_attention(query, key, value, attn_mask=None, scale=None, is_causal=False, softcap=0.0):
    return _primitives(query, key, value, attn_mask, scale, is_causal, softcap)[0]


def primitives_attention_weights(query, key, value, attn_mask=None, scale=None, is_causal=False, softcap=0.0):
    return _primitives(query, key, value, attn_mask, scale, is_causal, softcap)


# --- attention: the standard Attention op, opset 23 ----------------------------------------

def _standard(query, key, value, attn_mask, scale, is_causal, softcap):
    if attn_mask is not None and attn_mask.shape is not None and attn_mask.shape[-2] != query.shape[2]:
        # The spec broadcasts the mask, but ONNX Runtime's kernel wants its query axis to be
        # Tq: expand a padding mask (B, 1, 1, Tk) to (B, 1, Tq, Tk).
        lead = _shape(attn_mask, 0, len(attn_mask.shape) - 2)
        attn_mask = op.Expand(attn_mask, op.Concat(lead, _shape(query, 2, 3), _shape(attn_mask, -1), axis=0))
    attrs = {"is_causal": int(bool(is_causal))}
    if scale is not None:
        attrs["scale"] = float(scale)
    if softcap and softcap > 0:
        attrs["softcap"] = float(softcap)
    return op23.Attention(query, key, value, attn_mask, **attrs)[0]


def standard_attention(query, key, value, attn_mask=None, scale=None, is_causal=False, softcap=0.0):
    return _standard(query, key, value, attn_mask, scale, is_causal, softcap)


def _weights_beside(fused):
    """A translation with weights: the output from the fused node, the weights from MatMul +
    Softmax on the same inputs (paid only when --weights is asked for). Neither fused op can give
    them: com.microsoft.MultiHeadAttention has no such output, and ONNX Runtime's CUDA kernel for
    the standard op computes its fourth output in qk_matmul_output_mode 0 and 1 only ("Only kNone
    and kQK output modes are supported in unified unfused attention", onnxruntime-gpu 1.31.1 on an
    H100), where mode 3 would be the softmax."""
    def with_weights(query, key, value, attn_mask=None, scale=None, is_causal=False, softcap=0.0):
        out = fused(query, key, value, attn_mask, scale, is_causal, softcap)
        return out, _primitives(query, key, value, attn_mask, scale, is_causal, softcap)[1]
    return with_weights


# --- ort: com.microsoft.MultiHeadAttention --------------------------------------------------

def ort_attention(query, key, value, attn_mask=None, scale=None, is_causal=False, softcap=0.0):
    if softcap and softcap > 0:
        raise UnsupportedByFlavor("the ort flavor cannot express --softcap: com.microsoft.MultiHeadAttention "
                          "has no softcap; use --flavor attention or primitives")
    heads = _static(query.shape[1])
    groups = _groups(query, key)
    same_length = query.shape[2] == key.shape[2]  # the same symbolic length: self-attention
    key, value = _repeat_kv(key, groups, query), _repeat_kv(value, groups, query)
    bias = _bias(attn_mask, is_causal and not same_length, query, key, query)
    attrs = {"num_heads": heads or 1}
    if scale is not None:
        attrs["scale"] = float(scale)
    if is_causal and same_length:
        attrs["unidirectional"] = 1  # the kernel's own causal mask: no bias tensor to read
    if heads is not None:
        # (B, H, T, d) -> (B, T, H*d): the layout the kernel wants; the exporter's transposes
        # around it cancel with the module's own.
        q3 = op.Reshape(op.Transpose(query, perm=[0, 2, 1, 3]), [0, 0, -1])
        k3 = op.Reshape(op.Transpose(key, perm=[0, 2, 1, 3]), [0, 0, -1])
        v3 = op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), [0, 0, -1])
        if bias is not None:
            bias = op.Expand(bias, op.Concat(op.Constant(value_ints=[1, 1]), _shape(query, 2, 3),
                                             _shape(key, 2, 3), axis=0))  # (B|1, 1, Tq, Tk)
        out = _MultiHeadAttention(q3, k3, v3, None, None, bias, **attrs)
        out = op.Transpose(op.Reshape(out, op.Concat(op.Constant(value_ints=[0, 0]), _shape(query, 1, 2),
                                                     op.Constant(value_ints=[-1]), axis=0)), perm=[0, 2, 1, 3])
    else:
        # Symbolic head count (sdpa): fold the heads into the batch and run one head.
        minus1 = op.Constant(value_ints=[-1])
        q3 = op.Reshape(query, op.Concat(minus1, _shape(query, 2), axis=0))  # (B*H, Tq, d)
        k3 = op.Reshape(key, op.Concat(minus1, _shape(key, 2), axis=0))
        v3 = op.Reshape(value, op.Concat(minus1, _shape(value, 2), axis=0))
        if bias is not None:
            full = op.Concat(_shape(query, 0, 3), _shape(key, 2, 3), axis=0)  # (B, H, Tq, Tk)
            bias = op.Reshape(op.Expand(bias, full), op.Concat(minus1, op.Constant(value_ints=[1]),
                                                               _shape(query, 2, 3), _shape(key, 2, 3), axis=0))
        out = _MultiHeadAttention(q3, k3, v3, None, None, bias, **attrs)
        out = op.Reshape(out, op.Concat(_shape(query, 0, 3), minus1, axis=0))  # (B, H, Tq, dv)
    if _needs_guard(attn_mask):
        # Rows can be emptied by the mask and the causal mask together: guard on both.
        full_bias = _bias(attn_mask, is_causal, query, key, out)
        out = op.Where(_dead_rows(full_bias), _const(0.0, out), out)
    return out


TRANSLATIONS = {
    "primitives": (primitives_attention, primitives_attention_weights),
    "attention": (standard_attention, _weights_beside(standard_attention)),
    "ort": (ort_attention, _weights_beside(ort_attention)),
}


# --- with a key/value cache (attnexport::attention_cached) ---------------------------------------

def primitives_attention_cached(query, key, value, past_key, past_value, scale=None, is_causal=False):
    present_key = op.Concat(past_key, key, axis=2)
    present_value = op.Concat(past_value, value, axis=2)
    groups = _groups(query, key)
    k, v = _repeat_kv(present_key, groups, query), _repeat_kv(present_value, groups, query)
    scores = _scaled_scores(query, k, scale)
    if is_causal:
        scores = op.Add(scores, _causal_bias(query, present_key, scores, offset=True))
    # A causal row always sees key 0 and an uncausal one every key: no row is ever empty.
    return op.MatMul(op.Softmax(scores, axis=-1), v), present_key, present_value


def standard_attention_cached(query, key, value, past_key, past_value, scale=None, is_causal=False):
    # The standard op takes the cache itself: present = past followed by the new keys/values,
    # and its causal mask is offset-aligned by the past length.
    attrs = {"is_causal": int(bool(is_causal))}
    if scale is not None:
        attrs["scale"] = float(scale)
    y, present_key, present_value, _ = op23.Attention(query, key, value, None, past_key, past_value, **attrs)
    return y, present_key, present_value


def ort_attention_cached(query, key, value, past_key, past_value, scale=None, is_causal=False):
    heads, kv_heads = _static(query.shape[1]), _static(key.shape[1])
    if heads is None:
        raise UnsupportedByFlavor("the ort flavor's cache (com.microsoft.MultiHeadAttention with past_key/"
                                  "past_value) needs a fixed head count, and this graph's is symbolic (sdpa); "
                                  "use --flavor attention or primitives")
    if kv_heads != heads:
        raise UnsupportedByFlavor("the ort flavor's cache (com.microsoft.MultiHeadAttention with past_key/"
                                  "past_value) needs as many key/value heads as query heads; use --flavor "
                                  "attention or primitives for a grouped-query cache")
    attrs = {"num_heads": heads}
    if scale is not None:
        attrs["scale"] = float(scale)
    if is_causal:
        attrs["unidirectional"] = 1  # offset-aligned by the past length in ONNX Runtime's kernel
    q3 = op.Reshape(op.Transpose(query, perm=[0, 2, 1, 3]), [0, 0, -1])  # (B, T, H*d)
    k3 = op.Reshape(op.Transpose(key, perm=[0, 2, 1, 3]), [0, 0, -1])
    v3 = op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), [0, 0, -1])
    out, present_key, present_value = _MultiHeadAttentionCached(q3, k3, v3, None, None, None, past_key,
                                                                past_value, **attrs)
    out = op.Transpose(op.Reshape(out, op.Concat(op.Constant(value_ints=[0, 0]), _shape(query, 1, 2),
                                                 op.Constant(value_ints=[-1]), axis=0)), perm=[0, 2, 1, 3])
    return out, present_key, present_value


TRANSLATIONS_CACHED = {
    "primitives": primitives_attention_cached,
    "attention": standard_attention_cached,
    "ort": ort_attention_cached,
}
