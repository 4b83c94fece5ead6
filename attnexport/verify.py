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
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from attnexport import baseline as B
from attnexport import dtypes as D
from attnexport import export as E
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import golden, schema, seeding
from attnexport import modules as M
from attnexport import reference as ref
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport import weights as W
from attnexport.cases import seed_of
from attnexport.compare import (
    TOLERANCES,
    Tolerance,
    check_tolerance_values,
    compare_outputs,
    derived_tolerance,
    tolerance,
)
from attnexport.decode import (
    CHUNKS,
    decode,
    decode_all,
    decode_static,
    empty_cache,
    split_inputs,
    static_prompts,
    static_reach,
    stream_axis,
)
from attnexport.errors import AttnExportError, ProviderUnavailableError, UnsupportedByFlavor, UsageError, reason
from attnexport.inspect import attnexport_metadata, load_model
from attnexport.localize import Localization, locate
from attnexport.report import Report, Row

AUTO_LOCALIZE_LIMIT = 20  # failing runs localized without --localize, per verify call


# --- what one run is ---------------------------------------------------------------------------

class ModelSource:
    """Where a run's ONNX model comes from: a file's model, or an export made here (memoized).

    `known_good()` is what localization compares the model with: for a file, the torch module
    exported afresh with the same variant, options, flavour, opset, dtype and parameters (those
    the export wrote, when the file's weights changed since); for an export made here, the
    export itself, run on the reference evaluator.
    """

    def __init__(self, variant: str, options: dict, graph_flavor: str, opset: int | None, dtype: str,
                 params: dict, model: onnx.ModelProto | None = None, good_params: dict | None = None):
        self.variant, self.options, self.graph_flavor = variant, options, graph_flavor
        self.opset, self.dtype, self.params = opset, dtype, params
        self.good_params = params if good_params is None else good_params
        self.from_file = model is not None
        self._model: onnx.ModelProto | Exception | None = model
        self._good: onnx.ModelProto | Exception | None = None

    def get(self) -> onnx.ModelProto:
        if self._model is None:
            self._model = _export(self.variant, self.options, self.graph_flavor, self.opset, self.dtype, self.params)
        if isinstance(self._model, Exception):
            raise self._model
        return self._model

    def known_good(self) -> onnx.ModelProto:
        if not self.from_file:
            return self.get()
        if self._good is None:
            self._good = _export(self.variant, self.options, self.graph_flavor, self.opset, self.dtype,
                                 self.good_params)
        if isinstance(self._good, Exception):
            raise self._good
        return self._good


_GRAPHS: dict = {}  # the last exports, by what shapes the graph (at most _GRAPHS_KEPT of them)
_GRAPHS_KEPT = 64


def _export(variant, options, gf, opset, dtype, params) -> onnx.ModelProto | Exception:
    """The model of a variant with these options and parameters.

    One export per graph: variant, the options that shape the graph (sizes are symbolic), flavour,
    opset and dtype. Cases that differ only in sizes or parameters get that export with their
    parameters put into its initializers (`weights.reweight`), which is what a fresh export with
    them would hold; where that cannot be done, they are exported afresh.
    """
    key = (variant, json.dumps(V.get(variant).graph_options(options), sort_keys=True), gf, opset, dtype)
    if key not in _GRAPHS:
        while len(_GRAPHS) >= _GRAPHS_KEPT:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        try:
            _GRAPHS[key] = E.build_model(variant, options, gf, opset=opset, dtype=dtype)[0]
        except UnsupportedByFlavor as e:
            _GRAPHS[key] = e  # the same answer for every case and runtime, without exporting again
    graph = _GRAPHS[key]
    if isinstance(graph, Exception):
        return graph
    entries = W.from_metadata(attnexport_metadata(graph))
    model = W.reweight(graph, entries, params) if entries is not None else None
    if model is None:
        try:
            model = E.build_model(variant, options, gf, opset=opset, dtype=dtype, params=params)[0]
        except UnsupportedByFlavor as e:
            return e
    return model


@dataclass(frozen=True, eq=False)
class Step:
    """One run: a case on one runtime (and flavour), with what it is compared against."""

    case: golden.GoldenCase
    flavor: str  # "-" for the torch runtimes, which run the module itself
    runtime: str
    dtype: str
    tol: Tolerance
    expected: dict
    expected_kind: str  # "golden", or "reference (...)" when recomputed for a model's own parameters
    params: dict  # the torch module's parameters
    source: ModelSource | None = None  # None for the torch runtimes
    model: str = ""  # the model file's name in model mode
    problem: str = ""  # a failure known before running (changed weights)
    decode_chunk: int = 0  # > 0: decode the case's x in chunks from an empty cache (see attnexport.decode)


# --- arguments ---------------------------------------------------------------------------------

def case_tolerance(variant: schema.Variant, params: dict, inputs: dict, options: dict, expected: dict, dtype: str,
                   rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance of one case: the policy's (fp32), an override, or derived (fp16, see compare)."""
    if rtol is not None or atol is not None or dtype != "fp16":
        return tolerance(dtype, rtol, atol)
    with ref.rounded_to(np.float16):
        emulated = variant.reference(params, inputs, options)
    err = 0.0
    for name, e in expected.items():
        a, e = np.asarray(emulated[name], np.float64), np.asarray(e, np.float64)
        if (np.isfinite(a) != np.isfinite(e)).any():
            base = TOLERANCES[dtype]
            return Tolerance(base.rtol, base.atol, "policy (the fp16 emulation of this case overflows)")
        fin = np.isfinite(e)
        err = max(err, float(np.abs(a[fin] - e[fin]).max(initial=0.0)))
    return derived_tolerance(dtype, err)


# --- the entry point ---------------------------------------------------------------------------

def quiet_numerics(fn):
    """NumPy's warnings about NaN and Inf stay out of the user's terminal: a non-finite value is
    reported by the comparison (NaN never passes), not by a RuntimeWarning from the middle."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return wrapper


@dataclass(frozen=True)
class VerifyRequest:
    """What to verify: golden cases (no `models`) or model files, where and how strictly.

    Attributes:
        dtype: fp32 or fp16; default fp32 for golden cases, the model's own for model files.
        model_variant, model_options, seed: the variant, options and parameter seed of a model
            file without metadata (refused, when they disagree, for one that has it).
        flavors: golden mode: the flavours to export; model mode: at most one, checked against
            the model's.
        localize: localize every ONNX run, not only failing ones; a divergence fails the run.
        baseline, save_baseline, max_growth: compare with / write a known-good baseline folder.
    """

    variants: list[str] | None = None
    flavors: list[str] | None = None
    runtimes: list[str] | None = None
    dtype: str | None = None
    golden_dir: str | Path | None = None
    models: list[str | Path] | None = None
    rtol: float | None = None
    atol: float | None = None
    skip_unavailable: bool = False
    strict_placement: bool = False
    model_variant: str | None = None
    model_options: dict | None = None
    seed: int | None = None
    localize: bool = False
    baseline: str | Path | None = None
    save_baseline: str | Path | None = None
    max_growth: float = 10.0
    cases: list[str] | None = None


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
    rtol, atol, seed, cases, max_growth = r.rtol, r.atol, r.seed, r.cases, r.max_growth
    model_variant, model_options, baseline, save_baseline = r.model_variant, r.model_options, r.baseline, \
        r.save_baseline
    skip_unavailable, strict_placement, localize = r.skip_unavailable, r.strict_placement, r.localize
    if dtype is not None:
        D.check(dtype)
    check_tolerance_values(rtol, atol)
    if not (isinstance(max_growth, (int, float)) and np.isfinite(max_growth) and max_growth >= 1):
        raise UsageError(f"--max-growth must be a finite number >= 1, got {max_growth}")
    for name in variants or []:
        V.get(name)
    if not models and (model_variant or model_options or seed is not None):
        raise UsageError("variant options and --seed describe a MODEL file without metadata: give the file")
    if models and variants:
        raise UsageError("give the variant of a model file with model_variant")
    flavors = FL.check_all(flavors)
    if models and len(flavors) > 1 and flavors != list(E.FLAVORS):
        raise UsageError("a model file has one flavor: give at most one --flavor")
    entries = B.load(baseline) if baseline is not None else None
    if save_baseline is not None:  # before any work: the folder must be writable
        F.resolve_target(Path(save_baseline) / B.MANIFEST, new_folder=True)
    used, table = R.select(runtimes, skip_unavailable)
    if models:
        model_flavor = flavors[0] if flavors != list(E.FLAVORS) else None
        plan, dtypes = [], set()
        for path in models:
            steps, mdtype = _plan_model(path, used, golden_dir, dtype, model_variant, model_flavor,
                                        model_options, seed, rtol, atol)
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
        plan = _plan_golden(loaded, flavors, used, dtype, rtol, atol)
        flavors_used = flavors
    rows, localized = [], 0
    for i, step in enumerate(plan):
        if progress:
            progress(i, len(plan), f"{step.case.name} {step.flavor} {step.runtime}")
        row = _execute(step, strict_placement)
        # Localization needs one ONNX model run on one feed (not a decode loop): every run with
        # --localize, else failing runs up to a limit.
        can_localize = step.source is not None and not step.decode_chunk and not row.skipped
        if can_localize and (localize or (not row.passed and localized < AUTO_LOCALIZE_LIMIT)):
            localized += 1
            _localize(row, step, fail_on_divergence=localize)
        if entries is not None and not row.skipped:
            row.baseline = B.check(row, entries.get(B.key(row.case, row.flavor, row.runtime)), max_growth)
            row.passed = row.passed and row.baseline["passed"]
        rows.append(row)
    if progress:
        progress(len(plan), len(plan), "done")
    report = Report(rows, R.described(table), dtype, flavors_used, [str(m) for m in models or []],
                    baseline=None if baseline is None else str(baseline))
    if save_baseline is not None:
        report.saved_baseline = str(B.save(rows, save_baseline))
    return report


# --- planning ----------------------------------------------------------------------------------

def _plan_golden(cases, flavors, used, dtype, rtol, atol) -> list[Step]:
    plan = []
    for case in cases:
        variant = V.get(case.variant)
        tol = case_tolerance(variant, case.params, case.inputs, case.options, case.expected, dtype, rtol, atol)
        checks = [(case, case.expected, "golden", tol, 0)]
        checks += _decode_checks(variant, case, case.params, dtype, rtol, atol)
        for c, expected, kind, t, chunk in checks:
            for rt in used:
                if rt.startswith("torch"):
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


DECODE_LENGTH = 7  # tokens decoded by the cache property check: 7 steps of 1, chunks of 3, 3 and 1


def _decode_checks(variant, case, params, dtype, rtol, atol) -> list:
    """The cache property's checks of a causal cache-step case: (case, expected, kind, tolerance,
    chunk) for each chunk size; the expected output is the full causal forward's, from the reference."""
    o = case.options
    if not (o.get("kv_cache") and o.get("causal", True)):  # causal; the decoder always is
        return []
    sizes = {"seq": DECODE_LENGTH, **({"kv_seq": DECODE_LENGTH} if "kv_seq" in o else {})}
    full = variant.resolve({**o, "kv_cache": False, **({"max_seq": None} if "max_seq" in o else {}), **sizes})
    stream = seeding.make_inputs(variant, full, seed_of(case.name) + 1)
    expected = {"output": np.asarray(variant.reference(params, stream, full)["output"], np.float64)}
    if V.static_cache(o):  # sequences of different lengths: each compared up to where it ran
        reached = static_reach(static_prompts(o["batch"]), DECODE_LENGTH)
        axis = stream_axis(variant, o)
        past = np.arange(DECODE_LENGTH)[None, :] >= reached[:, None]  # (B, L)
        shape = [1] * expected["output"].ndim
        shape[0], shape[axis] = o["batch"], DECODE_LENGTH
        expected["output"][np.broadcast_to(past.reshape(shape), expected["output"].shape)] = 0.0
    tol = case_tolerance(variant, params, stream, full, expected, dtype, rtol, atol)
    out = []
    for chunk in CHUNKS:
        c = golden.GoldenCase(f"{case.name}/decode-{chunk}", case.variant, o, stream, params, expected,
                              {"source": f"decode {DECODE_LENGTH} tokens in chunks of {chunk} from an empty cache"})
        out.append((c, expected, "reference (the full causal forward)", tol, chunk))
    return out


_PROBE_SIZES = ({"batch": 2, "seq": 7, "kv_seq": 5}, {"batch": 1, "seq": 1, "kv_seq": 1})
_ELEM = {"bool": onnx.TensorProto.BOOL, "int64": onnx.TensorProto.INT64}


def matching_cases(variant, options: dict, cases: list) -> list:
    """The golden cases a model with these options can run: those that differ from its options
    only in sizes the model leaves symbolic. Which sizes those are depends on the options (sdpa's
    head counts are symbolic in its 4-D layout and fixed in bsd), so they are read from the
    model's own input specs, never from the variant's list of sizes that may be symbolic."""
    symbolic = variant.sizes(options)
    fixed = variant.graph_options(options)
    return [c for c in cases
            if {k: v for k, v in variant.with_defaults(c.options).items() if k not in symbolic} == fixed]


def _seeded_case(variant, options, sizes, i):
    given = {**options, **{k: v for k, v in sizes.items() if k in variant.sizes(options)}}
    for k, full in variant.broadcast:  # an axis that was full stays full at the new size
        if options[k] != 1:
            given[k] = given[full]
    o = variant.resolve(variant.refit(given))
    name = f"seeded-{'x'.join(str(o[k]) for k in ('batch', 'seq') if k in o)}"
    return golden.GoldenCase(name, variant.name, o, seeding.make_inputs(variant, o, 1000 + i), {}, {},
                             {"source": "seeded inputs (no stored golden case has these options)"})


def flavor_of(model: onnx.ModelProto) -> str:
    """The flavour a graph has, read from its attention op."""
    return FL.of_op(E.attention_op_of(model))


def dtype_of(model: onnx.ModelProto) -> str:
    """fp16 when the model's float inputs are float16, else fp32."""
    inits = {i.name for i in model.graph.initializer}
    for i in model.graph.input:
        if i.name not in inits and i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16:
            return "fp16"
    return "fp32"


def check_interface(path, model: onnx.ModelProto, variant: schema.Variant, options: dict, dtype: str) -> None:
    """The model's inputs must be the variant's, by name, rank and dtype; else a one-line UsageError."""
    inits = {i.name for i in model.graph.initializer}
    have = {i.name: i for i in model.graph.input if i.name not in inits}
    specs = variant.inputs(options)
    want = [s.name for s in specs]
    if set(have) != set(want):
        raise UsageError(f"{path}: its inputs ({', '.join(have) or 'none'}) do not fit {variant.name} with "
                         f"these options, which takes {', '.join(want)}")
    names = {v: k for k, v in onnx.TensorProto.DataType.items()}
    for s in specs:
        t = have[s.name].type.tensor_type
        elem = D.ONNX[dtype] if s.dtype == "float" else _ELEM[s.dtype]
        if t.elem_type != elem:
            raise UsageError(f"{path}: input {s.name!r} is {names.get(t.elem_type, '?').lower()}, "
                             f"{variant.name} ({dtype}) takes {names[elem].lower()}")
        if t.HasField("shape") and len(t.shape.dim) != len(s.dims):
            raise UsageError(f"{path}: input {s.name!r} has rank {len(t.shape.dim)}, {variant.name} takes "
                             f"rank {len(s.dims)} {list(s.dims)}")


def _plan_model(path, used, golden_dir, dtype, model_variant, model_flavor, model_options, seed, rtol, atol):
    """The runs of one model file; returns (steps, the model's dtype)."""
    model = load_model(path)
    meta = attnexport_metadata(model)
    name = Path(path).name
    changed, good_params = [], None
    if meta.get("variant"):
        variant = V.get(meta["variant"])
        options = variant.resolve(meta["options"])  # an earlier export's options lack newer ones
        for flag, given, has in (("--variant", model_variant, meta["variant"]), ("--flavor", model_flavor,
                                                                                  meta.get("flavor"))):
            if given is not None and given != has:
                raise UsageError(f"{path}: {flag} {given} disagrees with the model's metadata ({has})")
        for k, v in (model_options or {}).items():
            if options.get(k) != v:
                raise UsageError(f"{path}: --{k.replace('_', '-')} {v} disagrees with the model's metadata "
                                 f"({options.get(k)})")
        if seed is not None and str(seed) != meta.get("seed"):
            raise UsageError(f"{path}: --seed {seed} disagrees with the model's metadata ({meta.get('seed')})")
        flavor, gf = meta.get("flavor", "?"), meta.get("graph_flavor", flavor_of(model))
        mdtype, opset = meta.get("dtype", dtype_of(model)), int(meta.get("opset", 0)) or None
        seed_params = seeding.init_params(variant, options, int(meta.get("seed", 0)))
        entries = W.from_metadata(meta)
        if entries is None:  # exported before fingerprints: the parameters of its seed
            params, kind = seed_params, f"reference (parameters of seed {meta.get('seed', 0)})"
        else:
            params, changed = W.read(model, entries)
            params = {**{k: v for k, v in seed_params.items() if k not in params}, **params}
            kind = "reference (the model's own parameters)"
            if changed and meta.get("params_source") == "seed":
                good_params = seed_params  # localization compares with what the export wrote
    elif model_variant:
        variant = V.get(model_variant)
        options = variant.resolve(model_options or {})
        flavor = model_flavor or flavor_of(model)
        gf = E.graph_flavor(variant, flavor)
        mdtype = dtype_of(model)
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        seed = seed or 0
        params, kind = seeding.init_params(variant, options, seed), f"reference (parameters of seed {seed})"
    elif meta.get("module"):
        raise UsageError(f"{path} was exported from the module {meta['module']}: verify it against that module, "
                         f"`attnexport verify {path} --module {meta['module']}`")
    else:
        raise UsageError(f"{path} has no attnexport metadata: name its variant and options "
                         "(e.g. --variant mha --heads 8 --seed 0), or compare it with its torch module "
                         "(--module FILE.py:NAME --input NAME:SHAPE)")
    if dtype is not None and dtype != mdtype:
        raise UsageError(f"{path}: --dtype {dtype} disagrees with the model, which is {mdtype}")
    check_interface(path, model, variant, options, mdtype)
    problem = f"weights changed since export: {', '.join(changed)}" if changed else ""
    not_finite = sorted(k for k, v in params.items() if not np.isfinite(v).all())
    if not_finite and not problem:
        problem = f"the model's parameters are not finite (NaN or Inf): {', '.join(not_finite)}"

    cases = matching_cases(variant, options, golden.load_all(golden_dir, [variant.name]))
    if not cases:
        # No stored case has these options (e.g. --heads 8): seeded inputs at two shapes, one of
        # length 1, with the reference computing the expected outputs.
        cases = [_seeded_case(variant, options, sizes, i) for i, sizes in enumerate(_PROBE_SIZES)]
    source = ModelSource(variant.name, options, gf, opset, mdtype, params, model, good_params)
    steps = []
    for case in cases:
        same = set(params) == set(case.params) and all(np.array_equal(params[k], case.params[k]) for k in params)
        if same and case.expected:
            expected, ekind = case.expected, "golden"
        else:
            expected = {k: np.asarray(v, np.float64) for k, v in variant.reference(params, case.inputs,
                                                                                  case.options).items()}
            ekind = kind + (", seeded inputs" if not case.params else "")
        tol = case_tolerance(variant, params, case.inputs, case.options, expected, mdtype, rtol, atol)
        mcase = golden.GoldenCase(case.name, case.variant, case.options, case.inputs, params, expected, case.meta)
        checks = [(mcase, expected, ekind, tol, 0)] + _decode_checks(variant, mcase, params, mdtype, rtol, atol)
        for c, exp, kind_, t, chunk in checks:
            for rt in used:
                src = None if rt.startswith("torch") else source
                steps.append(Step(c, "-" if src is None else flavor, rt, mdtype, t, exp, kind_, params, src, name,
                                  problem, decode_chunk=chunk))
    return steps, mdtype


# --- execution ---------------------------------------------------------------------------------

def _execute(step: Step, strict: bool) -> Row:
    case = step.case
    variant = V.get(case.variant)
    dtype = step.dtype
    row = Row(case.name, case.variant, step.flavor, step.runtime, dtype, step.model, tolerance=step.tol,
              expected_kind=step.expected_kind, inputs=case.inputs, expected=step.expected)
    if step.problem:
        row.error = step.problem
        return row
    try:
        if step.source is None:
            prepared = R.prepare_torch(step.runtime, variant, case.options, step.params, dtype)
        else:
            prepared = R.prepare_onnx(step.runtime, step.source.get())
    except UnsupportedByFlavor as e:
        row.skipped = str(e)
        return row
    except ProviderUnavailableError:
        raise
    except AttnExportError as e:
        row.error = str(e)
        return row
    except Exception as e:  # noqa: BLE001 - a model a runtime cannot load fails verification
        row.error = reason(e)
        return row
    feed = D.cast_floats(case.inputs, dtype)
    try:
        if step.decode_chunk:
            got, ms = _decode_run(prepared, variant, case.options, feed, step.decode_chunk)
        else:
            # One untimed run, then a few timed ones: verify is a check, bench is the timing tool.
            got, ms = prepared.timed(feed, warmup=0 if step.runtime == "onnx-ref" else 1,
                                     iters=1 if step.runtime == "onnx-ref" else 3)
    except Exception as e:  # noqa: BLE001 - a runtime failing on a model is a verification failure
        row.error = reason(e)
        return row
    row.median_ms, row.arrays = ms, got
    declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]
    row.comparisons = compare_outputs(declared, got, step.expected, step.tol)
    row.cpu_nodes = prepared.cpu_nodes
    if not row.comparisons:
        row.error = "compared nothing: no output was declared or produced"
        return row
    row.passed = all(c.passed for c in row.comparisons)
    if strict and row.cpu_nodes:
        row.passed = False
        row.error = f"{len(row.cpu_nodes)} node(s) ran on the CPU: {', '.join(row.cpu_nodes[:5])}"
    return row


def _decode_run(prepared, variant, o, stream, chunk):
    """The cache property: the stream decoded in chunks from an empty cache; ({"output": ...}, ms)."""
    dtype = next(iter(stream.values())).dtype
    t0 = time.perf_counter()
    if V.static_cache(o):
        garbage = seeding.make_inputs(variant, o, 7)  # buffers whose unwritten positions must not be read
        specs = {s.name: s for s in variant.inputs(o)}
        names = [n for n in specs if n.endswith("_cache")]
        buffers = {n: garbage[n].astype(dtype) for n in names}
        pairs = {n: n + "_out" for n in names}
        once = {}
        if "past_cross_key" in specs:  # a decoder: its memory is given once, its cross cache carried
            once = {"memory": stream["memory"]}
            buffers.update({n: np.zeros((o["batch"], *specs[n].shape({**o, "past_kv_seq": 0})[1:]), dtype)
                            for n in ("past_cross_key", "past_cross_value")})
            pairs.update(past_cross_key="present_cross_key", past_cross_value="present_cross_value")
        streamed = {n: v for n, v in stream.items() if n not in buffers and n not in once and n != "write_pos"}
        def run(feed):  # in the inputs' order: the torch runtime passes them to forward by position
            return prepared.run({n: feed[n] for n in specs})
        out = decode_static(run, streamed, stream_axis(variant, o), static_prompts(o["batch"]), chunk, buffers,
                            pairs, once)
        return {"output": out}, (time.perf_counter() - t0) * 1e3
    stream, once, masks = split_inputs(variant, o, stream)
    out = decode(prepared.run, stream, chunk, empty_cache(variant, o, dtype), stream_axis(variant, o), once, masks)
    return {"output": out}, (time.perf_counter() - t0) * 1e3


def _localize(row: Row, step: Step, fail_on_divergence: bool) -> None:
    """Attaches the first diverging node; with --localize a divergence fails the run."""
    feed = D.cast_floats(step.case.inputs, row.dtype)
    if step.source is None:  # a torch run: no graph to localize in
        return
    try:
        model, good = step.source.get(), step.source.known_good()
        if model is good and row.runtime == "onnx-ref":
            row.localization = Localization(note="this run is the reference evaluator on the export itself: "
                                                 "nothing independent to compare with")
            return
        row.localization = locate(model, good, feed, row.runtime, row.dtype)
    except UnsupportedByFlavor:
        return
    except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
        row.localization = Localization(note=f"localization failed: {reason(e)}")
        return
    if fail_on_divergence and row.localization.diverged and row.passed:
        row.passed = False
        row.error = "intermediate values diverge from the export (--localize)"


# --- a user's module against its model -------------------------------------------------------

# The shapes a module's model is checked at besides the export's: (batch, length) of its symbolic
# axes; length 1, odd lengths, batch 1 and 3.
VERIFY_SIZES = ((1, 1), (1, 5), (3, 7))


def verify_module(model_path, spec: str, runtimes: list[str] | None = None, rtol: float | None = None,
                  atol: float | None = None, skip_unavailable: bool = False, *, input_specs=None,
                  seed: int | None = None, weights_file=None, cache: dict | None = None):
    """The model file against the torch module it was exported from, at the export's shape and
    at VERIFY_SIZES, on every selected runtime; a `verify.Report` like the golden runs'.

    A model from any exporter (a plain `torch.onnx.export`) works too, given `input_specs`
    (`parse_input` results, in `forward`'s order): its inputs are matched by name, else by order,
    and its symbolic axes are read from the graph. `seed` (default: the one the export recorded,
    else 0) seeds torch while the module is built; `weights_file` loads trained weights.

    The `torch` runtime is the module with its attention calls routed through attnexport's core
    (in eager torch): it shows the core agrees with torch's own kernels on these inputs.

    A module with its own key/value cache (`export_module(cache=...)`, recorded in the model, or
    `cache` here: {input: {"output": the output returning it updated, "axis": its positions
    axis}}) is also checked for the decode property: see `_decode_rows`.
    """

    check_tolerance_values(rtol, atol)
    with np.errstate(all="ignore"):  # a NaN is reported by the comparison, not by a RuntimeWarning
        return _verify_module(model_path, spec, runtimes, rtol, atol, skip_unavailable, input_specs, seed,
                              weights_file, cache)


def _verify_module(model_path, spec, runtimes, rtol, atol, skip_unavailable, input_specs, seed, weights_file, cache):
    import torch

    model = load_model(model_path)
    meta = {p.key: p.value for p in model.metadata_props}
    if "attnexport.variant" in meta:
        raise UsageError(f"{model_path} was exported from the variant {meta['attnexport.variant']!r}, not from a "
                         f"module: verify it without --module (`attnexport verify {model_path}`)")
    spec_inputs = _model_inputs(model, model_path, meta, input_specs)
    dtype = meta.get("attnexport.dtype") or dtype_of(model)
    flavor = meta.get("attnexport.flavor") or flavor_of(model)
    if seed is None:
        seed = int(meta.get("attnexport.seed", 0))
    module, example = M.load(spec, seed)
    if input_specs:
        M.check_input_names(module, [n for n, _, _ in input_specs], f"--module {spec}")
    if weights_file is not None:
        M.load_weights(module, weights_file)
    module = module.to(D.torch_dtype(dtype)).eval()
    names = [i["name"] for i in spec_inputs]
    entries = json.loads(meta.get("attnexport.params", "{}"))
    changed = _changed_params(module, entries, dtype)
    damaged = W.read(model, entries)[1] if entries else []  # the file's own initializers against the record
    used, table = R.select(runtimes, skip_unavailable)
    tol = tolerance(dtype, rtol, atol)
    declared = [o.name for o in model.graph.output]
    prepared = {rt: R.prepare_onnx(rt, model) for rt in used if rt in R.ONNX_RUNTIMES}
    rows = []
    known_good = _KnownGood(module, spec, names, spec_inputs, declared, flavor, meta, dtype)

    def plain(module, feed):
        return M.call_forward(module, feed, spec)

    def routed_call(module, feed):
        with M.export_semantics():
            return module(*feed)
    for label, feed in _verify_feeds(spec_inputs, example, dtype):
        known_good.example = known_good.example or feed
        compute, row_tol = plain, tol
        with torch.no_grad():
            want = M.outputs_of(M.call_forward(module, feed, spec))
        if len(want) != len(declared):
            raise UsageError(f"{spec} returns {len(want)} tensor(s), {Path(model_path).name} declares "
                             f"{len(declared)} output(s) ({', '.join(declared)}): it is not this model's module")
        kind = "the torch module"
        if any(w.is_floating_point() and torch.isnan(w).any() for w in want):
            # A fully padded sequence: torch's own kernels give NaN where every key is masked by
            # an additive -inf (nn.MultiheadAttention's key padding mask); attnexport's semantics
            # give zeros. The module with its attention routed through the core is the module
            # under those semantics.
            with torch.no_grad(), M.export_semantics():
                routed = M.outputs_of(module(*feed))
            if not any(r.is_floating_point() and torch.isnan(r).any() for r in routed):
                want, kind = routed, ("the torch module, its attention routed through attnexport's core (the module "
                                      "itself gives NaN for a fully masked row, attnexport zeros)")
                compute = routed_call
        if dtype == "fp16" and rtol is None and atol is None:  # the module in fp32: see modules.expected_of
            want, row_tol = M.expected_of(module, feed, spec, dtype, compute)
            kind += ", in float32 on its fp16 parameters and inputs"
        expected = {n: w.detach().double().numpy() for n, w in zip(declared, want, strict=True)}
        arrays = {n: t.numpy() for n, t in zip(names, feed, strict=True)}
        for rt in used:
            row = Row(case=label, variant=spec, flavor="-" if rt.startswith("torch") else flavor, runtime=rt,
                      dtype=dtype, model=Path(model_path).name, tolerance=row_tol,
                      expected_kind=kind, inputs=arrays, expected=expected)
            rows.append(row)
            if changed:
                source = meta.get("attnexport.params_source", "seed")
                hint = f"; it was exported with --weights {source[len('given: '):]}" \
                    if source.startswith("given: ") and weights_file is None else ""
                row.error = (f"the module's parameters differ from the model's: {', '.join(changed[:3])} "
                             f"(sha256 in the metadata{hint})")
                continue
            try:
                if rt == "torch":
                    started = time.perf_counter()
                    with torch.no_grad(), M.export_semantics():
                        got_t = M.outputs_of(module(*feed))
                    row.median_ms = (time.perf_counter() - started) * 1e3
                    got = {n: g.detach().double().numpy() for n, g in zip(declared, got_t, strict=True)}
                elif rt in prepared:
                    got, row.median_ms = prepared[rt].timed(arrays, warmup=0 if rt == "onnx-ref" else 1,
                                                            iters=1 if rt == "onnx-ref" else 3)
                else:
                    row.skipped = f"{rt} runs no module"
                    continue
            except Exception as e:  # noqa: BLE001 - a runtime failing on the model fails verification
                row.error = reason(e)
                continue
            row.comparisons = compare_outputs(declared, got, expected, row_tol)
            row.passed = bool(row.comparisons) and all(c.passed for c in row.comparisons)
            if not row.comparisons:
                row.error = "compared nothing: no output was declared or produced"
            if damaged and rt != "torch":
                row.passed = False
                row.error = (f"the model file's parameters differ from the sha256 recorded at its export: "
                             f"{', '.join(damaged[:3])} (the file was changed after the export)")
            elif not row.passed and rt in prepared and known_good.tries < AUTO_LOCALIZE_LIMIT:
                row.localization = known_good.locate(model, arrays, rt)
    cache = _cache_of(model, cache) if cache is not None else json.loads(meta.get("attnexport.cache", "{}"))
    if cache and not changed:
        rows += _decode_rows(module, model, spec, spec_inputs, known_good.example, cache, used, prepared, dtype,
                             tol, flavor, Path(model_path).name)
    return Report(rows, R.described(table), dtype, [flavor], [str(model_path)])


def _cache_of(model, pairs: dict) -> dict:
    """{input: output} -> {input: {"output", "axis"}}, the axis being the input's symbolic one
    besides the batch (the positions)."""
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    cache = {}
    for past, present in pairs.items():
        if past not in inputs or present not in outputs:
            raise UsageError(f"--cache {past}:{present}: the model has no input {past!r} or no output {present!r}")
        axes = [a for a, d in enumerate(inputs[past].type.tensor_type.shape.dim) if d.dim_param and a != 0]
        if len(axes) != 1:
            raise UsageError(f"--cache {past}:{present}: {past} has {len(axes)} symbolic axes besides the batch; a "
                             "cache has one, its positions")
        cache[past] = {"output": present, "axis": axes[0]}
    return cache


def _decode_rows(module, model, spec, spec_inputs, example, cache, used, prepared, dtype, tol, flavor, model_name):
    """The decode property of a module with its own cache (`cache`: {input: {"output", "axis"}}):
    run from empty caches over the export's inputs, a token at a time and in chunks, feeding each
    step's updated cache back, on every runtime (torch: the module itself), it must give the
    module's full forward: the outputs along the sequence, and the last cache."""
    import torch
    names = [i["name"] for i in spec_inputs]
    outputs = [o.name for o in model.graph.output]
    feed = dict(zip(names, (t.numpy() for t in example), strict=True))
    for n, c in cache.items():  # empty caches
        feed[n] = np.take(feed[n], np.arange(0), axis=c["axis"])
    length_dims = {d for i in spec_inputs if i["name"] not in cache for a, d in i["dynamic"].items() if a != "0"}
    if len(length_dims) != 1:
        raise UsageError(f"{spec}: the decode check splits one sequence axis, the inputs besides the cache have "
                         f"{len(length_dims)} symbolic lengths ({', '.join(sorted(length_dims)) or 'none'})")
    (length,) = length_dims
    stream = {i["name"]: int(a) for i in spec_inputs if i["name"] not in cache
              for a, d in i["dynamic"].items() if d == length}
    if len(set(stream.values())) != 1:
        raise UsageError(f"{spec}: the inputs along the sequence ({', '.join(stream)}) have it on different axes")
    axis = next(iter(stream.values()))
    along = {o.name: a for o in model.graph.output if o.name not in {c["output"] for c in cache.values()}
             for a, d in enumerate(o.type.tensor_type.shape.dim) if d.dim_param == length}
    always = {n: v for n, v in feed.items() if n not in stream and n not in cache}

    def module_step(given):
        with torch.no_grad(), M.export_semantics():
            out = M.call_forward(module, tuple(torch.from_numpy(np.asarray(given[n])) for n in names), spec)
        return {n: t.detach().numpy() for n, t in zip(outputs, M.outputs_of(out), strict=True)}

    full = module_step(feed)
    expected = {n: full[n].astype(np.float64) for n in along}
    expected.update({c["output"]: full[c["output"]].astype(np.float64) for c in cache.values()})
    rows = []
    for chunk in CHUNKS:
        label = "decode, a token a step" if chunk == 1 else f"decode, {chunk} tokens a step"
        for rt in used:
            row = Row(case=label, variant=spec, flavor="-" if rt.startswith("torch") else flavor, runtime=rt,
                      dtype=dtype, model=model_name, tolerance=tol,
                      expected_kind="the torch module's full forward from empty caches",
                      inputs=feed, expected=expected)
            rows.append(row)
            run = module_step if rt == "torch" else prepared[rt].run if rt in prepared else None
            if run is None:
                row.skipped = f"{rt} runs no module"
                continue
            started = time.perf_counter()
            try:
                got, last = decode_all(lambda g, run=run: run({**g, **always}), {n: feed[n] for n in stream}, chunk,
                                       {n: feed[n] for n in cache}, axis,
                                       pairs={n: c["output"] for n, c in cache.items()},
                                       cache_axes={n: c["axis"] for n, c in cache.items()}, outputs=along)
            except Exception as e:  # noqa: BLE001 - a runtime failing on a step fails the check
                row.error = reason(e)
                continue
            row.median_ms = (time.perf_counter() - started) * 1e3  # the whole decode, every step
            got.update({cache[n]["output"]: v for n, v in last.items()})
            row.comparisons = compare_outputs(list(expected), got, expected, tol)
            row.passed = bool(row.comparisons) and all(c.passed for c in row.comparisons)
    return rows


class _KnownGood:
    """The module exported afresh, as the model file says it was (flavour, opset, dtype, inputs,
    symbolic axes, output names): what a failing run's intermediate values are compared with to
    name the first diverging node (`attnexport.localize`). Exported once, on the first failure."""

    def __init__(self, module, spec, names, spec_inputs, declared, flavor, meta, dtype):
        self.module, self.spec, self.names, self.declared = module, spec, names, declared
        self.dynamic = {i["name"]: {int(a): d for a, d in i["dynamic"].items()} for i in spec_inputs}
        self.flavor, self.dtype = flavor, dtype
        self.opset = int(meta["attnexport.opset"]) if "attnexport.opset" in meta else None
        self.example, self.model, self.tries = None, None, 0

    def locate(self, model, feed, runtime):
        self.tries += 1
        try:
            if self.model is None:
                self.model = E.export_module(self.module, self.example, flavor=self.flavor, opset=self.opset,
                                             dtype=self.dtype, dynamic=self.dynamic, input_names=self.names,
                                             output_names=self.declared, name=self.spec).model
            return locate(model, self.model, feed, runtime, self.dtype)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            return Localization(note=f"localization failed: {reason(e)}")


_ELEM_NAMES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BOOL: "bool",
               onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32"}


def _model_inputs(model, model_path, meta, input_specs) -> list[dict]:
    """The model's inputs as [{name, shape, dtype, dynamic}]: from `--input` (matched with the
    graph's inputs by name, else by order; symbolic axes from the graph), else from the input
    spec an `export --module` recorded."""
    inits = {i.name for i in model.graph.initializer}
    graph = [i for i in model.graph.input if i.name not in inits]
    if input_specs:
        given = [n for n, _, _ in input_specs]
        if len(given) != len(graph):
            raise UsageError(f"{model_path} takes {len(graph)} input(s) ({', '.join(i.name for i in graph)}); "
                             f"--input gives {len(given)}")
        by_name = {i.name: i for i in graph}
        matched = [by_name[n] for n in given] if set(given) == set(by_name) else graph  # by name, else by order
        specs = []
        for (n, shape, dtype), vi in zip(input_specs, matched, strict=True):
            dims = vi.type.tensor_type.shape.dim
            if len(dims) != len(shape):
                raise UsageError(f"--input {n}: rank {len(shape)}, but {model_path}'s input {vi.name!r} has rank "
                                 f"{len(dims)}")
            want = _ELEM_NAMES.get(vi.type.tensor_type.elem_type)
            if want is not None and want != dtype and not (dtype.startswith("float") and want.startswith("float")):
                raise UsageError(f"--input {n}: {dtype}, but {model_path}'s input {vi.name!r} is {want}")
            for axis, (d, size) in enumerate(zip(dims, shape, strict=True)):
                if d.HasField("dim_value") and d.dim_value != size:
                    raise UsageError(f"--input {n}: axis {axis} is {size}, {model_path} fixes it at {d.dim_value}")
            specs.append({"name": vi.name, "shape": list(shape), "dtype": want or dtype,
                          "dynamic": {str(a): d.dim_param for a, d in enumerate(dims) if d.dim_param}})
        return specs
    if "attnexport.inputs" not in meta:
        raise UsageError(f"{model_path} records no input spec (it was not exported by `attnexport export --module`): "
                         f"give its inputs, e.g. --input {graph[0].name if graph else 'x'}:2x16x64 (one per input)")
    specs = json.loads(meta["attnexport.inputs"])
    if [i["name"] for i in specs] != [i.name for i in graph]:
        raise UsageError(f"{model_path}: its inputs are not those of its metadata")
    return specs


def _changed_params(module, entries, dtype) -> list[str]:
    """The parameters whose sha256 differs from the model's record (stored as the model holds
    them: a transposed layout is hashed transposed)."""
    state = {k: v.detach().float().numpy().astype(D.NUMPY[dtype]) for k, v in module.state_dict().items()}
    changed = []
    for name, entry in sorted(entries.items()):
        p = state.get(name)
        if p is None or W.sha256_of(p.T if entry["layout"] == "transposed" else p) != entry["sha256"]:
            changed.append(name)
    return changed


def _verify_feeds(spec_inputs, example, dtype):
    """(label, inputs): the export's shape, then VERIFY_SIZES on the symbolic axes.

    Floats are seeded. A padding mask (a (batch, length) input of two values, as its example
    has) gets real padding at every shape: each sequence valid for a drawn length, the rest the
    other value, and with more than one sequence the last one all padding. Other non-float
    inputs are filled with the example's most common value."""
    import torch
    rng = np.random.default_rng(0)
    common = {i["name"]: M.common_value(t)  # no example (a model from another exporter): none
              for i, t in zip(spec_inputs, example or (), strict=False) if not t.is_floating_point()}
    masks = {i["name"] for i, t in zip(spec_inputs, example or (), strict=False)
             if not t.is_floating_point() and t.dim() == 2 and len(torch.unique(t)) == 2 and
             set(torch.unique(t).tolist()) <= {0, 1}}
    feeds = []
    for batch, length in ((None, None), *VERIFY_SIZES):
        feed, label = [], "export shape" if batch is None else f"batch {batch}, length {length}"
        for i in spec_inputs:
            shape = list(i["shape"])
            if batch is not None:
                for axis, dim in i["dynamic"].items():  # a plain export names them s0, s1, ...
                    shape[int(axis)] = batch if dim == "batch" or int(axis) == 0 else length
            if i["dtype"].startswith("float"):
                feed.append(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(D.torch_dtype(dtype)))
            elif i["name"] in masks:
                valid = rng.integers(1, shape[1] + 1, size=shape[0])
                if shape[0] > 1:
                    valid[-1] = 0  # one sequence that is all padding
                token = np.arange(shape[1])[None, :] < valid[:, None]
                keep = bool(common[i["name"]])
                feed.append(torch.from_numpy(token if keep else ~token).to(getattr(torch, i["dtype"])))
            else:
                feed.append(torch.full(shape, common.get(i["name"], True if i["dtype"] == "bool" else 0),
                                       dtype=getattr(torch, i["dtype"])))
        feeds.append((label, tuple(feed)))
    return feeds
