"""The golden case catalogue: each case's variant, options, seed and provenance, and how its inputs
and parameters are made (the worked examples of the source texts with their numbers as printed,
seeded cases, edge cases). `attnexport.golden` computes, stores and checks them."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from attnexport import seeding
from attnexport import variants as V
from attnexport.semantics import MODE_OF


@dataclass(frozen=True)
class CaseDef:
    name: str
    variant: str
    options: dict
    seed: int | None = None  # default: derived from the name (see seed_of)
    source: str = "seeded"  # where the case comes from: a worked example (naming its file), or "seeded"
    make: Callable[[dict], tuple[dict, dict]] | None = None  # options -> (params, inputs)
    notes: dict = field(default_factory=dict)  # printed values and their relation, etc.

    @property
    def case_seed(self) -> int:
        return seed_of(self.name) if self.seed is None else self.seed


SRC_SELF = "000_abe9b2a049dfe229.txt"  # the source texts (shared/seeds), cited by file name
SRC_KERNEL = "001_efde4ef825fe046a.txt"
SRC_TIED = "002_349328470132ab37.txt"
SRC_CROSS = "003_61fe5aa5f14f9ed0.txt"
SRC_SIMPLE = "004_0a0a73ca3f6cf3e6.txt"


def provenance_line(case: CaseDef) -> str:
    """Where a case comes from, in a few words: a worked example (its source file) or seeded."""
    files = re.findall(r"\d{3}_[0-9a-f]{16}\.txt", case.source)
    if case.source.startswith("worked example"):
        return f"worked example, {files[0]}" if files else "worked example"
    if case.source.startswith("seeded"):
        return f"seeded, built on {files[0]}" if files else "seeded"
    return f"from {files[0]}" if files else case.source


def seed_of(name: str) -> int:
    """A case's seed from its name: adding or moving a case re-seeds no other."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)


# The cat/milk/it/{sweet,hungry} example (SRC_SELF): 4-dim word vectors of which the source prints
# the two middle coordinates, "(..., 2, 2, ...)", and replaces the "..." by 0. Q = K = V = X.
WORDS = {"cat": (2.0, 2.0), "milk": (1.0, 3.0), "it": (2.0, 2.0), "sweet": (0.0, 4.0), "hungry": (4.0, 0.0)}
# The source's printed rows of "Softmax(Q K^T / sqrt(d)) V", in the order cat, milk, it, <word>.
PRINTED_ROWS = {"sweet": [[0.625, 1.375], [0.089, 1.911], [0.625, 1.375], [0.010, 1.990]],
                "hungry": [[1.125, 0.875], [0.609, 1.391], [1.125, 0.875], [1.999, 0.001]]}
PRINTED_SCORES = {"sweet": [[8, 8, 8, 8], [8, 10, 8, 12], [8, 8, 8, 8], [8, 12, 8, 16]],
                  "hungry": [[8, 8, 8, 8], [8, 10, 8, 4], [8, 8, 8, 8], [8, 4, 8, 16]]}
# The relation the printed rows follow (all eight, to the printed three decimals): the softmax
# is taken of the unscaled scores, and the output is divided by sqrt(d_k) = 2 instead.
PRINTED_RELATION = "printed = softmax(Q K^T) V / sqrt(d_k): the scaling applied to the output, not the scores"
# The sim(...) lines after each example, as printed, and what they follow from.
PRINTED_SIM = {
    "sweet": {"sim(it, milk)": "0.0625 x 0.089 + 1.375 x 1.911 = 2.68",
              "sim(it, cat)": "0.0625 x 0.0625 + 1.375 x 1.375 = 2.28",
              "misprint": "0.0625 should read 0.625 (it -> (0.625, 1.375)): with 0.625 the products give the "
                          "printed 2.68 and 2.28; with 0.0625 they would give 2.63 and 1.89"},
    "hungry": {"sim(it, milk)": "1.125 x 0.609 + 0.875 x 1.391 = 1.90",
               "sim(it, cat)": "1.125 x 1.125 + 0.875 x 0.875 = 2.03"},
}


def _words(*names):
    """The words' 4-dim vectors, printed coordinates in the middle, zeros for the '...'."""
    x = np.zeros((1, len(names), 4), np.float32)
    x[0, :, 1:3] = np.array([WORDS[n] for n in names], np.float32)
    return x


def _identity_self(x):
    def make(o):
        eye = np.eye(o["dim"], dtype=np.float32)
        return {"W_q": eye, "W_k": eye, "W_v": eye}, {"x": x}
    return make


def _nadaraya_watson(o):
    # As SRC_KERNEL prints it: 100 sorted samples of U[0, 5), y = f(x) + N(0, 0.5), and every
    # sample queries the same samples as keys (the source's "each query uses its own keys").
    rng = np.random.default_rng(seed_of("kernel-nadaraya-watson"))
    f = lambda x: 2 * np.sin(x) + x**0.8  # noqa: E731
    x = np.sort(rng.uniform(0, 5, o["kv_seq"]))
    y = f(x) + rng.normal(0.0, 0.5, o["kv_seq"])
    params = {"w": np.array([1.5], np.float32)} if o["learnable_bandwidth"] else {}
    return params, {"queries": x[None].astype(np.float32), "keys": x[None].astype(np.float32),
                    "values": y[None].astype(np.float32)}


def _additive_example(o):
    rng = np.random.default_rng(3)
    params = seeding.init_params(V.get("additive"), o, 3)
    values = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
    return params, {"query": rng.standard_normal((2, 1, 20)).astype(np.float32),
                    "key": np.ones((2, 10, 2), np.float32), "value": values,
                    "valid_lens": np.array([2, 6], np.int64)}


def _masked_softmax_example(valid_lens, seed):
    def make(o):
        rng = np.random.default_rng(seed)
        return {}, {"scores": rng.random((2, 2, 4)).astype(np.float32),
                    "valid_lens": np.array(valid_lens, np.int64)}
    return make


def _tied_causal(o):
    seed = seed_of("mha-tied-causal-mask")
    params = seeding.init_params(V.get("mha-tied"), o, seed)
    inputs = seeding.make_inputs(V.get("mha-tied"), dict(o, mask="none"), seed)
    # A decoder-style (lower-triangular) target mask.
    inputs["mask"] = np.broadcast_to(np.tril(np.ones((o["seq"], o["kv_seq"]), bool)),
                                     (o["batch"], o["seq"], o["kv_seq"])).copy()
    return params, inputs


def _simple_64d(o):
    # SRC_SIMPLE draws q, k and v with torch.rand: uniform on [0, 1).
    seed = seed_of("self-64d-single-head")
    rng = np.random.default_rng(seed)
    return seeding.init_params(V.get("self"), o, seed), {"x": rng.random((1, 10, 64)).astype(np.float32)}


def _i_love_you(o):
    # SRC_CROSS: source "I love you", target "我 爱 你"; 我 attends to I, 爱 to love, 你 to you.
    # Target word j queries with a vector close to source word j, so the weights align.
    D = o["dim"]
    src = np.zeros((1, 3, D), np.float32)
    tgt = np.zeros((1, 3, D), np.float32)
    for j in range(3):
        src[0, j, j] = 3.0
        tgt[0, j, j] = 3.0
        tgt[0, j, 3] = 0.5  # a feature the source lacks: alignment must survive it
    eye, zero = np.eye(D, dtype=np.float32), np.zeros(D, np.float32)
    params = {f"{p}.{k}": (eye if k == "weight" else zero)
              for p in ("q_proj", "k_proj", "v_proj", "out_proj") for k in ("weight", "bias")}
    return params, {"query": tgt, "memory": src}


def _padding_empty(o):
    params = seeding.init_params(V.get("mha"), o, 4)
    inputs = seeding.make_inputs(V.get("mha"), o, 4)
    inputs["mask"][1, :] = False  # the second sequence is all padding: its rows attend to nothing
    return params, inputs


def _sdpa_fully_masked(o):
    inputs = seeding.make_inputs(V.get("sdpa"), o, 5)
    inputs["attn_mask"][0, 0, 1, :] = False
    inputs["attn_mask"][1, 0, 3, :] = False
    return {}, inputs


def _posenc_zeros(o):
    return {}, {"x": np.zeros((1, o["seq"], o["dim"]), np.float32)}


# --- the catalogue: data, one entry per case (a family of cases as one comprehension) -------------

# A seeded case per variant, at its default options.
SEEDED = tuple(CaseDef(f"{name}-seeded", name, {}, source="seeded") for name in V.VARIANTS)

# Each scaling mode of self and mha.
SCALINGS = tuple(
    case for mode in ("sqrt", "none", "norm", "cosine", "length") for case in (
        CaseDef(f"self-scaling-{mode}", "self", {"scaling": mode, "weights": True},
                source=f"seeded: the {mode} scaling mode of {SRC_SELF}"),
        CaseDef(f"mha-scaling-{mode}", "mha", {"scaling": mode, "weights": True, "mask": "padding"},
                source=f"seeded: the {mode} scaling mode of {SRC_SELF}")))

# The worked example of SRC_SELF, with both endings of its sentence.
CAT_MILK = tuple(
    CaseDef(
        f"self-cat-milk-it-{word}", "self", {"batch": 1, "seq": 4, "dim": 4, "weights": True},
        source=f"worked example of {SRC_SELF}: 'The cat drank the milk because it was {word}.'; words "
               f"cat, milk, it, {word} as printed, 4-dim with the '...' coordinates 0; Q = K = V = X, "
               "d_k = 4; expected = the formula softmax(QK^T / sqrt(d_k)) V",
        make=_identity_self(_words("cat", "milk", "it", word)),
        notes={"tokens": ["cat", "milk", "it", word], "vectors": {w: list(WORDS[w]) for w in
                                                                 ("cat", "milk", "it", word)},
               "printed": {"scores": PRINTED_SCORES[word], "rows": PRINTED_ROWS[word],
                           **PRINTED_SIM[word]},
               "relation": PRINTED_RELATION})
    for word in ("sweet", "hungry"))

# Worked examples, edge cases, caches and masks: one entry each.
LISTED = (
    CaseDef("sdpa-gqa-causal-bool", "sdpa",
            {"kv_heads": 2, "seq": 5, "kv_seq": 9, "causal": True, "mask": "bool", "weights": True},
            source="seeded"),
    CaseDef("sdpa-softcap-float-mask", "sdpa",
            {"softcap": 2.0, "scale": 0.3, "mask": "float", "v_head_dim": 24, "heads": 4, "kv_heads": 4},
            source="seeded"),
    CaseDef("sdpa-causal-long-query", "sdpa", {"seq": 12, "kv_seq": 7, "causal": True, "weights": True},
            source="seeded: causal with more queries than keys"),
    CaseDef("sdpa-mask-per-head", "sdpa", {"mask": "bool", "mask_heads": 8, "weights": True},
            source="seeded: a boolean mask per sequence and head, (B, Hq, Tq, Tk)"),
    CaseDef("sdpa-mask-rank3-float", "sdpa", {"mask": "float", "mask_rank": 3, "mask_heads": 4, "heads": 4,
                                              "kv_heads": 2, "seq": 5, "kv_seq": 11},
            source="seeded: an additive rank-3 mask per head, (Hq, Tq, Tk), shared by the batch"),
    CaseDef("sdpa-mask-rank2-causal", "sdpa", {"mask": "bool", "mask_rank": 2, "causal": True, "seq": 6,
                                               "kv_seq": 9, "weights": True},
            source="seeded: a rank-2 boolean mask (Tq, Tk) shared by every sequence and head, with causal"),
    CaseDef("sdpa-fully-masked-rows", "sdpa", {"mask": "bool", "weights": True},
            source="seeded, with two query rows whose mask is all False", make=_sdpa_fully_masked),
    CaseDef("mha-causal-gqa", "mha", {"causal": True, "kv_heads": 2, "mask": "padding", "weights": True},
            source="seeded"),
    CaseDef("mha-padding-all-masked", "mha", {"mask": "padding", "weights": True},
            source="seeded, with one sequence that is entirely padding", make=_padding_empty),
    CaseDef("self-64d-single-head", "self", {"batch": 1, "seq": 10, "dim": 64, "weights": True},
            source=f"worked example of {SRC_SIMPLE}: d_model 64, batch 1, length 10, one head, scores "
                   "scaled by 1/sqrt(64), inputs uniform on [0, 1) as the source's torch.rand. The source "
                   "projects three separate tensors q, k, v with biased linear layers; the self variant "
                   "projects one x without bias (q = k = v = x)", make=_simple_64d),
    CaseDef("mha-tied-10d-2h", "mha-tied", {"batch": 3, "seq": 5, "kv_seq": 5, "dim": 10, "heads": 2},
            source=f"worked example of {SRC_TIED}: embed size 10, 2 heads, 3 sequences of length 5, "
                   "values, keys and query drawn from a standard normal (torch.randn), no mask"),
    CaseDef("mha-tied-causal-mask", "mha-tied", {"batch": 3, "seq": 5, "kv_seq": 5, "dim": 10, "heads": 2,
                                                 "mask": "bool"},
            source=f"seeded: the sizes of {SRC_TIED}'s example with a lower-triangular mask",
            make=_tied_causal),
    CaseDef("cross-i-love-you", "cross", {"batch": 1, "seq": 3, "kv_seq": 3, "dim": 4, "kv_dim": 4, "heads": 1,
                                          "weights": True},
            source=f"worked example of {SRC_CROSS}: cross-attention of the target \"我 爱 你\" over the "
                   "source \"I love you\"", make=_i_love_you,
            notes={"source_tokens": ["I", "love", "you"], "target_tokens": ["我", "爱", "你"],
                   "relation": "target word j attends most to source word j: 我 -> I, 爱 -> love, 你 -> you"}),
    CaseDef("additive-valid-lens", "additive", {"batch": 2, "seq": 1, "kv_seq": 10, "dim": 20, "kv_dim": 2,
                                                "value_dim": 4, "hidden": 8, "weights": True}, seed=3,
            source=f"seeded: additive attention with a masked softmax as {SRC_KERNEL} defines them (it "
                   "prints no example values); keys all ones, values 0..39, valid lengths 2 and 6",
            make=_additive_example,
            notes={"analytic": {"output": [[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]},
                   "relation": "identical keys give uniform weights over the valid keys, so the "
                               "output is the mean of the first valid_len values"}),
    CaseDef("additive-zero-length", "additive", {"weights": True}, seed=8,
            source="seeded, valid length 0 in batch 0",
            make=lambda o: (seeding.init_params(V.get("additive"), o, 8),
                            dict(seeding.make_inputs(V.get("additive"), o, 8),
                                 valid_lens=np.array([0, 7], np.int64)))),
    CaseDef("masked-softmax-valid-lens", "masked-softmax", {},
            source=f"seeded: the masked softmax of {SRC_KERNEL} on 2x2x4 uniform scores, valid lengths 2 and 3",
            make=_masked_softmax_example([2, 3], 2)),
    CaseDef("masked-softmax-zero-length", "masked-softmax", {}, source="seeded, valid lengths 0 and 4",
            make=_masked_softmax_example([0, 4], 9)),
    CaseDef("kernel-nadaraya-watson", "kernel", {"seq": 100, "kv_seq": 100, "weights": True},
            source=f"worked example of {SRC_KERNEL}: Nadaraya-Watson regression of f(x) = 2 sin(x) + x^0.8 "
                   "from 100 samples x ~ U[0, 5), sorted, y = f(x) + N(0, 0.5); every sample is a query "
                   "over the same samples as keys", make=_nadaraya_watson),
    CaseDef("kernel-learnable-bandwidth", "kernel", {"seq": 100, "kv_seq": 100, "learnable_bandwidth": True},
            source=f"seeded: the data of {SRC_KERNEL}'s regression with a learnable bandwidth w = 1.5 "
                   "(the source fits the fixed kernel only)", make=_nadaraya_watson),
    CaseDef("posenc-table", "posenc", {"batch": 1, "seq": 60, "dim": 32},
            source=f"the sinusoidal encoding of {SRC_CROSS}: the table itself (zeros in), 60 steps, 32 dims",
            make=_posenc_zeros),
    CaseDef("mha-kv-cache", "mha", {"kv_cache": True, "causal": True, "seq": 3, "past_seq": 4},
            source="seeded: one causal block of 3 tokens over a cache of 4"),
    CaseDef("mha-kv-cache-gqa", "mha", {"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 1,
                                        "past_seq": 6},
            source="seeded: one token over a grouped-query cache (2 key/value heads for 4)"),
    CaseDef("mha-kv-cache-empty", "mha", {"kv_cache": True, "causal": True, "seq": 5, "past_seq": 0},
            source="seeded: a prompt of 5 tokens into an empty cache (prefill)"),
    CaseDef("mha-kv-cache-cosine", "mha", {"kv_cache": True, "causal": True, "scaling": "cosine",
                                           "seq": 2, "past_seq": 3},
            source="seeded: cosine scaling over a cache (keys cached normalized)"),
    CaseDef("mha-static-cache", "mha", {"kv_cache": True, "max_seq": 8, "causal": True, "kv_heads": 2,
                                        "seq": 3, "past_seq": 5, "batch": 3},
            source="seeded: a block of 3 into grouped-query static buffers of 8 positions (2 key/value heads "
                   "for 4): sequence 0 with 5 cached writes the buffer's last positions, sequences 1 and 2 "
                   "with 4 and 3 (the rest of each buffer garbage, never read)"),
    CaseDef("mha-static-cache-token", "mha", {"kv_cache": True, "max_seq": 8, "causal": True, "kv_heads": 2,
                                              "seq": 1, "past_seq": 6, "batch": 3},
        source="seeded: one token a sequence into grouped-query static buffers of 8 positions, written at 6, 5 "
               "and 4: the step every flavour takes at batch > 1 (the ort flavour's GroupQueryAttention takes "
               "a block of several positions over written ones at batch 1 only)"),
CaseDef("decoder-static-cache-token", "decoder", {"kv_cache": True, "max_seq": 10, "seq": 1, "past_seq": 4,
                                                      "kv_seq": 0, "past_kv_seq": 5},
        source="seeded: a decoder step of one position with its self-attention cache in static buffers of 10 "
               "(written at 4 and 3) and the memory's 5 positions cached"),
CaseDef("sdpa-static-cache", "sdpa", {"kv_cache": True, "max_seq": 12, "causal": True, "kv_heads": 2,
                                          "seq": 2, "kv_seq": 2, "past_seq": 5},
            source="seeded: the operator over static grouped-query buffers of 12 positions, a block of 2 "
                   "written at 5 and 4 (TensorScatter), the valid keys as nonpad_kv_seqlen"),
    CaseDef("sdpa-kv-cache", "sdpa", {"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 2, "kv_seq": 2,
                                       "past_seq": 5},
            source="seeded: the operator with a grouped-query cache, a block of 2 over 5 cached positions"),
    CaseDef("sdpa-kv-cache-empty", "sdpa", {"kv_cache": True, "causal": True, "seq": 4, "kv_seq": 4, "past_seq": 0},
            source="seeded: the operator's cache, empty (the prefill)"),
    CaseDef("sdpa-kv-cache-more-keys", "sdpa", {"kv_cache": True, "causal": True, "mask": "float", "seq": 2,
                                                "kv_seq": 3, "past_seq": 4, "weights": "bias"},
            source="seeded: a cache with more new keys than queries: the causal offset is the past "
                   "length (query i attends keys j <= 4 + i), not the keys' count minus the queries'"),
    CaseDef("sdpa-mask-shorter", "sdpa", {"mask": "bool", "mask_rank": 2, "mask_keys": 5, "seq": 3,
                                          "kv_seq": 7, "causal": True},
            source="seeded: a mask shorter than the keys (5 of 7): the keys past it are masked, as "
                   "the operator pads the mask with -inf"),
    CaseDef("sdpa-bsd-gqa-causal", "sdpa", {"layout": "bsd", "heads": 4, "kv_heads": 2, "causal": True,
                                            "seq": 5, "kv_seq": 7, "v_head_dim": 16},
            source="seeded: the 3-D layout, (B, T, H*d) inputs with 4 query and 2 key/value heads"),
    CaseDef("sdpa-nonpad-causal", "sdpa", {"nonpad": True, "causal": True, "kv_heads": 2, "seq": 3,
                                           "kv_seq": 8, "batch": 3},
            source="seeded: valid key counts in a preallocated cache (opset 24), the causal mask offset "
                   "by count - Tq per sequence; a count below Tq empties rows"),
    CaseDef("sdpa-kv-cache-mask-softcap", "sdpa", {"kv_cache": True, "causal": True, "mask": "bool",
                                                   "softcap": 2.0, "weights": "softmax", "seq": 3,
                                                   "kv_seq": 3, "past_seq": 4},
            source="seeded: a cache with a boolean mask over past and new keys, softcap and the weights"),
    CaseDef("sdpa-kv-cache-bsd-mask", "sdpa", {"layout": "bsd", "kv_cache": True, "causal": True,
                                               "mask": "float", "mask_rank": 2, "heads": 4, "kv_heads": 4,
                                               "seq": 2, "kv_seq": 2, "past_seq": 5},
            source="seeded: the 3-D layout with a cache and an additive (Tq, P + Tq) mask"),
    *(CaseDef(f"sdpa-weights-{mode}", "sdpa", {"weights": mode, "softcap": 1.5, "mask": "bool",
                                               "causal": True, "seq": 4, "kv_seq": 6, "heads": 2},
              source=f"seeded: the score output in mode {mode} (qk_matmul_output_mode "
                     f"{MODE_OF[mode]}) with softcap, a mask and causal")
      for mode in ("raw", "softcap", "bias")),
    CaseDef("decoder-kv-cache", "decoder", {"kv_cache": True, "seq": 2, "past_seq": 3, "kv_seq": 0,
                                            "past_kv_seq": 6},
            source="seeded: a decoder step of 2 tokens over 3 cached ones, the memory's 6 positions cached "
                   "(no memory given)"),
    CaseDef("decoder-static-cache", "decoder", {"kv_cache": True, "max_seq": 10, "seq": 2, "past_seq": 3,
                                                "kv_seq": 0, "past_kv_seq": 5},
            source="seeded: a decoder step of 2 positions with its self-attention cache in static buffers of "
                   "10 (written at 3 and 2) and the memory's 5 positions cached"),
    CaseDef("decoder-kv-cache-first", "decoder", {"kv_cache": True, "seq": 4, "past_seq": 0, "kv_seq": 5,
                                                  "past_kv_seq": 0},
            source="seeded: a decoder's first step: a prompt of 4 into empty caches, the memory of 5 "
                   "projected and returned as the cross cache"),
    CaseDef("encoder-padding", "encoder", {"mask": "padding"}, source="seeded"),
    CaseDef("decoder-padding", "decoder", {"mask": "padding"}, source="seeded"),
    CaseDef("cross-padding", "cross", {"mask": "padding", "weights": True}, source="seeded"),
)

CASE_DEFS: tuple[CaseDef, ...] = SEEDED + SCALINGS + CAT_MILK + LISTED


CASES: dict[str, CaseDef] = {c.name: c for c in CASE_DEFS}
