"""The NumPy reference against the onnx package's own reference of the Attention operator, and
the worked examples' relations."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from onnx.reference.ops.op_attention import _compute_attention

from attnexport import golden, reference as ref


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

def test_additive_example_matches_its_printed_output():
    case = golden.load("additive-valid-lens")
    printed = np.array(case.meta["notes"]["printed"]["output"])
    np.testing.assert_allclose(case.expected["output"], printed, atol=1e-12)
    # The relation: uniform weights over the valid keys.
    w = case.expected["weights"]
    np.testing.assert_allclose(w[0, 0, :2], 0.5)
    np.testing.assert_allclose(w[1, 0, :6], 1 / 6)
    assert (w[0, 0, 2:] == 0).all() and (w[1, 0, 6:] == 0).all()


def test_cross_attention_aligns_i_love_you():
    w = golden.load("cross-i-love-you").expected["weights"][0, 0]
    assert list(w.argmax(axis=-1)) == [0, 1, 2]
    assert (np.diag(w) > 0.9).all()


def test_kernel_regression_follows_the_function():
    case = golden.load("kernel-nadaraya-watson")
    x = case.inputs["queries"][0].astype(np.float64)
    f = 2 * np.sin(x) + x**0.8
    # Kernel smoothing of noisy samples (sigma 0.5): close to f, far better than predicting 0.
    err = np.abs(case.expected["output"][0] - f).mean()
    assert err < 0.7 and err < 0.3 * np.abs(f).mean()


def test_cat_milk_it_follows_the_formula_and_context():
    for word in ("sweet", "hungry"):
        case = golden.load(f"self-cat-milk-it-{word}")
        X = case.inputs["x"][0].astype(np.float64)
        S = X @ X.T / np.sqrt(4)
        W = np.exp(S) / np.exp(S).sum(-1, keepdims=True)
        np.testing.assert_allclose(case.expected["output"][0], W @ X, atol=1e-12)
        assert case.meta["notes"]["printed"]["milk"] == [0.089, 1.911]
    # The context word moves 'it': towards milk's direction with 'sweet', cat's with 'hungry'.
    it_sweet = golden.load("self-cat-milk-it-sweet").expected["output"][0, 2]
    it_hungry = golden.load("self-cat-milk-it-hungry").expected["output"][0, 2]
    assert it_sweet[1] > it_sweet[0] and it_hungry[0] > it_hungry[1]


def test_masked_softmax_zero_length_row_is_zero():
    p = golden.load("masked-softmax-zero-length").expected["probs"]
    assert (p[0] == 0).all()
    np.testing.assert_allclose(p[1].sum(-1), 1.0)
