"""ONNX translations of the attention core (`attnexport::attention`), one per export flavour.

Each translation is an onnxscript function the torch exporter calls in place of the custom op.
All three compute the same function as the op's eager implementation, edge cases included:
grouped-query heads, offset-aligned causal masks with different query and key lengths, softcap,
bool or additive masks of any broadcastable shape, a key/value cache, per-batch valid key counts,
the four kinds of score output, and fully masked rows, which give zeros.

Every translation takes the op's arguments and returns its four outputs: the output, the present
key and value (an empty constant without a cache) and the score output (an empty constant
without weights). The module uses only those its options declare; the others are dead code the
exporter's optimizer removes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx.defs import OpSchema
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript import opset23 as op23
from onnxscript.values import Op, Opset

from attnexport import flavors as FL
from attnexport.errors import UnsupportedByFlavor
from attnexport.semantics import NO_WEIGHTS, Core

op24 = Opset("", 24)  # onnxscript ships no opset24 module; the op's schema comes from onnx


def _msft_mha(cached: bool = False) -> Op:
    """com.microsoft.MultiHeadAttention as onnxscript can call it.

    The onnx package holds no schemas of ONNX Runtime's contrib ops, so the exporter is given
    one that declares the inputs, outputs and attributes this project uses: without a cache
    (one output), or with `past_key`/`past_value` inputs and `present_key`/`present_value` outputs.
    """
    P, A = OpSchema.FormalParameter, OpSchema.Attribute
    single, opt = OpSchema.FormalParameterOption.Single, OpSchema.FormalParameterOption.Optional
    names = ("query", "key", "value", "bias", "key_padding_mask", "attention_bias") + \
        (("past_key", "past_value") if cached else ())
    outputs = [P("output", "T")] + ([P("present_key", "T", param_option=opt), P("present_value", "T", param_option=opt)]
                                    if cached else [])
    schema = OpSchema(
        "MultiHeadAttention", "com.microsoft", 1,
        inputs=[P(n, "M" if n == "key_padding_mask" else "T", param_option=single if i == 0 else opt)
                for i, n in enumerate(names)],
        outputs=outputs,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[A("num_heads", OpSchema.AttrType.INT, "", required=True),
                    A("scale", OpSchema.AttrType.FLOAT, "", required=False),
                    A("unidirectional", OpSchema.AttrType.INT, "", required=False),
                    A("mask_filter_value", OpSchema.AttrType.FLOAT, "", required=False)])
    return Op(Opset("com.microsoft", 1), "MultiHeadAttention", schema)


_MultiHeadAttention = _msft_mha()
_MultiHeadAttentionCached = _msft_mha(cached=True)


def _msft_gqa() -> Op:
    """com.microsoft.GroupQueryAttention as onnxscript can call it (the inputs, outputs and
    attributes this project uses: no rotary, no packed QKV)."""
    P, A = OpSchema.FormalParameter, OpSchema.Attribute
    single = OpSchema.FormalParameterOption.Single
    schema = OpSchema(
        "GroupQueryAttention", "com.microsoft", 1,
        inputs=[P(n, t, param_option=single) for n, t in (
            ("query", "T"), ("key", "T"), ("value", "T"), ("past_key", "T"), ("past_value", "T"),
            ("seqlens_k", "M"), ("total_sequence_length", "M"))],
        outputs=[P("output", "T"), P("present_key", "T"), P("present_value", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], "")],
        attributes=[A("num_heads", OpSchema.AttrType.INT, "", required=True),
                    A("kv_num_heads", OpSchema.AttrType.INT, "", required=True),
                    A("scale", OpSchema.AttrType.FLOAT, "", required=False),
                    A("softcap", OpSchema.AttrType.FLOAT, "", required=False)])
    return Op(Opset("com.microsoft", 1), "GroupQueryAttention", schema)


_GroupQueryAttention = _msft_gqa()

# --- helpers (opset 18) --------------------------------------------------------------------


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def _const(value, like):
    return op.CastLike(op.Constant(value_float=float(value)), like)


# The lowest finite number of each float type a mask may have, and the one after it.
_LOWEST = {ir.DataType.FLOAT: np.finfo(np.float32).min, ir.DataType.FLOAT16: np.finfo(np.float16).min}
_NEXT_LOWEST = {t: np.nextafter(x, x.dtype.type(0)) for t, x in _LOWEST.items()}


def _lowest_added(mask):  # `mask` a graph input or a node's output whose type is known
    """ONNX Runtime's CPU Attention kernel (1.31.1) takes a mask value equal to its type's lowest
    finite number as -inf: a query whose keys all have it gets zeros, where the operator adds the
    mask and gives the mean of the values. transformers' eager masks are filled with that number
    (a fully padded sequence). Here the lowest becomes its neighbour, which the kernel adds."""
    lowest = _LOWEST.get(mask.dtype)
    if lowest is None:
        return mask
    return op.Where(op.Equal(mask, _const(lowest, mask)), _const(_NEXT_LOWEST[mask.dtype], mask), mask)


def _empty(like):
    """An unused output's placeholder (no cache, no weights): the optimizer drops it."""
    return op.CastLike(op.ConstantOfShape(op.Constant(value_ints=[0])), like)


def _shape(x, start, end=None):
    return op.Shape(x, start=start) if end is None else op.Shape(x, start=start, end=end)


def _key_length(key, past_key):
    """Tk as a 1-D tensor: the cache's length plus the new keys'."""
    tk = _shape(key, 2, 3)
    return tk if past_key is None else op.Add(_shape(past_key, 2, 3), tk)


def _neg_inf_where(condition, like):
    return op.Where(condition, _const(-math.inf, like), _const(0.0, like))


def _bias(attn_mask, is_causal, past, nonpad, tq, tk, like):
    """The additive bias, float, broadcastable to (B, Hq, Tq, Tk); None if there is none.

    Args:
        past: None, or the cache's length (1-D int64): a causal mask is offset by it (the
            operator's offset is the past length, whatever the number of new keys).
        nonpad: None, or (B,) int64 valid key counts: keys at or past them are padding, and a
            causal mask is offset by nonpad - Tq for each batch.
        tq, tk: the query and (total) key lengths, 1-D int64 tensors.
    """
    terms = []
    if attn_mask is not None:
        if attn_mask.dtype == ir.DataType.BOOL:
            terms.append(op.Where(attn_mask, _const(0.0, like), _const(-math.inf, like)))
        else:
            terms.append(op.CastLike(attn_mask, like))
    cols = None
    if nonpad is not None or is_causal:
        cols = op.Range(op.Constant(value_int=0), op.Squeeze(tk), op.Constant(value_int=1))  # (Tk,)
    if nonpad is not None:
        valid = op.Reshape(nonpad, op.Constant(value_ints=[-1, 1, 1, 1]))  # (B, 1, 1, 1)
        terms.append(_neg_inf_where(op.GreaterOrEqual(cols, valid), like))
    if is_causal:
        terms.append(_neg_inf_where(op.Greater(cols, _query_positions(tq, past, nonpad)), like))
    bias = terms[0] if terms else None
    for t in terms[1:]:
        bias = op.Add(bias, t)
    return bias


def _query_positions(tq, past=None, nonpad=None):
    """Each query's position among the keys, as a column: i (top-left, (Tq, 1)), past + i, or
    nonpad[b] - Tq + i ((B, 1, Tq, 1)); query i may attend the keys at or before it.

    Built by Range from the lengths, which ONNX Runtime's CUDA Range reads on the host: no host
    value enters a device node, so no copy to the device stops a CUDA graph's capture."""
    one = op.Constant(value_int=1)
    n = op.Squeeze(tq)
    if nonpad is not None:  # -Tq .. -1, then offset by each sequence's valid count
        steps = op.Unsqueeze(op.Range(op.Neg(n), op.Constant(value_int=0), one), [-1])
        return op.Add(steps, op.Reshape(nonpad, op.Constant(value_ints=[-1, 1, 1, 1])))
    start = op.Constant(value_int=0) if past is None else op.Squeeze(past)
    return op.Unsqueeze(op.Range(start, op.Add(start, n), one), [-1])


def _dead_rows(bias):
    """True where a row's bias is -inf everywhere: that query attends to nothing."""
    # Counts the keys a row may attend to. ReduceSum (not ReduceMax) keeps the graph the same in
    # opsets 13-18, and Equal (not IsInf) works on fp16 before opset 20.
    visible = op.Cast(op.Not(op.Equal(bias, _const(-math.inf, bias))), to=ir.DataType.FLOAT)
    return op.Equal(op.ReduceSum(visible, [-1], keepdims=1), op.Constant(value_float=0.0))


# Whether rows with nothing to attend to give zeros (the operator's semantics, attnexport's
# default) or are left to the softmax (NaN, as torch's kernels): False within `torch_dead_rows`,
# while a user's module that asks for torch's behaviour is exported. A context variable, so a
# block restores what it found (nested, or in another thread or task) and nothing lingers.
_ZERO_DEAD_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("attnexport_zero_dead_rows", default=True)


@contextlib.contextmanager
def torch_dead_rows():
    """Within the block, the primitives translation leaves fully masked rows to the softmax (NaN)."""
    token = _ZERO_DEAD_ROWS.set(False)
    try:
        yield
    finally:
        _ZERO_DEAD_ROWS.reset(token)


def _needs_guard(attn_mask, nonpad) -> bool:
    # A causal mask alone never empties a row (key 0, or the first new key, is always visible);
    # an explicit mask can, and so can a valid count (0, or below Tq with a causal offset).
    return (attn_mask is not None or nonpad is not None) and _ZERO_DEAD_ROWS.get()


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
    # allowzero: an empty cache's length is a real 0, not "copy this axis"
    return op.Reshape(expanded, op.Concat(_shape(x, 0, 1), hq, _shape(x, 2), axis=0), allowzero=1)


def _groups(query, key) -> int | None:
    hq, hkv = _static(query.shape[1]), _static(key.shape[1])
    return hq // hkv if hq is not None and hkv is not None else None


def _on_device(n):
    """A length (1-D int64 of one element, read from a shape: a host value) as a tensor of the
    device: Range(n, n + 1), whose bounds ONNX Runtime's CUDA kernel reads on the host. A device
    node that took the host value itself would need a copy to the device, which stops a CUDA
    graph's capture (and the arithmetic before it would run on the CPU)."""
    start = op.Squeeze(n)
    return op.Range(start, op.Add(start, op.Constant(value_int=1)), op.Constant(value_int=1))


def _scaled_scores(query, key, scale):
    """scale * Q K^T. The scale multiplies the product, not the query: ONNX Runtime's CUDA
    provider put `query / sqrt(d)` on the CPU in fp32 (both inputs are in host memory when the
    query is a graph input and d comes from its shape), a fallback `--strict-placement` caught;
    the product is made on the device, so the scaling stays there."""
    scores = op.MatMul(query, op.Transpose(key, perm=[0, 1, 3, 2]))
    if scale is None:  # 1/sqrt(head size) read at run time: sdpa's head size is symbolic
        return op.Div(scores, op.Sqrt(op.CastLike(_on_device(_shape(query, -1)), scores)))
    return op.Mul(scores, _const(scale, scores))


# --- primitives: MatMul + Softmax, opset 18 --------------------------------------------------

def _translation(compute):
    """The core op's translation for torch.onnx, which passes the op's schema (the operator's
    inputs and attributes) one by one: `compute(query, key, value, attn_mask, cache, nonpad,
    core)` with the cache as None or (past_key, past_value) and the attributes as one Core."""
    def translation(query, key, value, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
                    scale=None, is_causal=False, softcap=0.0, weights=NO_WEIGHTS, softmax_precision=None):
        cache = None if past_key is None else (past_key, past_value)
        return compute(query, key, value, attn_mask, cache, nonpad_kv_seqlen,
                       Core(scale, is_causal, softcap, weights, softmax_precision))
    return translation


def _primitives(query, key, value, attn_mask, cache, nonpad, core):
    scale, is_causal, softcap, weights, softmax_precision = core.attributes()
    cached = cache is not None
    past_key, past_value = cache if cache is not None else (None, None)
    groups = _groups(query, key)  # from the new keys: a Concat's result has no static shape here
    if cached:
        key, value = op.Concat(past_key, key, axis=2), op.Concat(past_value, value, axis=2)
    grouped = groups is not None and groups > 1
    if grouped:  # each key/value head read by its group of query heads as it is, not repeated
        raw = _from_groups(_scaled_scores(_to_groups(query, key), key, scale), query)
    else:
        k, v = _repeat_kv(key, groups, query), _repeat_kv(value, groups, query)
        raw = _scaled_scores(query, k, scale)
    capped = raw
    if softcap and softcap > 0:
        capped = op.Mul(op.Tanh(op.Div(raw, _const(softcap, raw))), _const(softcap, raw))
    past = _shape(past_key, 2, 3) if cached else None
    bias = _bias(attn_mask, is_causal, past, nonpad, _shape(query, 2, 3), _shape(key, 2, 3), raw)
    scores = capped if bias is None else op.Add(capped, bias)
    if softmax_precision is not None:
        probs = op.CastLike(op.Softmax(op.Cast(scores, to=softmax_precision), axis=-1), scores)
    else:
        probs = op.Softmax(scores, axis=-1)
    if _needs_guard(attn_mask, nonpad):
        # Softmax of an all -inf row is NaN (the mean of V in some kernels): select zeros.
        probs = op.Where(_dead_rows(bias), _const(0.0, probs), probs)
    shown = _empty(query) if weights == NO_WEIGHTS else (raw, capped, scores, probs)[weights]
    present = (key, value) if cached else (_empty(query), _empty(query))
    out = _from_groups(op.MatMul(_to_groups(probs, key), value), query) if grouped else op.MatMul(probs, v)
    return out, *present, shown


def _to_groups(x, key):
    """(B, Hq, T, n) -> (B, Hkv, G*T, n), `key` (B, Hkv, S, d) giving Hkv; a reshape (the G query
    heads of a group are consecutive). A MatMul of a group's rows with its key head's keys is then
    every query head of the group at once, the keys read once and never repeated."""
    return op.Reshape(x, op.Concat(_shape(x, 0, 1), _shape(key, 1, 2), op.Constant(value_ints=[-1]), _shape(x, 3, 4),
                                   axis=0))


def _from_groups(x, query):
    """(B, Hkv, G*T, n) -> (B, Hq, T, n), the query's heads again."""
    return op.Reshape(x, op.Concat(_shape(query, 0, 3), op.Constant(value_ints=[-1]), axis=0))


primitives_attention = _translation(_primitives)


def _with_weights_beside(fused):
    """A fused translation whose score output, when asked for, comes from MatMul + Softmax on
    the same inputs (paid only with --weights). Neither fused op can give it as the operator
    defines it: com.microsoft.MultiHeadAttention has no such output; ONNX Runtime's CUDA kernel
    for the standard op computes it in qk_matmul_output_mode 0 and 1 only ("Only kNone and kQK
    output modes are supported in unified unfused attention", onnxruntime-gpu 1.31.1 on an
    H100); and its CPU kernel writes -3.4e38 where the operator's mode 2 has -inf (pinned by
    tests/test_sdpa_operator.py)."""
    def compute(query, key, value, attn_mask, cache, nonpad, core):
        out, present_key, present_value = fused(query, key, value, attn_mask, cache, nonpad, core)
        shown = _empty(query)
        if core.weights != NO_WEIGHTS:
            shown = _primitives(query, key, value, attn_mask, cache, nonpad, core)[3]
        return out, present_key, present_value, shown
    return compute


# --- attention: the standard Attention op, opset 23 (24 for valid key counts) ---------------

def _standard(query, key, value, attn_mask, cache, nonpad, core):
    scale, is_causal, softcap, _, softmax_precision = core.attributes()
    past_key, past_value = cache if cache is not None else (None, None)
    if attn_mask is not None and attn_mask.shape is not None and attn_mask.shape[-2] != query.shape[2]:
        # The spec broadcasts the mask, but ONNX Runtime's kernel wants its query axis to be
        # Tq: expand a padding mask (B, 1, 1, Tk) to (B, 1, Tq, Tk).
        lead = _shape(attn_mask, 0, len(attn_mask.shape) - 2)
        shape = op.Concat(lead, _shape(query, 2, 3), _shape(attn_mask, -1), axis=0)
        attn_mask = op.Expand(_lowest_added(attn_mask), shape)
    elif attn_mask is not None:
        attn_mask = _lowest_added(attn_mask)
    attrs = {"is_causal": int(bool(is_causal))}
    if scale is not None:
        attrs["scale"] = float(scale)
    if softcap and softcap > 0:
        attrs["softcap"] = float(softcap)
    if softmax_precision is not None:
        attrs["softmax_precision"] = int(softmax_precision)
    if nonpad is not None:  # the valid key counts came with opset 24
        return op24.Attention(query, key, value, attn_mask, None, None, nonpad, **attrs)[0], _empty(query), \
            _empty(query)
    if past_key is not None:
        y, present_key, present_value, _ = op23.Attention(query, key, value, attn_mask, past_key, past_value,
                                                          **attrs)
        return y, present_key, present_value
    return op23.Attention(query, key, value, attn_mask, **attrs)[0], _empty(query), _empty(query)


standard_attention = _translation(_with_weights_beside(_standard))


# --- ort: com.microsoft.MultiHeadAttention --------------------------------------------------

def _ort(query, key, value, attn_mask, cache, nonpad, core):
    scale, is_causal, softcap, _, softmax_precision = core.attributes()
    past_key, past_value = cache if cache is not None else (None, None)
    if softcap and softcap > 0:
        raise UnsupportedByFlavor("the ort flavor cannot express --softcap: com.microsoft.MultiHeadAttention "
                                  "has no softcap; use --flavor attention or primitives")
    if softmax_precision is not None and softmax_precision != query.dtype:
        raise UnsupportedByFlavor("the ort flavor cannot express --softmax-precision: com.microsoft."
                                  "MultiHeadAttention has no such attribute; use --flavor attention or primitives")
    heads = _static(query.shape[1])
    cached = past_key is not None
    groups = _groups(query, key)
    tq, tk = _shape(query, 2, 3), _key_length(key, past_key)
    past = _shape(past_key, 2, 3) if cached else None
    new_keys = key.shape[2]
    joined = None
    if cached and (heads is None or _static(key.shape[3]) != _static(value.shape[3])):
        # The kernel's cache wants a fixed head count (its num_heads attribute) and value heads as
        # large as key heads ("Input 'past_value' dimension 3 should be same as head_size",
        # onnxruntime 1.31.1); the operator wants neither: the cache is joined here and the
        # kernel attends over it without one.
        key, value = op.Concat(past_key, key, axis=2), op.Concat(past_value, value, axis=2)
        joined, cached = (key, value), False
    # The kernel's own causal mask (unidirectional, offset by the keys before the block's last
    # Tq) is the operator's (offset by the past length) where the new keys are as many as the
    # queries: the same symbolic length (self-attention, a cache step of mha); the bias carries
    # anything else.
    own_causal = is_causal and nonpad is None and joined is None and query.shape[2] == new_keys
    key, value = _repeat_kv(key, groups, query), _repeat_kv(value, groups, query)
    if cached and groups != 1:
        # A grouped-query cache: the kernel takes as many key/value heads as query heads, so the
        # cache is widened for the step and the present narrowed back (see _narrow_kv).
        # com.microsoft.GroupQueryAttention takes the narrow cache, but refuses a block of more
        # than one position over a cache at batch > 1 ("batch_size must be 1 when
        # sequence_length > 1 and past context is given", onnxruntime 1.31.1).
        past_key, past_value = _repeat_kv(past_key, groups, query), _repeat_kv(past_value, groups, query)
    bias = _bias(attn_mask, is_causal and not own_causal, past, nonpad, tq, tk, query)
    attrs = {"num_heads": heads or 1}
    if scale is not None:
        attrs["scale"] = float(scale)
    if own_causal:
        attrs["unidirectional"] = 1  # no bias tensor to read
    present = (_empty(query), _empty(query))
    if heads is not None:
        # (B, H, T, d) -> (B, T, H*d): the layout the kernel wants; the exporter's transposes
        # around it cancel with the module's own.
        q3 = op.Reshape(op.Transpose(query, perm=[0, 2, 1, 3]), [0, 0, -1])
        k3 = op.Reshape(op.Transpose(key, perm=[0, 2, 1, 3]), [0, 0, -1])
        v3 = op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), [0, 0, -1])
        if bias is not None:
            bias = op.Expand(bias, op.Concat(op.Constant(value_ints=[1, 1]), tq, tk, axis=0))  # (B|1, H|1, Tq, Tk)
        if cached:
            out, *present = _MultiHeadAttentionCached(q3, k3, v3, None, None, bias, past_key, past_value, **attrs)
            present = [_narrow_kv(p, groups) for p in present]
        else:
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
            # To (B, H, Tq, Tk) by adding zeros of that shape, not by Expand: the exporter's
            # optimizer knows a mask's batch and head axes at their traced (full) sizes only, and
            # drops an Expand to the full shape as a no-op; the Reshape then got B * 1 rows.
            full = op.Expand(_const(0.0, bias), op.Concat(_shape(query, 0, 3), tk, axis=0))
            bias = op.Reshape(op.Add(bias, full), op.Concat(minus1, op.Constant(value_ints=[1]), tq, tk, axis=0))
        out = _MultiHeadAttention(q3, k3, v3, None, None, bias, **attrs)
        out = op.Reshape(out, op.Concat(_shape(query, 0, 3), minus1, axis=0))  # (B, H, Tq, dv)
    if joined is not None:
        present = joined
    if _needs_guard(attn_mask, nonpad):
        # Rows can be emptied by the mask and the causal mask together: guard on both.
        full_bias = _bias(attn_mask, is_causal, past, nonpad, tq, tk, out)
        out = op.Where(_dead_rows(full_bias), _const(0.0, out), out)
    return out, *present


def _narrow_kv(present, groups):
    """(B, Hq, T, d) of key/value heads each repeated `groups` times -> (B, Hkv, T, d): the first
    copy of each (all copies are equal)."""
    if groups == 1:
        return present
    shape = op.Concat(_shape(present, 0, 1), op.Div(_shape(present, 1, 2), op.Constant(value_ints=[groups])),
                      op.Constant(value_ints=[groups]), _shape(present, 2), axis=0)
    return op.Gather(op.Reshape(present, shape), op.Constant(value_int=0), axis=2)


ort_attention = _translation(_with_weights_beside(_ort))




# --- a static cache's write: attnexport::cache_write ------------------------------------------

def _scattered_write(cache, update, write_pos):
    """The new positions written with standard opset-18 ops: ScatterElements at write_pos[b] + t."""
    t = _shape(update, 2, 3)
    steps = op.Range(op.Constant(value_int=0), op.Squeeze(t), op.Constant(value_int=1))  # (T,)
    rows = op.Add(op.Unsqueeze(write_pos, [1]), op.Unsqueeze(steps, [0]))  # (B, T)
    index = op.Expand(op.Unsqueeze(rows, [1, 3]), op.Shape(update))  # (B, H, T, d)
    return op.ScatterElements(cache, index, update, axis=2)


def _tensor_scatter(cache, update, write_pos):
    """The operator itself: TensorScatter (opset 24), which ONNX Runtime can run in place when the
    output is bound to the input's buffer."""
    return op24.TensorScatter(cache, update, write_pos, axis=2)




# --- a static cache's step: attnexport::static_attention ------------------------------------

def _like(written, cache):
    """The written buffer, declared with the buffer's type and shape (the attention's translation
    reads the head counts from them, as it does from the exporter's values)."""
    written.type, written.shape = cache.type, cache.shape
    return written


def _static_step(write, compute):
    """The static step as the flavour's cache write of the new keys and values, then its attention
    over each sequence's valid prefix (`compute`, one of the translations' computations)."""
    def translation(query, key, value, key_cache, value_cache, write_pos, valid, scale=None, is_causal=False,
                    softcap=0.0, softmax_precision=None):
        key_cache, value_cache = _like(write(key_cache, key, write_pos), key_cache), \
            _like(write(value_cache, value, write_pos), value_cache)
        core = Core(scale, is_causal, softcap, NO_WEIGHTS, softmax_precision)
        return compute(query, key_cache, value_cache, None, None, valid, core)[0], key_cache, value_cache
    return translation


_ort_static_scattered = _static_step(_scattered_write, _with_weights_beside(_ort))


def _ort_static(query, key, value, key_cache, value_cache, write_pos, valid, scale=None, is_causal=False,
                softcap=0.0, softmax_precision=None):
    """The ort flavour's static step: com.microsoft.GroupQueryAttention over the buffers, which it
    takes as past_key/past_value and returns as present_key/present_value of the same size: bound
    to the same memory (IO binding), they are written in place, and the kernel reads each
    sequence's valid prefix only (seqlens_k), so a step costs what its context holds, not what the
    buffer does. Its causal mask puts query i of sequence b at write_pos[b] + i, the operator's.
    GroupQueryAttention is causal only and wants fixed head counts: a step that is not causal, has a
    softmax precision of its own, or symbolic heads (sdpa's 4-D layout) is the ScatterElements +
    MultiHeadAttention graph instead; a softcap is its attribute (Gemma2's). The operator cannot take
    a block of more than one position over written positions at batch > 1: the model's metadata
    says so (`attnexport.static_blocks`, see attnexport.export), verify reports such runs as not
    applicable, and the graph answers NaN there (`_nan_where_out_of_contract`). Its total length
    is shape arithmetic (`_gqa_total`), so the step can be captured in a CUDA graph."""
    heads, kv_heads = _static(query.shape[1]), _static(key.shape[1])
    plain_precision = softmax_precision is None or softmax_precision == query.dtype
    if not is_causal or heads is None or kv_heads is None or not plain_precision:
        return _ort_static_scattered(query, key, value, key_cache, value_cache, write_pos, valid, scale, is_causal,
                                     softcap, softmax_precision)
    q3, k3, v3 = (op.Reshape(op.Transpose(t, perm=[0, 2, 1, 3]), [0, 0, -1]) for t in (query, key, value))
    seqlens = op.Cast(op.Sub(valid, op.Constant(value_int=1)), to=6)  # INT32: the last valid position
    total, first_block = _gqa_total(q3, key_cache)
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads}
    if scale is not None:
        attrs["scale"] = float(scale)
    if softcap and softcap > 0:
        attrs["softcap"] = float(softcap)
    out, key_cache, value_cache = _GroupQueryAttention(q3, k3, v3, key_cache, value_cache, seqlens, total, **attrs)
    out = _nan_where_out_of_contract(out, write_pos, first_block, _const(float("nan"), query))
    out = op.Transpose(op.Reshape(out, op.Concat(op.Constant(value_ints=[0, 0, heads]), op.Constant(value_ints=[-1]),
                                                 axis=0)), perm=[0, 2, 1, 3])
    return out, key_cache, value_cache


def _gqa_total(query, key_cache):
    """GroupQueryAttention's total_sequence_length, from shapes alone: the block's length S when a
    batch of several sequences takes a block of several positions (the operator's first prompt:
    its only block at batch > 1, into empty buffers), else the buffers' length L (one token at any
    positions, or a block at batch 1 over what is written: the kernel reads each sequence's
    length from seqlens_k). ONNX Runtime's CUDA provider reads this input on the host, so a value
    computed from the step's device-held positions is copied there every step, and a graph with
    such a copy cannot be captured in a CUDA graph (so it was, to 2026-11-26); shape arithmetic
    stays on the host with no copy. `query`: the operator's (B, S, heads x d) input, whose first
    two dims attnexport.pretrained.fusions keeps when it feeds the operator the projection instead. Returns
    (the total as INT32 [1], the first-prompt flag)."""
    one = op.Constant(value_ints=[1])
    batch, block = op.Shape(query, start=0, end=1), op.Shape(query, start=1, end=2)
    first_block = op.And(op.Greater(batch, one), op.Greater(block, one))
    return op.Cast(op.Where(first_block, block, op.Shape(key_cache, start=2, end=3)), to=6), first_block


def _nan_where_out_of_contract(out, write_pos, first_block, nan):
    """`out` with NaN in each sequence that the operator could not compute: a block of several at
    batch > 1 (the first prompt, `_gqa_total`) over written positions (write_pos > 0), which it
    would read as a first prompt and answer wrong without a word. The model's metadata states the
    limit (`attnexport.static_blocks`); this makes a step beyond it fail every comparison. The
    flag reaches the device as Slice bounds (which the kernel reads on the host) picking 0 or 1
    from a constant there, not as a copied value (nor as an empty tensor: ONNX Runtime's CUDA
    ReduceSum refuses to reduce one away)."""
    at = op.Cast(first_block, to=7)
    flag = op.Slice(op.Constant(value_ints=[0, 1]), at, op.Add(at, op.Constant(value_ints=[1])))
    beyond = op.Reshape(op.Greater(op.Mul(write_pos, flag), op.Constant(value_int=0)),
                        op.Constant(value_ints=[-1, 1, 1]))
    return op.Where(beyond, nan, out)


def share_static_totals(model) -> None:
    """A graph of several static steps over GroupQueryAttention (a language model's layers) computed
    the total length and the NaN guard once per layer, from each layer's own query (`_gqa_total`,
    `_nan_where_out_of_contract`): some fifteen small ops a layer on every step. Every layer's block
    has the same batch and length, so each reads the first one's total, and the first one's guard
    alone is kept (its NaN reaches every later layer through the residual stream and the logits).
    In place; the nodes left unread are removed."""
    g = model.graph
    gqas = [n for n in g.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if len(gqas) < 2:
        return
    guards = {w.input[2]: w for w in g.node if w.op_type == "Where" and len(w.input) == 3}
    renamed = {}
    for gqa in gqas[1:]:
        gqa.input[6] = gqas[0].input[6]
        guard = guards.get(gqa.output[0])
        if guard is not None:
            renamed[guard.output[0]] = gqa.output[0]
    for node in g.node:
        for i, x in enumerate(node.input):
            node.input[i] = renamed.get(x, x)
    kept = list(g.node)
    while True:  # drop what nothing reads any more, back to the graph's inputs
        read = {x for n in kept for x in n.input} | {o.name for o in g.output}
        alive = [n for n in kept if any(o in read for o in n.output)]
        if len(alive) == len(kept):
            break
        kept = alive
    del g.node[:]
    g.node.extend(kept)


# --- each flavour's translations, in one table ----------------------------------------------

@dataclass(frozen=True)
class Translation:
    """What a flavour makes of attnexport's three custom ops: the attention core, a static cache's
    write, and a static cache's whole step (the write and the attention over the buffer)."""

    attention: Callable
    cache_write: Callable
    static_step: Callable


TRANSLATIONS = {
    "primitives": Translation(primitives_attention, _scattered_write, _static_step(_scattered_write, _primitives)),
    "attention": Translation(standard_attention, _tensor_scatter,
                             _static_step(_tensor_scatter, _with_weights_beside(_standard))),
    "ort": Translation(ort_attention, _scattered_write, _ort_static),
}
assert set(TRANSLATIONS) == set(FL.FLAVORS), "every flavour (attnexport.flavors) has its translations here"
