"""verify: run golden cases through every flavour and runtime, compare in float64, time, report."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from attnexport import __version__, golden
from attnexport import export as E
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.compare import compare, tolerance
from attnexport.errors import AttnExportError, ProviderUnavailableError, UnsupportedByFlavor, UsageError


@dataclass
class Row:
    case: str
    variant: str
    flavor: str  # "-" for the torch runtimes, which run the module itself
    runtime: str
    dtype: str
    passed: bool
    outputs: list[dict] = field(default_factory=list)  # Comparison.to_dict() per output
    median_ms: float | None = None
    expected: str = "golden"  # or "reference" when recomputed for a model's own parameters
    cpu_nodes: list[str] = field(default_factory=list)
    error: str = ""
    skipped: str = ""  # why this flavour does not apply to the case's options (not a failure)

    @property
    def worst(self) -> dict | None:
        return max(self.outputs, key=lambda c: c["max_abs"], default=None)

    def describe(self) -> str:
        where = f"{self.case} / {self.flavor} / {self.runtime}"
        if self.skipped:
            return f"{where}: not applicable: {self.skipped}"
        if self.error:
            return f"{where}: {self.error}"
        bad = [c for c in self.outputs if not c["passed"]]
        c = (bad or self.outputs)[0]
        if c["problem"]:
            return f"{where}: {c['name']}: {c['problem']}"
        return (f"{where}: {c['name']} max abs {c['max_abs']:.3g}, max rel {c['max_rel']:.3g}, "
                f"tolerance rtol={c['rtol']:g} atol={c['atol']:g}, needs atol>={c['needed_atol']:.3g}")


@dataclass
class Report:
    rows: list[Row]
    runtimes: list[dict]  # name, available, reason, used
    dtype: str
    flavors: list[str]
    models: list[str]

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed and not r.skipped]

    @property
    def ok(self) -> bool:
        return not self.failures and any(r.passed for r in self.rows)

    def summary(self) -> dict:
        by = {}
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
                "versions": versions(), "device": device(), "runtimes": self.runtimes,
                "summary": self.summary(), "results": [asdict(r) for r in self.rows]}


def versions() -> dict:
    import onnx
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


def parse_runtimes(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        if n not in R.RUNTIMES:
            raise UsageError(f"unknown runtime {n!r}; valid: {', '.join(R.RUNTIMES)}")
    return names


def parse_flavors(names: list[str] | None) -> list[str]:
    names = list(names or E.FLAVORS)
    for n in names:
        if n not in E.FLAVORS:
            raise UsageError(f"unknown flavor {n!r}; valid: {', '.join(E.FLAVORS)}")
    return names


def _select_runtimes(requested, skip_unavailable):
    """Returns (runtimes to use, status list). Asked-for and unavailable is an error unless skipped."""
    names = list(R.RUNTIMES) if requested is None else requested
    used, table = [], []
    for n in names:
        s = R.status(n)
        if not s.available and requested is not None and not skip_unavailable:
            raise ProviderUnavailableError(f"runtime {n} is not available: {s.reason} "
                                           f"(use --skip-unavailable to skip it)")
        table.append({"name": n, "available": s.available, "reason": s.reason, "used": s.available})
        if s.available:
            used.append(n)
    if not used:
        raise ProviderUnavailableError("none of the requested runtimes is available: "
                                       + "; ".join(f"{t['name']}: {t['reason']}" for t in table))
    return used, table


def _cast_feed(inputs: dict, dtype: str) -> dict:
    np_dtype = {"fp32": np.float32, "fp16": np.float16}[dtype]
    return {k: (a.astype(np_dtype) if a.dtype.kind == "f" else a) for k, a in inputs.items()}


def _compare_outputs(names, got, expected: dict, tol) -> list:
    results = []
    for name in expected:
        if name not in names:
            results.append({"name": name, "passed": False, "max_abs": float("inf"), "max_rel": float("inf"),
                            "nan_diff": 0, "inf_diff": 0, "rtol": tol.rtol, "atol": tol.atol,
                            "needed_atol": float("inf"), "needed_rtol": float("inf"),
                            "problem": "output missing"})
            continue
        results.append(compare(name, got[names.index(name)], expected[name], tol).to_dict())
    return results


def _run_row(case, flavor, runtime, prepared, feed, names, expected, tol, dtype, expected_kind, strict):
    row = Row(case.name, case.variant, flavor, runtime, dtype, False, expected=expected_kind)
    try:
        got, ms = prepared.timed(feed, warmup=1, iters=3 if runtime == "onnx-ref" else 5)
    except Exception as e:  # noqa: BLE001 - a runtime failing on a model is a verification failure
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    row.median_ms = ms
    row.outputs = _compare_outputs(names, got, expected, tol)
    row.cpu_nodes = prepared.cpu_nodes
    row.passed = all(c["passed"] for c in row.outputs)
    if strict and row.cpu_nodes:
        row.passed = False
        row.error = f"{len(row.cpu_nodes)} node(s) ran on the CPU: {', '.join(row.cpu_nodes[:5])}"
    return row


def verify(variants: list[str] | None = None, flavors: list[str] | None = None,
           runtimes: list[str] | None = None, dtype: str = "fp32", golden_dir: str | Path | None = None,
           models: list[str | Path] | None = None, rtol: float | None = None, atol: float | None = None,
           skip_unavailable: bool = False, strict_placement: bool = False, model_variant: str | None = None,
           model_options: dict | None = None, seed: int = 0,
           progress: Callable[[int, int, str], None] | None = None) -> Report:
    """Runs golden cases on the selected flavours and runtimes; returns a report (never raises on a
    mismatch: `report.ok` says whether everything passed)."""
    if dtype not in E.DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; valid: {', '.join(E.DTYPES)}")
    for name in variants or []:
        V.get(name)
    flavors = parse_flavors(flavors)
    used, table = _select_runtimes(runtimes, skip_unavailable)
    tol = tolerance(dtype, rtol, atol)
    if models:
        plan = _plan_models(models, used, golden_dir, model_variant, model_options, seed)
        flavors_used = sorted({p[1] for p in plan})
    else:
        cases = golden.load_all(golden_dir, variants)
        if not cases:
            raise UsageError(f"no golden cases for {', '.join(variants or [])}")
        plan = _plan_golden(cases, flavors, used)
        flavors_used = flavors
    rows = []
    for i, step in enumerate(plan):
        if progress:
            progress(i, len(plan), f"{step[0].name} {step[1]} {step[2]}")
        rows.append(_execute(step, tol, dtype, strict_placement))
    if progress:
        progress(len(plan), len(plan), "done")
    return Report(rows, table, dtype, flavors_used, [str(m) for m in models or []])


# A plan step: (case, flavor, runtime, how to prepare, expected outputs, expected kind)

def _plan_golden(cases, flavors, used):
    plan = []
    for case in cases:
        variant = V.get(case.variant)
        for rt in used:
            if rt.startswith("torch"):
                plan.append((case, "-", rt, ("module", case.params), case.expected, "golden"))
        for flavor in flavors:
            gf = E.graph_flavor(variant, flavor)
            for rt in used:
                if rt in R.ONNX_RUNTIMES:
                    plan.append((case, flavor, rt, ("export", gf), case.expected, "golden"))
    return plan


def _execute(step, tol, dtype, strict):
    case, flavor, rt, how, expected, kind = step
    variant = V.get(case.variant)
    names = [s.name for s in variant.outputs(case.options)]
    try:
        if how[0] == "module":
            prepared = R.prepare_torch(rt, variant, case.options, how[1], dtype)
        else:
            model = _model_for(case, how, dtype)
            prepared = R.prepare_onnx(rt, model, dtype)
    except UnsupportedByFlavor as e:
        return Row(case.name, case.variant, flavor, rt, dtype, False, skipped=str(e), expected=kind)
    except AttnExportError as e:
        if isinstance(e, ProviderUnavailableError):
            raise
        return Row(case.name, case.variant, flavor, rt, dtype, False, error=str(e), expected=kind)
    except Exception as e:  # noqa: BLE001 - a model a runtime cannot load fails verification
        return Row(case.name, case.variant, flavor, rt, dtype, False, expected=kind,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    feed = _cast_feed(case.inputs, dtype)
    return _run_row(case, flavor, rt, prepared, feed, names, expected, tol, dtype, kind, strict)


_EXPORTS: dict = {}


def _model_for(case, how, dtype):
    if how[0] == "model":
        return how[1]
    gf = how[1]
    key = (case.name, json.dumps(case.options, sort_keys=True), gf, dtype,
           hash(tuple(sorted((k, v.tobytes()) for k, v in case.params.items()))))
    if key not in _EXPORTS:
        try:
            _EXPORTS[key] = E.build_model(case.variant, case.options, gf, dtype=dtype, params=case.params)[0]
        except UnsupportedByFlavor as e:
            _EXPORTS[key] = e  # the same answer for every runtime, without exporting again
    if isinstance(_EXPORTS[key], Exception):
        raise _EXPORTS[key]
    return _EXPORTS[key]


# --- model files -----------------------------------------------------------------------------

_PROBE_SIZES = ({"batch": 2, "seq": 7, "kv_seq": 5}, {"batch": 1, "seq": 1, "kv_seq": 1})


def _seeded_case(variant, options, sizes, i):
    o = variant.resolve({**options, **{k: v for k, v in sizes.items() if k in variant.dynamic}})
    name = f"seeded-{'x'.join(str(o[k]) for k in ('batch', 'seq') if k in o)}"
    return golden.GoldenCase(name, variant.name, o, V.make_inputs(variant, o, 1000 + i), {}, {},
                             {"source": "seeded inputs (no stored golden case has these options)"})


def _plan_models(models, used, golden_dir, model_variant, model_options, seed):
    from attnexport.inspect import attnexport_metadata, load_model
    plan = []
    for path in models:
        model = load_model(path)
        meta = attnexport_metadata(model)
        if meta.get("variant"):
            variant = V.get(meta["variant"])
            options = meta["options"]
            seed_ = int(meta.get("seed", 0))
            flavor = meta.get("flavor", "?")
        elif model_variant:
            variant = V.get(model_variant)
            options = variant.resolve(model_options or {})
            seed_, flavor = seed, "external"
        else:
            raise UsageError(f"{path} has no attnexport metadata: name its variant (--variant) and options "
                             "to compare it with the torch module")
        static = {k: v for k, v in options.items() if k not in variant.dynamic}
        cases = [c for c in golden.load_all(golden_dir, [variant.name])
                 if {k: v for k, v in c.options.items() if k not in variant.dynamic} == static]
        if not cases:
            # No stored case has these options (e.g. --heads 8): seeded inputs at two shapes,
            # one of length 1, with the reference computing the expected outputs.
            cases = [_seeded_case(variant, options, sizes, i) for i, sizes in enumerate(_PROBE_SIZES)]
        params = V.init_params(variant, options, seed_)
        for case in cases:
            same = set(params) == set(case.params) and all(np.array_equal(params[k], case.params[k]) for k in params)
            if same:
                expected, kind = case.expected, "golden"
            else:
                # The model has its own (seeded) parameters: the float64 reference recomputes the
                # expected outputs for them on the golden inputs.
                expected = {k: np.asarray(v, np.float64)
                            for k, v in variant.reference(params, case.inputs, case.options).items()}
                kind = f"reference (parameters of seed {seed_})"
                if not case.params:
                    kind += ", seeded inputs"
            mcase = golden.GoldenCase(f"{Path(path).name}:{case.name}", case.variant, case.options,
                                      case.inputs, params, expected, case.meta)
            for rt in used:
                if rt.startswith("torch"):
                    plan.append((mcase, "-", rt, ("module", params), expected, kind))
                else:
                    plan.append((mcase, flavor, rt, ("model", model), expected, kind))
    return plan
