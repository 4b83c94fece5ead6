"""Planning model mode: a model file's variant, options, dtype and parameters taken from the
file itself (checked against the fingerprints of its export), run through the golden cases
with its options or seeded inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from attnexport import dtypes as D
from attnexport import export as E
from attnexport import golden, schema, seeding
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport import weights as W
from attnexport.errors import UsageError
from attnexport.reading import load_model
from attnexport.record import ExportRecord
from attnexport.verify.decode_checks import golden_decode_checks
from attnexport.verify.request import VerifyRequest
from attnexport.verify.run import ModelSource, Step, case_tolerance

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


def plan_model(path, used: list[str], request: VerifyRequest, model_flavor: str | None):
    """The runs of one model file on the runtimes `used`, as `request` asks (its golden folder,
    dtype, tolerances, and for a file without metadata its variant, options and seed);
    `model_flavor`: the flavour given, checked against the file's. Returns (steps, the model's dtype)."""
    golden_dir, dtype, model_variant, model_options = (request.golden_dir, request.dtype, request.model_variant,
                                                       request.model_options)
    seed, rtol, atol = request.seed, request.rtol, request.atol
    model = load_model(path)
    record = ExportRecord.of(model)
    name = Path(path).name
    changed: list[str] = []
    good_params: dict | None = None
    if record.variant:
        variant = V.get(record.variant)
        options = variant.resolve(record.parsed("options", {}))  # an earlier export's options lack newer ones
        for flag, given, has in (("--variant", model_variant, record.variant), ("--flavor", model_flavor,
                                                                                 record.flavor)):
            if given is not None and given != has:
                raise UsageError(f"{path}: {flag} {given} disagrees with the model's metadata ({has})")
        for k, v in (model_options or {}).items():
            if options.get(k) != v:
                raise UsageError(f"{path}: --{k.replace('_', '-')} {v} disagrees with the model's metadata "
                                 f"({options.get(k)})")
        if seed is not None and str(seed) != record.seed:
            raise UsageError(f"{path}: --seed {seed} disagrees with the model's metadata ({record.seed})")
        flavor, gf, mdtype, opset = record.flavor, record.graph_flavor, record.dtype, record.number("opset") or None
        seed_params = seeding.init_params(variant, options, record.number("seed", 0))
        entries = record.parsed("params")
        if entries is None:  # exported before fingerprints: the parameters of its seed
            params, kind = seed_params, f"reference (parameters of seed {record.number('seed', 0)})"
        else:
            params, changed = W.read(model, entries)
            params = {**{k: v for k, v in seed_params.items() if k not in params}, **params}
            kind = "reference (the model's own parameters)"
            if changed and record.params_source == "seed":
                good_params = seed_params  # localization compares with what the export wrote
    elif model_variant:
        variant = V.get(model_variant)
        options = variant.resolve(model_options or {})
        flavor = model_flavor or record.flavor
        gf = E.graph_flavor(variant, flavor)
        mdtype = record.dtype
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        seed = seed or 0
        params, kind = seeding.init_params(variant, options, seed), f"reference (parameters of seed {seed})"
    elif record.module:
        raise UsageError(f"{path} was exported from the module {record.module}: verify it against that module, "
                         f"`attnexport verify {path} --module {record.module}`")
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

    folder = None if golden_dir is None else Path(golden_dir)
    cases = matching_cases(variant, options, golden.load_all(folder, [variant.name]))
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
        checks = [(mcase, expected, ekind, tol, 0)] + golden_decode_checks(variant, mcase, params, mdtype, rtol, atol)
        for c, exp, kind_, t, chunk in checks:
            for rt in used:
                src = None if R.runs_module(rt) else source
                steps.append(Step(c, "-" if src is None else flavor, rt, mdtype, t, exp, kind_, params, src, name,
                                  problem, decode_chunk=chunk))
    return steps, mdtype
