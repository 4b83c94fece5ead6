"""The catalogue of variants: name -> frozen spec (`attnexport.schema`). It drives the CLI,
export, golden cases and tests."""

from __future__ import annotations

import difflib

from attnexport import models
from attnexport import reference as ref
from attnexport.errors import UnknownVariantError
from attnexport.schema import Option, TensorSpec, Variant
from attnexport.semantics import SOFTMAX_PRECISION_TYPES_BY_NAME, WEIGHT_MODES, Core
from attnexport.signature import CachePair, StepSignature, WritePos

# --- options shared by several variants ---------------------------------------------------

def _size(name, default, help):
    return Option(name, int, default, help)


BATCH = lambda d=2: _size("batch", d, "batch size")  # noqa: E731
SEQ = lambda d=16: _size("seq", d, "sequence length (queries)")  # noqa: E731
KV_SEQ = lambda d=16: _size("kv_seq", d, "key/value sequence length")  # noqa: E731
DIM = lambda d=64: _size("dim", d, "model (embedding) dimension")  # noqa: E731
HEADS = lambda d=4: _size("heads", d, "number of (query) heads")  # noqa: E731
WEIGHTS = Option("weights", bool, False, "also output the attention weights")
SCALING = Option("scaling", str, "sqrt", "score scaling", ("sqrt", "none", "norm", "cosine", "length"))
TEMPERATURE = Option("temperature", float, 0.1, "cosine scaling: scores are cos(q, k) / temperature",
                     bounds=(1e-3, 1e3))
CAUSAL = Option("causal", bool, False, "causal mask: query i attends keys 0..i")


def _divides(a, b):
    def check(o):
        if o[b] % o[a]:
            return f"--{a.replace('_', '-')} ({o[a]}) must divide --{b.replace('_', '-')} ({o[b]})"
        return None
    return check


def _positive(name):
    def check(o):
        return None if o[name] > 0 else f"--{name} must be > 0, got {o[name]}"
    return check


def _with_weights(o, outputs):
    return outputs if o["weights"] else outputs[:1]


def _mha_flops(B, Tq, Tk, D, H, hd, kv_dim=None, kv_heads=None):
    kv_dim, kv_heads = kv_dim or D, kv_heads or H
    proj = 2 * B * Tq * D * H * hd + 2 * 2 * B * Tk * kv_dim * kv_heads * hd + 2 * B * Tq * H * hd * D
    return proj + 2 * B * H * Tq * Tk * 2 * hd


# --- builders (each module read from `models` when built: `list` and the reference stay light) ---

def _build_sdpa(o):
    bsd = o["layout"] == "bsd"
    core = Core(o["scale"], o["causal"], o["softcap"], Core.mode(None if o["weights"] == "none" else o["weights"]),
                SOFTMAX_PRECISION_TYPES_BY_NAME.get(o["softmax_precision"]))
    return models.ScaledDotProductAttention(core, inputs=[s.name for s in _sdpa_inputs(o)],
                                            heads=o["heads"] if bsd else None, kv_heads=o["kv_heads"] if bsd else None,
                                            pad_mask=o["mask_keys"] is not None)


def _sdpa_inputs(o):
    if o["layout"] == "bsd":  # (B, T, H * d); the head counts are attributes, so fixed
        qkv = (T("query", ("batch", "seq", o["heads"] * o["head_dim"]), "float"),
               T("key", ("batch", "kv_seq", o["kv_heads"] * o["head_dim"]), "float"),
               T("value", ("batch", "kv_seq", o["kv_heads"] * o["v_head_dim"]), "float"))
    else:
        qkv = (T("query", ("batch", "heads", "seq", "head_dim"), "float"),
               T("key", ("batch", "kv_heads", "kv_seq", "head_dim"), "float"),
               T("value", ("batch", "kv_heads", "kv_seq", "v_head_dim"), "float"))
    # The cache is 4-D in either layout; in bsd its head axes are fixed, as the layout's are.
    heads, hd, vd = (o["kv_heads"], o["head_dim"], o["v_head_dim"]) if o["layout"] == "bsd" else \
        ("kv_heads", "head_dim", "v_head_dim")
    if o["mask"] != "none":
        # Any shape the operator broadcasts to (B, Hq, Tq, Tk): its batch and head axes are 1 or full.
        total = "past_seq+kv_seq" if o["kv_cache"] else "kv_seq"
        keys = "mask_keys" if o["mask_keys"] is not None else total
        dims = ("mask_batch", "mask_heads", "seq", keys)[4 - o["mask_rank"]:]
        kind = {"bool": ("bool", "bool_mask"), "float": ("float", "additive_mask")}[o["mask"]]
        qkv += (T("attn_mask", dims, *kind),)
    if static_cache(o):  # buffers of --max-seq positions, garbage past each sequence's write position
        qkv += (T("key_cache", ("batch", heads, o["max_seq"], hd), "float",
                  cache=("key_cache_out", "static")),
                T("value_cache", ("batch", heads, o["max_seq"], vd), "float",
                  cache=("value_cache_out", "static")),
                T("write_pos", ("batch",), "int64", "write_pos"))
    elif o["kv_cache"]:
        qkv += (T("past_key", ("batch", heads, "past_seq", hd), "float",
                  cache=("present_key", "concat")),
                T("past_value", ("batch", heads, "past_seq", vd), "float",
                  cache=("present_value", "concat")))
    if o["nonpad"]:
        qkv += (T("nonpad_kv_seqlen", ("batch",), "int64", "valid_lens"),)
    return qkv


def _sdpa_outputs(o):
    bsd = o["layout"] == "bsd"
    out = (T("output", ("batch", "seq", o["heads"] * o["v_head_dim"]) if bsd else
             ("batch", "heads", "seq", "v_head_dim"), "float"),)
    total = "kv_seq"
    if static_cache(o):
        given = {s.name: s for s in _sdpa_inputs(o)}
        return out + (T("key_cache_out", given["key_cache"].dims, "float"),
                      T("value_cache_out", given["value_cache"].dims, "float"))
    if o["kv_cache"]:
        past = {s.name: s for s in _sdpa_inputs(o)}
        total = "past_seq+kv_seq"
        out += tuple(T(f"present_{n}", (*past[f"past_{n}"].dims[:2], total, past[f"past_{n}"].dims[3]), "float")
                     for n in ("key", "value"))
    if o["weights"] != "none":
        out += (T("weights", ("batch", o["heads"] if bsd else "heads", "seq", total), "float"),)
    return out


def _sdpa_mask_check(o):
    if o["mask_rank"] not in (2, 3, 4):
        return f"--mask-rank must be 2, 3 or 4, got {o['mask_rank']}"
    for axis, full in (("mask_batch", "batch"), ("mask_heads", "heads")):
        if o[axis] not in (1, o[full]):
            return f"--{axis.replace('_', '-')} must be 1 or --{full} ({o[full]}), got {o[axis]}"
    if o["mask_rank"] < 4 and o["mask_batch"] != 1:
        return f"a rank-{o['mask_rank']} mask has no batch axis: --mask-batch must be 1"
    if o["mask_rank"] < 3 and o["mask_heads"] != 1:
        return "a rank-2 mask has no head axis: --mask-heads must be 1"
    if o["mask_keys"] is not None:
        total = o["kv_seq"] + (o["past_seq"] if o["kv_cache"] else 0)
        if o["mask"] == "none":
            return "--mask-keys is the length of a mask: give --mask bool or float"
        if not 1 <= o["mask_keys"] <= total:
            return f"--mask-keys must be from 1 to the number of keys ({total}), got {o['mask_keys']}"
    return None


def _sdpa_refit(o):
    """A short mask (--mask-keys) at other sizes: one key shorter than the keys, where it can be."""
    if o.get("mask_keys") is None:
        return o
    return {**o, "mask_keys": max(1, o["kv_seq"] + (o["past_seq"] if o.get("kv_cache") else 0) - 1)}


def _sdpa_cache_check(o):
    if o.get("max_seq") is not None and not o["kv_cache"]:
        return "--max-seq is the static cache's size: it goes with --kv-cache static"
    if static_cache(o):
        for name, ok in (("--layout bsd", o["layout"] == "bhsd"), ("--mask", o["mask"] == "none"),
                         ("--weights", o["weights"] == "none"), ("--nonpad", not o["nonpad"])):
            if not ok:
                return (f"--kv-cache static takes no {name} (its valid keys are write_pos + the new ones, "
                        "passed as nonpad_kv_seqlen)")
        if o["past_seq"] + o["kv_seq"] > o["max_seq"]:
            return (f"--past-seq {o['past_seq']} + --kv-seq {o['kv_seq']} positions do not fit a static cache "
                    f"of --max-seq {o['max_seq']}")
    if o["kv_cache"] and o["nonpad"]:
        return ("--nonpad counts the valid keys of a preallocated cache passed as key/value; the operator "
                "takes it or --kv-cache's past_key/past_value, not both")
    return None


def _build_self(o):
    return models.SelfAttention(o["dim"], o["scaling"], o["temperature"], o["weights"])


def static_cache(o) -> bool:
    """Whether the options ask for the static cache (`--kv-cache static --max-seq S`)."""
    return bool(o.get("kv_cache")) and o.get("max_seq") is not None


def step_signature(variant: Variant, o: dict) -> StepSignature:
    """The cache pairs and write position of a variant's step at options `o`, as its inputs declare
    them (a cache input's `TensorSpec.cache`: the output it pairs with and its kind; the write
    position, the input of kind "write_pos"); the graph fills in the rest at export."""
    specs = variant.inputs(o)
    caches = tuple(CachePair(s.name, s.cache[0], len(s.dims) - 2, s.cache[1]) for s in specs if s.cache)
    write = next((WritePos(s.name) for s in specs if s.kind == "write_pos"), None)
    return StepSignature(caches=caches, write_pos=write)


def _build_mha(o):
    cls = models.StaticCachedSelfAttention if static_cache(o) else \
        models.CachedSelfAttention if o["kv_cache"] else models.MultiHeadAttention
    return cls(o["dim"], o["heads"], o["kv_heads"], causal=o["causal"], scaling=o["scaling"],
               temperature=o["temperature"], weights=o["weights"])


def _mha_block_flops(o):
    B, T, D, H, hd = o["batch"], o["seq"], o["dim"], o["heads"], o["dim"] // o["heads"]
    if not o["kv_cache"]:
        return _mha_flops(B, T, T, D, H, hd, kv_heads=o["kv_heads"])
    # A cache step projects only its T new tokens, and attends over past and new keys.
    Tk = o["past_seq"] + T
    return 2 * B * T * D * (H + 2 * o["kv_heads"]) * hd + 2 * B * T * H * hd * D + 2 * B * H * T * Tk * 2 * hd


def _kv_cache_check(o):
    """What a cache cannot be combined with (a step must see what the full forward sees)."""
    if o.get("max_seq") is not None and not o["kv_cache"]:
        return "--max-seq is the static cache's size: it goes with --kv-cache static"
    if not o["kv_cache"]:
        return None
    if static_cache(o) and o["past_seq"] + o["seq"] > o["max_seq"]:
        return (f"--past-seq {o['past_seq']} + --seq {o['seq']} positions do not fit a static cache of "
                f"--max-seq {o['max_seq']}")
    if o["mask"] != "none":
        return "--kv-cache takes no --mask (a padding mask over cached keys is not supported yet)"
    if o["weights"]:
        return "--kv-cache takes no --weights"
    if o["scaling"] in ("norm", "length"):
        return (f"--scaling {o['scaling']} depends on all keys at once, so decoding step by step cannot "
                "reproduce it: use sqrt, none or cosine with --kv-cache")
    return None


def _mha_inputs(o):
    x = (T("x", ("batch", "seq", "dim"), "float"),)
    if static_cache(o):  # garbage past each sequence's write position: attention must not read it
        hd = o["dim"] // o["heads"]
        return x + (T("key_cache", ("batch", o["kv_heads"], "max_seq", hd), "float",
                      cache=("key_cache_out", "static")),
                    T("value_cache", ("batch", o["kv_heads"], "max_seq", hd), "float",
                      cache=("value_cache_out", "static")),
                    T("write_pos", ("batch",), "int64", "write_pos"))
    if o["kv_cache"]:
        hd = o["dim"] // o["heads"]
        return x + (T("past_key", ("batch", o["kv_heads"], "past_seq", hd), "float",
                      cache=("present_key", "concat")),
                    T("past_value", ("batch", o["kv_heads"], "past_seq", hd), "float",
                      cache=("present_value", "concat")))
    return x + ((T("mask", ("batch", "seq"), "bool", "padding"),) if o["mask"] == "padding" else ())


def _mha_outputs(o):
    out = T("output", ("batch", "seq", "dim"), "float")
    if static_cache(o):
        hd = o["dim"] // o["heads"]
        return (out, T("key_cache_out", ("batch", o["kv_heads"], "max_seq", hd), "float"),
                T("value_cache_out", ("batch", o["kv_heads"], "max_seq", hd), "float"))
    if o["kv_cache"]:
        hd = o["dim"] // o["heads"]
        return (out, T("present_key", ("batch", o["kv_heads"], "past_seq+seq", hd), "float"),
                T("present_value", ("batch", o["kv_heads"], "past_seq+seq", hd), "float"))
    return _with_weights(o, (out, T("weights", ("batch", "heads", "seq", "seq"), "float")))


def _build_tied(o):
    return models.TiedMultiHeadAttention(o["dim"], o["heads"])


def _build_cross(o):
    return models.CrossAttention(o["dim"], o["heads"], kv_dim=o["kv_dim"], weights=o["weights"])


def _build_additive(o):
    return models.AdditiveAttention(o["dim"], o["kv_dim"], o["hidden"], o["weights"])


def _build_masked_softmax(o):
    return models.MaskedSoftmax()


def _build_kernel(o):
    return models.KernelRegression(o["learnable_bandwidth"], o["weights"])


def _build_posenc(o):
    return models.PositionalEncoding()


def _build_encoder(o):
    return models.EncoderLayer(o["dim"], o["heads"], o["ffn_dim"])


def _build_decoder(o):
    cls = models.StaticCachedDecoderLayer if static_cache(o) else \
        models.CachedDecoderLayer if o["kv_cache"] else models.DecoderLayer
    return cls(o["dim"], o["heads"], o["ffn_dim"])


def _decoder_inputs(o):
    x = (T("x", ("batch", "seq", "dim"), "float"), T("memory", ("batch", "kv_seq", "dim"), "float"))
    if static_cache(o):
        hd = o["dim"] // o["heads"]
        return x + (T("key_cache", ("batch", o["heads"], o["max_seq"], hd), "float",
                      cache=("key_cache_out", "static")),
                    T("value_cache", ("batch", o["heads"], o["max_seq"], hd), "float",
                      cache=("value_cache_out", "static")),
                    T("write_pos", ("batch",), "int64", "write_pos"),
                    T("past_cross_key", ("batch", o["heads"], "past_kv_seq", hd), "float",
                      cache=("present_cross_key", "cross")),
                    T("past_cross_value", ("batch", o["heads"], "past_kv_seq", hd), "float",
                      cache=("present_cross_value", "cross")))
    if o["kv_cache"]:
        hd = o["dim"] // o["heads"]
        return x + tuple(T(f"past_{n}", ("batch", o["heads"], length, hd), "float",
                           cache=(f"present_{n}", kind))
                         for n, length, kind in (("key", "past_seq", "concat"), ("value", "past_seq", "concat"),
                                                 ("cross_key", "past_kv_seq", "cross"),
                                                 ("cross_value", "past_kv_seq", "cross")))
    return x + ((T("memory_mask", ("batch", "kv_seq"), "bool", "padding"),) if o["mask"] == "padding" else ())


def _decoder_outputs(o):
    out = (T("output", ("batch", "seq", "dim"), "float"),)
    if not o["kv_cache"]:
        return out
    hd = o["dim"] // o["heads"]
    if static_cache(o):
        return out + (T("key_cache_out", ("batch", o["heads"], o["max_seq"], hd), "float"),
                      T("value_cache_out", ("batch", o["heads"], o["max_seq"], hd), "float"),
                      T("present_cross_key", ("batch", o["heads"], "past_kv_seq+kv_seq", hd), "float"),
                      T("present_cross_value", ("batch", o["heads"], "past_kv_seq+kv_seq", hd), "float"))
    return out + tuple(T(f"present_{n}", ("batch", o["heads"], length, hd), "float")
                       for n, length in (("key", "past_seq+seq"), ("value", "past_seq+seq"),
                                         ("cross_key", "past_kv_seq+kv_seq"), ("cross_value", "past_kv_seq+kv_seq")))


def _decoder_cache_check(o):
    if o.get("max_seq") is not None and not o["kv_cache"]:
        return "--max-seq is the static cache's size: it goes with --kv-cache static"
    if static_cache(o) and o["past_seq"] + o["seq"] > o["max_seq"]:
        return (f"--past-seq {o['past_seq']} + --seq {o['seq']} positions do not fit a static cache of "
                f"--max-seq {o['max_seq']}")
    if not o["kv_cache"]:
        return None if o["kv_seq"] >= 1 else "--kv-seq must be >= 1 (0 is for the steps of --kv-cache)"
    if o["mask"] != "none":
        return "--kv-cache takes no --mask (a memory padding mask over cached keys is not supported yet)"
    if o["kv_seq"] + o["past_kv_seq"] < 1:
        return "the memory is empty: --kv-seq (the memory given now) or --past-kv-seq (cached) must be >= 1"
    return None


def _decoder_flops(o):
    B, T, D, H = o["batch"], o["seq"], o["dim"], o["heads"]
    hd = D // H
    if not o["kv_cache"]:
        return (_mha_flops(B, T, T, D, H, hd) + _mha_flops(B, T, o["kv_seq"], D, H, hd)
                + 4 * B * T * D * o["ffn_dim"])
    # A step projects its T new tokens (self q, k, v, out; cross q, out: six D x D matmuls) and the
    # memory given now (cross k, v), and attends over both caches.
    tk, tm = o["past_seq"] + T, o["past_kv_seq"] + o["kv_seq"]
    proj = 2 * B * T * D * D * 6 + 2 * B * o["kv_seq"] * D * D * 2
    return proj + 2 * B * H * T * (tk + tm) * 2 * hd + 4 * B * T * D * o["ffn_dim"]


T = TensorSpec

_VARIANTS = (
    Variant(
        name="sdpa",
        summary="scaled dot-product attention with the ONNX Attention (opset 23) semantics",
        options=(BATCH(), HEADS(8),
                 Option("kv_heads", int, None, "key/value heads (default: --heads; grouped-query when fewer)",
                        optional=True),
                 SEQ(), KV_SEQ(), _size("head_dim", 32, "query/key head size"),
                 _size("v_head_dim", 32, "value head size"), CAUSAL,
                 Option("scale", float, None, "scale of QK^T (default 1/sqrt(head_dim))", optional=True,
                        bounds=(0.0, 1e3)),
                 Option("softcap", float, 0.0, "if > 0: scores = softcap * tanh(scores / softcap)",
                        bounds=(0.0, 1e4)),
                 Option("mask", str, "none", "attention mask input", ("none", "bool", "float")),
                 Option("mask_rank", int, 4, "mask rank: 2 (Tq, Tk), 3 (1|Hq, Tq, Tk) or 4 (1|B, 1|Hq, Tq, Tk)"),
                 Option("mask_batch", int, None, "the example mask's batch axis: 1 or --batch (default: "
                        "--batch at rank 4; the export takes either)", optional=True),
                 Option("mask_heads", int, 1, "the example mask's head axis: 1 or --heads (the export takes "
                        "either)"),
                 Option("mask_keys", int, None, "the mask's key axis when shorter than the keys (default: as long "
                        "as them); the keys past it count as masked, as the operator pads the mask with -inf",
                        optional=True),
                 Option("weights", str, "none", "also output the scores: raw (Q K^T x scale), softcap (after "
                        "softcap), bias (after softcap and mask), softmax (the weights); --weights alone: softmax",
                        ("none",) + tuple(WEIGHT_MODES)),
                 Option("layout", str, "bhsd", "bhsd: 4-D (B, H, T, d) inputs; bsd: 3-D (B, T, H*d), the heads "
                        "fixed", ("bhsd", "bsd")),
                 Option("kv_cache", bool, False, "past_key/past_value inputs and present_key/present_value "
                        "outputs, as the operator's cache"),
                 Option("past_seq", int, 4, "cached positions before the block (--kv-cache; may be 0)",
                        minimum=0),
                 Option("max_seq", int, None, "the static cache's positions (--kv-cache static)", optional=True),
                 Option("nonpad", bool, False, "nonpad_kv_seqlen input (B,): the valid keys of each sequence in a "
                        "preallocated cache (opset 24 for the attention flavor)"),
                 Option("softmax_precision", str, None, "the precision of the softmax (default: the input's)",
                        tuple(SOFTMAX_PRECISION_TYPES_BY_NAME), optional=True)),
        build=_build_sdpa,
        inputs=_sdpa_inputs,
        outputs=_sdpa_outputs,
        reference=ref.ref_sdpa,
        flops=lambda o: (2 * o["batch"] * o["heads"] * o["seq"] * (o["past_seq"] + o["kv_seq"] if o["kv_cache"] else
                                                                  o["kv_seq"]) * (o["head_dim"] + o["v_head_dim"])),
        dot_product_core=True,
        dynamic=("batch", "heads", "kv_heads", "seq", "kv_seq", "head_dim", "v_head_dim", "past_seq",
                 "mask_batch", "mask_heads", "mask_keys"),
        broadcast=(("mask_batch", "batch"), ("mask_heads", "heads")),
        refit=_sdpa_refit,
        checks=(_divides("kv_heads", "heads"), _sdpa_mask_check, _sdpa_cache_check,
                lambda o: None if o["softcap"] >= 0 else "--softcap must be >= 0",
                lambda o: None if o["scale"] is None or o["scale"] > 0 else "--scale must be > 0"),
    ),
    Variant(
        name="self",
        summary="single-head self-attention, Q = X W_q, K = X W_k, V = X W_v (W: D x D)",
        options=(BATCH(), SEQ(10), DIM(), SCALING, TEMPERATURE,
                 Option("mask", str, "none", "additive mask input (B, T, T)", ("none", "additive")), WEIGHTS),
        build=_build_self,
        inputs=lambda o: (T("x", ("batch", "seq", "dim"), "float"),) + (
            (T("mask", ("batch", "seq", "seq"), "float", "additive_mask"),) if o["mask"] == "additive" else ()),
        outputs=lambda o: _with_weights(o, (T("output", ("batch", "seq", "dim"), "float"),
                                            T("weights", ("batch", "seq", "seq"), "float"))),
        reference=ref.ref_self,
        flops=lambda o: 3 * 2 * o["batch"] * o["seq"] * o["dim"] ** 2 + 2 * o["batch"] * o["seq"] ** 2 * 2 * o["dim"],
        dot_product_core=True,
        checks=(_positive("temperature"),),
    ),
    Variant(
        name="mha",
        summary="multi-head self-attention with output projection; padding and causal masks",
        options=(BATCH(), SEQ(), DIM(), HEADS(),
                 Option("kv_heads", int, None, "key/value heads (default: --heads)", optional=True),
                 CAUSAL, SCALING, TEMPERATURE,
                 Option("mask", str, "none", "key padding mask input (B, T), True = token", ("none", "padding")),
                 WEIGHTS,
                 Option("kv_cache", bool, False, "self-attention key/value cache: past_key/past_value inputs, "
                        "present_key/present_value outputs, for decoding step by step; `static`: buffers of "
                        "--max-seq positions written in place (key_cache/value_cache, write_pos)"),
                 Option("past_seq", int, 4, "cached positions before the block (--kv-cache; may be 0; with "
                        "--kv-cache static: sequence b's write position is past_seq - b)", minimum=0),
                 Option("max_seq", int, None, "the static cache's positions (--kv-cache static)", optional=True)),
        build=_build_mha,
        inputs=_mha_inputs,
        outputs=_mha_outputs,
        reference=ref.ref_mha,
        flops=_mha_block_flops,
        dot_product_core=True,
        dynamic=("batch", "seq", "past_seq"),  # a static cache's buffers keep their size: --max-seq is fixed
        checks=(_divides("heads", "dim"), _divides("kv_heads", "heads"), _positive("temperature"),
                _kv_cache_check),
    ),
    Variant(
        name="mha-tied",
        summary="multi-head attention with Q/K/V projections shared by all heads, scores / sqrt(E)",
        options=(BATCH(3), SEQ(5), KV_SEQ(5), DIM(10), HEADS(2),
                 Option("mask", str, "none", "bool mask input (B, Tq, Tk), True = attend", ("none", "bool"))),
        build=_build_tied,
        inputs=lambda o: (T("values", ("batch", "kv_seq", "dim"), "float"),
                          T("keys", ("batch", "kv_seq", "dim"), "float"),
                          T("query", ("batch", "seq", "dim"), "float")) + (
            (T("mask", ("batch", "seq", "kv_seq"), "bool", "bool_mask"),) if o["mask"] == "bool" else ()),
        outputs=lambda o: (T("output", ("batch", "seq", "dim"), "float"),),
        reference=ref.ref_mha_tied,
        flops=lambda o: (2 * o["batch"] * (o["seq"] + 2 * o["kv_seq"]) * o["dim"] * (o["dim"] // o["heads"])
                         + 2 * o["batch"] * o["seq"] * o["kv_seq"] * 2 * o["dim"]
                         + 2 * o["batch"] * o["seq"] * o["dim"] ** 2),
        dot_product_core=True,
        dynamic=("batch", "seq", "kv_seq"),
        checks=(_divides("heads", "dim"),),
    ),
    Variant(
        name="cross",
        summary="cross-attention: queries from one sequence, keys/values from another",
        options=(BATCH(), SEQ(3), KV_SEQ(5), DIM(32), _size("kv_dim", 48, "memory feature size"), HEADS(),
                 Option("mask", str, "none", "memory padding mask input (B, Tk)", ("none", "padding")), WEIGHTS),
        build=_build_cross,
        inputs=lambda o: (T("query", ("batch", "seq", "dim"), "float"),
                          T("memory", ("batch", "kv_seq", "kv_dim"), "float")) + (
            (T("memory_mask", ("batch", "kv_seq"), "bool", "padding"),) if o["mask"] == "padding" else ()),
        outputs=lambda o: _with_weights(o, (T("output", ("batch", "seq", "dim"), "float"),
                                            T("weights", ("batch", "heads", "seq", "kv_seq"), "float"))),
        reference=ref.ref_cross,
        flops=lambda o: _mha_flops(o["batch"], o["seq"], o["kv_seq"], o["dim"], o["heads"],
                                   o["dim"] // o["heads"], kv_dim=o["kv_dim"]),
        dot_product_core=True,
        dynamic=("batch", "seq", "kv_seq"),
        checks=(_divides("heads", "dim"),),
    ),
    Variant(
        name="additive",
        summary="additive (Bahdanau) attention with a masked softmax over valid lengths",
        options=(BATCH(), SEQ(1), KV_SEQ(10), _size("dim", 20, "query feature size"),
                 _size("kv_dim", 2, "key feature size"), _size("value_dim", 4, "value feature size"),
                 _size("hidden", 8, "hidden units of the scoring MLP"), WEIGHTS),
        build=_build_additive,
        inputs=lambda o: (T("query", ("batch", "seq", "dim"), "float"),
                          T("key", ("batch", "kv_seq", "kv_dim"), "float"),
                          T("value", ("batch", "kv_seq", "value_dim"), "float"),
                          T("valid_lens", ("batch",), "int64", "valid_lens")),
        outputs=lambda o: _with_weights(o, (T("output", ("batch", "seq", "value_dim"), "float"),
                                            T("weights", ("batch", "seq", "kv_seq"), "float"))),
        reference=ref.ref_additive,
        flops=lambda o: (2 * o["batch"] * (o["seq"] * o["dim"] + o["kv_seq"] * o["kv_dim"]) * o["hidden"]
                         + 3 * o["batch"] * o["seq"] * o["kv_seq"] * o["hidden"]
                         + 2 * o["batch"] * o["seq"] * o["kv_seq"] * o["value_dim"]),
        dot_product_core=False,
        dynamic=("batch", "seq", "kv_seq"),
    ),
    Variant(
        name="masked-softmax",
        summary="softmax over the last axis ignoring positions past each row's valid length",
        options=(BATCH(), SEQ(2), KV_SEQ(4)),
        build=_build_masked_softmax,
        inputs=lambda o: (T("scores", ("batch", "seq", "kv_seq"), "float"),
                          T("valid_lens", ("batch",), "int64", "valid_lens")),
        outputs=lambda o: (T("probs", ("batch", "seq", "kv_seq"), "float"),),
        reference=ref.ref_masked_softmax,
        flops=lambda o: 5 * o["batch"] * o["seq"] * o["kv_seq"],
        dot_product_core=False,
        dynamic=("batch", "seq", "kv_seq"),
    ),
    Variant(
        name="kernel",
        summary="Nadaraya-Watson kernel regression as attention: softmax(-(x_q - x_k)^2 / 2)",
        options=(BATCH(1), SEQ(50), KV_SEQ(50),
                 Option("learnable_bandwidth", bool, False, "a learnable bandwidth w: -((x_q - x_k) w)^2 / 2"),
                 WEIGHTS),
        build=_build_kernel,
        inputs=lambda o: (T("queries", ("batch", "seq"), "float", "sorted"),
                          T("keys", ("batch", "kv_seq"), "float", "sorted"),
                          T("values", ("batch", "kv_seq"), "float")),
        outputs=lambda o: _with_weights(o, (T("output", ("batch", "seq"), "float"),
                                            T("weights", ("batch", "seq", "kv_seq"), "float"))),
        reference=ref.ref_kernel,
        flops=lambda o: 7 * o["batch"] * o["seq"] * o["kv_seq"],
        dot_product_core=False,
        dynamic=("batch", "seq", "kv_seq"),
    ),
    Variant(
        name="posenc",
        summary="sinusoidal positional encoding added to embeddings",
        options=(BATCH(1), SEQ(60), DIM(32)),
        build=_build_posenc,
        inputs=lambda o: (T("x", ("batch", "seq", "dim"), "float"),),
        outputs=lambda o: (T("output", ("batch", "seq", "dim"), "float"),),
        reference=ref.ref_posenc,
        flops=lambda o: 4 * o["batch"] * o["seq"] * o["dim"],
        dot_product_core=False,
    ),
    Variant(
        name="encoder",
        summary="Transformer encoder layer: self-attention, feed-forward, residuals, layer norms",
        options=(BATCH(), SEQ(12), DIM(), HEADS(), _size("ffn_dim", 128, "feed-forward hidden size"),
                 Option("mask", str, "none", "key padding mask input (B, T)", ("none", "padding"))),
        build=_build_encoder,
        inputs=lambda o: (T("x", ("batch", "seq", "dim"), "float"),) + (
            (T("mask", ("batch", "seq"), "bool", "padding"),) if o["mask"] == "padding" else ()),
        outputs=lambda o: (T("output", ("batch", "seq", "dim"), "float"),),
        reference=ref.ref_encoder,
        flops=lambda o: (_mha_flops(o["batch"], o["seq"], o["seq"], o["dim"], o["heads"], o["dim"] // o["heads"])
                         + 4 * o["batch"] * o["seq"] * o["dim"] * o["ffn_dim"]),
        dot_product_core=True,
        checks=(_divides("heads", "dim"),),
    ),
    Variant(
        name="decoder",
        summary="Transformer decoder layer: causal self-attention, cross-attention, feed-forward",
        options=(BATCH(), SEQ(10),
                 Option("kv_seq", int, 12, "memory length (with --kv-cache: the memory given at this step, "
                        "0 after the first)", minimum=0),
                 DIM(), HEADS(), _size("ffn_dim", 128, "feed-forward hidden size"),
                 Option("mask", str, "none", "memory padding mask input (B, Tk)", ("none", "padding")),
                 Option("kv_cache", bool, False, "a step: self-attention past_key/past_value and the memory's "
                        "cross-attention past_cross_key/past_cross_value in, present_* out"),
                 Option("past_seq", int, 4, "cached target positions before the block (--kv-cache; may be 0)",
                        minimum=0),
                 Option("max_seq", int, None, "the self-attention cache's positions (--kv-cache static)",
                        optional=True),
                 Option("past_kv_seq", int, 0, "cached memory positions (--kv-cache; 0 at the first step)",
                        minimum=0)),
        build=_build_decoder,
        inputs=_decoder_inputs,
        outputs=_decoder_outputs,
        reference=ref.ref_decoder,
        flops=_decoder_flops,
        dot_product_core=True,
        dynamic=("batch", "seq", "kv_seq", "past_seq", "past_kv_seq"),
        checks=(_divides("heads", "dim"), _decoder_cache_check),
    ),
)

VARIANTS: dict[str, Variant] = {v.name: v for v in _VARIANTS}


def get(name: str) -> Variant:
    """Returns the variant called `name`; an unknown name lists the valid ones and the closest."""
    try:
        return VARIANTS[name]
    except KeyError:
        close = difflib.get_close_matches(name, VARIANTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownVariantError(
            f"unknown variant {name!r}{hint}; valid: {', '.join(VARIANTS)}") from None


def catalogue() -> list[dict]:
    """Every variant as `attnexport list` shows it (and `--json` prints it): its summary, inputs
    and outputs (those only some options bring marked optional; a cache step's own listed after
    them), options and symbolic axes."""
    rows = []
    for v in VARIANTS.values():
        o = v.resolve()
        full = dict(o, **{k: True for k in o if v.option(k).type is bool and k != "kv_cache"})
        for opt in v.options:
            if opt.choices and "none" in opt.choices:
                full[opt.name] = opt.choices[-1]
        cached = dict(o, kv_cache=True) if "kv_cache" in o else None

        def union(specs_of, full=full, cached=cached):
            specs = list(specs_of(full))
            names = {s.name for s in specs}
            return specs + [s for s in (specs_of(cached) if cached else ()) if s.name not in names]

        def listed(specs_of, plain):
            return [{"name": s.name, "dims": list(s.dims), "dtype": s.dtype, "optional": s.name not in plain,
                     **({"cache": {"output": s.cache[0], "kind": s.cache[1]}} if s.cache else {})}
                    for s in union(specs_of)]
        rows.append({
            "name": v.name,
            "summary": v.summary,
            "dot_product_core": v.dot_product_core,
            "inputs": listed(v.inputs, {t.name for t in v.inputs(o)}),
            "outputs": listed(v.outputs, {t.name for t in v.outputs(o)}),
            "options": [{"name": opt.name, "flag": opt.flag, "type": opt.type.__name__,
                         "default": opt.default, "choices": list(opt.choices) if opt.choices else None,
                         "help": opt.help} for opt in v.options],
            "dynamic_axes": list(v.dynamic),
        })
    return rows
