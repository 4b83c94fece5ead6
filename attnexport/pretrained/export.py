"""A whole language model's export (`export --hf`): its step graph through the module path, checked
before it is written against the same model in float64 (`attnexport.pretrained.reference`), written as one
file or as the folder a deployment loads (config, generation config, tokenizer, `onnx/model.onnx`:
what Optimum's ORTModelForCausalLM and transformers.js read)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from attnexport import dtypes as D
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import runtimes as R
from attnexport.compare import QUANTIZED_FACTOR
from attnexport.errors import ExportError, UsageError, reason
from attnexport.export import ModuleExport, ModuleExportResult, export_module
from attnexport.pretrained import accuracy as A
from attnexport.pretrained import fusions as HF
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR

# The step shapes an export is checked at before it is written: (label, batch, block, past,
# padded). Each cache is written by the model from a token prefix; the none form's `past` is 0.
# The static form's stay within 8 positions (the least --max-seq) and give a block over written
# positions at batch 1 only (GroupQueryAttention's limit, see attnexport.export.GQA_BLOCKS).
CHECKS = {
    "none": [("batch 2, 6 tokens", 2, 6, 0, 0), ("batch 1, one token", 1, 1, 0, 0),
             ("batch 3, 7 tokens, sequence 0 left-padded by 3", 3, 7, 0, 3)],
    "concat": [("batch 1, one token after 1", 1, 1, 1, 0),
               ("batch 3, block 6 after 4, sequence 0 left-padded by 2", 3, 6, 4, 2),
               ("batch 2, block 4, no past", 2, 4, 0, 0)],
    "static": [("batch 1, one token into empty buffers", 1, 1, 0, 0),
               ("batch 3, block 6 into empty buffers", 3, 6, 0, 0), ("batch 2, one token after 7", 2, 1, 7, 0),
               ("batch 1, block 3 after 5", 1, 3, 5, 0)],
}
MIN_MAX_SEQ = 8

# Where the step graph goes in a deployment folder: the name Optimum and transformers.js load for
# the forms they run (none: no cache; concat: Optimum's names); the static form's inputs (write_pos,
# buffers) are attnexport's own, and no client loads them, so its file says what it is.
DEPLOY_FILES = {"none": "onnx/model.onnx", "concat": "onnx/model.onnx", "static": "onnx/model_static.onnx"}
# A source folder's files a deployment keeps as they are: the tokenizer and the generation config.
_KEPT = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
         "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclass(frozen=True)
class HFExport:
    """How to export a language model (`export --hf`).

    Attributes:
        source: a save_pretrained folder, a GGUF file or a model id (see `hf.load`).
        form: the cache form: `none`, `concat`, `static`.
        max_seq: the static buffers' positions.
        flavor, opset, dtype, seed: the module export's settings (seed: a config-only folder's weights).
        output: the .onnx file to write; None with no deploy: in memory only.
        deploy: a folder to write as a deployment loads it (config.json, generation_config.json,
            the tokenizer's files, the model in onnx/), instead of `output`.
        rtol, atol: the user's budget for every output of the check before writing, instead of the
            one derived from torch's fp32 error (`attnexport.pretrained.reference`).
        precision: fp32, fp16 (the model exported in half), int8 or int4 (its weight matrices as
            MatMulNBits, `attnexport.pretrained.precision`).
        plan: how int8/int4 quantize (default: `precision.DEFAULT_PLANS`).
    """

    source: str | Path
    form: str = "none"
    max_seq: int = 0
    flavor: str | None = None
    opset: int | None = None
    dtype: str = "fp32"
    output: str | Path | None = None
    seed: int = 0
    deploy: str | Path | None = None
    rtol: float | None = None
    atol: float | None = None
    precision: str = "fp32"
    plan: P.Plan | None = None


# The options of a quantization plan as `export --hf` names them (`precision.plan_for`'s keywords).
PLAN_OPTIONS = ("block_size", "accuracy_level", "keep", "symmetric", "requantize", "minimums")


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
                          None if how.get("requantize") is None else not how["requantize"], how.get("minimums"))
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


def dynamic_axes(layout: hf.Layout) -> dict:
    """The symbolic axes of each input of the step graph."""
    dims = {"input_ids": {0: "batch", 1: "sequence"}}
    cache_axes = {0: "batch"} if layout.form == "static" else {0: "batch", 2: "past_len"}
    if layout.form == "none":
        return {**dims, "attention_mask": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"}}
    if layout.form == "concat":
        dims["attention_mask"] = {0: "batch", 1: "total_len"}
        dims["position_ids"] = {0: "batch", 1: "sequence"}
    else:
        dims["write_pos"] = {0: "batch"}
    for name in layout.cache_names("past_key_values"):
        dims[name] = dict(cache_axes)
    return dims


def export_hf(request: HFExport) -> tuple[ModuleExportResult, hf.Layout]:
    """Exports the model at `request.source` in its cache form, checked against the model in
    float64 before anything is written; returns (the ModuleExportResult, the layout)."""
    r = request
    if r.form not in hf.FORMS:
        raise UsageError(f"--kv-cache for --hf is one of {', '.join(hf.FORMS)}, got {r.form!r}")
    if r.form == "static" and r.max_seq < MIN_MAX_SEQ:
        raise UsageError(f"--kv-cache static needs --max-seq N, the buffers' positions (at least {MIN_MAX_SEQ}), "
                         f"got {r.max_seq}")
    if r.form != "static" and r.max_seq:
        raise UsageError("--max-seq sizes the static cache's buffers: give it with --kv-cache static")
    if r.deploy is not None and r.output is not None:
        raise UsageError("give -o FILE.onnx or --deploy FOLDER, not both")
    dtype, plan = _precision(r)
    deploy = _deploy_target(Path(r.deploy)) if r.deploy is not None else None
    model, params_source = hf.load(r.source, r.seed)
    layout = hf.layout_of(model, r.form, r.max_seq)
    tokenizer = hf.tokenizer_of(r.source)
    wrapper = hf.step_module(model, layout)
    # The example only shapes the trace; the check below feeds what the model writes.
    feed = hf.example_feed(layout, block=3 if r.form == "static" else 5, past=0 if r.form == "static" else 3)
    example = tuple(torch.from_numpy(v) for v in feed.values())
    flavor = r.flavor or FL.DEFAULT
    opset = FL.opset_for(flavor, r.opset, ["--kv-cache static"] if r.form == "static" else [])
    name = f"{model.config.model_type} ({r.form})"
    quantized: dict = {}

    def quantize(onnx_model):
        before = {s.weight: onnx.numpy_helper.to_array(i) for s in P.sites(onnx_model, layout.vocab)
                  for i in onnx_model.graph.initializer if i.name == s.weight}
        if dtype != "fp32":  # the matrices the half graph rounds: a grid is carried from these
            before.update(_float_matrices(onnx_model, wrapper, layout.vocab))
        quantized["before"] = before
        quantized["done"] = P.quantize(onnx_model, plan, layout.layers, layout.vocab,
                                       weights=before if dtype != "fp32" else None)
        return onnx_model

    def check(onnx_model):
        if plan is None:  # the float64 copy made here, once the trace no longer needs the memory
            return check_before_writing(onnx_model, HR.Reference(model, layout, dtype, r.rtol, r.atol), tokenizer,
                                        name)
        return check_quantized(onnx_model, model, layout, quantized["before"], tokenizer, name, r)

    module_request = ModuleExport(
        flavor=flavor, opset=opset, dtype=dtype, dynamic=dynamic_axes(layout),
        output=None if deploy else r.output, input_names=list(feed), name=name,
        seed=r.seed if params_source == "seed" else None, output_names=layout.outputs,
        cache=layout.cache_pairs if r.form != "none" else None,
        extra_meta={hf.META: layout.meta(), "attnexport.params_source": params_source},
        write_pos="write_pos" if r.form == "static" else None,
        check=check, finalize=quantize if plan is not None else None,
        rewrite=lambda onnx_model: _rewritten(onnx_model, model, layout, flavor, dtype, name),
        optimized_by_rewrite=FL.FLAVORS[flavor].fuses_language_models)
    try:
        result = export_module(wrapper, example, module_request)
    except ExportError as e:
        if model.config.model_type not in hf.TESTED:
            raise ExportError(f"{e} (model type {model.config.model_type!r} is not one attnexport tests: "
                              f"{', '.join(hf.TESTED)})") from None
        raise
    result.notes.append(_checked_note(result.checked))
    if plan is not None:
        result.notes.append(f"{r.precision}: {quantized['done'].summary()} (block {plan.block}, accuracy level "
                            f"{plan.accuracy}); what it costs in answers: attnexport verify MODEL --hf SOURCE")
    if r.form == "static" and result.attention_op.endswith("GroupQueryAttention") and dtype == "fp32":
        result.notes.append(CPU_ONLY_STATIC)
    if deploy is not None:
        result.path = write_deployment(deploy, result, model, r.source, tokenizer, layout)
    return result, layout


# What export says of a static step whose GroupQueryAttention computes in float32 (fp32, int8,
# int4): ONNX Runtime's CUDA provider has no float32 kernel for it, and the node it leaves on the
# CPU between buffers bound in place on the device answers wrong (H200, 2026-11-26: KL 0.94 on a
# random Llama in fp32 and int4 alike; docs/benchmarks.md).
CPU_ONLY_STATIC = ("not for CUDA: ONNX Runtime's CUDA provider has no float32 GroupQueryAttention, and the one it "
                   "leaves on the CPU gives wrong answers over device buffers; for CUDA export --dtype fp16 or "
                   "--precision q4f16 (verify --runtimes ort-cuda --strict-placement refuses this one)")


def _float_matrices(onnx_model, module, vocab: int | None) -> dict:
    """{weight initializer: (K, N) float32} of every matrix a graph exported in half holds, put
    together from `module`'s float32 parameters as the export's record places them (a parameter's
    columns, transposed); a matrix the record does not fill whole is left out."""
    state = {k: v.detach().float().numpy() for k, v in module.state_dict().items()}
    out = {}
    for s in P.sites(onnx_model, vocab):
        w = np.full((s.k, s.n), np.nan, np.float32)
        for name, columns in s.params.items():
            p = state.get(name)
            if p is None or p.ndim != 2:
                continue
            start, stop = columns if columns is not None else (0, s.n)
            if p.shape == (stop - start, s.k):
                w[:, start:stop] = p.T
        if np.isfinite(w).all():
            out[s.weight] = w
    return out


def _precision(r: HFExport) -> tuple[str, P.Plan | None]:
    """(the dtype the model is exported in, the quantization plan or None) of `r.precision`."""
    if r.precision not in P.PRECISIONS:
        raise UsageError(f"--precision is one of {', '.join(P.PRECISIONS)}, got {r.precision!r}")
    if r.precision != "fp32" and r.dtype != "fp32":
        raise UsageError("give --precision or --dtype, not both (--precision fp16 is --dtype fp16)")
    if r.plan is not None and r.precision not in P.QUANTIZED:
        raise UsageError(f"--precision {r.precision} quantizes nothing: a quantization plan goes with int8 or int4")
    if r.precision in P.QUANTIZED:
        return P.ACTIVATIONS[r.precision], r.plan or P.DEFAULT_PLANS[r.precision]
    return ("fp16" if r.precision == "fp16" else r.dtype), None


def check_quantized(onnx_model, model, layout: hf.Layout, before: dict, tokenizer, name: str, r: HFExport) -> list:
    """The checks of a quantized step graph before it is written: every quantized matrix is a
    quantization of the float one it replaced (a carried grid bit for bit, ONNX Runtime's within a
    step); the graph with float activations computes what its weights say (against the model with
    the file's weights, in float64, at CHECKS' shapes, fp32's derived budget); and the graph as
    written runs at each shape with finite logits. What it costs in answers is verify's to say."""
    bad = P.unfaithful(before, onnx_model)
    if bad:
        raise ExportError(f"{name}: the quantized weights are not a quantization of the model's: {bad[0]}"
                          + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    held = HR.Reference(A.file_model(model, onnx_model), layout, P.ACTIVATIONS[r.precision], r.rtol, r.atol,
                        QUANTIZED_FACTOR)
    checked = check_before_writing(P.float_activations(onnx_model), held, tokenizer, name)
    session = R.prepare_onnx("ort-cpu", onnx_model)
    for label, batch, block, past, padded in CHECKS[layout.form]:
        ids = HR.token_rows(tokenizer, layout.vocab, batch, past + block, seed=1)
        logits = np.asarray(session.run(HR.prefilled_feed(held, ids, past, padded))["logits"])
        if not np.isfinite(logits).all():
            raise ExportError(f"{name}: the quantized export gives logits that are not finite at {label}")
    return checked


def _rewritten(onnx_model, model, layout: hf.Layout, flavor: str, dtype: str, name: str):
    """The traced step graph made what a deployment wants: each past fitting the block's batch
    (concat), a tied vocabulary matrix kept once as the head reads it, ONNX Runtime's fused ops
    (ort flavour); see `attnexport.pretrained.fusions`."""
    if layout.form == "concat":
        pasts_fit_the_batch(onnx_model, layout)
    HF.tied_head(onnx_model)
    if FL.FLAVORS[flavor].fuses_language_models:
        positions = layout.max_seq if layout.form == "static" else \
            int(getattr(model.config, "max_position_embeddings", 0) or 0)
        tables = HF.rotary_tables(model, positions, D.NUMPY[dtype]) if positions else None
        onnx_model = HF.fuse_for_ort(onnx_model, tables, layout.form == "static", name)
    return onnx_model


def pasts_fit_the_batch(model, layout: hf.Layout) -> None:
    """Each past of the concat form first reshaped to (the block's batch, kv heads, -1, head size):
    a past as it comes (no copy), and an empty one of any batch as (batch, kv heads, 0, head size).
    transformers.js 4 feeds the first step's empty pasts with batch 0, which a fused attention op
    (Attention, MultiHeadAttention) refuses next to a block of batch 1, and from which the exporter
    may take the batch size for the whole graph."""
    from onnx import helper

    pasts = set(layout.cache_names("past_key_values"))
    renamed = {p: f"{p}.batched" for p in pasts}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    dims = helper.make_tensor("attnexport_past_dims", onnx.TensorProto.INT64, [3],
                              [layout.kv_heads, -1, layout.head_dim])
    first = [helper.make_node("Shape", ["input_ids"], ["attnexport_batch"], "attnexport_batch", start=0, end=1),
             helper.make_node("Constant", [], ["attnexport_past_dims"], "attnexport_past_dims", value=dims),
             helper.make_node("Concat", ["attnexport_batch", "attnexport_past_dims"], ["attnexport_past_shape"],
                              "attnexport_past_shape", axis=0)]
    first += [helper.make_node("Reshape", [p, "attnexport_past_shape"], [renamed[p]], f"attnexport_fit_{p}")
              for p in layout.cache_names("past_key_values")]
    nodes = first + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def check_before_writing(onnx_model, reference: HR.Reference, tokenizer, name: str) -> list:
    """The step graph on ONNX Runtime's CPU provider at each of CHECKS' shapes against the model in
    float64, each output within its budget; an ExportError (nothing written) naming the first
    output that is not. Returns, a shape each: its label and each output's worst error and budget."""

    layout = reference.layout
    session = R.prepare_onnx("ort-cpu", onnx_model)
    checked = []
    for label, batch, block, past, padded in CHECKS[layout.form]:
        ids = HR.token_rows(tokenizer, layout.vocab, batch, past + block, seed=1)
        feed = HR.prefilled_feed(reference, ids, past, padded)
        expected = reference.expect(feed)
        try:
            got = session.run(feed)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's reason, in one line
            raise ExportError(f"{name}: the export does not run on ONNX Runtime at {label} ({reason(e)[:300]})") \
                from None
        comparisons = expected.compare(got, layout.outputs)
        bad = [c for c in comparisons if not c]
        if bad:
            raise ExportError(f"{name}: the export differs from the model in float64 at {label}: {bad[0]}")
        caches = [c for c in comparisons if c.name != "logits"]
        entry = {"step": label, "logits": _worst(comparisons[0])}
        if caches:
            entry["cache"] = _worst(max(caches, key=lambda c: c.needed_atol / max(c.atol, 1e-30)))
        checked.append(entry)
    return checked


def _worst(c) -> dict:
    return {"output": c.name, "max_abs": c.max_abs, "atol": c.atol, "rtol": c.rtol, "basis": c.basis}


def _checked_note(checked: list) -> str:
    worst = max((e["logits"] for e in checked), key=lambda w: w["max_abs"])
    return (f"checked against the model in float64 at {len(checked)} step shapes: logits max abs "
            f"{worst['max_abs']:.3g}, budget atol {worst['atol']:.3g} rtol {worst['rtol']:g} ({worst['basis']})")


# --- the deployment folder -----------------------------------------------------------------------

def _deploy_target(folder: Path) -> Path:
    """The deployment folder, checked before any work: a folder or nothing yet (then its parent
    must exist: one level is made, never a tree)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--deploy {folder}: it is a file, not a folder")
    if not folder.exists() and not folder.parent.is_dir():
        raise UsageError(f"--deploy {folder}: its folder {folder.parent} does not exist")
    target = folder if folder.exists() else folder.parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"--deploy {folder}: {target} is not writable")
    return folder


def write_deployment(folder: Path, result: ModuleExportResult, model, source, tokenizer, layout: hf.Layout) -> Path:
    """Writes the deployment folder: config.json and generation_config.json (the model's), the
    tokenizer's files (the source folder's as they are, or the tokenizer a GGUF file holds, saved),
    and the model at DEPLOY_FILES[form]. Every file is made in a temporary folder beside it first;
    a new folder is then renamed into place whole, an existing one gets each file renamed over its
    own (a link is written through), so an interrupted run leaves no half-written file. Returns
    the model's path."""
    assert result.model is not None
    staging = Path(tempfile.mkdtemp(prefix=".attnexport-", dir=folder.parent if not folder.exists() else folder))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700: the folder a plain mkdir would make
    try:
        source_dir = Path(source)
        kept = [f for f in _KEPT if source_dir.is_dir() and (source_dir / f).is_file()]
        for f in kept:
            shutil.copyfile(source_dir / f, staging / f)
        if tokenizer is not None and not any(f.startswith("tokenizer") for f in kept):
            with contextlib.redirect_stdout(None):
                tokenizer.save_pretrained(str(staging))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["use_cache"] = layout.form != "none"
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if "generation_config.json" not in kept and getattr(model, "generation_config", None) is not None:
            (staging / "generation_config.json").write_text(model.generation_config.to_json_string())
        model_file = staging / DEPLOY_FILES[layout.form]
        model_file.parent.mkdir()
        onnx.save_model(result.model, str(model_file))
        if not folder.exists():
            os.replace(staging, folder)
        else:
            for path in sorted(p for p in staging.rglob("*") if p.is_file()):
                target = folder / path.relative_to(staging)
                if not target.parent.exists():
                    target.parent.mkdir()
                if target.is_symlink():
                    F.atomic_write(target, path.read_bytes())  # through the link, which stays
                else:
                    F.resolve_target(target)
                    os.replace(path, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder / DEPLOY_FILES[layout.form]


def _umask() -> int:
    """The process's umask, read from /proc (setting it to read it would race other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022

