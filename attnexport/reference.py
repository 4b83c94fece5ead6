"""Float64 NumPy reference for every variant: the source of golden outputs. Imports no torch.

Each `ref_<variant>(params, inputs, options)` takes the module's parameters as arrays (named as
in its state_dict), the named inputs and the variant's options, and returns the named outputs.
It shares no code with `attnexport.models`: the two are written from the math independently,
so a bug in one is not silently copied into the other.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

NEG_INF = -np.inf

# The precision every value is rounded to after it is computed: None (float64, the golden
# outputs) or a narrower NumPy dtype while `rounded_to` is active. Rounding the inputs, the
# weights and each intermediate result the way an implementation in that dtype must store
# them gives the error a correct implementation can reach: the basis of fp16 tolerances. A
# context variable: a block restores what it found, in its own thread or task only.
_ROUND_TO: contextvars.ContextVar = contextvars.ContextVar("attnexport_round_to", default=None)


@contextlib.contextmanager
def rounded_to(dtype):
    """Within the block, every reference function rounds its values to `dtype` (e.g. np.float16)."""
    token = _ROUND_TO.set(dtype)
    try:
        yield
    finally:
        _ROUND_TO.reset(token)


def _r(x):
    """x rounded to the emulated precision, kept as float64."""
    dtype = _ROUND_TO.get()
    if dtype is None:
        return x
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(dtype).astype(np.float64)


def _f64(x):
    return _r(np.asarray(x, dtype=np.float64))


def softmax_rows(scores, bias=None):
    """Softmax over the last axis; a row whose bias is -inf everywhere becomes zeros.

    The guard is decided on the bias, not on the scores, as the ONNX Attention operator does.
    """
    z = scores if bias is None else scores + bias
    zmax = np.max(z, axis=-1, keepdims=True)
    dead = np.isneginf(zmax) if bias is None else np.isneginf(np.max(bias, axis=-1, keepdims=True))
    e = np.exp(z - np.where(np.isfinite(zmax), zmax, 0.0))
    s = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(s == 0, 1.0, s)
    return _r(np.where(dead, 0.0, p))


def sdpa(q, k, v, mask=None, *, scale=None, causal=False, softcap=0.0, causal_offset=0, valid=None):
    """ONNX Attention (opsets 23 and 24) on 4-D inputs, in float64. Returns (output, the weights),
    the weights being the softmax; `scores_of` gives every score output the operator has.

    Args:
        causal_offset: the number of cached keys before the queries' block: query i attends
            keys j <= causal_offset + i (0: top-left, the no-cache case).
        valid: None, or (B,) counts of valid keys (nonpad_kv_seqlen): later keys are padding, and
            the causal offset of sequence b is valid[b] - Tq.
    """
    out, scores = scores_of(q, k, v, mask, scale=scale, causal=causal, softcap=softcap, causal_offset=causal_offset,
                            valid=valid)
    return out, scores["softmax"]


def scores_of(q, k, v, mask=None, *, scale=None, causal=False, softcap=0.0, causal_offset=0, valid=None):
    """sdpa's output and every score the operator can show: {raw (scale * Q K^T), softcap (after
    the softcap), bias (after softcap and mask), softmax (the weights)}."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = np.repeat(k, hq // hkv, axis=1)
        v = np.repeat(v, hq // hkv, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    raw = _r(_r(np.einsum("bhqd,bhkd->bhqk", q, k)) * scale)
    s = _r(softcap * np.tanh(raw / softcap)) if softcap and softcap > 0 else raw
    tq, tk = s.shape[-2:]
    bias = np.zeros((tq, tk))
    if mask is not None:
        mask = np.asarray(mask)
        given = np.where(mask, 0.0, NEG_INF) if mask.dtype == np.bool_ else _f64(mask)
        # A mask shorter than the keys: the keys past it are masked (the operator pads with -inf).
        given = np.concatenate([given, np.full((*given.shape[:-1], tk - given.shape[-1]), NEG_INF)], axis=-1)
        bias = bias + given
    cols = np.arange(tk)
    if valid is not None:
        valid = np.asarray(valid).reshape(-1, 1, 1, 1)
        bias = bias + np.where(cols < valid, 0.0, NEG_INF)
        causal_offset = valid - tq
    if causal:
        rows = np.arange(tq)[:, None] + causal_offset
        bias = bias + np.where(cols <= rows, 0.0, NEG_INF)
    bias = np.broadcast_to(bias, s.shape)
    p = softmax_rows(s, bias)
    scores = {"raw": raw, "softcap": s, "bias": _r(s + bias), "softmax": p}
    return _r(np.einsum("bhqk,bhkd->bhqd", p, v)), scores


def _scale_qk(q, k, scaling, temperature):
    """Mirrors the scaling modes from their definitions (see the README's table)."""
    d = q.shape[-1]
    if scaling == "sqrt":
        return q, k, 1.0 / np.sqrt(d)
    if scaling == "none":
        return q, k, 1.0
    if scaling == "norm":
        scores = _r(np.einsum("bhqd,bhkd->bhqk", q, k))
        return _r(q / _r(np.sqrt(np.sum(scores**2, axis=(-2, -1), keepdims=True)))), k, 1.0
    if scaling == "cosine":
        qn = _r(q / np.maximum(_r(np.linalg.norm(q, axis=-1, keepdims=True)), 1e-12))
        kn = _r(k / np.maximum(_r(np.linalg.norm(k, axis=-1, keepdims=True)), 1e-12))
        return qn, kn, 1.0 / temperature
    if scaling == "length":
        return q, k, 1.0 / (np.sqrt(d) * np.sqrt(k.shape[-2]))
    raise ValueError(scaling)


def _linear(x, params, name):
    y = _r(x @ _f64(params[f"{name}.weight"]).T)
    b = params.get(f"{name}.bias")
    return y if b is None else _r(y + _f64(b))


def _heads(x, h):
    B, T, C = x.shape
    return x.reshape(B, T, h, C // h).transpose(0, 2, 1, 3)


def _merge(x):
    B, h, T, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, h * d)


def _same_heads(heads: int, causal: bool = False) -> dict:
    """Attention whose keys and values have as many heads as its queries, scaled by 1/sqrt(d)."""
    return {"heads": heads, "kv_heads": heads, "causal": causal}


def _mha(params, prefix, x, kv, a: dict, key_padding=None):
    """Multi-head attention of x over kv; `a`: heads, kv_heads, and optionally causal, scaling
    (default sqrt) and temperature (default 0.1)."""
    heads, kv_heads, causal = a["heads"], a["kv_heads"], a.get("causal", False)
    scaling, temperature = a.get("scaling", "sqrt"), a.get("temperature", 0.1)
    q = _heads(_linear(x, params, f"{prefix}q_proj"), heads)
    k = _heads(_linear(kv, params, f"{prefix}k_proj"), kv_heads)
    v = _heads(_linear(kv, params, f"{prefix}v_proj"), kv_heads)
    if heads != kv_heads:
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
    q, k, scale = _scale_qk(q, k, scaling, temperature)
    mask = None if key_padding is None else np.asarray(key_padding, bool)[:, None, None, :]
    out, w = sdpa(q, k, v, mask, scale=scale, causal=causal)
    return _linear(_merge(out), params, f"{prefix}out_proj"), w


def _mha_step(params, prefix, x, kv, past_key, past_value, a: dict):
    """One block of attention over a cache: the keys and values of `kv` follow the P cached ones,
    and with `causal` query i of the block sits at position P + i (`a` as for _mha). Returns
    (output, present_key, present_value)."""
    heads, kv_heads, causal = a["heads"], a["kv_heads"], a.get("causal", False)
    scaling, temperature = a.get("scaling", "sqrt"), a.get("temperature", 0.1)
    q = _heads(_linear(x, params, f"{prefix}q_proj"), heads)
    k = _heads(_linear(kv, params, f"{prefix}k_proj"), kv_heads)
    v = _heads(_linear(kv, params, f"{prefix}v_proj"), kv_heads)
    q, k, scale = _scale_qk(q, k, scaling, temperature)
    present_key = np.concatenate([_f64(past_key), k], axis=2)
    present_value = np.concatenate([_f64(past_value), v], axis=2)
    out, _ = sdpa(q, present_key, present_value, scale=scale, causal=causal, causal_offset=past_key.shape[2])
    return _linear(_merge(out), params, f"{prefix}out_proj"), present_key, present_value


def _layer_norm(x, params, name, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return _r((x - mu) / np.sqrt(var + eps) * _f64(params[f"{name}.weight"]) + _f64(params[f"{name}.bias"]))


def _ffn(x, params, prefix):
    return _linear(np.maximum(_linear(x, params, f"{prefix}dense1"), 0.0), params, f"{prefix}dense2")


def _masked_softmax(scores, valid_lens):
    keep = np.arange(scores.shape[-1])[None, None, :] < np.asarray(valid_lens)[:, None, None]
    bias = np.broadcast_to(np.where(keep, 0.0, NEG_INF), scores.shape)
    return softmax_rows(scores, bias)


# --- one function per variant -------------------------------------------------------------

def ref_sdpa(params, inputs, o):
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    if o["layout"] == "bsd":  # (B, T, H*d) -> (B, H, T, d)
        q, k, v = _heads(_f64(q), o["heads"]), _heads(_f64(k), o["kv_heads"]), _heads(_f64(v), o["kv_heads"])
    present, offset = {}, 0
    if o["kv_cache"] and o.get("max_seq") is not None:  # static buffers: write, then attend the valid prefix
        key_cache, value_cache = _f64(inputs["key_cache"]).copy(), _f64(inputs["value_cache"]).copy()
        t = k.shape[2]
        for b, w in enumerate(np.asarray(inputs["write_pos"])):
            key_cache[b, :, w:w + t], value_cache[b, :, w:w + t] = _f64(k[b]), _f64(v[b])
        out, _ = sdpa(q, key_cache, value_cache, scale=o["scale"], causal=o["causal"], softcap=o["softcap"],
                      valid=np.asarray(inputs["write_pos"]) + t)
        return {"output": out, "key_cache_out": key_cache, "value_cache_out": value_cache}
    if o["kv_cache"]:
        k = np.concatenate([_f64(inputs["past_key"]), _f64(k)], axis=2)
        v = np.concatenate([_f64(inputs["past_value"]), _f64(v)], axis=2)
        present = {"present_key": k, "present_value": v}
        offset = inputs["past_key"].shape[2]
    shown = "softmax" if o["weights"] == "none" else o["weights"]
    out, every = scores_of(q, k, v, inputs.get("attn_mask"), scale=o["scale"], causal=o["causal"],
                           softcap=o["softcap"], causal_offset=offset, valid=inputs.get("nonpad_kv_seqlen"))
    scores = every[shown]
    result = {"output": _merge(out) if o["layout"] == "bsd" else out, **present}
    if o["weights"] != "none":
        result["weights"] = scores
    return result


def ref_self(params, inputs, o):
    x = _f64(inputs["x"])
    q, k, v = (_r(x @ _f64(params[n])) for n in ("W_q", "W_k", "W_v"))
    q, k, scale = _scale_qk(q[:, None], k[:, None], o["scaling"], o["temperature"])
    mask = inputs.get("mask")
    out, w = sdpa(q, k, v[:, None], None if mask is None else _f64(mask)[:, None], scale=scale)
    return {"output": out[:, 0], "weights": w[:, 0]} if o["weights"] else {"output": out[:, 0]}


def _mha_static_step(params, x, key_cache, value_cache, write_pos, o, prefix=""):
    """One block over static buffers: sequence b's keys and values are written at write_pos[b],
    and its query i attends the buffer's positions up to write_pos[b] + i (the rest is ignored)."""
    q = _heads(_linear(x, params, f"{prefix}q_proj"), o["heads"])
    k = _heads(_linear(x, params, f"{prefix}k_proj"), o["kv_heads"])
    v = _heads(_linear(x, params, f"{prefix}v_proj"), o["kv_heads"])
    q, k, scale = _scale_qk(q, k, o["scaling"], o["temperature"])
    key_cache, value_cache = _f64(key_cache).copy(), _f64(value_cache).copy()
    t = x.shape[1]
    for b, w in enumerate(np.asarray(write_pos)):
        key_cache[b, :, w:w + t] = k[b]
        value_cache[b, :, w:w + t] = v[b]
    valid = np.asarray(write_pos) + t
    out, _ = sdpa(q, key_cache, value_cache, scale=scale, causal=o["causal"], valid=valid)
    return _linear(_merge(out), params, f"{prefix}out_proj"), key_cache, value_cache


def ref_mha(params, inputs, o):
    x = _f64(inputs["x"])
    if o.get("kv_cache") and o.get("max_seq") is not None:
        out, key_cache, value_cache = _mha_static_step(params, x, inputs["key_cache"], inputs["value_cache"],
                                                       inputs["write_pos"], o)
        return {"output": out, "key_cache_out": key_cache, "value_cache_out": value_cache}
    if o.get("kv_cache"):
        out, present_key, present_value = _mha_step(params, "", x, x, inputs["past_key"], inputs["past_value"], o)
        return {"output": out, "present_key": present_key, "present_value": present_value}
    out, w = _mha(params, "", x, x, o, inputs.get("mask"))
    return {"output": out, "weights": w} if o["weights"] else {"output": out}


def ref_mha_tied(params, inputs, o):
    h, E = o["heads"], o["dim"]
    proj = {n: _r(_heads(_f64(inputs[n]), h) @ _f64(params[f"{p}.weight"]).T)
            for n, p in (("values", "values"), ("keys", "keys"), ("query", "queries"))}
    mask = inputs.get("mask")
    mask = None if mask is None else np.asarray(mask, bool)[:, None]
    out, _ = sdpa(proj["query"], proj["keys"], proj["values"], mask, scale=1.0 / np.sqrt(E))
    return {"output": _linear(_merge(out), params, "fc_out")}


def ref_cross(params, inputs, o):
    out, w = _mha(params, "", _f64(inputs["query"]), _f64(inputs["memory"]), _same_heads(o["heads"]),
                  inputs.get("memory_mask"))
    return {"output": out, "weights": w} if o["weights"] else {"output": out}


def ref_additive(params, inputs, o):
    q = _r(_f64(inputs["query"]) @ _f64(params["W_q.weight"]).T)  # (B, Tq, h)
    k = _r(_f64(inputs["key"]) @ _f64(params["W_k.weight"]).T)  # (B, Tk, h)
    feats = _r(np.tanh(_r(q[:, :, None, :] + k[:, None, :, :])))
    scores = _r(feats @ _f64(params["w_v.weight"])[0])  # (B, Tq, Tk)
    w = _masked_softmax(scores, inputs["valid_lens"])
    out = _r(w @ _f64(inputs["value"]))
    return {"output": out, "weights": w} if o["weights"] else {"output": out}


def ref_masked_softmax(params, inputs, o):
    return {"probs": _masked_softmax(_f64(inputs["scores"]), inputs["valid_lens"])}


def ref_kernel(params, inputs, o):
    q, k, v = _f64(inputs["queries"]), _f64(inputs["keys"]), _f64(inputs["values"])
    d = _r(q[:, :, None] - k[:, None, :])
    if "w" in params:
        d = _r(d * _f64(params["w"])[0])
    w = softmax_rows(_r(-(d**2) / 2))
    out = _r(np.einsum("bqk,bk->bq", w, v))
    return {"output": out, "weights": w} if o["weights"] else {"output": out}


def positional_table(T, D):
    """P (T, D): sin at even columns, cos at odd ones, angle t / 10000^(2i/D)."""
    t = np.arange(T, dtype=np.float64)[:, None]
    two_i = (np.arange(D) // 2 * 2).astype(np.float64)[None, :]
    angle = t / np.power(10000.0, two_i / D)
    return np.where(np.arange(D) % 2 == 0, np.sin(angle), np.cos(angle))


def ref_posenc(params, inputs, o):
    x = _f64(inputs["x"])
    return {"output": _r(x + _r(positional_table(x.shape[1], x.shape[2]))[None])}


def ref_encoder(params, inputs, o):
    x = _f64(inputs["x"])
    a, _ = _mha(params, "attn.", x, x, _same_heads(o["heads"]), inputs.get("mask"))
    y = _layer_norm(_r(x + a), params, "norm1")
    return {"output": _layer_norm(_r(y + _ffn(y, params, "ffn.")), params, "norm2")}


def ref_decoder(params, inputs, o):
    x, mem = _f64(inputs["x"]), _f64(inputs["memory"])
    if o.get("kv_cache"):
        return _decoder_step(params, inputs, x, mem, o["heads"], o)
    a, _ = _mha(params, "self_attn.", x, x, _same_heads(o["heads"], causal=True))
    y = _layer_norm(_r(x + a), params, "norm1")
    c, _ = _mha(params, "cross_attn.", y, mem, _same_heads(o["heads"]), inputs.get("memory_mask"))
    z = _layer_norm(_r(y + c), params, "norm2")
    return {"output": _layer_norm(_r(z + _ffn(z, params, "ffn.")), params, "norm3")}


def _decoder_step(params, inputs, x, mem, h, o=None):
    """A decoder layer's step: self-attention over its cache (static buffers with `max_seq`),
    cross-attention over the memory's cached keys and values followed by those of the memory given
    now (empty after the first step)."""
    if o is not None and o.get("max_seq") is not None:
        static = {"heads": h, "kv_heads": h, "scaling": "sqrt", "temperature": 0.1, "causal": True}
        a, pk, pv = _mha_static_step(params, x, inputs["key_cache"], inputs["value_cache"], inputs["write_pos"],
                                     static, prefix="self_attn.")
    else:
        a, pk, pv = _mha_step(params, "self_attn.", x, x, inputs["past_key"], inputs["past_value"],
                              _same_heads(h, causal=True))
    y = _layer_norm(_r(x + a), params, "norm1")
    c, ck, cv = _mha_step(params, "cross_attn.", y, mem, inputs["past_cross_key"], inputs["past_cross_value"],
                          _same_heads(h))
    z = _layer_norm(_r(y + c), params, "norm2")
    names = ("key_cache_out", "value_cache_out") if o is not None and o.get("max_seq") is not None else \
        ("present_key", "present_value")
    return {"output": _layer_norm(_r(z + _ffn(z, params, "ffn.")), params, "norm3"), names[0]: pk, names[1]: pv,
            "present_cross_key": ck, "present_cross_value": cv}
