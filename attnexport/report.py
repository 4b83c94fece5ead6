"""What verify reports: a row per run (a case on one flavour and runtime, with each output's
comparison) and the report of a whole call, with the versions and the machine it ran on."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from attnexport import __version__
from attnexport import runtimes as R
from attnexport.compare import Comparison, Tolerance
from attnexport.localize import Localization


@dataclass
class Row:
    case: str
    variant: str
    flavor: str
    runtime: str
    dtype: str
    model: str = ""
    passed: bool = False
    comparisons: list[Comparison] = field(default_factory=list)
    tolerance: Tolerance | None = None
    median_ms: float | None = None
    expected_kind: str = "golden"
    cpu_nodes: list[str] = field(default_factory=list)
    error: str = ""
    skipped: str = ""  # why this flavour does not apply to the case's options (not a failure)
    localization: Localization | None = None
    baseline: dict | None = None
    detail: dict | None = None  # what a check adds (a generation's tokens and its error per step)
    # Kept for baselines and localization; not serialized.
    inputs: dict = field(default_factory=dict, repr=False)
    expected: dict = field(default_factory=dict, repr=False)
    arrays: dict = field(default_factory=dict, repr=False)

    def judge(self, comparisons: list[Comparison], cpu_nodes=(), strict: bool = False) -> Row:
        """The one judgement of a run, whichever check made it: its comparisons (every declared
        output against what was expected; NaN never passes), a run that compared nothing fails,
        and the compute nodes an accelerated runtime left on the CPU are recorded, a failure with
        `strict` (--strict-placement). Returns the row."""
        self.comparisons, self.cpu_nodes = list(comparisons), list(cpu_nodes)
        if not self.comparisons:
            self.passed, self.error = False, "compared nothing: no output was declared or produced"
            return self
        self.passed = all(c.passed for c in self.comparisons)
        if strict and self.cpu_nodes:
            self.passed = False
            self.error = f"{len(self.cpu_nodes)} node(s) ran on the CPU: {', '.join(self.cpu_nodes[:5])}"
        return self

    @property
    def label(self) -> str:
        return f"{self.model}:{self.case}" if self.model else self.case

    @property
    def worst(self) -> Comparison | None:
        """The failing comparison if any, else the one with the largest error."""
        bad = [c for c in self.comparisons if not c.passed]
        ranked = bad or sorted(self.comparisons, key=lambda c: -c.max_abs)
        return ranked[0] if ranked else None

    def describe(self, localization: bool = True) -> str:
        where = f"{self.label} / {self.flavor} / {self.runtime}"
        if self.skipped:
            return f"{where}: not applicable: {self.skipped}"
        text = f"{where}: {self.error}" if self.error else None
        if text is None:
            c = self.worst
            if c is None:
                text = f"{where}: compared nothing"
            elif c.problem:
                text = f"{where}: {c.name}: {c.problem}"
            else:
                basis = f" ({c.basis})" if c.basis and c.basis != "policy" else ""
                text = (f"{where}: {c.name} max abs {c.max_abs:.3g} at {list(c.argmax)}, max rel {c.max_rel:.3g}, "
                        f"tolerance rtol={c.rtol:g} atol={c.atol:g}{basis}, needs atol>={c.needed_atol:.3g}")
        if self.baseline and not self.baseline["passed"]:
            text += f"; baseline: {self.baseline['problem']}"
        if localization and self.localization is not None and self.localization.diverged:
            text += f"; localized: {self.localization.describe()}"
        return text

    def to_dict(self) -> dict:
        return {"case": self.case, "model": self.model, "variant": self.variant, "flavor": self.flavor,
                "runtime": self.runtime, "dtype": self.dtype, "passed": self.passed,
                "outputs": [c.to_dict() for c in self.comparisons],
                "tolerance": None if self.tolerance is None else vars(self.tolerance).copy(),
                "median_ms": self.median_ms, "expected": self.expected_kind, "cpu_nodes": self.cpu_nodes,
                "error": self.error, "skipped": self.skipped,
                "localization": None if self.localization is None else self.localization.to_dict(),
                "baseline": self.baseline, **({"detail": self.detail} if self.detail else {})}


@dataclass
class Report:
    rows: list[Row]
    runtimes: list[dict]  # name, available, reason, used
    dtype: str
    flavors: list[str]
    models: list[str]
    baseline: str | None = None
    saved_baseline: str | None = None
    resources: dict | None = None  # a whole model's verify: wall time and resident memory (usage.Meter)
    resources_line: str = ""

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed and not r.skipped]

    @property
    def ok(self) -> bool:
        return not self.failures and any(r.passed for r in self.rows)

    def summary(self) -> dict:
        by: dict[str, dict] = {}
        for r in self.rows:
            s = by.setdefault(r.runtime, {"passed": 0, "failed": 0, "not_applicable": 0, "total": 0,
                                          "time_ms": 0.0})
            s["total"] += 1
            s["not_applicable" if r.skipped else "passed" if r.passed else "failed"] += 1
            s["time_ms"] += r.median_ms or 0.0
        return {"passed": sum(r.passed for r in self.rows), "failed": len(self.failures),
                "not_applicable": sum(bool(r.skipped) for r in self.rows), "total": len(self.rows),
                "ok": self.ok, "by_runtime": by}

    def to_dict(self) -> dict:
        return {"attnexport": __version__, "dtype": self.dtype, "flavors": self.flavors, "models": self.models,
                "baseline": self.baseline, "saved_baseline": self.saved_baseline,
                "versions": versions(), "device": device(), "runtimes": self.runtimes,
                "summary": self.summary(), "results": [r.to_dict() for r in self.rows],
                **({"resources": self.resources} if self.resources is not None else {})}


def versions() -> dict:
    import onnxruntime
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__}


def device() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cuda = R.status("torch-cuda")
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": cuda.reason if cuda.available else None,
            "platform": platform.platform()}
