"""The commands as library calls: `export`, `verify` and `bench` take what their command lines
take, as the user wrote it (the repeatable `--input`/`--cache`/`--dynamic` texts, `--context
128,1024`, a variant's options as keywords), refuse what does not go together with one
`UsageError`, build the library's request and run it. The command line (`attnexport.cli`) parses,
calls these and prints what they return (`attnexport.render`); a Python caller gets the same
checks and the same results.

    from attnexport import commands
    result = commands.export(variant="mha", heads=8, flavor="ort", output="mha.onnx")
    report = commands.verify(models=["mha.onnx"], runtimes=["ort-cpu"])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from attnexport import bench as bench_mod
from attnexport import export as export_mod
from attnexport import files as F
from attnexport import load as background_load
from attnexport import modules, pretrained
from attnexport import options as O
from attnexport import verify as verify_mod
from attnexport.compare import check_tolerance_values
from attnexport.errors import UsageError
from attnexport.pretrained import clients

_MODULE_ONLY = "--input, --dynamic, --nan-rows, --allow-unfused, --cache, --write-pos and --output-names"


# --- the options as the command line spells them ---------------------------------------------------

def given(options: dict) -> dict:
    """A variant's options as the command line gives them (None: not given) as the variant takes
    them: `--kv-cache` (concat) and `--kv-cache static` (with `--max-seq`) are both the kv_cache
    option, the buffers' size telling them apart."""
    out = {k: v for k, v in options.items() if v is not None}
    cache = out.get("kv_cache")
    if cache in ("concat", "static"):
        if cache == "static" and out.get("max_seq") is None:
            raise UsageError("--kv-cache static needs --max-seq S, the buffers' positions")
        if cache == "concat" and out.get("max_seq") is not None:
            raise UsageError("--max-seq is the static cache's size: give --kv-cache static")
        out["kv_cache"] = True
    return out


def int_list(flag: str, text: str | None) -> list[int] | None:
    """`--seq 512,2048` -> [512, 2048]; None when not given."""
    if text is None:
        return None
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes positive integers, got {text!r}")
    return values


def cache_pairs(specs) -> dict:
    """`--cache INPUT:OUTPUT` (repeatable) -> {input: output}."""
    pairs = {}
    for text in specs or ():
        past, sep, present = text.partition(":")
        if not sep or not past or not present or ":" in present:
            raise UsageError(f"--cache takes INPUT:OUTPUT (e.g. past_key:present_key), got {text!r}")
        pairs[past] = present
    return pairs


def dynamic_axes(specs) -> dict | None:
    """`--dynamic NAME:AXIS=DIM` (repeatable) -> {input: {axis: dim name}}, or None."""
    if not specs:
        return None
    dynamic: dict = {}
    for t in specs:
        n, axis, dim = modules.parse_dynamic(t)
        dynamic.setdefault(n, {})[axis] = dim
    return dynamic


def module_weights(options: dict):
    """With --module, `--weights FILE` is the module's trained weights (the variant option of that
    name, an output choice, means nothing for a module); taken out of `options`."""
    weights = options.pop("weights", None)
    if weights == "softmax":  # `--weights` given without a value
        raise UsageError("with --module, --weights takes a file: a state_dict saved with torch.save, or .safetensors")
    return weights


def hf_form(options: dict) -> tuple[str | None, int]:
    """(cache form (None: the family's default), max_seq) from --kv-cache [static] and --max-seq
    (`hf_export` checks that they go together); no other variant option."""
    kv_cache, max_seq = options.pop("kv_cache", None), options.pop("max_seq", None)
    rest = {k: v for k, v in options.items() if v is not None}
    if rest:
        raise UsageError(f"--hf takes no variant options but --kv-cache and --max-seq "
                         f"({', '.join('--' + k.replace('_', '-') for k in rest)})")
    return kv_cache, max_seq or 0


def _one_source(variant, module_spec, hf_path) -> None:
    if sum(x is not None for x in (variant, module_spec, hf_path)) != 1:
        raise UsageError("give --variant NAME, --module FILE.py:NAME or --hf PATH (one of them)")


# --- export ------------------------------------------------------------------------------------

def export(variant=None, module_spec=None, hf_path=None, **passed):
    """`attnexport export`: a variant, a user's module (`module_spec`, FILE.py:NAME) or a language
    model (`hf_path`), exported and checked as the command does. Returns the export's result
    (`to_dict()`, `summary()`)."""
    a, options = O.read(O.EXPORT, {"variant": variant, "module_spec": module_spec, "hf_path": hf_path, **passed})
    _one_source(a.variant, a.module_spec, a.hf_path)
    check_tolerance_values(a.rtol, a.atol)
    if a.deploy is not None and a.hf_path is None:
        raise UsageError("--deploy writes a language model's folder: it goes with --hf")
    quant = {"block_size": a.block_size, "accuracy_level": a.accuracy_level, "keep": a.keep, "symmetric": a.symmetric,
             "requantize": a.requantize, "minimums": a.minimums, "file_widths": a.file_widths,
             "int8_kernel": a.int8_kernel}
    if a.hf_path is None and (a.precision is not None or any(v is not None for v in quant.values())):
        raise UsageError("--precision, --block-size, --accuracy-level, --keep, --symmetric, --requantize, "
                         "--minimums, --file-widths/--asked-width and --int8-kernel go with --hf")
    module_only = (a.input_specs or a.dynamic_specs or a.nan_rows or a.allow_unfused or a.cache_specs or a.write_pos
                   or a.output_names)
    if a.hf_path is not None:
        if module_only:
            raise UsageError(f"{_MODULE_ONLY} go with --module (--hf knows its model's inputs, outputs and cache)")
        hf_export = pretrained.export
        form, max_seq = hf_form(options)
        request = hf_export.request(a.hf_path, quant, **O.pick(a, hf_export.HFExport, form=form, max_seq=max_seq))
        return hf_export.export(request)
    if a.variant is not None and (a.rtol is not None or a.atol is not None):
        raise UsageError("--rtol/--atol set the check before writing of --hf and --module exports; a variant's "
                         "export is checked by verify (which takes them too)")
    if a.module_spec is None:
        if module_only:
            raise UsageError(f"{_MODULE_ONLY} go with --module")
        return export_mod.export(export_mod.ExportRequest(**O.pick(a, export_mod.ExportRequest,
                                                                   options=given(options), seed=a.seed or 0)))
    if isinstance(a.output_names, str):
        a.output_names = a.output_names.split(",")
    request = export_mod.ModuleExport(**O.pick(a, export_mod.ModuleExport, dynamic=dynamic_axes(a.dynamic_specs),
                                               name=a.module_spec, cache=cache_pairs(a.cache_specs) or None,
                                               output_names=a.output_names or None))
    weights = module_weights(options)
    if given(options):
        flags = ", ".join("--" + k.replace("_", "-") for k in given(options))
        raise UsageError(f"--module takes no variant options ({flags})")
    return export_mod.export_module_file(a.module_spec, a.input_specs, request, weights)


# --- verify ------------------------------------------------------------------------------------

def verify(models=(), *, progress: Callable | None = None, **passed):
    """`attnexport verify`: golden cases exported and run (no `models`), model files judged by
    their metadata, a model against its module (`module_spec`) or against its language model
    (`hf_path`). Returns the `verify.Report`; `progress(i, n, what)` is told of each run."""
    a, options = O.read(O.VERIFY, passed)
    if models and len(a.variants) > 1:
        raise UsageError("a MODEL takes one --variant")
    if a.clients_text is not None and a.hf_path is None:
        raise UsageError("--clients generate from a language model's deployment folder: it goes with --hf")
    if a.audio and a.hf_path is None:
        raise UsageError("--audio gives a Whisper folder's clips: it goes with --hf")
    if a.budget is not None and a.hf_path is None:
        raise UsageError("--budget is the accuracy budget of a quantized or fp16 model: it goes with --hf")
    if a.hf_path is not None:
        checking = pretrained.check
        if len(models) != 1 or a.module_spec is not None:
            raise UsageError("--hf compares one MODEL with the whole model it was exported from: give one MODEL "
                             "(and no --module)")
        if given(options) or a.variants or a.flavors or a.cases or a.input_specs or a.cache_specs or a.write_pos:
            raise UsageError("--hf takes no --variant, --flavor, --case, --input, --cache, --write-pos or variant "
                             "options: the model says what it is")
        family = pretrained.registry.of_export(models[0])
        return checking.verify_hf(checking.HFCheck(models[0], a.hf_path, **O.pick(
            a, checking.HFCheck, clients=tuple(clients.parse(a.clients_text)), budget=family.budget(a.budget))))
    if a.module_spec is not None:
        if len(models) != 1:
            raise UsageError("--module compares one MODEL with the module it was exported from: give one MODEL")
        weights = module_weights(options)
        if given(options) or a.variants or a.flavors or a.cases:
            raise UsageError("--module takes no --variant, --flavor, --case or variant options: the model and the "
                             "module say what to compare")
        return verify_mod.verify_module(models[0], a.module_spec, **O.pick(
            a, verify_mod.module_check.ModuleCheck, input_specs=[modules.parse_input(t) for t in a.input_specs] or None,
            weights_file=weights, cache=cache_pairs(a.cache_specs) or None))
    if a.input_specs or a.cache_specs or a.write_pos:
        raise UsageError("--input, --cache and --write-pos go with --module (the inputs of a MODEL exported from a "
                         "module)")
    if models and a.cases:
        raise UsageError("--case selects golden cases to export and run; a MODEL runs those of its own options")
    request = verify_mod.VerifyRequest(**O.pick(
        a, verify_mod.VerifyRequest, variants=None if models else (list(a.variants) or None),
        flavors=list(a.flavors) or None, models=list(models) or None,
        model_variant=a.variants[0] if models and a.variants else None, model_options=given(options) or None,
        cases=list(a.cases) or None))
    return verify_mod.verify(request, progress=progress)


# --- bench -------------------------------------------------------------------------------------

@dataclass
class BenchResult:
    """What `bench` measured: `rows` (bench.BenchRow, or a whole model's family's rows with `info`),
    titled `title`; `plot`, the chart written, if one was asked for."""

    rows: list
    title: str
    dtype: str
    family: Any = None  # a whole model's (`registry.Family`): it says its rows
    info: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None

    def to_json(self):
        """`bench --json`: the rows as a list; a whole model's as {"rows": [...], "info": {...}}."""
        if self.family is not None:
            return self.family.bench_json(self.rows, self.info)
        return bench_mod.to_json(self.rows)

    def lines(self) -> list[str]:
        """What a whole model's bench prints (a variant's and a module's are `render.bench_table`'s),
        under the load it ran with where there was one."""
        load = self.info.get("load", {})
        return self.family.bench_lines(self.rows, self.info, self.title) + \
            ([f"timed under a background load: {load['what']}"] if load.get("processes") else [])


def bench(variant=None, module_spec=None, hf_path=None, *, progress: Callable | None = None,
          said: Callable[[str], None] | None = None, **passed) -> BenchResult:
    """`attnexport bench`: a variant or a user's module timed on every runtime and flavour beside
    torch eager, or a whole model's engines side by side (`hf_path`: its family's bench). The sizes
    are the command line's texts (`seq="512,2048"`); `said(text)` is told what is about to be
    timed and what the run should know (a note), before it runs."""
    a, options = O.read(O.BENCH, {"variant": variant, "module_spec": module_spec, "hf_path": hf_path, **passed})
    said = said or (lambda text: None)
    _one_source(a.variant, a.module_spec, a.hf_path)
    if (a.genai_python or a.precisions_text or a.genai_precisions_text) is not None and a.hf_path is None:
        raise UsageError("--genai-python, --precision and --genai-precision go with --hf")
    contexts = int_list("--context", a.context)
    if a.audio is not None and a.hf_path is None:
        raise UsageError("--audio goes with --hf and a model that hears it")
    if a.load and a.hf_path is None:
        raise UsageError("--load goes with --hf (a whole model's engines timed on a shared machine)")
    if a.hf_path is not None:
        told = SimpleNamespace(**vars(a), options=options, contexts=contexts, batches=int_list("--batch", a.batch),
                               seqs=int_list("--seq", a.seq))
        if a.load:
            said(f"note: timing under a background load: {background_load.describe(a.load)}")
        with background_load.background(a.load):
            family, rows, info = pretrained.bench.run(a.hf_path, told, said)
        info = {**info, "load": {"processes": a.load, "what": background_load.describe(a.load)}}
        return BenchResult(rows, str(a.hf_path), "fp32", family=family, info=info)
    if contexts and not a.decode:
        raise UsageError("--context goes with --decode")
    title = a.module_spec or a.variant
    if a.module_spec is not None:
        weights = module_weights(options)
        if a.decode or given(options) or a.kv_seq:
            raise UsageError("--module takes --batch and --seq (no --decode, --kv-seq or variant options)")
        loaded, example, names = modules.load_with_inputs(a.module_spec, a.input_specs, a.seed or 0, weights)
        a.variant = bench_mod.module_variant(a.module_spec, loaded, example, names)
    elif a.input_specs:
        raise UsageError("--input goes with --module")
    opts = given(options)
    for name, text in (("batch", a.batch), ("seq", a.seq), ("kv_seq", a.kv_seq)):
        values = int_list("--" + name.replace("_", "-"), text)
        if values:
            opts[name] = values
    request = bench_mod.BenchRequest(**O.pick(a, bench_mod.BenchRequest, options=opts, flavors=list(a.flavors) or None,
                                                 seed=a.seed or 0))
    chart = str(F.resolve_target(a.plot)) if a.plot else None  # refused before the benchmark runs, not after
    for w in bench_mod.warnings_for(a.runtimes, a.dtype, a.cuda_graph):
        said(f"note: {w}")
    rows = bench_mod.bench_decode(request, None, contexts, progress=progress) if a.decode else \
        bench_mod.bench(request, progress=progress)
    if chart:
        bench_mod.plot(rows, chart, f"{title} {a.dtype}, median latency")
    return BenchResult(rows, title, a.dtype, plot=chart)
