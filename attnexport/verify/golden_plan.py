"""Planning golden mode: every selected golden case, exported in every selected flavour, on
every runtime against its stored expected outputs (and the decode checks of cache cases)."""

from __future__ import annotations

from attnexport import export as E
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.verify.decode_checks import golden_decode_checks
from attnexport.verify.run import ModelSource, Step, case_tolerance

# --- planning ----------------------------------------------------------------------------------

def plan_golden(cases, flavors, used, dtype, rtol, atol) -> list[Step]:
    plan = []
    for case in cases:
        variant = V.get(case.variant)
        tol = case_tolerance(variant, case.params, case.inputs, case.options, case.expected, dtype, rtol, atol)
        checks = [(case, case.expected, "golden", tol, 0)]
        checks += golden_decode_checks(variant, case, case.params, dtype, rtol, atol)
        for c, expected, kind, t, chunk in checks:
            for rt in used:
                if R.runs_module(rt):
                    plan.append(Step(c, "-", rt, dtype, t, expected, kind, case.params, decode_chunk=chunk))
        for flavor in flavors:
            source = ModelSource(case.variant, case.options, E.graph_flavor(variant, flavor), None, dtype,
                                 case.params)
            for c, expected, kind, t, chunk in checks:
                for rt in used:
                    if rt in R.ONNX_RUNTIMES:
                        plan.append(Step(c, flavor, rt, dtype, t, expected, kind, case.params, source,
                                         decode_chunk=chunk))
    return plan
