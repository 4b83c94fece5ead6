"""A whole language model's export (`export --hf`): its step graph through the module path, checked
before it is written against the same model in float64 (`attnexport.pretrained.reference`), written as one
file or as the folder a deployment loads (config, generation config, tokenizer, `onnx/model.onnx`:
what Optimum's ORTModelForCausalLM and transformers.js read)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from attnexport import aside as A
from attnexport import dtypes as D
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import localize as L
from attnexport import runtimes as R
from attnexport import usage as U
from attnexport import weights as W
from attnexport.compare import QUANTIZED_FACTOR
from attnexport.errors import ExportError, UsageError, reason
from attnexport.export import ModuleExport, ModuleExportResult, export_module
from attnexport.pretrained import calibrate, emulate, forms, fusions, ggml, registry, tanh_gelu
from attnexport.pretrained import layers as LC
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained.fusions import rotary, tied_head
from attnexport.record import ExportRecord

# A source folder's files a deployment keeps as they are: the tokenizer and the generation config.
_KEPT = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
         "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
         "generation_config.json")


@dataclass(frozen=True)
class HFExport:
    """How to export a language model (`export --hf`).

    Attributes:
        source: a save_pretrained folder, a GGUF file or a model id (see `hf.load`).
        form: the cache form: `none`, `concat`, `static` (None: the family's default: none for a
            causal language model, embed for a sentence encoder).
        max_seq: the static buffers' positions.
        flavor, opset, dtype: the module export's settings.
        seed: a config-only folder's weights are drawn from it (None: such a folder is refused).
        output: the .onnx file to write; None with no deploy: in memory only.
        deploy: a folder to write as a deployment loads it (config.json, generation_config.json,
            the tokenizer's files, the model in onnx/), instead of `output`.
        rtol, atol: the user's budget for every output of the check before writing, instead of the
            one derived from torch's fp32 error (`attnexport.pretrained.reference`).
        precision: fp32, fp16 (the model exported in half), int8 or int4 (its weight matrices as
            MatMulNBits, `attnexport.pretrained.precision`).
        plan: how int8/int4 quantize (default: the precision's in `precision.TABLE`).
        external_data: the weights in one file beside the graph (`files.data_file`), written before
            the check, which loads them from there; False: all in the .onnx; None: beside it when
            the graph's weights reach EXTERNAL_FROM (a file above protobuf's 2 GB limit cannot be one).
        memory_check: refuse, before it loads, a model the machine has not the memory to export
            (`model.check_fits`).
        frees_model: the model is the export's own (`export` loads it): its weights are let go
            once the check before writing has run it (in torch and in float64), before ONNX
            Runtime runs the graph, so the two are never held together.
        grids_from: the GGUF file whose own blocks int8/int4 carry (`precision.file_grid`), where
            the source is a folder saved from it (bench's); None: the source, where it is one.
        stamp: a model of more than three alike layers traced with three, the rest stamped from the
            third's graph (`attnexport.stamping`); False: every layer traced.
    """

    source: str | Path
    form: str | None = None
    max_seq: int = 0
    flavor: str | None = None
    opset: int | None = None
    dtype: str = "fp32"
    output: str | Path | None = None
    seed: int | None = None
    deploy: str | Path | None = None
    rtol: float | None = None
    atol: float | None = None
    precision: str = "fp32"
    plan: P.Plan | None = None
    external_data: bool | None = None
    memory_check: bool = True
    frees_model: bool = False
    grids_from: str | Path | None = None
    stamp: bool = True


# From this many bytes of weights in the graph's float type, a whole model's weights go beside its graph.
EXTERNAL_FROM = 1 << 30
PROTOBUF_LIMIT = F.PROTOBUF_LIMIT

# The options of a quantization plan as `export --hf` names them (`precision.plan_for`'s keywords).
PLAN_OPTIONS = ("block_size", "accuracy_level", "keep", "symmetric", "requantize", "minimums", "file_widths",
                "int8_kernel")


def request(source: str | Path, plan_options: dict | None = None, **fields) -> HFExport:
    """`export --hf`'s request from its options as the command line takes them: `fields` are
    HFExport's (precision None: fp32), `plan_options` the plan's (PLAN_OPTIONS; None or absent: the
    precision's default): the precision's plan with those given applied (`keep="none"` keeps
    nothing; a plan's option with fp32 or fp16 refused), and the file written named after the
    source (`models/<name>.onnx`) where neither `output` nor `deploy` is given; an `output` that
    cannot be written is refused here, before anything runs."""
    how = {k: v for k, v in (plan_options or {}).items() if v is not None}
    unknown = set(how) - set(PLAN_OPTIONS)
    if unknown:
        raise TypeError(f"unknown plan options: {', '.join(sorted(unknown))}")
    precision = fields.pop("precision", None) or "fp32"
    plan = None
    if how or precision in P.QUANTIZED:
        plan = P.plan_for(precision, how.get("block_size"), how.get("accuracy_level"),
                          "" if how.get("keep") == "none" else how.get("keep"), how.get("symmetric"),
                          None if how.get("requantize") is None else not how["requantize"], how.get("minimums"),
                          how.get("file_widths"), how.get("int8_kernel"))
    output, deploy = fields.get("output"), fields.get("deploy")
    if output is not None and deploy is not None:
        raise UsageError("give -o FILE.onnx or --deploy FOLDER, not both")
    if output is not None:
        F.resolve_target(Path(output))
    if output is None and deploy is None:
        name = Path(str(source).rstrip("/"))
        fields["output"] = str(F.default_output((name.stem if name.suffix.lower() == ".gguf" else name.name)
                                                or "model"))
    return HFExport(source, precision=precision, plan=plan, **fields)


def export(request: HFExport) -> Any:
    """`export --hf`: the model at `request.source` exported as its family does (`Family.export`:
    one step graph, `export_hf`, or a family's graphs); returns the result (`summary()`, `to_dict()`)."""
    _check_request(request)
    mapped = _maps_weights(request)
    with hf.gguf_parsed_once():
        if request.memory_check:
            work = ("export quantized" if request.precision in P.QUANTIZED else
                    "export in one file" if request.external_data is False else "export")
            hf.check_fits(request.source, work + (", mapped" if mapped is not None else ""))
        with U.metered() as meter:
            with U.phase("load"):
                model, params_source = hf.load(request.source, request.seed, mapped_in=mapped)
                hf.loaded_readers_dropped(request.source)
            result = registry.of_model(model).export(replace(request, frees_model=True), model, params_source)
    if hasattr(result, "resources"):
        result.resources = meter.to_dict()
        result.notes.append(meter.line())
    return result


def _maps_weights(r: HFExport) -> Path | None:
    """Where an export that writes its weights beside the graph (a model of EXTERNAL_FROM bytes in
    float32 or more, by its files' headers, or --external-data) maps the model's float32 weights
    from a file rather than holding them (`model.map_float32`): the folder of the output (or of the
    deployment folder, which is not made before the export succeeds), whose disk takes the weights
    anyway; None where the export holds them (one file, a small model)."""
    folder = Path(str(r.source))
    if r.external_data is False or not folder.is_dir() or registry.reading(folder) is not None:
        return None  # a GGUF file is dequantized by transformers, a family's own folder read by the family
    count = hf.parameter_count(r.source)
    if not r.external_data and (count is None or 4 * count < EXTERNAL_FROM):
        return None
    target = r.deploy if r.deploy is not None else r.output
    beside = Path(target).resolve().parent if target is not None else None
    return beside if beside is not None and beside.is_dir() else Path(tempfile.gettempdir())


def _check_request(r: HFExport) -> None:
    """What a request can be refused for before the model loads."""
    if r.form is not None:  # the family's own forms are checked once the model is loaded
        registry.form(r.form).check_max_seq(r.max_seq)
    else:
        forms.no_max_seq(r.max_seq)
    if r.deploy is not None and r.output is not None:
        raise UsageError("give -o FILE.onnx or --deploy FOLDER, not both")
    _precision(r)
    if r.deploy is not None:
        F.deploy_target(Path(r.deploy))


def file_tensors(source):
    """A GGUF source's tensors, found by their values (`ggml.Tensors`: what int8/int4 carry from the
    file's own blocks), or None for any other source."""
    path = Path(str(source))
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    return ggml.Tensors(path)


def export_hf(request: HFExport, loaded: tuple | None = None) -> tuple[ModuleExportResult, hf.Layout]:
    """Exports the model at `request.source` (or `loaded`: the model and where its parameters came
    from, loaded already) in its cache form, checked against the model in float64 before anything is
    written; returns (the ModuleExportResult, the layout)."""
    r = request
    _check_request(r)
    dtype, plan = _precision(r)
    deploy = F.deploy_target(Path(r.deploy)) if r.deploy is not None else None
    model, params_source = loaded or hf.load(r.source, r.seed)
    layout = hf.layout_of(model, r.form, r.max_seq, r.source)
    form = layout.cache_form
    tokenizer = hf.tokenizer_of(r.source)
    hf.check_tokenizer(layout, tokenizer, r.source)
    wrapper = hf.step_module(model, layout)
    if plan is not None and plan.kernel is None:  # the family's int8 form
        plan = replace(plan, kernel=layout.family.int8_kernel if plan.bits == 8 else "blockwise")
    if plan is not None and plan.kernel == "integer" and layout.family.calibration(layout, tokenizer) is None:
        raise UsageError(f"--int8-kernel integer is calibrated on a family's own text, which sentence encoders have; "
                         f"a {layout.family.what}'s int8 is the blockwise form (MatMulNBits)")
    # The example only shapes the trace; the check below feeds what the model writes.
    block, past = form.trace_shape
    feed = hf.example_feed(layout, block=block, past=past)
    example = tuple(torch.from_numpy(v) for v in feed.values())
    flavor = r.flavor or FL.DEFAULT
    opset = FL.opset_for(flavor, r.opset, list(form.needs))
    name = f"{model.config.model_type} ({layout.form})"
    quantized: dict = {}

    def quantize(onnx_model):
        # The float matrices the quantized ones stand for (in half, those the graph rounds: a grid is
        # carried from these), each read from the module when it is needed.
        before = SourceMatrices(onnx_model, wrapper, layout.vocab)
        quantized["before"] = before
        calibration = None
        if plan.kernel == "integer" and plan.calibrate:
            calibration = calibrated(onnx_model, wrapper, layout, tokenizer, name)
        quantized["done"] = P.quantize(onnx_model, plan, layout.layers, layout.vocab,
                                       weights=before if dtype != "fp32" else None,
                                       tensors=file_tensors(r.grids_from or r.source), calibration=calibration)
        return onnx_model

    expected: dict = {}

    def expect():  # the check's torch side: the model in float64, a layer at a time (no float64 copy of it)
        return expectations(HR.Reference(model, layout, dtype, r.rtol, r.atol), tokenizer)

    # A float graph's reference is computed aside from now, while the model is traced and its weights
    # written (`aside`: a forked child on the other core); where the platform does not fork, on a
    # thread of its own while the weights are written.
    forked = plan is None and A.forks()
    aside: A.Aside | None = None

    stalled: list[str] = []
    spelled: list[int] = []  # the tanh GELUs written as their formula (`_rewritten`)

    def check(onnx_model):
        release = (lambda: release_weights(model)) if r.frees_model else None
        if plan is None:
            try:
                cases = aside.result() if aside is not None else expected.pop("cases", None) or expect()
            except A.Stalled as e:  # computed here instead, and said
                stalled.append(f"{e}: computed in this process instead")
                cases = expect()
            return check_before_writing(onnx_model, layout, cases, name, release=release)
        return check_quantized(onnx_model, model, layout, quantized["before"], tokenizer, name, r, release=release)

    external = external_data(r, model, dtype)
    output = None if deploy else r.output
    scratch = None
    if external and deploy is not None:  # the graph and its data staged here, then moved into the folder
        scratch = Path(tempfile.mkdtemp(prefix=".attnexport-", dir=deploy if deploy.exists() else deploy.parent))
        output = scratch / Path(layout.cache_form.deploy_file).name
    module_request = ModuleExport(
        flavor=flavor, opset=opset, dtype=dtype, dynamic=form.dynamic_axes(layout),
        output=output, input_names=list(feed), name=name, external_data=external,
        seed=r.seed if params_source == "seed" else None, output_names=layout.outputs,
        cache=layout.cache_pairs or None,
        record={"params_source": params_source}, model_sizes=layout.sizes(),
        write_pos=layout.signature.write_pos.name if layout.signature.write_pos else None,
        cache_kinds={c.past: c.kind for c in layout.signature.caches},
        check=check, finalize=quantize if plan is not None else None,
        rewrite=lambda onnx_model: _rewritten(onnx_model, model, layout, flavor, dtype, name, spelled,
                                              quantized=plan is not None and plan.kernel != "integer"),
        optimized_by_rewrite=FL.FLAVORS[flavor].fuses_language_models, float32_inputs=form.float32_inputs(layout),
        repeat=form.repeat(wrapper, layout) if r.stamp else None,
        beside_write=(lambda: expected.update(cases=expect())) if plan is None and not forked else None,
        shares_cores=forked)
    try:
        if forked:
            aside = A.Aside(expect, "the float64 reference")
        result = export_module(wrapper, example, module_request)
    except ExportError as e:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if module_request.repeat is not None and "float64" in str(e):  # a departure from the model
            raise ExportError(f"{e} (the graph may have been stamped from three of its layers: "
                              "--trace-all-layers traces every one)") from None
        tested = layout.family.tested
        if model.config.model_type not in tested:
            raise ExportError(f"{e} (model type {model.config.model_type!r} is not one attnexport tests: "
                              f"{', '.join(tested)})") from None
        raise
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        if aside is not None:  # the export failed before its check: the child is not waited for
            aside.cancel()
    if external:
        result.notes.append(f"the weights are in {F.data_file(str(result.path or output)).name} beside the graph "
                            "(external data: keep the two files together)")
    result.notes.append(_checked_note(result.checked))
    if sum(spelled):
        result.notes.append(f"{sum(spelled)} Gelu(approximate='tanh') written as its formula with Tanh "
                            "(onnxruntime-web's WebGPU kernel for it errs by 4.7e-4 on Chromium's software adapter, "
                            "its Tanh by 1.3e-7)")
    result.notes.extend(stalled)
    if params_source == "seed":
        result.notes.append(hf.random_note(r.source, r.seed))
    if plan is not None:
        ops = sorted({e["op"] for e in quantized["done"].entries if e["how"] == "integer"})
        how = (" and ".join(ops) + ": int8 weights per column, uint8 activations per tensor"
               + (f"; smoothing and float matrices chosen by what each of "
                  f"{len(quantized['done'].calibration['per_input'])} inputs costs on calibration text"
                  if quantized["done"].calibration else "")
               if plan.kernel == "integer" else f"block {plan.block}, accuracy level {plan.accuracy}")
        result.notes.append(f"{r.precision}: {quantized['done'].summary()} ({how}); what it costs in answers: "
                            "attnexport verify MODEL --hf SOURCE")
    result.notes.extend(form.notes(result.attention_op, dtype))
    if deploy is not None:
        try:
            result.path = write_deployment(deploy, result, model, r.source, tokenizer, layout)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
    return result, layout


def external_data(r: HFExport, model, dtype: str) -> bool:
    """Whether the export writes its weights beside the graph: as asked, else from EXTERNAL_FROM
    bytes of weights in the graph's float type (a quantized graph's counted as float: its
    embedding stays so); asking for one file above protobuf's limit is a UsageError."""
    size = sum(p.numel() for p in model.parameters()) * D.NUMPY[dtype]().itemsize
    if r.external_data is False and size > PROTOBUF_LIMIT and r.precision not in P.QUANTIZED:
        raise UsageError(f"--one-file: the model's weights are {F.human_size(size)} in {dtype}, above the 2 GB "
                         "protobuf holds in one .onnx file: export with --external-data (the default at this size)")
    return r.external_data if r.external_data is not None else size >= EXTERNAL_FROM


class SourceMatrices(Mapping):
    """{weight initializer: (K, N) float32} of every matrix of a graph about to be quantized: put
    together from `module`'s float32 parameters as the export's record places them (a parameter's
    columns, transposed) each time one is read, so that no copy of a whole model's matrices is
    held; a matrix the record does not fill whole from transposed parameters is copied from the
    graph when this is made (before the quantizer replaces it)."""

    def __init__(self, onnx_model, module, vocab: int | None):
        # The parameters themselves, not state_dict()'s detached views of them: when the check lets the
        # model's weights go (`release_weights`), nothing here keeps their memory.
        self._state = dict(module.named_parameters(remove_duplicate=False))
        layouts = {k: e.get("layout") for k, e in ExportRecord.of(onnx_model).parsed("params", {}).items()}
        inits = {i.name: i for i in onnx_model.graph.initializer}
        self._sites: dict = {}
        self._copied: dict = {}
        for s in P.sites(onnx_model, vocab, attention=True):
            covered = np.zeros(s.n, bool)
            for name, columns in s.params.items():
                start, stop = columns if columns is not None else (0, s.n)
                p = self._state.get(name)
                if p is not None and layouts.get(name) == "transposed" and tuple(p.shape) == (stop - start, s.k):
                    covered[start:stop] = True
            if covered.all():
                self._sites[s.weight] = s
            else:
                self._copied[s.weight] = np.array(W.values(inits[s.weight]), dtype=np.float32)

    def __getitem__(self, weight: str) -> np.ndarray:
        if weight in self._copied:
            return self._copied[weight]
        s = self._sites[weight]
        w = np.empty((s.k, s.n), np.float32)
        for name, columns in s.params.items():
            start, stop = columns if columns is not None else (0, s.n)
            p = self._state.get(name)
            if p is not None and tuple(p.shape) == (stop - start, s.k):
                w[:, start:stop] = p.detach().float().numpy().T
        return w

    def __contains__(self, weight) -> bool:  # Mapping's own would put the matrix together
        return weight in self._sites or weight in self._copied

    def rows(self, weight: str, first: int, stop: int) -> np.ndarray:
        """Columns [first, stop) of the matrix as (stop - first, K) rows: its parameters' own rows
        where one parameter holds them all (no copy), else put together."""
        if weight in self._copied:
            return self._copied[weight][:, first:stop].T
        s = self._sites[weight]
        pieces: dict = {}  # by first column: a tied matrix's two names hold the same columns
        for name, columns in s.params.items():
            start, end = columns if columns is not None else (0, s.n)
            p = self._state.get(name)
            if p is not None and start < stop and first < end and tuple(p.shape) == (end - start, s.k):
                pieces[start] = p.detach()[max(first, start) - start:min(stop, end) - start].float().numpy()
        if len(pieces) == 1:
            return next(iter(pieces.values()))
        return np.concatenate([pieces[start] for start in sorted(pieces)])

    def __iter__(self):
        return iter([*self._sites, *self._copied])

    def __len__(self) -> int:
        return len(self._sites) + len(self._copied)


def _precision(r: HFExport) -> tuple[str, P.Plan | None]:
    """(the dtype the model is exported in, the quantization plan or None) of `r.precision`."""
    if r.precision not in P.PRECISIONS:
        raise UsageError(f"--precision is one of {', '.join(P.PRECISIONS)}, got {r.precision!r}")
    if r.precision != "fp32" and r.dtype != "fp32":
        raise UsageError("give --precision or --dtype, not both (--precision fp16 is --dtype fp16)")
    if r.plan is not None and r.precision not in P.QUANTIZED:
        raise UsageError(f"--precision {r.precision} quantizes nothing: a quantization plan goes with int8 or int4")
    precision = P.TABLE[r.precision]
    if precision.plan is not None:
        return precision.activations, r.plan or precision.plan
    return (r.dtype if precision.activations == "fp32" else precision.activations), None  # fp32 takes --dtype


def calibrated(onnx_model, wrapper, layout: hf.Layout, tokenizer, name: str) -> P.Calibration | None:
    """The integer int8 form's smoothing and float matrices (`calibrate.choose`) on the family's
    calibration text, or None where the family has none."""
    found = layout.family.calibration(layout, tokenizer)
    if found is None:
        return None
    if layout.family.needs_tokenizer and tokenizer is None:
        raise UsageError(f"{name}: the integer int8 form is calibrated on text, and the source has no tokenizer")
    feeds, cost, target = found
    with U.phase("calibration"):
        return calibrate.choose(wrapper, onnx_model, P.sites(onnx_model, layout.vocab, attention=True), feeds,
                                layout.outputs, cost, target)


def check_quantized(graph, model, layout: hf.Layout, before: dict, tokenizer, name: str, r: HFExport,
                    release=None) -> list:
    """The checks of a quantized step graph before it is written: every quantized matrix is a
    quantization of the float one it replaced (a carried grid bit for bit, ONNX Runtime's within a
    step); the graph with float activations computes what its weights say (against the model with
    the file's weights, in float64, at its form's export_checks shapes, fp32's derived budget); and the graph as
    written runs at each shape with finite logits. What it costs in answers is verify's to say.
    `graph` is the ModelProto, or the path of one staged with its external data: then its weights
    are read from the data file where they are needed (mapped), the twin with float activations is
    staged beside it, naming the same data, and both sessions map the file (no copy of the
    quantized weights is held in memory). `release()` (where given) lets the model's weights go once
    the float64 side is computed, before ONNX Runtime's sessions are made."""
    onnx_model = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph), load_external_data=False)
    bad = P.unfaithful(before, onnx_model)
    if bad:
        raise ExportError(f"{name}: the quantized weights are not a quantization of the model's: {bad[0]}"
                          + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    # The model computing with the file's weights, each matrix decoded as its layer runs (no copy of
    # the model): what the graph with float activations is checked against.
    with emulate.decoding_from_file(model, onnx_model):
        held = HR.Reference(model, layout, P.TABLE[r.precision].activations, r.rtol, r.atol, QUANTIZED_FACTOR)
        feeds = [(label, layout.family.check_feed(held, tokenizer, batch, block, past, padded, seed=1))
                 for label, batch, block, past, padded in layout.cache_form.export_checks]
        twin_model = P.float_activations(onnx_model)
        twin: onnx.ModelProto | str = twin_model
        if not isinstance(graph, onnx.ModelProto):  # beside the staged graph, its data named as the graph names it
            path = Path(graph).with_name(f"float-activations-{Path(graph).name}")
            onnx.save(twin_model, str(path))
            twin = str(path)
        checked = check_before_writing(twin, layout, expectations(held, tokenizer, feeds), name, release=release,
                                       prepack=True)
    session = R.prepare_onnx("ort-cpu", graph if isinstance(graph, onnx.ModelProto) else str(graph))
    first = layout.outputs[0]  # logits, or an encoder's token states
    for label, feed in feeds:
        got = np.asarray(session.run(feed)[first])
        if not np.isfinite(got).all():
            raise ExportError(f"{name}: the quantized export gives {first} that are not finite at {label}")
    return checked


def _rewritten(onnx_model, model, layout: hf.Layout, flavor: str, dtype: str, name: str, spelled: list,
               quantized: bool = False):
    """The traced step graph made what a deployment wants: each past fitting the block's batch
    (concat), a tied vocabulary matrix kept once as the head reads it, ONNX Runtime's fused ops
    (ort flavour; an encoder's projections packed into its attention in fp32, where they are
    neither rounded to half nor left for the blockwise quantizer's MatMuls (`quantized`): the
    integer form makes the packed Attention a QAttention); see `attnexport.pretrained.fusions`. In
    an fp32 graph of the portable flavours, GELU's tanh approximation written as its formula
    (`tanh_gelu`: WebGPU's kernel errs), how many appended to `spelled`."""
    layout.cache_form.fit_pasts(onnx_model, layout)
    tied_head.tied_head(onnx_model)
    if dtype == "fp32" and not FL.FLAVORS[flavor].fuses_language_models:
        spelled.append(tanh_gelu.spell_out(onnx_model))
    if FL.FLAVORS[flavor].fuses_language_models:
        positions = layout.cache_form.rotary_positions(model, layout)
        tables = rotary.rotary_tables(model, positions, D.NUMPY[dtype]) if positions else None
        onnx_model = fusions.fuse_for_ort(onnx_model, tables, layout.cache_form.writes_in_place, name,
                                          encoder=layout.family.fuses_encoder_layers,
                                          packed=dtype == "fp32" and not quantized)
    return onnx_model


def release_weights(model) -> None:
    """Lets go of every parameter of `model` (each left an empty tensor: running it again fails
    loudly), so that its memory goes back before ONNX Runtime maps the graph's own copy."""
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                p.data = torch.empty(0, dtype=p.dtype)
    gc.collect()


def expectations(reference: HR.Reference, tokenizer, feeds: list | None = None) -> list:
    """The torch side of `check_before_writing`: each of the form's export_checks shapes' (label,
    feed, the model's float64 outputs with each layer's). `feeds`: each shape's (label, feed), where
    the caller has made them already. It reads the model only, never the graph's file, so an
    export computes it while the weights are written (`ModuleExport.beside_write`)."""
    layout = reference.layout
    with U.phase("reference"):
        if feeds is None:
            feeds = [(label, layout.family.check_feed(reference, tokenizer, batch, block, past, padded, seed=1))
                     for label, batch, block, past, padded in layout.cache_form.export_checks]
        return [(label, feed, reference.expect(feed, layers=True)) for label, feed in feeds]


def check_before_writing(onnx_model, layout: hf.Layout, cases: list, name: str, release=None,
                         prepack: bool = False) -> list:
    """The step graph (a ModelProto, or the path of one staged with its external data) on ONNX
    Runtime's CPU provider at each of its form's export_checks shapes against the model in
    float64, each output within its budget, and each decoder layer alone within its own
    (`attnexport.pretrained.layers`: its input the float64 model's); an ExportError (nothing
    written) naming the first output that is not, and the first layer that departs. Returns, a
    shape each: its label, each output's worst error and budget, and its layers' worst.
    `cases`: each shape run in torch first (`expectations`); then `release()` (where given) lets
    the model's weights go, and ONNX Runtime runs the graph. `prepack`:
    ONNX Runtime's sessions pack the weights for their kernels, as a quantized graph wants (without,
    each run of a MatMulNBits decodes its whole matrix: 3 s a run of a 1.07B int4 graph against
    0.03-0.4 s, for the packed copy's 0.5-0.9 GB); a float graph's are not packed (a copy of every
    weight for a few runs)."""
    if release is not None:
        release()
    with U.phase("check session"):
        session = R.prepare_onnx("ort-cpu", onnx_model, prepack=prepack)
    checked = []
    failure = None
    for label, feed, expected in cases:
        try:
            got = session.run(feed)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's reason, in one line
            raise ExportError(f"{name}: the export does not run on ONNX Runtime at {label} ({reason(e)[:300]})") \
                from None
        comparisons = expected.compare(got, layout.outputs)
        bad = [c for c in comparisons if not c]
        if bad and L.nonfinite(got):
            raise ExportError(f"{name}: the export overflows at {label}: {L.overflow_said(onnx_model, feed)}")
        if bad:
            failure = f"{name}: the export differs from the model in float64 at {label}: {bad[0]}"
            break
        first, rest = comparisons[0], comparisons[1:]  # logits, or an encoder's token states, first
        presents = set(layout.cache_pairs.values())
        caches = [c for c in rest if c.name in presents]
        entry = {"step": label, first.name: _worst(first),
                 **{c.name: _worst(c) for c in rest if c.name not in presents}}
        if caches:
            entry["cache"] = _worst(max(caches, key=lambda c: c.needed_atol / max(c.atol, 1e-30)))
        checked.append(entry)
    del session
    sides = [(label, feed, expected.layers) for label, feed, expected in cases if expected.layers is not None]
    if len(sides) == len(cases):
        with U.phase("layers"):
            layer_checks = LC.check_layers(onnx_model, sides, prepack=prepack)
        departed = next((c for c in layer_checks if c.departing is not None), None)
        if departed is not None and (i := departed.departing) is not None:
            said = (f"layer {i} of {len(departed.comparisons)} departs at {departed.label}, its input the float64 "
                    f"model's: {departed.comparisons[i]}")
            raise ExportError(f"{failure}; the first layer to depart: {said}" if failure else f"{name}: {said}")
        for entry, check in zip(checked, layer_checks, strict=False):
            entry["layers"] = check.to_dict()
    if failure:
        raise ExportError(failure + ("; no layer departs alone (their errors add up)" if len(sides) == len(cases)
                                     else ""))
    return checked


def _worst(c) -> dict:
    return {"output": c.name, "max_abs": c.max_abs, "atol": c.atol, "rtol": c.rtol, "basis": c.basis}


def _checked_note(checked: list) -> str:
    first = next(k for k in checked[0] if k != "step")  # logits, or an encoder's token states
    worst = max((e[first] for e in checked), key=lambda w: w["max_abs"])
    said = (f"checked against the model in float64 at {len(checked)} step shapes: {first} max abs "
            f"{worst['max_abs']:.3g}, budget atol {worst['atol']:.3g} rtol {worst['rtol']:g} ({worst['basis']})")
    layers = [e["layers"] for e in checked if "layers" in e]
    if not layers:
        return said + "; its layers not checked alone (no single stack of decoder layers)"
    done = [w for e in layers if (w := e["worst"])]
    top = max(done, key=lambda w: w["of_budget"]) if done else None
    compared = min(e["compared"] for e in layers)
    said += (f"; each of its {layers[0]['layers']} layers alone (its input the float64 model's), "
             f"{compared} of them found in the graph")
    if top is not None:
        said += f", the worst layer {top['layer']} at {top['of_budget']:.2g} of its budget"
    return said


# --- the deployment folder -----------------------------------------------------------------------

def write_deployment(folder: Path, result: ModuleExportResult, model, source, tokenizer, layout: hf.Layout) -> Path:
    """Writes the deployment folder: config.json and generation_config.json (the model's), the
    tokenizer's files (the source folder's as they are, or the tokenizer a GGUF file holds, saved),
    and the model at its form's `deploy_file`, as `files.write_folder` writes a folder (nothing
    half-written). Returns the model's path."""
    onnx_model = result.model
    assert onnx_model is not None

    def fill(staging: Path) -> None:
        source_dir = Path(source)
        kept = [f for f in _KEPT if source_dir.is_dir() and (source_dir / f).is_file()]
        for f in kept + layout.family.deploy_files(source):
            (staging / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source_dir / f, staging / f)
        if tokenizer is not None and not any(f.startswith("tokenizer") for f in kept):
            with contextlib.redirect_stdout(None):
                tokenizer.save_pretrained(str(staging))
        portable_tokenizer_config(staging)
        layout.family.finish_folder(staging, source, layout)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["use_cache"] = layout.cache_form.caches
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if "generation_config.json" not in kept and getattr(model, "generation_config", None) is not None:
            (staging / "generation_config.json").write_text(model.generation_config.to_json_string())
        model_file = staging / layout.cache_form.deploy_file
        model_file.parent.mkdir()
        if result.path is not None:  # written with its external data already (`export_hf`): moved in
            os.replace(F.data_file(result.path), F.data_file(model_file))
            os.replace(result.path, model_file)
        else:
            onnx.save_model(onnx_model, str(model_file))
    F.write_folder(folder, fill)
    return folder / layout.cache_form.deploy_file


# The tokenizer class transformers 5 writes for a fast tokenizer of its own, which transformers 4
# (Optimum's, whose optimum-onnx pins it below 4.58) cannot import; the class both load it as.
_NEW_TOKENIZER_CLASSES = ("TokenizersBackend",)
_PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def portable_tokenizer_config(folder: Path) -> None:
    """The deployment folder's tokenizer_config.json made readable by every client: a chat template
    kept in chat_template.jinja (how transformers writes it now) also in the config's
    `chat_template`, the one place transformers.js 4 reads it; and a tokenizer class only
    transformers 5 knows named as the fast tokenizer class both transformers 4 and 5 load (the
    tokenizer.json beside it is the tokenizer itself)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    template = folder / "chat_template.jinja"
    changed = False
    if template.is_file() and not config.get("chat_template"):
        config["chat_template"] = template.read_text()
        changed = True
    if config.get("tokenizer_class") in _NEW_TOKENIZER_CLASSES and (folder / "tokenizer.json").is_file():
        config["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
        changed = True
    if changed:
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
