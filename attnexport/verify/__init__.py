"""verify: run golden cases through every flavour and runtime, compare in float64, localize, report.

Two modes share the execution and differ in planning:
- golden mode (no model files): every selected golden case is exported in every selected
  flavour and run on every runtime against its stored expected outputs;
- model mode: each file's variant, options, dtype and parameters are taken from the file itself
  (its metadata and its initializers, checked against the weight fingerprints of the export),
  and the golden cases with those options (or seeded inputs at two shapes) are run through it.
A run passes only when every output the variant declares was compared, by name, then shape,
then values; a run that compared nothing fails.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

from attnexport import dtypes as D
from attnexport import export as E
from attnexport import flavors as FL
from attnexport import golden
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.compare import check_tolerance_values
from attnexport.errors import UsageError
from attnexport.report import Report, Row
from attnexport.verify.execute import execute
from attnexport.verify.executor import Executor
from attnexport.verify.golden_plan import plan_golden
from attnexport.verify.model_plan import matching_cases, plan_model
from attnexport.verify.module_check import verify_module
from attnexport.verify.request import VerifyRequest
from attnexport.verify.run import quiet_numerics

__all__ = ["Report", "Row", "VerifyRequest", "matching_cases", "verify", "verify_module"]


@quiet_numerics
def verify(request: VerifyRequest | None = None, *, progress: Callable[[int, int, str], None] | None = None,
           **fields) -> Report:
    """Runs golden cases (or model files) on the selected flavours and runtimes; returns a report.

    Takes a VerifyRequest, or its fields as keywords (`verify(cases=["mha-seeded"])`). Never
    raises on a mismatch (`report.ok` says whether everything passed); raises a UsageError
    (exit 2) on bad input: an unknown name, a tolerance that is not finite, a model whose
    interface does not fit its variant, a `--variant`/`--flavor` that contradicts a model's
    metadata.
    """
    if request is not None and fields:
        raise TypeError("give a VerifyRequest or its fields, not both")
    r = request or VerifyRequest(**fields)
    variants, flavors, runtimes, dtype, golden_dir, models = \
        r.variants, r.flavors, r.runtimes, r.dtype, r.golden_dir, r.models
    rtol, atol, seed, cases = r.rtol, r.atol, r.seed, r.cases
    model_variant, model_options = r.model_variant, r.model_options
    if dtype is not None:
        D.check(dtype)
    check_tolerance_values(rtol, atol)
    for name in variants or []:
        V.get(name)
    if not models and (model_variant or model_options or seed is not None):
        raise UsageError("variant options and --seed describe a MODEL file without metadata: give the file")
    if models and variants:
        raise UsageError("give the variant of a model file with model_variant")
    flavors = FL.check_all(flavors)
    if models and len(flavors) > 1 and flavors != list(E.FLAVORS):
        raise UsageError("a model file has one flavor: give at most one --flavor")
    executor = Executor(r.checking)
    used, table = R.select(runtimes, r.skip_unavailable)
    if models:
        model_flavor = flavors[0] if flavors != list(E.FLAVORS) else None
        plan, dtypes = [], set()
        for path in models:
            steps, mdtype = plan_model(path, used, r, model_flavor)
            plan += steps
            dtypes.add(mdtype)
        flavors_used = sorted({s.flavor for s in plan if s.flavor != "-"})
        dtype = "/".join(sorted(dtypes))
    else:
        dtype = dtype or "fp32"
        loaded = golden.load_all(None if golden_dir is None else Path(golden_dir), variants)
        if cases:
            unknown = sorted(set(cases) - {c.name for c in loaded})
            if unknown:
                close = difflib.get_close_matches(unknown[0], [c.name for c in loaded], n=3, cutoff=0.5)
                hint = f"; close: {', '.join(close)}" if close else ""
                raise UsageError(f"no golden case {', '.join(unknown)}"
                                 + (f" among {', '.join(variants)}'s" if variants else "")
                                 + f"{hint} (`attnexport golden --list` lists them)")
            loaded = [c for c in loaded if c.name in cases]
        if not loaded:
            raise UsageError(f"no golden cases for {', '.join(variants or [])}")
        plan = plan_golden(loaded, flavors, used, dtype, rtol, atol)
        flavors_used = flavors
    for i, step in enumerate(plan):
        if progress:
            progress(i, len(plan), f"{step.case.name} {step.flavor} {step.runtime}")
        execute(step, executor)
    if progress:
        progress(len(plan), len(plan), "done")
    report = executor.report(R.described(table), dtype, flavors_used, [str(m) for m in models or []])
    return report
