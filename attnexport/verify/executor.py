"""The one way verify runs a row, whichever mode planned it (golden cases, model files, a user's
module, a language model and its clients): the work timed by the one timing loop
(`runtimes.time_calls`), a failure to run recorded as the row's error, the outputs judged by the
row's one judgement (`Row.judge`: every declared output compared, placement, a run that compared
nothing fails), the first diverging node named under one policy, and the run compared with a
known-good baseline.

A mode plans; the executor runs. Each planned row comes with three things of its own: `work`
(what runs, on a runtime the plan prepared), `judge` (the comparisons of what the work returned)
and, where there is a graph to look inside, `locate` (its first diverging node)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnexport import baseline as B
from attnexport import files as F
from attnexport import runtimes as R
from attnexport.compare import Comparison
from attnexport.errors import UsageError, reason
from attnexport.localize import Localization
from attnexport.report import Report, Row
from attnexport.verify.request import Checking

AUTO_LOCALIZE_LIMIT = 20  # failing runs localized without --localize, per verify call


class Executor:
    """Runs the rows of one verify call and keeps them, as `checking` (a request's Checking) says.

    Its `strict_placement`: a compute node an accelerated runtime left on the CPU fails the row.
    `localize`: every run with a graph is localized, and a divergence fails it; otherwise failing
    runs are, up to `auto_localize` of them. `baseline`: a folder of a known-good run
    (`attnexport.baseline`) every run is compared with, failing where an output's error grew more
    than `max_growth` times; `save_baseline`: where `report` writes the runs as one.
    """

    def __init__(self, checking: Checking | None = None, auto_localize: int = AUTO_LOCALIZE_LIMIT):
        checking = checking or Checking()
        growth = checking.max_growth
        if not (isinstance(growth, (int, float)) and math.isfinite(growth) and growth >= 1):
            raise UsageError(f"--max-growth must be a finite number >= 1, got {growth}")
        self.checking, self.auto_localize = checking, auto_localize
        self.entries = B.load(checking.baseline) if checking.baseline is not None else None
        if checking.save_baseline is not None:  # before any work: the folder must be writable
            F.resolve_target(Path(checking.save_baseline) / B.MANIFEST, new_folder=True)
        self.rows: list[Row] = []
        self.localized = 0

    def run(self, row: Row, work: Callable[[], Any] | None, judge: Callable[[Any], list[Comparison]], *,
            cpu_nodes=(), warmup: int = 0, iters: int = 1,
            locate: Callable[[Any], Localization | None] | None = None) -> Any:
        """Runs `work` for `row` (`warmup` untimed calls, then `iters` timed ones: the median is the
        row's time), judges what the last call returned with `judge` (which may also set the row's
        error and detail: a row with an error never passes), names the first diverging node with
        `locate(result)` under the policy, and checks the baseline. Returns the work's result, None
        when it did not run (a row skipped or failed before running, or a run that raised). `work`
        is None only for a row skipped or failed before running."""
        self.rows.append(row)
        if row.skipped:
            return None
        got = None
        if not row.error:
            if work is None:
                raise ValueError(f"{row.case} on {row.runtime}: nothing to run, and the row says not why")
            results: list = []
            try:
                times = R.time_calls(lambda: results.append(work()), warmup, iters)
            except Exception as e:  # noqa: BLE001 - a runtime failing on a model is a verification failure
                row.error = reason(e)
            else:
                got, row.median_ms = results[-1], statistics.median(times)
                if isinstance(got, dict):  # outputs by name: kept for the baseline
                    row.arrays = got
                row.judge(judge(got), cpu_nodes, self.checking.strict_placement)
                row.passed = row.passed and not row.error
        if locate is not None and (self.checking.localize or (not row.passed and self.localized < self.auto_localize)):
            self._localize(row, locate, got)
        if self.entries is not None and not row.skipped:
            row.baseline = B.check(row, self.entries.get(B.key(row.case, row.flavor, row.runtime)),
                                   self.checking.max_growth)
            row.passed = row.passed and row.baseline["passed"]
        return got

    def record(self, row: Row) -> Row:
        """Keeps a row judged without a runtime (a file's parameters, its quantized weights)."""
        self.rows.append(row)
        return row

    def _localize(self, row: Row, locate, got) -> None:
        try:
            found = locate(got)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            found = Localization(note=f"localization failed: {reason(e)}")
        if found is None:  # nothing to look inside for this run
            return
        self.localized += 1
        row.localization = found
        if found.kind == "overflow" and found.node:  # its own named failure, whatever the numbers were compared with
            row.passed = False
            row.error = row.error or f"overflow in {row.dtype}: {found.output} of {found.op_type} node {found.node!r}"
        if self.checking.localize and found.diverged and row.passed:
            row.passed = False
            row.error = "intermediate values diverge from the export (--localize)"

    def report(self, runtimes: list[dict], dtype: str, flavors: list[str], models: list[str]) -> Report:
        """The report of every row run, the baseline written where asked (`save_baseline`)."""
        report = Report(self.rows, runtimes, dtype, flavors, models,
                        baseline=None if self.checking.baseline is None else str(self.checking.baseline))
        if self.checking.save_baseline is not None:
            report.saved_baseline = str(B.save(self.rows, self.checking.save_baseline))
        return report
