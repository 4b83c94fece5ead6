"""baseline: what a known-good run had, saved with a manifest, and the growth check against it."""

import pytest

from attnexport import baseline as B
from attnexport import verify as VF
from attnexport.errors import GoldenIntegrityError, UsageError


@pytest.fixture(scope="module")
def rows():
    return VF.verify(cases=["mha-seeded"], flavors=["primitives"], runtimes=["ort-cpu"]).rows


def test_save_load_and_a_run_that_did_not_grow_passes(rows, tmp_path):
    folder = B.save(rows, tmp_path / "base")
    entries = B.load(folder)
    row = rows[0]
    entry = entries[B.key(row.case, row.flavor, row.runtime)]
    result = B.check(row, entry, max_growth=10)
    assert result["passed"] and result["outputs"][0]["growth"] == pytest.approx(1.0)
    assert result["outputs"][0]["drift_from_baseline"] == 0.0


def test_growth_beyond_the_limit_fails_and_says_by_how_much(rows, tmp_path):
    """Growth is the error now over the baseline's, which counts as at least one fp32 ulp of the
    output's scale (an exact baseline must not make every rounding an infinite growth)."""
    row = rows[0]
    entry = B.load(B.save(rows, tmp_path / "base"))[B.key(row.case, row.flavor, row.runtime)]
    now = row.comparisons[0].max_abs
    floor = B.EPS["fp32"] * max(1.0, entry.meta["scales"]["output"])
    entry.meta["errors"]["output"] = 0.0  # an exact baseline: growth against the floor
    result = B.check(row, entry, max_growth=1e6)
    assert result["passed"] and result["outputs"][0]["growth"] == pytest.approx(now / floor)
    grown = now / floor  # what the check measured against the exact baseline
    result = B.check(row, entry, max_growth=grown / 2)
    assert not result["passed"] and "output error grew" in result["problem"]
    assert f"--max-growth {grown / 2:g}" in result["problem"]
    assert B.check(row, None, 10)["problem"] == "no baseline entry for this run"


def test_a_damaged_baseline_file_is_caught(rows, tmp_path):
    folder = B.save(rows, tmp_path / "base")
    victim = next(p for p in folder.glob("*.npz"))
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises((GoldenIntegrityError, UsageError)):
        B.load(folder)
