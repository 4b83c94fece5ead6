"""The NumPy reference against the onnx package's own reference of the Attention operator, and
the worked examples' relations."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx.reference.ops.op_attention import _compute_attention

from attnexport import cases, golden
from attnexport import reference as ref


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), kv=st.integers(1, 3), group=st.integers(1, 3), tq=st.integers(1, 6),
       tk=st.integers(1, 6), d=st.integers(1, 8), dv=st.integers(1, 8), causal=st.booleans(),
       softcap=st.sampled_from([0.0, 1.5]), mask=st.sampled_from(["none", "bool", "float"]),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**16))
def test_sdpa_equals_onnx_reference(B, kv, group, tq, tk, d, dv, causal, softcap, mask, scale, seed):
    rng = np.random.default_rng(seed)
    hq = kv * group
    q = rng.standard_normal((B, hq, tq, d))
    k = rng.standard_normal((B, kv, tk, d))
    v = rng.standard_normal((B, kv, tk, dv))
    m = None
    if mask != "none":
        keep = rng.random((B, 1, tq, tk)) < 0.6
        m = keep if mask == "bool" else np.where(keep, rng.standard_normal(keep.shape), -np.inf)
    ours_out, ours_w = ref.sdpa(q, k, v, m, scale=scale, causal=causal, softcap=softcap)
    theirs = _compute_attention(q, k, v, m, scale=scale, is_causal=causal,
                                softcap=softcap if softcap else None, qk_matmul_output_mode=3)
    np.testing.assert_allclose(ours_out, theirs[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours_w, theirs[3], rtol=1e-12, atol=1e-12)


def test_softmax_rows_fully_masked_is_zero_not_nan():
    p = ref.softmax_rows(np.zeros((2, 3)), np.array([[0, -np.inf, 0], [-np.inf] * 3]))
    assert np.array_equal(p[1], np.zeros(3))
    np.testing.assert_allclose(p[0], [0.5, 0, 0.5])


def test_scaling_length_reads_the_length():
    q = np.ones((1, 1, 4, 2))
    _, _, scale = ref._scale_qk(q, q, "length", 0.1)
    assert scale == pytest.approx(1 / (np.sqrt(2) * np.sqrt(4)))


def test_norm_scaling_gives_unit_score_norm():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 6, 4))
    qs, ks, scale = ref._scale_qk(q, k, "norm", 0.1)
    s = np.einsum("bhqd,bhkd->bhqk", qs, ks) * scale
    np.testing.assert_allclose(np.sqrt((s**2).sum(axis=(-2, -1))), 1.0)


def test_positional_table_known_values():
    P = ref.positional_table(3, 4)
    np.testing.assert_allclose(P[0], [0, 1, 0, 1])
    np.testing.assert_allclose(P[2], [np.sin(2), np.cos(2), np.sin(2 / 100), np.cos(2 / 100)])


# --- the worked examples' relations ---------------------------------------------------------

def test_additive_example_follows_its_analytic_output():
    case = golden.load("additive-valid-lens")
    assert cases.SRC_KERNEL in case.meta["source"] and "printed" not in case.meta["notes"]
    np.testing.assert_allclose(case.expected["output"], case.meta["notes"]["analytic"]["output"], atol=1e-12)
    # The relation: uniform weights over the valid keys.
    w = case.expected["weights"]
    np.testing.assert_allclose(w[0, 0, :2], 0.5)
    np.testing.assert_allclose(w[1, 0, :6], 1 / 6)
    assert (w[0, 0, 2:] == 0).all() and (w[1, 0, 6:] == 0).all()


def test_cross_attention_aligns_i_love_you():
    case = golden.load("cross-i-love-you")
    assert case.meta["notes"]["target_tokens"] == ["我", "爱", "你"] and cases.SRC_CROSS in case.meta["source"]
    w = case.expected["weights"][0, 0]
    assert list(w.argmax(axis=-1)) == [0, 1, 2]
    assert (np.diag(w) > 0.9).all()


def test_kernel_regression_is_the_printed_setup_and_follows_the_function():
    case = golden.load("kernel-nadaraya-watson")
    x = case.inputs["queries"][0].astype(np.float64)
    # As printed: 100 sorted samples of [0, 5), each a query over the same samples as keys.
    assert x.shape == (100,) and (np.diff(x) >= 0).all() and 0 <= x.min() and x.max() < 5
    np.testing.assert_array_equal(case.inputs["keys"], case.inputs["queries"])
    f = 2 * np.sin(x) + x**0.8
    noise = case.inputs["values"][0] - f
    assert 0.35 < noise.std() < 0.65  # N(0, 0.5) noise
    # Kernel smoothing of noisy samples: close to f, far better than predicting 0.
    err = np.abs(case.expected["output"][0] - f).mean()
    assert err < 0.5 and err < 0.3 * np.abs(f).mean()


@pytest.mark.parametrize("word", ["sweet", "hungry"])
def test_cat_milk_it_uses_the_printed_vectors_and_follows_the_formula(word):
    case = golden.load(f"self-cat-milk-it-{word}")
    assert cases.SRC_SELF in case.meta["source"]
    X = case.inputs["x"][0].astype(np.float64)
    printed = {w: cases.WORDS[w] for w in ("cat", "milk", "it", word)}
    np.testing.assert_array_equal(X[:, 1:3], list(printed.values()))
    assert (X[:, [0, 3]] == 0).all()
    np.testing.assert_array_equal(X @ X.T, case.meta["notes"]["printed"]["scores"])
    # The expected value is the formula's: softmax(QK^T / sqrt(d_k)) V with d_k = 4.
    S = X @ X.T / np.sqrt(4)
    W = np.exp(S) / np.exp(S).sum(-1, keepdims=True)
    np.testing.assert_allclose(case.expected["output"][0], W @ X, atol=1e-12)


@pytest.mark.parametrize("word", ["sweet", "hungry"])
def test_cat_milk_it_printed_rows_follow_the_stated_relation(word):
    """All eight printed rows are softmax(QK^T) V / sqrt(d_k), to the printed three decimals,
    and differ from the formula's value: the source scaled the output, not the scores."""
    case = golden.load(f"self-cat-milk-it-{word}")
    X = case.inputs["x"][0].astype(np.float64)
    S = X @ X.T
    W = np.exp(S - S.max(-1, keepdims=True))
    W /= W.sum(-1, keepdims=True)
    related = (W @ X / np.sqrt(4))[:, 1:3]
    printed = np.array(case.meta["notes"]["printed"]["rows"])
    np.testing.assert_array_equal(np.round(related, 3), printed)
    assert np.abs(case.expected["output"][0][:, 1:3] - printed).max() > 0.4
    assert case.meta["notes"]["relation"] == cases.PRINTED_RELATION


def test_cat_milk_it_sim_lines_and_their_misprint():
    rows = {w: np.array(cases.PRINTED_ROWS[w]) for w in ("sweet", "hungry")}
    it, milk, cat = rows["sweet"][2], rows["sweet"][1], rows["sweet"][0]
    # Printed: sim(it, milk) = 2.68, sim(it, cat) = 2.28 with "0.0625" for it's first coordinate.
    assert round(float(it @ milk), 2) == 2.68 and round(float(it @ cat), 2) == 2.28
    misread = np.array([0.0625, 1.375])
    assert round(float(misread @ milk), 2) != 2.68 and round(float(misread @ np.array([0.0625, 1.375])), 2) != 2.28
    it, milk, cat = rows["hungry"][2], rows["hungry"][1], rows["hungry"][0]
    assert round(float(it @ milk), 2) == 1.90 and round(float(it @ cat), 2) == 2.03
    assert "0.0625 should read 0.625" in cases.PRINTED_SIM["sweet"]["misprint"]


def test_worked_examples_cite_their_source_file():
    for name, file in (("self-cat-milk-it-sweet", cases.SRC_SELF), ("kernel-nadaraya-watson", cases.SRC_KERNEL),
                       ("mha-tied-10d-2h", cases.SRC_TIED), ("cross-i-love-you", cases.SRC_CROSS),
                       ("self-64d-single-head", cases.SRC_SIMPLE)):
        case = golden.load(name)
        assert case.meta["source"].startswith(f"worked example of {file}")
    tied = golden.load("mha-tied-10d-2h")
    assert tied.options["mask"] == "none" and tied.inputs["query"].shape == (3, 5, 10)
    simple = golden.load("self-64d-single-head").inputs["x"]
    assert simple.shape == (1, 10, 64) and 0 <= simple.min() and simple.max() < 1


def test_masked_softmax_zero_length_row_is_zero():
    p = golden.load("masked-softmax-zero-length").expected["probs"]
    assert (p[0] == 0).all()
    np.testing.assert_allclose(p[1].sum(-1), 1.0)
