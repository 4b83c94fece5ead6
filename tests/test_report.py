"""attnexport.report: rows and reports, as the table and --json show them."""

import json

import numpy as np

from attnexport.compare import compare, tolerance
from attnexport.report import Report, Row


def _row(passed_values: bool, **kw):
    got = np.zeros(3) if passed_values else np.array([0.0, 0.5, 0.0])
    row = Row("case", "mha", "attention", "ort-cpu", "fp32", **kw)
    row.comparisons = [compare("output", got, np.zeros(3), tolerance("fp32"))]
    row.passed = all(c.passed for c in row.comparisons)
    return row


def test_a_report_passes_only_when_some_run_passed_and_none_failed():
    good, bad = _row(True), _row(False)
    skipped = Row("case", "mha", "ort", "ort-cpu", "fp32", skipped="no softcap")
    assert Report([good, skipped], [], "fp32", ["attention"], []).ok
    assert not Report([good, bad], [], "fp32", ["attention"], []).ok
    assert not Report([skipped], [], "fp32", ["ort"], []).ok  # nothing compared is not a pass
    assert not Report([], [], "fp32", [], []).ok


def test_a_failing_row_says_where_how_much_and_what_tolerance_it_needs():
    text = _row(False).describe()
    assert text.startswith("case / attention / ort-cpu: output max abs 0.5 at [1]")
    assert "tolerance rtol=0.0001 atol=1e-05, needs atol>=0.5" in text
    assert _row(True, model="m.onnx").label == "m.onnx:case"


def test_the_summary_counts_by_runtime_and_the_dict_is_json():
    rows = [_row(True, median_ms=2.0), _row(False, median_ms=3.0),
            Row("c", "mha", "ort", "ort-cpu", "fp32", skipped="n/a")]
    report = Report(rows, [{"name": "ort-cpu"}], "fp32", ["attention"], [])
    s = report.summary()
    assert (s["passed"], s["failed"], s["not_applicable"], s["total"]) == (1, 1, 1, 3)
    assert s["by_runtime"]["ort-cpu"]["time_ms"] == 5.0
    doc = json.loads(json.dumps(report.to_dict()))
    assert [r["passed"] for r in doc["results"]] == [True, False, False]
    assert doc["results"][1]["outputs"][0]["max_abs"] == 0.5


def test_every_check_judges_a_run_the_same_way():
    """Row.judge, which verify's golden, model, module, decode and language-model rows all end
    with: a run that compared nothing fails, NaN never passes, and nodes an accelerated runtime
    left on the CPU are kept, failing the row only when placement is strict."""
    tol = tolerance("fp32")
    want = np.ones((2, 3))
    row = Row("c", "mha", "ort", "ort-cuda", "fp32").judge([])
    assert not row.passed and row.error.startswith("compared nothing")
    nan = Row("c", "mha", "ort", "ort-cuda", "fp32").judge([compare("output", np.full((2, 3), np.nan), want, tol)])
    assert not nan.passed
    good = [compare("output", want + 1e-9, want, tol)]
    loose = Row("c", "mha", "ort", "ort-cuda", "fp32").judge(good, ["Softmax:s"])
    assert loose.passed and loose.cpu_nodes == ["Softmax:s"] and not loose.error
    strict = Row("c", "mha", "ort", "ort-cuda", "fp32").judge(good, ["Softmax:s"], strict=True)
    assert not strict.passed and "1 node(s) ran on the CPU: Softmax:s" in strict.error
