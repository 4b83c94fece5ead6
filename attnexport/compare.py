"""Tolerances as data, and comparisons of outputs against expected values in float64."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from attnexport.errors import UsageError


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    basis: str = "policy"  # where the numbers come from: the policy table, an override, a derivation


# The one place tolerances live. |actual - expected| <= atol + rtol * |expected|, elementwise.
TOLERANCES: dict[str, Tolerance] = {
    "fp64": Tolerance(rtol=1e-7, atol=1e-9),
    "fp32": Tolerance(rtol=1e-4, atol=1e-5),
    "fp16": Tolerance(rtol=1e-3, atol=2.5e-3),
}

# fp16 tolerances are derived per case: the float64 reference is run again with its inputs,
# weights and intermediate results rounded to fp16 (what a correct fp16 implementation can
# reach), and the atol becomes this factor times the error that rounding alone causes, never
# less than the policy's atol. Why 4: a real kernel rounds at other places than the emulation
# (fp32 accumulation, fused softmax, another summation order), so its error is of the same
# order but not the same realization; 4x covers that spread in every case we have, while a
# wrong result (a lost mask, a wrong scale) is off by far more.
FP16_FACTOR = 4.0

# A whole language model in fp32 is judged against the same model run in float64, and each output's
# atol is this factor times the error torch's own fp32 forward makes against that float64 run
# (never less than the policy's): thirty layers of a trained model round their way to 3e-5..5e-4
# in the logits, which single-op constants cannot allow for (attnexport.pretrained.reference). Why 4: on
# SmolLM2-135M's step at six shapes, ONNX Runtime's error was at most 1.6x torch's on every output
# (presents and logits, with the policy's rtol), and an export that is wrong (a lost mask, a rotary
# table off by one position) is off by orders of magnitude more.
FP32_FACTOR = 4.0

# A quantized language model's graph with float activations (MatMulNBits at accuracy level 0) is
# checked against the model holding the very weights the file holds, in float64, before it is
# written: the same derivation with this factor. MatMulNBits sums a block's products before scaling
# them, and a carried Q4_1 grid adds its minimums times the input's block sums apart, so its rounding
# is not the dense MatMul's: on SmolLM2-135M its cache error reached 8x torch's own at one position
# (1.8e-5). A wrong quantization (a scale, a zero point, a packing, a minimum) moves every output by
# the weights' step, orders of magnitude more.
QUANTIZED_FACTOR = 16.0

# Localization: an intermediate value diverges when its max abs error exceeds this fraction of
# the tensor's own scale (max |value|, at least 1). Two graphs that compute the same function in
# the same dtype differ by a few roundings; damage does not stay that small.
DIVERGENCE: dict[str, float] = {"fp32": 1e-5, "fp16": 1e-2}


def check_tolerance_values(rtol: float | None, atol: float | None) -> None:
    """Overrides must be finite and >= 0 (a NaN or negative tolerance would pass or fail anything)."""
    for flag, v in (("--rtol", rtol), ("--atol", atol)):
        if v is not None and (not math.isfinite(v) or v < 0):
            raise UsageError(f"{flag} must be a finite number >= 0, got {v}")


def tolerance(dtype: str, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance for `dtype`, with optional per-run overrides."""
    check_tolerance_values(rtol, atol)
    base = TOLERANCES[dtype]
    if rtol is None and atol is None:
        return base
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol, "override")


def derived_tolerance(dtype: str, error: float, source: str = "fp16-emulated reference error",
                      factor: float | None = None) -> Tolerance:
    """A tolerance derived from a measured error (FP16_FACTOR times the error of a case's
    fp16-emulated reference; FP32_FACTOR times torch's fp32 error against a float64 run of the
    same model): the policy's rtol, and the factor times `error` as atol, never below the
    policy's. Its basis says `source`, the error and the factor."""
    base = TOLERANCES[dtype]
    factor = factor or (FP16_FACTOR if dtype == "fp16" else FP32_FACTOR)
    atol = max(base.atol, factor * error)
    basis = f"{source} {error:.3g} x {factor:g}" + ("; below the policy atol: policy" if atol == base.atol else "")
    return Tolerance(base.rtol, float(atol), basis)


@dataclass(frozen=True)
class Comparison:
    """One output compared; bool() means passed, str() says what would have passed."""

    name: str
    passed: bool
    max_abs: float
    max_rel: float
    nan_diff: int  # NaN count in actual minus NaN count in expected
    inf_diff: int  # Inf count in actual minus Inf count in expected
    rtol: float
    atol: float
    needed_atol: float  # smallest atol that passes at this rtol
    needed_rtol: float  # smallest rtol that passes at this atol (inf if none does)
    problem: str = ""  # missing, extra, shape or NaN problem; empty when values were compared
    mean_abs: float = math.inf
    median_abs: float = math.inf
    p99_abs: float = math.inf
    argmax: tuple[int, ...] = field(default=())  # index of the largest absolute error
    compared: int = 0  # elements compared
    basis: str = ""  # where the tolerance came from (the policy, an override, a derivation)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.problem:
            return f"{self.name}: {verdict} ({self.problem})"
        basis = f" ({self.basis})" if self.basis and self.basis != "policy" else ""
        return (f"{self.name}: {verdict} max abs {self.max_abs:.3g} at {list(self.argmax)}, max rel "
                f"{self.max_rel:.3g}; tolerance rtol={self.rtol:g} atol={self.atol:g}{basis}; passes with "
                f"atol>={self.needed_atol:.3g} or rtol>={self.needed_rtol:.3g}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["argmax"] = list(self.argmax)
        return d


def failed(name: str, problem: str, tol: Tolerance) -> Comparison:
    """A comparison that could not compare values: the reason says why."""
    inf = math.inf
    return Comparison(name, False, inf, inf, 0, 0, tol.rtol, tol.atol, inf, inf, problem, basis=tol.basis)


# compare() reads its arrays this many elements at a time: the logits of a generation over a vocabulary
# of 262,144 tokens are 63M values, whose float64 temporaries (a dozen, taken whole) held gigabytes;
# a chunk's are some 25 MB, beside the one float64 array of the errors the median and p99 need.
COMPARE_CHUNK = 1 << 18


def compare(name: str, actual, expected, tol: Tolerance) -> Comparison:
    """Compares in float64. NaN never passes; infinities must match exactly."""
    a_all = np.asarray(actual)
    e_all = np.asarray(expected)
    if a_all.shape != e_all.shape:
        return failed(name, f"shape {a_all.shape} != expected {e_all.shape}", tol)
    a_flat, e_flat = a_all.reshape(-1), e_all.reshape(-1)
    size = a_flat.size
    err = np.empty(size, np.float64)
    nan_a = nan_e = inf_a = inf_e = 0
    bad = ""
    max_rel = needed_atol = needed_rtol = 0.0
    passed, worst, at = True, -1.0, 0
    for lo in range(0, size, COMPARE_CHUNK):
        a = a_flat[lo:lo + COMPARE_CHUNK].astype(np.float64)
        e = e_flat[lo:lo + COMPARE_CHUNK].astype(np.float64)
        isnan_a, isnan_e, isinf_a, isinf_e = np.isnan(a), np.isnan(e), np.isinf(a), np.isinf(e)
        nan_a, nan_e = nan_a + int(isnan_a.sum()), nan_e + int(isnan_e.sum())
        inf_a, inf_e = inf_a + int(isinf_a.sum()), inf_e + int(isinf_e.sum())
        if isnan_a.any() or isnan_e.any():
            bad = "nan"  # over any other problem, as it was with the whole arrays
        if bad:
            continue
        same_inf = isinf_a & isinf_e & (np.sign(a) == np.sign(e))
        if (isinf_a | isinf_e)[~same_inf].any():
            bad = "inf"
            continue
        both_inf = isinf_a & isinf_e
        chunk = np.where(both_inf, 0.0, np.abs(np.where(both_inf, 0.0, a) - np.where(both_inf, 0.0, e)))
        mag = np.where(both_inf, 0.0, np.abs(e))
        err[lo:lo + chunk.size] = chunk
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(mag > 0, chunk / mag, np.where(chunk > 0, np.inf, 0.0))
            need_r = np.where(chunk <= tol.atol, 0.0, np.where(mag > 0, (chunk - tol.atol) / mag, np.inf))
        max_rel = max(max_rel, float(rel.max()))
        needed_rtol = max(needed_rtol, float(need_r.max()))
        needed_atol = max(needed_atol, float(np.maximum(chunk - tol.rtol * mag, 0.0).max()))
        passed = passed and bool(np.all(chunk <= tol.atol + tol.rtol * mag))
        i = int(np.argmax(chunk))
        if chunk[i] > worst:  # the first of the largest errors, as np.argmax over the whole
            worst, at = float(chunk[i]), lo + i
    nan_diff, inf_diff = nan_a - nan_e, inf_a - inf_e
    if bad:
        problem = (f"{nan_a} NaN in actual, {nan_e} in expected (NaN never passes)" if bad == "nan"
                   else "infinities differ")
        inf = math.inf
        return Comparison(name, False, inf, inf, nan_diff, inf_diff, tol.rtol, tol.atol, inf, inf, problem,
                          compared=int(size), basis=tol.basis)
    if size == 0:
        return Comparison(name, True, 0.0, 0.0, 0, 0, tol.rtol, tol.atol, 0.0, 0.0, "", 0.0, 0.0, 0.0, (), 0,
                          tol.basis)
    argmax = tuple(int(i) for i in np.unravel_index(at, a_all.shape))
    mean = float(err.mean())
    # The order statistics last: they may reorder `err` (ours) in place rather than copy it.
    median = float(np.median(err, overwrite_input=True))
    p99 = float(np.percentile(err, 99, overwrite_input=True))
    return Comparison(name, passed, worst, max_rel, nan_diff, inf_diff, tol.rtol, tol.atol, needed_atol,
                      needed_rtol, "", mean, median, p99, argmax, int(size), tol.basis)


def largest_error(actual, expected) -> float | None:
    """max |actual - expected| in float64, a chunk at a time; None where either is not finite."""
    a, e = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    error = 0.0
    for lo in range(0, a.size, COMPARE_CHUNK):
        x, y = a[lo:lo + COMPARE_CHUNK].astype(np.float64), e[lo:lo + COMPARE_CHUNK].astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            return None
        error = max(error, float(np.abs(x - y).max(initial=0.0)))
    return error


def compare_outputs(declared: list[str], got: dict, expected: dict, tol: Tolerance) -> list[Comparison]:
    """Every declared output, matched by name, then shape, then values.

    A declared output the run did not produce, one with no expected value, and an output the
    variant does not declare are each a failed comparison with its reason.
    """
    out = []
    for name in declared:
        if name not in expected:
            out.append(failed(name, "no expected value for this output", tol))
        elif name not in got:
            out.append(failed(name, "output missing", tol))
        else:
            out.append(compare(name, got[name], expected[name], tol))
    for name in got:
        if name not in declared:
            out.append(failed(name, f"unexpected output (the variant declares {', '.join(declared)})", tol))
    return out


def divergence(actual, expected, dtype: str) -> tuple[bool, float, float]:
    """(diverges, max abs error, scale) of an intermediate value; NaN where the other has none diverges."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return True, math.inf, math.nan
    if a.size == 0:
        return False, 0.0, 0.0
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if (nan_a != nan_e).any():
        return True, math.inf, math.nan
    fin = np.isfinite(a) & np.isfinite(e)
    if ((np.isinf(a) | np.isinf(e)) & ~(a == e)).any():
        return True, math.inf, math.nan
    err = float(np.abs(a[fin] - e[fin]).max(initial=0.0))
    scale = max(1.0, float(np.abs(e[fin]).max(initial=0.0)))
    return err > DIVERGENCE[dtype] * scale, err, scale


def past_ends_zeroed(arrays: dict, names, ends, axis: int = 2) -> dict:
    """`arrays` with each named buffer's positions (on `axis`: (B, H, S, d) by default) at or
    past `ends[b]` set to 0 in sequence b (a static cache's buffers, which a model may leave
    undefined past each sequence's written positions); the other arrays as they are."""
    out = dict(arrays)
    for name in names:
        if name in arrays:
            a = np.array(arrays[name], copy=True)
            for b, end in enumerate(np.asarray(ends).reshape(-1)):
                at: list = [slice(None)] * a.ndim
                at[0], at[axis] = b, slice(int(end), None)
                a[tuple(at)] = 0
            out[name] = a
    return out
