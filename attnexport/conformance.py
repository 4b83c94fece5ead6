"""onnx's own node test cases for the Attention operator, as a conformance suite for `sdpa`.

The installed onnx package holds the cases (`onnx.backend.test.case.node.attention`): each builds
one Attention node, its inputs and the outputs onnx's reference implementation gives. Each case
is mapped to `sdpa` options (its attributes, its input shapes and which optional inputs and
outputs it has), its inputs and expected outputs renamed to sdpa's, and then run like any golden
case, by verify's own executor (`verify.execute`): exported in each flavour, executed on each
runtime, every output sdpa declares compared.

Run `python -m attnexport.conformance` for the counts per flavour and runtime.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from attnexport import export as E
from attnexport import files as F
from attnexport import jsonout
from attnexport import variants as V
from attnexport.compare import tolerance
from attnexport.errors import AttnExportError
from attnexport.golden import GoldenCase
from attnexport.report import Row
from attnexport.semantics import SOFTMAX_PRECISION_TYPES_BY_NAME, WEIGHT_MODES
from attnexport.verify.execute import execute
from attnexport.verify.executor import Executor
from attnexport.verify.run import ModelSource, Step, quiet_numerics

OPSETS = (23, 24)  # the Attention opsets attnexport exports; 25 adds sliding windows
# The operator's inputs and outputs by position, as sdpa names them.
INPUTS = ("query", "key", "value", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
OUTPUTS = ("output", "present_key", "present_value", "weights")
_DTYPES = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16"}


@dataclass(frozen=True)
class OnnxCase:
    name: str
    opset: int
    dtype: str  # fp32, fp16, or the case's own element type when out of scope
    options: dict  # sdpa options ({} when out of scope)
    inputs: dict = field(repr=False)  # by sdpa's input names
    expected: dict = field(repr=False)  # by sdpa's output names
    out_of_scope: str = ""  # why attnexport does not take this case ("" when it does)


def _collected() -> list[tuple]:
    """(name, node, inputs, outputs, opset) of every Attention case the installed onnx has."""
    module: Any = importlib.import_module("onnx.backend.test.case.node.attention")  # its `expect` is swapped
    found = []

    def expect(node, inputs, outputs, name, **kwargs):
        opsets = kwargs.get("opset_imports")
        opset = opsets[0].version if opsets else onnx.defs.get_schema(node.op_type).since_version
        found.append((name, node, list(inputs), list(outputs), opset))
    original = module.expect
    module.expect = expect
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            for attr in sorted(dir(module.Attention)):
                if attr.startswith("export"):
                    getattr(module.Attention, attr)()
    finally:
        module.expect = original
    return found


def load_cases() -> list[OnnxCase]:
    """Every Attention case of the installed onnx, mapped to sdpa (or said to be out of scope)."""
    return [_case(*c) for c in _collected()]


def _case(name, node, inputs, outputs, opset) -> OnnxCase:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    given = dict(zip([INPUTS[i] for i, n in enumerate(node.input) if n], inputs, strict=True))
    wanted = dict(zip([OUTPUTS[i] for i, n in enumerate(node.output) if n], outputs, strict=True))
    q = given["query"]
    dtype = _DTYPES.get(q.dtype, str(q.dtype))
    why = ""
    if opset not in OPSETS:
        why = f"opset {opset} (attnexport exports Attention at opsets {', '.join(map(str, OPSETS))})"
    elif dtype not in ("fp32", "fp16"):
        why = f"{q.dtype} inputs (attnexport exports fp32 and fp16)"
    if why:
        return OnnxCase(name, opset, dtype, {}, given, wanted, why)
    return OnnxCase(name, opset, dtype, _options(attrs, given, wanted), given, wanted)


def _options(attrs: dict, given: dict, wanted: dict) -> dict:
    q, k, v = given["query"], given["key"], given["value"]
    bsd = q.ndim == 3
    heads = attrs["q_num_heads"] if bsd else q.shape[1]
    kv_heads = attrs["kv_num_heads"] if bsd else k.shape[1]
    length = 1 if bsd else 2  # the sequence axis: (B, T, H*d) or (B, H, T, d)
    o = {"layout": "bsd" if bsd else "bhsd", "batch": q.shape[0], "heads": heads, "kv_heads": kv_heads,
         "seq": q.shape[length], "kv_seq": k.shape[length],
         "head_dim": q.shape[-1] // heads if bsd else q.shape[-1],
         "v_head_dim": v.shape[-1] // kv_heads if bsd else v.shape[-1],
         "causal": bool(attrs.get("is_causal", 0)), "softcap": float(attrs.get("softcap", 0.0))}
    if "scale" in attrs:
        o["scale"] = float(attrs["scale"])
    if "softmax_precision" in attrs:
        names = {t: n for n, t in SOFTMAX_PRECISION_TYPES_BY_NAME.items()}
        o["softmax_precision"] = names.get(attrs["softmax_precision"], f"type {attrs['softmax_precision']}")
    mask = given.get("attn_mask")
    if mask is not None:
        o["mask"] = "bool" if mask.dtype == np.bool_ else "float"
        o["mask_rank"] = mask.ndim
        if mask.ndim == 4:
            o["mask_batch"] = mask.shape[0]
        if mask.ndim >= 3:
            o["mask_heads"] = mask.shape[-3]
        total = k.shape[length] + (given["past_key"].shape[2] if "past_key" in given else 0)
        if mask.shape[-1] != total:
            o["mask_keys"] = mask.shape[-1]
    if "past_key" in given:
        o["kv_cache"], o["past_seq"] = True, given["past_key"].shape[2]
    if "nonpad_kv_seqlen" in given:
        o["nonpad"] = True
    if "weights" in wanted:
        o["weights"] = WEIGHT_MODES[attrs.get("qk_matmul_output_mode", 0)]
    return o


@dataclass
class Outcome:
    case: str
    flavor: str
    runtime: str
    status: str  # passed, failed, declined (the flavour cannot express the case, with the reason), error
    detail: str = ""


def plan(cases: list[OnnxCase], flavors=None, runtimes=("ort-cpu", "onnx-ref")) -> tuple[list[Step], list[Outcome]]:
    """verify's runs of the in-scope cases: each case in each flavour on each runtime, as a golden
    case of sdpa with the operator's own outputs expected (one export per graph: cases that differ
    only in sizes share it); and the outcomes known before running (a case sdpa cannot take)."""
    variant = V.get("sdpa")
    steps: list[Step] = []
    refused: list[Outcome] = []
    for case in cases:
        if case.out_of_scope:
            continue
        try:
            o = variant.resolve(case.options)
        except AttnExportError as e:
            refused += [Outcome(case.name, f, rt, "error", f"sdpa cannot take it: {e}")
                        for f in flavors or E.FLAVORS for rt in runtimes]
            continue
        as_golden = GoldenCase(case.name, "sdpa", o, case.inputs, {}, case.expected, {"source": "onnx"})
        tol = tolerance(case.dtype)
        for flavor in flavors or E.FLAVORS:
            source = ModelSource("sdpa", o, E.graph_flavor(variant, flavor), None, case.dtype, {})
            steps += [Step(as_golden, flavor, rt, case.dtype, tol, case.expected, "onnx's reference", {}, source)
                      for rt in runtimes]
    return steps, refused


def outcome(row: Row) -> Outcome:
    """A verify row as a conformance outcome: a case the flavour cannot express is declined (with
    the flavour's reason), a run that raised is an error, else passed or failed by the row's
    judgement (every output compared, NaN never passes)."""
    if row.skipped:
        return Outcome(row.case, row.flavor, row.runtime, "declined", row.skipped)
    if row.error and not row.comparisons:
        return Outcome(row.case, row.flavor, row.runtime, "error", row.error)
    bad = [str(c) for c in row.comparisons if not c.passed]
    return Outcome(row.case, row.flavor, row.runtime, "passed" if row.passed else "failed",
                   "; ".join(bad) or row.error)


@quiet_numerics
def run(cases: list[OnnxCase], flavors=None, runtimes=("ort-cpu", "onnx-ref")) -> list[Outcome]:
    """Runs each in-scope case in each flavour on each runtime through verify's executor (the one
    that runs the golden cases) and says how each went."""
    steps, refused = plan(cases, flavors, runtimes)
    executor = Executor(auto_localize=0)  # an outcome is a status, not a diagnosis
    return refused + [outcome(execute(step, executor)) for step in steps]


def counts(outcomes: list[Outcome]) -> dict:
    """{flavor: {runtime: {status: count}}}."""
    table: dict = {}
    for o in outcomes:
        by = table.setdefault(o.flavor, {}).setdefault(o.runtime, {})
        by[o.status] = by.get(o.status, 0) + 1
    return table


def main(argv=None) -> int:
    """Prints the counts per flavour and runtime, then each case that did not pass; --json FILE
    writes every outcome. Exit 1 when a case fails in a flavour (a declined case is not a failure)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnexport.conformance", description=main.__doc__)
    parser.add_argument("--json", help="write the outcomes to this file")
    args = parser.parse_args(argv)
    cases = load_cases()
    outcomes = run(cases)
    scope = [c for c in cases if not c.out_of_scope]
    print(f"onnx {onnx.__version__}: {len(cases)} Attention cases, {len(scope)} in scope "
          f"(opsets {', '.join(map(str, OPSETS))}, fp32 and fp16)")
    for flavor, by in counts(outcomes).items():
        for rt, c in by.items():
            print(f"  {flavor:<11} {rt:<9} " + ", ".join(f"{c[k]} {k}" for k in sorted(c)))
    for o in outcomes:
        if o.status != "passed":
            print(f"{o.case} / {o.flavor} / {o.runtime}: {o.status}: {o.detail}")
    if args.json:
        doc = {"onnx": onnx.__version__, "cases": len(cases), "in_scope": len(scope),
               "out_of_scope": {c.name: c.out_of_scope for c in cases if c.out_of_scope},
               "counts": counts(outcomes), "outcomes": [vars(o) for o in outcomes]}
        F.atomic_write(args.json, (jsonout.dumps(doc, indent=1) + "\n").encode())
    return 1 if any(o.status in ("failed", "error") for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
