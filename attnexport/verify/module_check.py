"""A user's module against its model file: output by output at several shapes on every
runtime, the decode property of its caches, localization against the module exported afresh."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from attnexport import dtypes as D
from attnexport import export as E
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport import signature as SG
from attnexport import weights as W
from attnexport.compare import (
    check_tolerance_values,
    compare_outputs,
    tolerance,
)
from attnexport.errors import UsageError, reason
from attnexport.localize import Localization, locate
from attnexport.reading import load_model
from attnexport.record import ExportRecord
from attnexport.report import Report, Row
from attnexport.signature import WritePos
from attnexport.verify.decode_checks import cache_of, module_decode_rows, module_static_rows, write_pos_of
from attnexport.verify.executor import Executor
from attnexport.verify.request import Checking
from attnexport.verify.run import LoadedModule

# --- a user's module against its model -------------------------------------------------------

# The shapes a module's model is checked at besides the export's: (batch, length) of its symbolic
# axes; length 1, odd lengths, batch 1 and 3.
VERIFY_SIZES = ((1, 1), (1, 5), (3, 7))


@dataclass(frozen=True)
class ModuleCheck(Checking):
    """What `verify --module` checks: a model file against the module `spec` (FILE.py:NAME) it was
    exported from, with the Checking fields (where and how strictly); the fields are
    verify_module's keywords."""

    model_path: str | Path
    spec: str
    input_specs: list | None = None  # parse_input results, in forward's order
    seed: int | None = None
    weights_file: str | Path | None = None
    cache: dict | None = None  # {input: output} pairs of a model that does not record them
    write_pos: str | None = None  # the write position of its static cache (`cache` its buffers)


def verify_module(model_path, spec: str, runtimes: list[str] | None = None, **fields) -> Report:
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
    axis}}) is also checked for the decode property: see `decode_checks.module_decode_rows`.
    """

    check = ModuleCheck(model_path, spec, runtimes=runtimes, **fields)
    check_tolerance_values(check.rtol, check.atol)
    with np.errstate(all="ignore"):  # a NaN is reported by the comparison, not by a RuntimeWarning
        return _verify_module(check)


def _verify_module(check: ModuleCheck) -> Report:
    import torch
    model_path, spec, input_specs, seed, weights_file = (check.model_path, check.spec, check.input_specs, check.seed,
                                                         check.weights_file)

    model = load_model(model_path)
    meta = ExportRecord.of(model)
    if meta.variant is not None:
        raise UsageError(f"{model_path} was exported from the variant {meta.variant!r}, not from a "
                         f"module: verify it without --module (`attnexport verify {model_path}`)")
    spec_inputs = _model_inputs(model, model_path, meta, input_specs)
    dtype, flavor = meta.dtype, meta.flavor
    if seed is None:
        seed = meta.number("seed", 0)
    module, example = M.load(spec, seed)
    if input_specs:
        M.check_input_names(module, [n for n, _, _ in input_specs], f"--module {spec}")
    if weights_file is not None:
        M.load_weights(module, weights_file)
    module = module.to(D.torch_dtype(dtype)).eval()
    names = [i["name"] for i in spec_inputs]
    entries = meta.parsed("params", {})
    changed = changed_params(module, entries, dtype)
    damaged = W.read(model, entries)[1] if entries else []  # the file's own initializers against the record
    used, table = R.select(check.runtimes, check.skip_unavailable)
    tol = tolerance(dtype, check.rtol, check.atol)
    declared = [o.name for o in model.graph.output]
    prepared = {rt: R.prepare_onnx(rt, model) for rt in used if rt in R.ONNX_RUNTIMES}
    recorded = SG.of(model, Path(model_path).name) or _before_signatures(model, meta)
    cache = cache_of(model, check.cache, static=check.write_pos is not None) if check.cache is not None else \
        recorded.cache()
    write = _write_pos(model, recorded, check, cache)
    executor = Executor(check.checking)
    known_good = _KnownGood(module, spec, names, spec_inputs, declared, flavor, meta, dtype)

    def plain(module, feed):
        return M.call_forward(module, feed, spec)

    def routed_call(module, feed):
        with M.export_semantics():
            return module(*feed)
    for label, feed in _verify_feeds(spec_inputs, example, dtype, cache if write else None, write):
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
        if dtype == "fp16" and check.rtol is None and check.atol is None:  # the module in fp32: see modules.expected_of
            want, row_tol = M.expected_of(module, feed, spec, dtype, compute)
            kind += ", in float32 on its fp16 parameters and inputs"
        expected = {n: w.detach().double().numpy() for n, w in zip(declared, want, strict=True)}
        arrays = {n: t.numpy() for n, t in zip(names, feed, strict=True)}
        for rt in used:
            row = Row(case=label, variant=spec, flavor="-" if R.runs_module(rt) else flavor, runtime=rt,
                      dtype=dtype, model=Path(model_path).name, tolerance=row_tol,
                      expected_kind=kind, inputs=arrays, expected=expected)
            itself = R.runs_module(rt) and not R.on_cuda(rt)  # the module itself, as it runs on the CPU
            work = _module_call(module, feed, declared) if itself else \
                functools.partial(prepared[rt].run, arrays) if rt in prepared else None
            if changed:
                source = meta.params_source or "seed"
                hint = f"; it was exported with --weights {source[len('given: '):]}" \
                    if source.startswith("given: ") and weights_file is None else ""
                row.error = (f"the module's parameters differ from the model's: {', '.join(changed[:3])} "
                             f"(sha256 in the metadata{hint})")
            elif work is None:
                row.skipped = f"{rt} runs no module"
            once = itself or rt == "onnx-ref"
            executor.run(row, work, functools.partial(_judged, row, declared, expected, row_tol, damaged),
                         cpu_nodes=prepared[rt].cpu_nodes if rt in prepared else (), warmup=0 if once else 1,
                         iters=1 if once else 3,
                         locate=functools.partial(known_good.locate, model, arrays, rt) if rt in prepared else None)
    if cache and not changed:
        loaded = LoadedModule(module, model, spec, spec_inputs, used, prepared, dtype, tol, flavor,
                              Path(model_path).name, executor)
        if write:
            module_static_rows(loaded, known_good.example, cache, write)
        else:
            module_decode_rows(loaded, known_good.example, cache)
    return executor.report(R.described(table), dtype, [flavor], [str(model_path)])


def _module_call(module, feed: tuple, declared: list[str]):
    """The module run on `feed` under the export's semantics: {output: float64 array}."""
    import torch

    def call():
        with torch.no_grad(), M.export_semantics():
            got = M.outputs_of(module(*feed))
        return {n: g.detach().double().numpy() for n, g in zip(declared, got, strict=True)}
    return call


def _judged(row: Row, declared, expected, tol, damaged: list[str], got: dict) -> list:
    """Every declared output against the module's; a model file whose parameters changed since its
    export fails whatever it computes."""
    if damaged and not R.runs_module(row.runtime):
        row.error = (f"the model file's parameters differ from the sha256 recorded at its export: "
                     f"{', '.join(damaged[:3])} (the file was changed after the export)")
    return compare_outputs(declared, got, expected, tol)


class _KnownGood:
    """The module exported afresh, as the model file says it was (flavour, opset, dtype, inputs,
    symbolic axes, output names): what a failing run's intermediate values are compared with to
    name the first diverging node (`attnexport.localize`). Exported once, on the first failure."""

    def __init__(self, module, spec, names, spec_inputs, declared, flavor, meta, dtype):
        self.module, self.spec, self.names, self.declared = module, spec, names, declared
        self.dynamic = {i["name"]: {int(a): d for a, d in i["dynamic"].items()} for i in spec_inputs}
        self.flavor, self.dtype = flavor, dtype
        self.opset = meta.number("opset")
        self.example, self.model = None, None

    def locate(self, model, feed, runtime, _result=None):
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
    if meta.inputs is None:
        raise UsageError(f"{model_path} records no input spec (it was not exported by `attnexport export --module`): "
                         f"give its inputs, e.g. --input {graph[0].name if graph else 'x'}:2x16x64 (one per input)")
    specs = meta.parsed("inputs")
    if [i["name"] for i in specs] != [i.name for i in graph]:
        raise UsageError(f"{model_path}: its inputs are not those of its metadata")
    return specs


def changed_params(module, entries, dtype) -> list[str]:
    """The parameters whose sha256 differs from the model's record (stored as the model holds
    them: a transposed layout is hashed transposed)."""
    state = module.state_dict()
    changed = []
    for name, entry in sorted(entries.items()):  # one parameter at a time: a whole model is not copied
        t = state.get(name)
        p = None if t is None else t.detach().float().numpy().astype(D.NUMPY[dtype], copy=False)
        if p is None or W.sha256_of(p.T if entry["layout"] == "transposed" else p) != entry["sha256"]:
            changed.append(name)
    return changed


def _write_pos(model, recorded: SG.StepSignature, check: ModuleCheck, cache: dict) -> WritePos | None:
    """The static cache's write position: `--write-pos` (with --cache), else what the export recorded."""
    if check.write_pos is not None:
        if check.cache is None:
            raise UsageError("--write-pos names a static cache's write position: give its buffers with --cache")
        return write_pos_of(model, check.write_pos, cache)
    return None if check.cache is not None else recorded.write_pos


def _before_signatures(model, meta: ExportRecord) -> SG.StepSignature:
    """The signature of a file exported before `attnexport.signature`: its cache pairs and write
    position as that export recorded them (`attnexport.cache`, `attnexport.write_pos` metadata)."""
    cache = meta.parsed("cache", {})
    write = meta.parsed("write_pos")["input"] if meta.write_pos is not None else None
    kind = "concat" if write is None else "static"
    caches = tuple(SG.CachePair(n, c["output"], c["axis"], kind) for n, c in cache.items())
    return SG.StepSignature(caches=caches, write_pos=write_pos_of(model, write, cache) if write else None)


def _verify_feeds(spec_inputs, example, dtype, buffers=None, write=None):
    """(label, inputs): the export's shape, then VERIFY_SIZES on the symbolic axes.

    Floats are seeded. A padding mask (a (batch, length) input of two values, as its example
    has) gets real padding at every shape: each sequence valid for a drawn length, the rest the
    other value, and with more than one sequence the last one all padding. Other non-float
    inputs are filled with the example's most common value. A static cache's (`buffers`: {input:
    {"axis"}}, `write`: its WritePos) blocks are at most as long as its buffers, and are written
    where they fit: at a drawn position per sequence (one for all but in the "start" form)."""
    import torch
    rng = np.random.default_rng(0)
    common = {i["name"]: M.common_value(t)  # no example (a model from another exporter): none
              for i, t in zip(spec_inputs, example or (), strict=False) if not t.is_floating_point()}
    masks = {i["name"] for i, t in zip(spec_inputs, example or (), strict=False)
             if not t.is_floating_point() and t.dim() == 2 and len(torch.unique(t)) == 2 and
             set(torch.unique(t).tolist()) <= {0, 1}}
    positions = min(i["shape"][buffers[i["name"]]["axis"]] for i in spec_inputs if i["name"] in buffers) \
        if buffers else None
    feeds = []
    for batch, length in ((None, None), *VERIFY_SIZES):
        if positions is not None and length is not None:
            length = min(length, positions)
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
        if write is not None:
            at = next(k for k, i in enumerate(spec_inputs) if i["name"] == write.name)
            sequences = next(f.shape[0] for f, i in zip(feed, spec_inputs, strict=True) if i["name"] in buffers)
            length = next(f.shape[int(a)] for f, i in zip(feed, spec_inputs, strict=True)
                          if i["name"] not in buffers and i["name"] != write.name for a in i["dynamic"] if a != "0")
            feed[at] = torch.from_numpy(write.drawn(rng, sequences, length, positions))
        feeds.append((label, tuple(feed)))
    return feeds
