"""verify's one executor: how a row is run, timed, judged, localized and held to a baseline, the
same for every mode; and --localize, --baseline and --save-baseline taken by `verify --module`,
which runs through it (before, the module and language-model checks ignored them)."""

import json
import math

import numpy as np
import pytest
from conftest import cli as _run

from attnexport.compare import compare, tolerance
from attnexport.errors import UsageError
from attnexport.localize import Localization
from attnexport.report import Row
from attnexport.verify.executor import Executor
from attnexport.verify.request import Checking

TOL = tolerance("fp32")


def _row(name="case", runtime="ort-cpu") -> Row:
    return Row(name, "v", "ort", runtime, "fp32", inputs={"x": np.ones(2)}, expected={"y": np.ones(2)})


def _judge(got):
    return [compare("y", got["y"], np.ones(2), TOL)]


def test_a_run_is_timed_warmed_judged_and_its_outputs_kept():
    calls = []

    def work():
        calls.append(1)
        return {"y": np.ones(2)}
    ex = Executor()
    row = _row()
    got = ex.run(row, work, _judge, warmup=2, iters=3)
    assert len(calls) == 5 and got is row.arrays and row.passed
    assert row.median_ms is not None and row.median_ms >= 0 and ex.rows == [row]
    assert [c.name for c in row.comparisons] == ["y"]


def test_a_failing_run_a_run_that_compared_nothing_and_a_judged_error_all_fail():
    ex = Executor()
    raised = _row("raised")
    assert ex.run(raised, lambda: 1 / 0, _judge) is None
    assert not raised.passed and "ZeroDivisionError" in raised.error and raised.median_ms is None
    nothing = _row("nothing")
    ex.run(nothing, lambda: {}, lambda got: [])
    assert not nothing.passed and "compared nothing" in nothing.error
    said = _row("said")

    def judge(got):  # its comparisons pass, but the check found something else wrong (tokens differ)
        said.error = "sequence 0, step 3: another token"
        return _judge(got)
    ex.run(said, lambda: {"y": np.ones(2)}, judge)
    assert said.comparisons[0].passed and not said.passed
    nan = _row("nan")
    ex.run(nan, lambda: {"y": np.array([1.0, math.nan])}, _judge)
    assert not nan.passed


def test_a_row_skipped_or_failed_before_running_is_not_run():
    ex = Executor()
    skipped, known = _row("skipped"), _row("known")
    skipped.skipped, known.error = "the flavour has no such op", "the parameters changed"
    for row in (skipped, known):
        assert ex.run(row, None, _judge) is None
    assert not known.passed and known.error == "the parameters changed" and ex.rows == [skipped, known]
    with pytest.raises(ValueError, match="nothing to run"):
        ex.run(_row(), None, _judge)


def _diverged(_):
    return Localization(node="n1", op_type="MatMul", output="o", error=1.0, scale=1.0)


def test_failing_runs_are_localized_up_to_the_limit_and_passing_ones_only_with_localize():
    ex = Executor(auto_localize=2)
    rows = [_row(f"bad {i}") for i in range(3)]
    for row in rows:
        ex.run(row, lambda: {"y": np.zeros(2)}, _judge, locate=_diverged)
    assert [r.localization is not None for r in rows] == [True, True, False]
    good = _row("good")
    ex.run(good, lambda: {"y": np.ones(2)}, _judge, locate=_diverged)
    assert good.passed and good.localization is None
    # --localize: every run, and a divergence fails a run whose outputs passed.
    ex = Executor(Checking(localize=True))
    good = _row("good")
    ex.run(good, lambda: {"y": np.ones(2)}, _judge, locate=_diverged)
    assert not good.passed and "diverge" in good.error and good.localization.node == "n1"
    # A localization that fails is reported as a note, and the run's verdict stands.
    clean = _row("clean")
    ex.run(clean, lambda: {"y": np.ones(2)}, _judge, locate=lambda _: 1 / 0)
    assert clean.passed and "localization failed" in clean.localization.note


def test_max_growth_is_checked_once_for_every_mode(tmp_path):
    for bad in (0.5, math.inf, math.nan):
        with pytest.raises(UsageError, match="--max-growth"):
            Executor(Checking(max_growth=bad))


def test_the_baseline_holds_every_row_that_compared_something(tmp_path):
    """Rows without output arrays (a language model's accuracy, generation's tokens) are kept by
    their comparisons, and a later run is held to them."""
    ex = Executor(Checking(save_baseline=tmp_path / "b"))
    kl = Row("accuracy", "v", "-", "ort-cpu", "fp32")
    ex.run(kl, lambda: 0.001,
           lambda got: [compare("mean KL", np.array(got), np.array(0.0), tolerance("fp32", 0, 0.01))])
    ex.report([], "fp32", [], [])
    again = Executor(Checking(baseline=tmp_path / "b", max_growth=10))
    grown = Row("accuracy", "v", "-", "ort-cpu", "fp32")
    again.run(grown, lambda: 0.05, lambda got: [compare("mean KL", np.array(got), np.array(0.0),
                                                        tolerance("fp32", 0, 0.1))])
    assert grown.comparisons[0].passed and not grown.passed
    assert "mean KL error grew 50x" in grown.baseline["problem"]


def test_a_row_that_fails_on_its_own_fails_whatever_its_baseline_says(tmp_path):
    """The baseline adds a reason to fail, never a reason to pass: a run whose output is over its
    tolerance fails even where the baseline recorded the same error (no growth)."""
    ex = Executor(Checking(save_baseline=tmp_path / "b"))
    ex.run(_row(), lambda: {"y": np.full(2, 1.5)}, _judge)
    ex.report([], "fp32", [], [])
    again = Executor(Checking(baseline=tmp_path / "b"))
    row = _row()
    again.run(row, lambda: {"y": np.full(2, 1.5)}, _judge)
    assert row.baseline["passed"] and row.baseline["outputs"][0]["growth"] == pytest.approx(1.0)
    assert not row.comparisons[0].passed and not row.passed


def test_verify_module_takes_localize_and_a_baseline(tmp_path):
    spec = "examples/causal_self_attention.py:example"
    path = tmp_path / "m.onnx"
    assert _run("export", "--module", spec, "-o", path).exit_code == 0
    r = _run("verify", path, "--module", spec, "--runtimes", "torch,ort-cpu", "--localize", "--save-baseline",
             tmp_path / "b", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    onnx_rows = [row for row in rows if row["runtime"] == "ort-cpu"]
    assert len(onnx_rows) == 4 and all(row["localization"] is not None and row["localization"]["compared"] > 0
                                       for row in onnx_rows)
    assert all(row["localization"] is None for row in rows if row["runtime"] == "torch")  # no graph to look inside
    saved = json.loads((tmp_path / "b" / "MANIFEST.json").read_text())["files"]
    assert len(saved) == len(rows)
    r = _run("verify", path, "--module", spec, "--runtimes", "torch,ort-cpu", "--baseline", tmp_path / "b", "--json")
    assert r.exit_code == 0, r.output
    assert all(row["baseline"]["passed"] for row in json.loads(r.output)["results"])
    # A run the baseline does not hold fails: the baseline is read.
    r = _run("verify", path, "--module", spec, "--runtimes", "onnx-ref", "--baseline", tmp_path / "b", "--json")
    assert r.exit_code == 1
    assert {row["baseline"]["problem"] for row in json.loads(r.output)["results"]} == {"no baseline entry for this run"}
