"""compare: tolerances, NaN/inf/shape paths, name matching, error statistics, divergence."""

import math

import numpy as np
import pytest

from attnexport import compare as C
from attnexport.compare import TOLERANCES, compare, compare_outputs, derived_tolerance, divergence, tolerance
from attnexport.errors import UsageError

TOL = TOLERANCES["fp32"]


def test_pass_and_statistics():
    e = np.zeros((2, 3))
    a = e.copy()
    a[1, 2] = 4e-6
    a[0, 0] = 1e-6
    c = compare("y", a, e, TOL)
    assert c and c.max_abs == pytest.approx(4e-6) and c.argmax == (1, 2)
    assert c.mean_abs == pytest.approx(5e-6 / 6) and c.median_abs == 0.0
    assert c.compared == 6 and c.needed_atol == pytest.approx(4e-6)


def test_fail_reports_the_tolerance_that_would_pass():
    c = compare("y", [1.0, 2.0 + 1e-3], [1.0, 2.0], TOL)
    assert not c and c.needed_atol == pytest.approx(1e-3 - 2e-4)
    assert "passes with atol>=" in str(c)


def test_nan_never_passes_even_where_expected_is_nan():
    assert not compare("y", [np.nan], [np.nan], TOL)
    c = compare("y", [np.nan, 1.0], [0.0, 1.0], TOL)
    assert not c and "NaN never passes" in c.problem and c.nan_diff == 1


def test_infinities_must_match():
    assert compare("y", [np.inf, 1.0], [np.inf, 1.0], TOL)
    assert not compare("y", [-np.inf], [np.inf], TOL)
    assert compare("y", [np.inf], [1.0], TOL).problem == "infinities differ"


def test_shape_mismatch_fails():
    c = compare("y", np.zeros((2, 3)), np.zeros((3, 2)), TOL)
    assert not c and "shape (2, 3) != expected (3, 2)" in c.problem


def test_outputs_matched_by_name_missing_and_extra_fail():
    got = {"weights": np.zeros(2), "extra": np.zeros(1)}
    cs = {c.name: c for c in compare_outputs(["output", "weights"], got, {"output": np.zeros(2),
                                                                         "weights": np.zeros(2)}, TOL)}
    assert cs["weights"] and not cs["output"] and cs["output"].problem == "output missing"
    assert not cs["extra"] and "unexpected output" in cs["extra"].problem
    assert not compare_outputs(["output"], {"output": np.zeros(1)}, {}, TOL)[0]


def test_tolerance_overrides_must_be_finite_and_non_negative():
    assert tolerance("fp32", atol=0.0).atol == 0.0 and tolerance("fp32", rtol=1e-3).basis == "override"
    for bad in (math.nan, math.inf, -1e-6):
        with pytest.raises(UsageError):
            tolerance("fp32", atol=bad)
        with pytest.raises(UsageError):
            tolerance("fp32", rtol=bad)


def test_fp16_tolerance_is_derived_with_the_policy_as_floor():
    """4x the emulated error, stated as numbers: loosening the factor fails here."""
    t = derived_tolerance("fp16", 0.01)
    assert t.atol == pytest.approx(0.04) and t.rtol == 1e-3 and t.basis == "fp16-emulated reference error 0.01 x 4"
    assert derived_tolerance("fp16", 1e-6).atol == 2.5e-3
    expected = np.full(3, 10.0)  # |expected| 10: the rtol part is 1e-3 x 10 = 0.01
    assert compare("y", expected + 0.0499, expected, t)  # 0.04 + 0.01 = 0.05 allowed
    assert not compare("y", expected + 0.0501, expected, t)


@pytest.mark.parametrize("factor, value", [(C.FP32_FACTOR, 4), (C.QUANTIZED_FACTOR, 16)])
def test_a_whole_models_factors_are_pinned_from_both_sides(factor, value):
    """A whole model's fp32 budget is 4x torch's own error, a quantized graph's float twin's 16x:
    written here as numbers, with a result just inside the bound passing and one just outside not."""
    assert factor == value
    t = derived_tolerance("fp32", 1e-4, "torch's fp32 error", factor)
    assert t.atol == pytest.approx(value * 1e-4) and t.rtol == 1e-4
    assert t.basis == f"torch's fp32 error 0.0001 x {value}"
    expected = np.full(3, 2.0)  # the rtol part: 1e-4 x 2
    assert compare("y", expected + 0.99 * (value * 1e-4 + 2e-4), expected, t)
    assert not compare("y", expected + 1.01 * (value * 1e-4 + 2e-4), expected, t)


@pytest.mark.parametrize("dtype, rtol, atol", [("fp32", 1e-4, 1e-5), ("fp16", 1e-3, 2.5e-3), ("fp64", 1e-7, 1e-9)])
def test_policy_tolerances_are_pinned_from_both_sides(dtype, rtol, atol):
    """The policy's numbers, written here as numbers: a result just inside the bound passes, one
    just outside fails, so neither a looser nor a tighter policy goes unnoticed."""
    t = tolerance(dtype)
    assert (t.rtol, t.atol) == (rtol, atol)
    for scale in (0.0, 1.0, 3.0):
        expected = np.full(4, scale)
        bound = atol + rtol * scale
        assert compare("y", expected + 0.99 * bound, expected, t), (dtype, scale)
        assert not compare("y", expected + 1.01 * bound, expected, t), (dtype, scale)
        assert not compare("y", expected - 1.01 * bound, expected, t), (dtype, scale)


def test_divergence_is_relative_to_the_tensor_scale():
    assert not divergence(np.full(4, 100.0) + 1e-4, np.full(4, 100.0), "fp32")[0]
    assert divergence(np.full(4, 100.0) + 1e-2, np.full(4, 100.0), "fp32")[0]
    assert divergence([np.nan], [0.0], "fp32")[0] and not divergence([np.nan], [np.nan], "fp32")[0]
    assert divergence(np.zeros(2), np.zeros(3), "fp32")[0]


@pytest.mark.parametrize("chunk", [7, 64, 1 << 18])
def test_a_comparison_read_in_chunks_says_what_the_whole_arrays_say(monkeypatch, chunk):
    """compare() reads its arrays a chunk at a time (a vocabulary's logits over a generation are
    tens of millions of values): every statistic is the one the whole arrays give, the first
    largest error's index included, and NaN or unequal infinities anywhere still fail."""
    import attnexport.compare as C
    monkeypatch.setattr(C, "COMPARE_CHUNK", chunk)
    rng = np.random.default_rng(5)
    e = rng.normal(size=(3, 50, 7)).astype(np.float32)
    a = e + rng.normal(scale=1e-7, size=e.shape).astype(np.float32)
    e[2, 40, 3] = e[2, 41, 0] = 0.0  # the largest error, twice: the first is reported
    a[2, 40, 3] = a[2, 41, 0] = 0.5
    e[0, 3, 1] = a[0, 3, 1] = np.inf
    c = compare("y", a, e, TOL)
    x, y = a.astype(np.float64).ravel(), e.astype(np.float64).ravel()
    live = ~np.isinf(y)
    err = np.where(live, np.abs(np.where(live, x, 0) - np.where(live, y, 0)), 0.0)
    mag = np.where(live, np.abs(y), 0.0)
    assert c.argmax == (2, 40, 3) and c.max_abs == pytest.approx(err.max(), rel=1e-12)
    assert c.mean_abs == pytest.approx(err.mean(), rel=1e-9) and c.compared == e.size
    assert c.median_abs == pytest.approx(np.median(err), rel=1e-12)
    assert c.p99_abs == pytest.approx(np.percentile(err, 99), rel=1e-12)
    assert c.max_rel == np.inf  # an error where 0 was expected
    first = slice(0, err.size * 2 // 3)  # a[:2]: no zero expected, one infinity in both
    rel = err[first][live[first]] / mag[first][live[first]]
    assert compare("y", a[:2], e[:2], TOL).max_rel == pytest.approx(rel.max(), rel=1e-12)
    assert c.needed_atol == pytest.approx(np.maximum(err - TOL.rtol * mag, 0).max(), rel=1e-12)
    assert not c.passed and compare("y", a[:2], e[:2], TOL).passed
    # The derived budgets' largest error, read the same way: None where a value is not finite.
    assert C.largest_error(a[1:], e[1:]) == pytest.approx(err[350:].max(), rel=1e-12) == 0.5
    assert C.largest_error(a, e) is None
    a[1, 49, 6], e[0, 0, 0] = np.nan, -np.inf  # a NaN in a late chunk, infinities parting in an early one
    c = compare("y", a, e, TOL)
    assert not c and c.problem == "1 NaN in actual, 0 in expected (NaN never passes)" and c.inf_diff == -1
    a[1, 49, 6] = 0.0
    assert compare("y", a, e, TOL).problem == "infinities differ"
