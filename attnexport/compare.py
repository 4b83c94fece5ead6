"""Tolerances as data, and comparisons of outputs against expected values in float64."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# The one place tolerances live. |actual - expected| <= atol + rtol * |expected|, elementwise.
TOLERANCES: dict[str, Tolerance] = {
    "fp64": Tolerance(rtol=1e-7, atol=1e-9),
    "fp32": Tolerance(rtol=1e-4, atol=1e-5),
    "fp16": Tolerance(rtol=1e-3, atol=2.5e-3),
    "bf16": Tolerance(rtol=1e-2, atol=2e-2),
}


def tolerance(dtype: str, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance for `dtype`, with optional per-run overrides."""
    base = TOLERANCES[dtype]
    return Tolerance(base.rtol if rtol is None else rtol, base.atol if atol is None else atol)


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
    problem: str = ""  # shape or dtype problem, or NaN

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.problem:
            return f"{self.name}: {verdict} ({self.problem})"
        return (f"{self.name}: {verdict} max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}; "
                f"tolerance rtol={self.rtol:g} atol={self.atol:g}; passes with atol>={self.needed_atol:.3g} "
                f"or rtol>={self.needed_rtol:.3g}")

    def to_dict(self) -> dict:
        return asdict(self)


def compare(name: str, actual, expected, tol: Tolerance) -> Comparison:
    """Compares in float64. NaN never passes; infinities must match exactly."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    nan_diff = int(np.isnan(a).sum() - np.isnan(e).sum())
    inf_diff = int(np.isinf(a).sum() - np.isinf(e).sum())
    if a.shape != e.shape:
        return Comparison(name, False, np.inf, np.inf, nan_diff, inf_diff, tol.rtol, tol.atol,
                          np.inf, np.inf, f"shape {a.shape} != expected {e.shape}")
    if np.isnan(a).any() or np.isnan(e).any():
        return Comparison(name, False, np.inf, np.inf, nan_diff, inf_diff, tol.rtol, tol.atol,
                          np.inf, np.inf, f"{int(np.isnan(a).sum())} NaN in actual, "
                          f"{int(np.isnan(e).sum())} in expected (NaN never passes)")
    same_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    if (np.isinf(a) | np.isinf(e))[~same_inf].any():
        return Comparison(name, False, np.inf, np.inf, nan_diff, inf_diff, tol.rtol, tol.atol,
                          np.inf, np.inf, "infinities differ")
    fin = ~same_inf
    err = np.abs(a - e)[fin]
    mag = np.abs(e)[fin]
    max_abs = float(err.max(initial=0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(mag > 0, err / mag, np.where(err > 0, np.inf, 0.0))
    max_rel = float(rel.max(initial=0.0))
    needed_atol = float(np.maximum(err - tol.rtol * mag, 0.0).max(initial=0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        need_r = np.where(err <= tol.atol, 0.0, np.where(mag > 0, (err - tol.atol) / mag, np.inf))
    needed_rtol = float(need_r.max(initial=0.0))
    passed = bool(np.all(err <= tol.atol + tol.rtol * mag))
    return Comparison(name, passed, max_abs, max_rel, nan_diff, inf_diff, tol.rtol, tol.atol,
                      needed_atol, needed_rtol)
