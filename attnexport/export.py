"""torch -> ONNX for every variant, every user's module and every flavour: one core (`to_onnx`
then `finish`: trace and translate, opset conversion, weights record, metadata, checks) and the
atomic write."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import importlib
import inspect
import io
import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx

from attnexport import __version__, decomposed, golden, memo, schema, seeding
from attnexport import dtypes as D
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport import stamping as ST
from attnexport import target as T
from attnexport import usage as U
from attnexport import variants as V
from attnexport import weights as W
from attnexport.compare import compare, past_ends_zeroed, tolerance
from attnexport.errors import AttnExportError, ExportError, UsageError, first_line, reason
from attnexport.record import ExportRecord, as_json, attention_op_of
from attnexport.signature import PLAIN, StepSignature, WritePos

FLAVORS = tuple(FL.FLAVORS)  # names, in the registry's order
DEFAULT_FLAVOR = FL.DEFAULT
DTYPES = D.DTYPES


@dataclass(frozen=True)
class ExportResult:
    path: Path
    variant: str
    options: dict
    flavor: str  # the flavour asked for
    graph_flavor: str  # the flavour the graph has (primitives for variants without a dot-product core)
    opset: int
    dtype: str
    attention_op: str  # the attention op in the graph, "MatMul+Softmax", or "none"
    size: int  # bytes
    note: str = ""

    def summary(self) -> str:
        line = (f"{self.path}: {self.variant}, flavor {self.flavor}, opset {self.opset}, {self.dtype}, "
                f"attention op {self.attention_op}, {F.human_size(self.size)}")
        return f"{line} ({self.note})" if self.note else line

    def to_dict(self) -> dict:
        """The result as `export --json` prints it."""
        return {"path": str(self.path), "variant": self.variant, "options": self.options, "flavor": self.flavor,
                "graph_flavor": self.graph_flavor, "opset": self.opset, "dtype": self.dtype,
                "attention_op": self.attention_op, "size": self.size, "note": self.note}


def _tracing():
    """The modules that trace and translate (`onnx_attention`, `recognize`): they import torch and
    onnxscript, put off until an export runs (the command line starts without them)."""
    from attnexport import onnx_attention, recognize
    return SimpleNamespace(onnx_attention=onnx_attention, recognize=recognize)


def graph_flavor(variant: schema.Variant, flavor: str) -> str:
    return flavor if variant.dot_product_core else FL.UNFUSED_FLAVOR


def example_sizes(variant: schema.Variant, o: dict) -> dict:
    """Options with every symbolic size at least 2, so the exporter keeps it symbolic; a size that
    broadcasts against another takes the other's (a size-1 axis would be specialized)."""
    ex = {**o, **{k: max(o[k], 2) for k in variant.sizes(o)}}  # only the sizes these options leave open
    return {**ex, **{k: ex[full] for k, full in variant.broadcast}}


def _validate(variant, flavor, opset, dtype, o=None):
    FL.check(flavor)
    D.check(dtype)
    gf = graph_flavor(variant, flavor)
    needs = [option for option, asked in (("--nonpad", (o or {}).get("nonpad")),
                                          ("--kv-cache static", V.static_cache(o or {}))) if asked]
    return gf, FL.opset_for(gf, opset, needs)


@contextlib.contextmanager
def _quiet():
    """Keeps the exporter's progress lines and library warnings away from the user."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# Python's default is a full collection every 10 collections of the middle generation.
_FULL_COLLECTIONS_EVERY = 100


@contextlib.contextmanager
def torch_sped_up():
    """torch's exporter with attnexport's caches in it for the duration of one trace or export
    (`torch_patches`), and what was there put back after: a user's own torch.export and
    torch.onnx calls in the same process run torch as it came.

    Python's full garbage collections are made rarer meanwhile (`_FULL_COLLECTIONS_EVERY`): an export
    allocates millions of short-lived objects beside torch's large heap, and each full collection walks
    that whole heap (a seventh of a small export's time here); the young generations still collect every
    cycle the export leaves, as before."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], _FULL_COLLECTIONS_EVERY))
    patches = torch_patches()
    missing = object()  # an attribute the owner finds elsewhere (a lazy module's, a base class's)
    saved = [(owner, attr, vars(owner).get(attr, missing)) for owner, attr, _ in patches]
    for owner, attr, replacement in patches:
        setattr(owner, attr, replacement)
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            if original is missing:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        gc.set_threshold(*thresholds)


@functools.cache
def torch_patches() -> tuple:
    """(owner, attribute, replacement) of each of torch's exporter internals attnexport replaces
    while it exports, made once per process so that what they keep outlives one export. Each is
    optional: torch internals that moved leave exports only slower.

    - torch.onnx rebuilds its table of about 500 ONNX functions on every export (0.3-0.7 s here,
      a third of a small export); the table does not change within a process: built once.
    - It fills a new registry from the table on every export (`_registry_filled_once`).
    - It decomposes the traced program on every export, tracing it again (`_decomposed_once`).
    - torch.export lists the composite ops twice per trace (`_cia_ops_listed_once`).
    - onnxscript's rewriter tries a rule of several output nodes at every node by listing the whole
      graph first (`_multi_output_rules_by_op`)."""
    patches: list = []
    with contextlib.suppress(Exception):
        from torch.onnx._internal.exporter import _registration
        apis = _registration.onnxscript_apis
        patches.append((apis, "get_torchlib_ops", functools.cache(apis.get_torchlib_ops)))
    for make in (_registry_filled_once, _decomposed_once, _cia_ops_listed_once, _multi_output_rules_by_op):
        with contextlib.suppress(Exception):
            patches += make()
    return tuple(patches)


def _registry_filled_once() -> list:
    """torch.onnx fills a new registry from the table on every export, then adds the custom
    translations to it. Filled once per opset and copied (the copy has lists of its own, so one
    export's custom translations never reach another's): `verify --variant mha`, 30 exports,
    took 31.2 s instead of 32.9 s here."""
    from torch.onnx._internal.exporter import _registration
    registry_class = _registration.ONNXRegistry
    fill = registry_class.from_torchlib.__func__  # type: ignore[attr-defined]  # a classmethod's function
    filled: dict = {}

    def from_torchlib(cls, *args, **kwargs):  # (opset_version=...) in newer torch; nothing in 2.7
        key = (args, tuple(sorted(kwargs.items())))
        if key not in filled:
            filled[key] = fill(cls, *args, **kwargs)
        base, copy_ = filled[key], cls()
        copy_.__dict__.update(base.__dict__)
        copy_.functions = {k: list(v) for k, v in base.functions.items()}
        return copy_
    return [(registry_class, "from_torchlib", classmethod(from_torchlib))]


def _cia_ops_listed_once() -> list:
    """torch.export lists the composite ops of every op namespace twice per trace (0.12 s each
    here, 9% of `verify --variant sdpa`). The list changes only when ops are registered: it is
    kept per namespace and number of op names, so a namespace or op registered later (a user's
    module may register its own) is listed afresh."""
    import torch
    from torch._export import utils
    from torch.export import decomp_utils, exported_program
    collect = utils._collect_all_valid_cia_ops
    kept: dict = {}

    def listed():
        key = tuple((name, len(list(getattr(torch.ops, name)))) for name in sorted(torch.ops._dir)
                    if hasattr(torch.ops, name))
        if key not in kept:
            kept.clear()
            kept[key] = frozenset(collect())
        return set(kept[key])
    return [(exported_program, "_collect_all_valid_cia_ops", listed),
            (decomp_utils, "_collect_all_valid_cia_ops", listed)]


def _decomposed_once() -> list:
    """torch.onnx decomposes the traced program into the ops ONNX functions exist for, on every
    export (0.7 s of 1.2 here). The three flavours of one trace ask for the same decomposition
    (the same ops are registered; only the attention op's translation differs): for a program
    `_traced` made, it is done once and kept on the program. Where it would change nothing but the
    few ops `attnexport.decomposed` knows, that pass does it without tracing the program again."""
    from torch.onnx._internal.exporter import _fx_passes
    torchs = _fx_passes.decompose_with_registry

    def decompose(exported_program, registry):
        kept = decomposed.as_decomposed(exported_program, registry)
        return kept if kept is not None else torchs(exported_program, registry)

    def once(exported_program, registry):
        if not getattr(exported_program, "_attnexport_traced", False):
            return decompose(exported_program, registry)
        if getattr(exported_program, "_attnexport_decomposed", None) is None:
            exported_program._attnexport_decomposed = decompose(exported_program, registry)
        return exported_program._attnexport_decomposed
    return [(_fx_passes, "decompose_with_registry", once)]


def _multi_output_rules_by_op() -> list:
    """onnxscript's pattern matcher tries a rule whose pattern has several output nodes at every node
    of the graph, and for each one lists every node of the graph by op before it compares the first
    output node with the node it was given: quadratic in the graph's size (a whole language model's
    6,000 nodes: 7 s of a 49 s export here; 30 s of 86 s in the ort flavour, whose fusions run the
    rewriter again). A node of another op than the pattern's first output node fails that comparison
    in every combination the listing would make: it is failed at once, so the rules rewrite exactly
    what they did (the same bytes out, checked on SmolLM2-135M in both flavours)."""
    from onnxscript.rewriter import _basics, _matcher
    match = _matcher.SimplePatternMatcher.match

    def by_op(self, model, graph_or_function, node, **kwargs):
        if not self.pattern.has_single_output_node:
            first = self.pattern.output_nodes[0].op_identifier()
            if first is not None and first != node.op_identifier():
                return _basics.MatchResult().fail("the node's op is not the pattern's first output node's")
        return match(self, model, graph_or_function, node, **kwargs)
    return [(_matcher.SimplePatternMatcher, "match", by_op)]


@dataclass(frozen=True)
class ExportRequest:
    """What to export: a variant with its options, in a flavour, opset and dtype, with seeded or
    given parameters. `export` and `build_model` take one, or its fields as arguments (the
    variant, options and flavour by position, the rest by name).

    Attributes:
        options: the variant's options (defaults fill the rest).
        opset: default: the flavour's (see attnexport.flavors).
        params: parameters as NumPy arrays (default: seeded ones from `seed`).
        output: the file `export` writes (default `models/<variant>.onnx`); build_model writes none.
        use_cache: reuse an identical earlier export from the export cache (see `attnexport.memo`).
    """

    variant: str
    options: dict | None = None
    flavor: str = DEFAULT_FLAVOR
    opset: int | None = None
    dtype: str = "fp32"
    params: dict | None = None
    seed: int = 0
    output: str | Path | None = None
    use_cache: bool = True


def _export_request(request: ExportRequest | str, options, flavor, fields) -> ExportRequest:
    if isinstance(request, ExportRequest):
        if options is not None or flavor is not None or fields:
            raise TypeError("give an ExportRequest or its fields, not both")
        return request
    return ExportRequest(request, options, DEFAULT_FLAVOR if flavor is None else flavor, **fields)


@dataclass(frozen=True)
class _Resolved:
    """An export request with everything decided: the options resolved, the graph's flavour and
    opset, the parameters and where they came from."""

    request: ExportRequest
    variant: schema.Variant
    options: dict
    graph_flavor: str
    opset: int
    params: dict
    params_source: str  # "seed" or "given"


def build_model(request: ExportRequest | str, options: dict | None = None, flavor: str | None = None,
                **fields) -> tuple[onnx.ModelProto, ExportResult]:
    """Exports a variant to an in-memory ONNX model; returns it with a result (path unset).
    Takes an ExportRequest, or its fields (`build_model("mha", {"heads": 8}, "ort", dtype="fp16")`)."""
    r = _export_request(request, options, flavor, fields)
    variant = V.get(r.variant)
    o = variant.resolve(r.options)
    gf, opset = _validate(variant, r.flavor, r.opset, r.dtype, o)
    schema.check_memory(variant, o, D.ITEMSIZE[r.dtype])
    params_source = "seed" if r.params is None else "given"
    params = seeding.init_params(variant, o, r.seed) if r.params is None else W.validate(variant, o, r.params)
    decided = _Resolved(r, variant, o, gf, opset, params, params_source)
    request_key = {"variant": variant.name, "options": o, "flavor": r.flavor, "graph_flavor": gf, "opset": opset,
                   "dtype": r.dtype, "seed": r.seed, "params_source": params_source,
                   "params": {k: W.sha256_of(v) for k, v in sorted(params.items())}}
    key = memo.key(request_key) if r.use_cache else None
    hit = memo.get(key) if key else None
    if hit is not None:
        model, info = hit
        return model, ExportResult(Path(), variant.name, o, r.flavor, gf, opset, r.dtype, info["attention_op"], 0,
                                   info["note"])
    # The flavours share one trace of the module: everything in the request but the flavour.
    trace_key = json.dumps({k: v for k, v in request_key.items() if k not in ("flavor", "graph_flavor", "opset")},
                           sort_keys=True)
    model, result = _build(decided, trace_key)
    if key:
        memo.put(key, model, {"attention_op": result.attention_op, "note": result.note})
    return model, result


def _build(decided: _Resolved, trace_key: str):
    import torch

    variant, o, gf, opset, params = decided.variant, decided.options, decided.graph_flavor, decided.opset, \
        decided.params
    flavor, dtype, seed = decided.request.flavor, decided.request.dtype, decided.request.seed
    # Building the module imports the core (its custom op); to_onnx sets up the exporter.
    target = T.of_variant(variant, o, params)
    module = target.module(dtype)
    ex = example_sizes(variant, o)
    args = target.args(seeding.make_inputs(variant, ex, seed), dtype)
    # The sizes these options leave open (sdpa's head counts only in its 4-D layout); a cache may
    # be empty: its length starts at 0.
    open_sizes = variant.sizes(ex)
    dims = {name: torch.export.Dim(name, min=0 if variant.option(name).minimum == 0 else 1)
            for name in open_sizes if name not in dict(variant.broadcast)}
    for k, full in variant.broadcast:  # traced as the full size, even where that size is fixed
        if k in open_sizes:
            dims[k] = dims.get(full) or torch.export.Dim(full)
    # An axis as long as a sum of sizes (a cache step's mask: past_seq+seq) is left to the
    # exporter to relate to the others; it is named after the export.
    dynamic_shapes: tuple = tuple({axis: dims[d] if d in dims else torch.export.Dim.AUTO
                                   for axis, d in enumerate(spec.dims)
                                   if d in dims or (isinstance(d, str) and "+" in d)}
                                  for spec in variant.inputs(ex))
    if any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(module.forward).parameters.values()):
        dynamic_shapes = (dynamic_shapes,)  # forward(*tensors): one argument holding them all
    out_specs = variant.outputs(o)
    what = f"{variant.name} ({gf})"
    with export_errors(what), _quiet(), torch_sped_up(), torch.no_grad():
        traced = _traced(module, args, dynamic_shapes, trace_key)
    program = to_onnx(traced, args, flavor=gf, opset=opset, input_names=target.inputs, output_names=target.outputs,
                      what=what)
    model = program.model_proto
    _name_axes(model, variant, ex, out_specs)
    # params_source "seed": the parameters come from the seed; "given": the caller's own (params=).
    meta = ExportRecord(variant=variant.name, options=as_json(o), flavor=flavor, graph_flavor=gf, opset=str(opset),
                        dtype=dtype, seed=str(seed), params_source=decided.params_source,
                        golden_manifest_sha256=golden.manifest_hash())
    model, op_name = finish(model, Finishing(gf, opset, dtype, what, variant.dot_product_core, flavor), params, meta,
                            target.signature)
    note = "" if variant.dot_product_core or not FL.FLAVORS[flavor].fused else \
        f"{variant.name} has no dot-product core: exported as {FL.UNFUSED_FLAVOR}"
    return model, ExportResult(Path(), variant.name, o, flavor, gf, opset, dtype, op_name, 0, note)


_TRACED: dict = {}  # the last few torch.export programs, by module, options, dtype and parameters


def _traced(module, args, dynamic_shapes, key):
    """torch.export's program of the module: traced once for every flavour (the flavours differ
    only in the translation of the attention op, applied after tracing), which saves about 40%
    of exporting the three."""
    import torch
    if key not in _TRACED:
        while len(_TRACED) >= 256:
            _TRACED.pop(next(iter(_TRACED)))
        _TRACED[key] = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
        _TRACED[key]._attnexport_traced = True  # its decomposition is kept (_decomposed_once)
    return _TRACED[key]


def _name_axes(model, variant, ex, out_specs):
    """Names every symbolic axis of the model's inputs and outputs after the variant's sizes
    (the exporter's names are s0, s1, ... when it is given a traced program), and the same
    symbols in the intermediate shapes.

    An input axis that is 1 or another size (a mask's batch or head axis) was traced as that
    size: it gets its own name, so the model's interface says it may differ, and the intermediate
    shapes are dropped (they still say the traced size: ONNX Runtime plans its buffers from them,
    and reused one of (B, 1, T, T) for (B, H, T, T)); the runtime infers them from the inputs.
    """
    broadcast = dict(variant.broadcast)
    open_sizes = variant.sizes(ex)

    def symbolic(d):  # a size the model leaves open (dim is an option too, but fixed)
        return isinstance(d, str) and all(p in open_sizes for p in d.split("+"))
    renames, drop_shapes = {}, False
    inputs = {i.name: i for i in model.graph.input}
    for spec in variant.inputs(ex):
        for axis, d in enumerate(spec.dims):
            if symbolic(d) and spec.name in inputs:
                dim = inputs[spec.name].type.tensor_type.shape.dim[axis]
                if d in broadcast:
                    drop_shapes = True
                elif dim.dim_param and "+" not in d:
                    renames[dim.dim_param] = d
                dim.dim_param = d
    if drop_shapes:
        del model.graph.value_info[:]
    rename_symbols(model, renames)
    outputs = {o.name: o for o in model.graph.output}
    for spec in out_specs:
        for axis, d in enumerate(spec.dims):
            if symbolic(d) and spec.name in outputs:
                outputs[spec.name].type.tensor_type.shape.dim[axis].dim_param = d


def to_onnx(program, args, *, flavor: str, opset: int, input_names, output_names=None, dynamic_shapes=None,
            what: str, optimize: bool = True):
    """The one way a torch module (or a program torch.export made of one) becomes ONNX here, for
    the variants and for users' modules alike: the attention core translated for `flavor`,
    torch.onnx run quietly at opset 18 or the Attention op's (older opsets are reached by
    `convert_opset`). Any failure is an ExportError that names `what` and torch's own reason.
    `optimize`: torch.onnx's own pass over the graph (onnxscript's optimizer and rewrite rules);
    False where the caller runs that optimizer itself (`attnexport.pretrained.fusions`)."""
    import torch
    importlib.import_module("attnexport.models.core")  # registers the attnexport::attention custom ops
    TRANSLATIONS = _tracing().onnx_attention.TRANSLATIONS
    translation = TRANSLATIONS[flavor]
    table: dict[Callable[..., Any], Callable[..., Any]] = {
        torch.ops.attnexport.attention.default: translation.attention,
        torch.ops.attnexport.cache_write.default: translation.cache_write,
        torch.ops.attnexport.static_attention.default: translation.static_step,
        **decomposed.translations()}
    with export_errors(what), _quiet(), torch_sped_up(), torch.no_grad():
        return torch.onnx.export(
            program, args, dynamo=True, opset_version=max(opset, 18), dynamic_shapes=dynamic_shapes,
            input_names=list(input_names), output_names=None if output_names is None else list(output_names),
            custom_translation_table=table, optimize=optimize, verbose=False, report=False)


@contextlib.contextmanager
def export_errors(what: str):
    """Turns a failure of torch.export or torch.onnx into one ExportError naming `what` and
    torch's own reason (an attnexport error raised inside them passes as it is)."""
    try:
        yield
    except AttnExportError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's reasons, in one line
        cause = export_error_cause(e)
        raise ExportError(f"torch.onnx could not export {what}: {reason(cause)}") from None


def convert_opset(model, opset: int, what: str):
    """The model at `opset`: the translations are written for opset 18 (23 or 24 for Attention),
    and an older opset is reached with onnx's version converter."""
    if opset >= 18:
        return model
    from onnx import version_converter
    try:
        with _quiet():
            return version_converter.convert_version(model, opset)
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"cannot convert the {what} model to opset {opset}: {first_line(e)}") from None


def check_flavor_op(model, flavor: str, what: str, applies: bool = True, flavor_asked: str | None = None) -> str:
    """The attention op in the graph, which must be the one `flavor` promises (where an attention
    core was exported at all: `applies`); else an ExportError."""
    op_name = attention_op_of(model)
    want = FL.FLAVORS[flavor].expected_ops
    if applies and not all(op in want for op in op_name.split(", ")):  # a decoder's may be two of them
        raise ExportError(f"the {flavor_asked or flavor} flavor of {what} should use {' or '.join(want)}, "
                          f"but the exported graph has {op_name}")
    return op_name


# What a static step on com.microsoft.GroupQueryAttention accepts, in its metadata: ONNX Runtime
# (1.31.1) has no computation for a block of more than one position over written positions at
# batch > 1 (it takes such a block as a first prompt); the graph answers NaN in those sequences
# (attnexport.onnx_attention) and verify reports such runs as not applicable with this text (the
# record's `static_blocks`).
GQA_BLOCKS = ("one position a step over written positions at batch > 1 (a block of several: at batch 1, or into "
              "empty buffers, write_pos 0): ONNX Runtime's GroupQueryAttention computes no more, and the graph "
              "answers NaN beyond it")
# And what its buffers' outputs hold: GroupQueryAttention copies each sequence's valid prefix into
# a present output that is not the past input's memory, and leaves what lies past it undefined
# (bound in place, the buffer keeps it). verify compares those outputs over the valid prefix (the
# record's `static_buffers`).
GQA_BUFFERS = ("key_cache_out and value_cache_out hold each sequence's positions up to write_pos + the block; past "
               "them they are undefined unless bound to the input buffers (IO binding), which keeps them")


@dataclass(frozen=True)
class Finishing:
    """How an export is finished: the graph's flavour, opset and dtype, its name in messages,
    whether the flavour's op applies (a graph with attention), and the flavour asked for."""

    flavor: str
    opset: int
    dtype: str
    what: str
    applies: bool = True
    flavor_asked: str | None = None


def finish(model, how: Finishing, params: Mapping, meta: ExportRecord, signature: StepSignature = PLAIN):
    """What every export ends with, a variant's and a user's module's alike: the conversion to
    `opset`, the record of where each parameter is held (`attnexport.params`, with the sha256 of
    its bytes), the step's signature (`signature`'s caches and write position, the graph's
    inputs, outputs and symbolic axes: `attnexport.signature`), the metadata and the onnx checks
    (`stamp`), and the check that the graph has the flavour's attention op. Returns (model, the
    attention op's name)."""
    model = convert_opset(model, how.opset, how.what)
    try:
        meta = replace(meta, signature=signature.with_graph(model).to_json())
    except ValueError as e:
        raise ExportError(f"{how.what}: {e}") from None
    _rotary_caches_per_batch(model)
    _rms_norms_in_one_type(model)
    if any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        meta = replace(meta, static_blocks=GQA_BLOCKS, static_buffers=GQA_BUFFERS)
        _tracing().onnx_attention.share_static_totals(model)
    with U.phase("record"):
        entries = W.record(model, params, D.NUMPY[how.dtype])
    with U.phase("onnx checks"):
        stamp(model, replace(meta, params=as_json(entries), params_sha256=W.total_sha256(entries)), how.what)
    return model, check_flavor_op(model, how.flavor, how.what, how.applies, how.flavor_asked)


def _rms_norms_in_one_type(model) -> None:
    """torch.onnx's optimizer fuses a norm that casts its input up before it normalizes (Gemma 3's
    RMSNorm in fp16: x.float(), the norm, the scale 1 + w in float32, the result cast back) into
    the RMSNormalization op (opset 23) reading the fp16 input itself beside its float32 scale, its
    output float32: onnx's checks refuse the mixed types (the output's type inferred from the
    input's) and ONNX Runtime's kernel takes one type. The cast the model made is put back before
    the node, so the norm computes in the scale's type as the model does."""
    from onnx import helper
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    nodes, changed = [], False
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "RMSNormalization" and len(node.input) > 1:
            x, scale = node.input[0], node.input[1]
            if types.get(x) and types.get(scale) and types[x] != types[scale]:
                cast = f"{node.name}_x_as_scale"
                nodes.append(helper.make_node("Cast", [x], [cast], name=cast, to=types[scale]))
                node.input[0] = cast
                changed = True
        nodes.append(node)
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)


def _rotary_caches_per_batch(model) -> None:
    """torch.onnx's optimizer fuses a rotary embedding (transformers' rotate_half form) into the
    standard RotaryEmbedding op (opset 23), passing cos and sin as they were computed: from
    position ids of batch 1, (1, T, d/2), which the unfused graph broadcasts against the batch.
    The operator takes them per sequence, (B, T, d/2) without position ids, and ONNX Runtime
    refuses batch 1 for batch 2 ("Inputs 'cos_cache' and 'sin_cache' are expected to have the
    same shape as input 'x'", onnxruntime 1.31.1). The fused node is kept (one node for about
    twenty) and each cache is expanded to the input's batch before it."""
    from onnx import helper
    nodes, changed = [], False
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "RotaryEmbedding" and \
                (len(node.input) < 4 or not node.input[3]):
            x = node.input[0]
            batch = f"{node.name}_x_batch"
            nodes.append(helper.make_node("Shape", [x], [batch], name=batch, start=0, end=1))
            for i in (1, 2):
                cache = node.input[i]
                rest, shape, wide = (f"{node.name}_{cache}_{k}" for k in ("rest", "shape", "per_batch"))
                nodes += [helper.make_node("Shape", [cache], [rest], name=rest, start=1),
                          helper.make_node("Concat", [batch, rest], [shape], name=shape, axis=0),
                          helper.make_node("Expand", [cache, shape], [wide], name=wide)]
                node.input[i] = wide
            changed = True
        nodes.append(node)
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)


def stamp(model, meta: ExportRecord, what: str) -> None:
    """Strips exporter noise, sets the lowest IR version, records `meta` (with attnexport's and
    torch's versions), and checks the model: onnx.checker (full) and strict shape inference."""
    import torch

    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for coll in (model.graph.input, model.graph.output, model.graph.value_info):
        for vi in coll:
            del vi.metadata_props[:]
            vi.doc_string = ""
    for init in model.graph.initializer:
        del init.metadata_props[:]
    del model.metadata_props[:]
    model.doc_string = ""
    model.graph.doc_string = ""
    model.producer_name, model.producer_version = "attnexport", __version__
    # onnx's default IR version is newer than many ONNX Runtime releases accept: use the lowest
    # the opsets allow.
    model.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    replace(meta, version=__version__, torch_version=torch.__version__.split("+")[0]).write(model)
    try:
        checked = W.skeleton(model)  # what the checks read, without a copy of the weights
        onnx.checker.check_model(checked, full_check=True)
        onnx.shape_inference.infer_shapes(checked, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:  # noqa: BLE001 - any failure of onnx's checks is the export's error, said in one line
        raise ExportError(f"the exported {what} model fails onnx checks: {first_line(e)}") from None


def export_error_cause(e: BaseException) -> BaseException:
    """The exception that says why torch.onnx failed: an attnexport error raised inside it (a
    translation's UnsupportedByFlavor, say) is re-raised as it is; otherwise the innermost cause."""
    cause = e
    while cause.__cause__ is not None or cause.__context__ is not None:
        nxt: BaseException = cause.__cause__ or cause.__context__  # type: ignore[assignment]  # one is set
        if isinstance(nxt, AttnExportError):
            raise nxt from None
        cause = nxt
    return cause


def rename_symbols(model, renames: dict) -> None:
    """Renames the exporter's symbols (s0, s1, ...) in the intermediate and output shapes."""
    symbol = re.compile(r"\bs\d+\b")
    for vi in [*model.graph.value_info, *model.graph.output]:
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = symbol.sub(lambda m: renames.get(m.group(), m.group()), dim.dim_param)


def export(request: ExportRequest | str, options: dict | None = None, flavor: str | None = None,
           **fields) -> ExportResult:
    """Exports a variant to an ONNX file (default `models/<variant>.onnx`), written atomically.
    Takes an ExportRequest, or its fields (`export("mha", {"heads": 8}, "ort", output="mha.onnx")`)."""
    r = _export_request(request, options, flavor, fields)
    V.get(r.variant)  # an unknown name fails before any work
    path = Path(r.output) if r.output is not None else F.default_output(r.variant)
    F.resolve_target(path)  # and so does a target that cannot or must not be written
    model, result = build_model(r)
    data = model.SerializeToString(deterministic=True)
    F.atomic_write(path, data)
    return ExportResult(path, result.variant, result.options, result.flavor, result.graph_flavor,
                        result.opset, result.dtype, result.attention_op, len(data), result.note)


# --- a user's module ----------------------------------------------------------------------------

@dataclass
class ModuleExportResult:
    path: Path | None
    module: str
    flavor: str
    opset: int
    dtype: str
    attention_op: str
    routed: int
    dynamic: dict  # input name -> {axis: dim name}
    checked: list  # sizes checked before writing: [{input: shape}]
    size: int = 0
    notes: list = field(default_factory=list)
    model: onnx.ModelProto | None = field(default=None, repr=False)
    outputs: list = field(default_factory=list)  # the model's output names
    recognized: list = field(default_factory=list)  # attention found in the traced program (recognize.Found)
    resources: dict | None = None  # a whole model's: wall time and resident memory, phase by phase (usage.Meter)

    def summary(self) -> str:
        line = (f"{self.path}: {self.module}, flavor {self.flavor}, opset {self.opset}, {self.dtype}, attention op "
                f"{self.attention_op}, {self.routed} attention call(s) routed, {F.human_size(self.size)}")
        return "\n".join([line] + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict:
        """The result as `export --module ... --json` prints it."""
        return {"path": str(self.path), "module": self.module, "flavor": self.flavor, "opset": self.opset,
                "dtype": self.dtype, "attention_op": self.attention_op, "routed": self.routed,
                "dynamic": self.dynamic, "checked": self.checked, "outputs": self.outputs, "size": self.size,
                "notes": self.notes, "recognized": [vars(f) for f in self.recognized],
                **({"resources": self.resources} if self.resources is not None else {})}


@dataclass(frozen=True)
class ModuleExport:
    """How to export a user's module: `export_module`'s keywords, as one object.

    Attributes:
        dynamic: {input name: {axis: dim name}}; default: axes 0 (`batch`) and 1 (`<input>_len`)
            of every input of rank 2 or more, wherever torch.export can keep them symbolic.
        output: the file to write (atomically); None: build in memory only.
        input_names: the model's input names; default: forward's parameters.
        name: the module's name in messages and metadata (the CLI's FILE.py:NAME).
        nan_rows: keep torch's behaviour for a query row whose mask hides every key (NaN, where
            attnexport gives zeros); only the primitives flavour can, the fused ops define zeros.
        output_names: the model's output names; default: `output` for one tensor, `output_0`,
            `output_1`, ... for a tuple, the keys of a dict (a transformers ModelOutput).
        seed, weights_file: where the module's parameters came from (recorded in the metadata):
            the seed its file was loaded with (`load`), or the file its weights were loaded from.
        allow_unfused: export attention that was not recognized (see `attnexport.recognize`) as
            MatMul+Softmax in a fused flavour; without it that is an ExportError.
        cache: the module's own key/value cache, {input: the output that returns it updated}:
            each such input's positions axis (axis -2 unless `dynamic` names another) is symbolic
            (`past_len`), the export is checked with empty caches too, and `verify --module`
            checks the decode property (recorded as `attnexport.cache` metadata).
        record: more of the export's record (`record.ExportRecord`'s fields: where a whole model's
            parameters came from).
        model_sizes: a whole model's sizes, recorded in its step signature (`signature.StepSignature.model`).
        write_pos: the module's cache is static, given: `cache`'s inputs are buffers that keep
            their size (positions on axis -2), each step writes its block into them where the
            input `write_pos` says (each sequence's first position (B,), the block's positions
            (T,), or one first position for all; see `decode.WritePos`). The export is checked at
            other sizes with valid positions, and `verify --module` decodes sequences of
            different lengths from buffers full of noise (recorded as `attnexport.write_pos`).
        cache_kinds: the kind the step signature records of a cache input, where it is not the
            one `cache` and `write_pos` make it (a whole model's sliding-window rings: "ring").
        check: the check of the finished model before it is written, in place of the default one
            (the module against the model at other sizes, each symbolic axis at 1 and at the
            example's size + 3): called with the model, it returns what it checked (a list, the
            result's `checked`) and raises an ExportError when the model is wrong. A whole language
            model's (`attnexport.pretrained.export`) feeds caches the model wrote and compares with the
            model in float64.
        rewrite: the traced graph changed before it is finished (checked, stamped and checked
            again): a language model's past made to fit the block's batch, ONNX Runtime's fused
            ops in its ort flavour (`attnexport.pretrained.export`).
        rtol, atol: the tolerance of the default check instead of the policy's (or, in fp16, the
            one derived from torch's fp16 error).
        finalize: the finished model changed once more before its check (a language model's
            weight matrices quantized, `attnexport.pretrained.precision`, which needs the parameters' record).
        optimized_by_rewrite: `rewrite` runs onnxscript's optimizer itself, so torch.onnx's pass
            is skipped (it took about half of SmolLM2's export, for nothing the fusions keep).
        float32_inputs: the inputs (by `input_names`) kept in float32 whatever the dtype: the
            module casts them itself (a vision transformer's pixel values, as clients make them).
        external_data: write the weights into one file beside the graph (`files.data_file`:
            `model.onnx` -> `model.onnx_data`) before the check, which then loads the graph from
            there (`check` is given its path): the weights are held once, on disk, and a model
            above protobuf's 2 GB limit can be written at all. Needs `output` and `check`.
        beside_write: work that reads the module only (a whole model's float64 reference, for its
            `check`), run on a thread of its own while the trace's weights are written to the
            staging folder (external data written straight from the module's tensors); not run
            otherwise (the check then does it itself).
        shares_cores: other work runs beside the export until its check (a forked child computing
            the check's reference): torch's operators take one thread each until the weights are
            written (`weights.one_thread_each`), as they do beside the export's own early write.
        repeat: the module's layers are alike (`attnexport.stamping.Repeat`): it is traced with
            three of them and the graph of the third stamped out for the rest; where the traced
            layers turn out not to be alike, the whole module is traced (and a note says why).
    """

    flavor: str = FL.DEFAULT
    opset: int | None = None
    dtype: str = "fp32"
    dynamic: dict | None = None
    output: str | Path | None = None
    input_names: list[str] | None = None
    name: str = "module"
    nan_rows: bool = False
    seed: int | None = None
    weights_file: str | Path | None = None
    output_names: list[str] | None = None
    allow_unfused: bool = False
    cache: dict | None = None
    record: dict | None = None
    model_sizes: dict | None = None
    write_pos: str | None = None
    cache_kinds: dict | None = None  # {cache input: its kind} where it is not what `cache` and write_pos make it
    check: Callable[[Any], list] | None = None  # given the ModelProto, or with external_data the staged graph's path
    rewrite: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None
    rtol: float | None = None
    atol: float | None = None
    optimized_by_rewrite: bool = False
    float32_inputs: tuple = ()
    finalize: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None
    external_data: bool = False
    repeat: Any = None  # attnexport.stamping.Repeat: the module traced with three of its alike layers
    beside_write: Callable[[], None] | None = None
    shares_cores: bool = False


@dataclass
class _ModuleTrace:
    """A user's module on its way to ONNX: its copy in the export's dtype, the example arguments,
    the input and output names, the dynamic shapes asked for and its target (its cache pairs)."""

    module: Any
    args: tuple
    names: list[str]
    dims: tuple  # (torch.export's dynamic_shapes, {input: {axis: dim name}} asked for)
    out_names: list[str] | None
    target: T.Target
    request: ModuleExport

    @property
    def cache(self) -> dict:
        """{cache input: the output that returns it}."""
        return self.target.signature.pairs


def export_module_file(spec: str, input_specs=(), request: ModuleExport | None = None,
                       weights=None) -> ModuleExportResult:
    """`export --module FILE.py:NAME`: the module loaded (`modules.load_with_inputs`: the request's
    seed, `weights`, the `--input` texts), then exported as `request` says, to its output or to
    `models/<file>.onnx` (a target that cannot be written refused before the export runs)."""
    import dataclasses

    r = request or ModuleExport()
    seed = 0 if r.seed is None else r.seed
    module, example, names = M.load_with_inputs(spec, input_specs, seed, weights)
    if r.output is not None:
        F.resolve_target(r.output)
    path = r.output or str(F.default_output(Path(spec.rpartition(":")[0]).stem))
    return export_module(module, example, dataclasses.replace(r, output=path, input_names=names, seed=seed,
                                                              weights_file=weights))


def export_module(module, example_inputs, request: ModuleExport | None = None, **fields) -> ModuleExportResult:
    """Exports a user's attention module through attnexport's core; `example_inputs`: a tuple of
    tensors for `forward`. Takes a ModuleExport, or its fields as keywords (`flavor="ort"`)."""
    import torch

    if request is not None and fields:
        raise TypeError("give a ModuleExport or its fields, not both")
    r = request or ModuleExport(**fields)
    FL.check(r.flavor)
    D.check(r.dtype)
    opset = FL.opset_for(r.flavor, r.opset)
    torch_nan = M.torch_gives_nan_rows(r.dtype)
    if r.nan_rows and not torch_nan:
        raise UsageError(f"--nan-rows: torch {torch.__version__} gives zeros for a fully masked row too (on the "
                         "CPU), as the export does: there is no NaN to keep")
    if r.nan_rows and FL.FLAVORS[r.flavor].fused:
        raise UsageError(f"--nan-rows needs --flavor {FL.UNFUSED_FLAVOR}: the {r.flavor} flavor's fused op gives zeros "
                         "for a fully masked row by its own definition")
    if r.output is not None:
        F.resolve_target(Path(r.output))
    staged = None
    if r.external_data:
        if r.output is None or r.check is None:
            raise ValueError("external_data needs an output and a check")
        staged = F.new_staging(r.output)
    try:
        with W.external_base(staged.folder if staged is not None else ""):
            return _export_module(module, example_inputs, r, opset, torch_nan, staged)
    except BaseException:
        if staged is not None:
            staged.discard()
        raise


def _export_module(module, example_inputs, r: ModuleExport, opset: int, torch_nan: bool,
                   staged: F.Staged | None) -> ModuleExportResult:
    """`export_module`'s work, with the request checked: with external data, staged in `staged`
    (the trace's weights written there straight from the module's tensors where nothing after
    the trace rewrites them in memory (no fusion by onnxscript's optimizer): the passes that read
    them, the quantizer too, read one at a time from there, `weights.values`)."""
    import torch

    direct = staged is not None and not r.optimized_by_rewrite
    early: W.Prewrite | None = None
    with W.one_thread_each() if direct or r.shares_cores else contextlib.nullcontext():
        try:
            with U.phase("copy"):
                module = _in_dtype(module, D.torch_dtype(r.dtype))
                # The module's matrices written from now, beside the trace (`weights.Prewrite`).
                early = W.Prewrite(W.planned(module), staged.folder / F.SCRATCH, F.EXTERNAL_ALIGN) \
                    if direct and staged is not None else None
                t = _module_trace(module, tuple(example_inputs), r)
            traced = _trace_to_onnx(t, opset, staged.folder if direct and staged is not None else None, early)
        except BaseException:
            if early is not None:  # stopped after the array it writes: the staging folder goes
                early.cancel()
            raise
    found, model, calls, trace_notes = traced.found, traced.model, traced.calls, traced.notes
    missed = [f for f in found if f.reason]
    kept = _name_dims(model, t.names, t.dims[1])
    cache_axes = _kept_axes(t, kept)
    write = _write_pos_of(t, kept, r.write_pos) if r.write_pos is not None else None
    spec = [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype).replace("torch.", ""),
             "dynamic": {str(ax): d for ax, d in kept.get(n, {}).items()}}
            for n, a in zip(t.names, t.args, strict=True)]
    meta = ExportRecord(module=r.name, inputs=as_json(spec, sort_keys=False), routed=as_json(calls, sort_keys=False),
                        flavor=r.flavor, graph_flavor=r.flavor, opset=str(opset), dtype=r.dtype,
                        seed=str(r.seed) if r.seed is not None else None,
                        params_source=("given: " + Path(r.weights_file).name) if r.weights_file else "seed")
    meta = replace(meta, **(r.record or {}))
    params = _ParamArrays(t.module.state_dict())
    if r.rewrite is not None:
        with U.phase("rewrite"):
            model = r.rewrite(model)
    caches = tuple(replace(c, axis=cache_axes[c.past], kind=(r.cache_kinds or {}).get(c.past, c.kind))
                   for c in t.target.signature.caches)
    with U.phase("finish"):
        model, op_name = finish(model, Finishing(r.flavor, opset, r.dtype, r.name, bool(calls)), params, meta,
                                StepSignature(caches=caches, write_pos=write, model=r.model_sizes))
    if r.finalize is not None:
        with U.phase("quantize"):
            model = r.finalize(model)
    # The module's parameters are not held here past this point (a caller may let them go: a whole
    # model's check does once the float64 reference has run).
    del params, traced
    if staged is not None:
        with U.phase("write"):
            F.stage_external(model, staged.target, staged)
            # The graph read back as a new message: protobuf frees the one that held the weights
            # only when it goes (clearing its fields keeps their memory in its arena).
            model = onnx.load(str(staged.graph), load_external_data=False)
    with U.phase("check"):
        checked = r.check(str(staged.graph) if staged else model) if r.check is not None else \
            _check_other_sizes(t, model, kept, set() if write else {kept[n][a] for n, a in cache_axes.items()}, write)
    version = torch.__version__.split("+")[0]
    semantics = ["fully masked query rows give NaN, as in torch (--nan-rows)"] if r.nan_rows else \
        [M.SEMANTICS_NOTE.format(version=version) + " (--nan-rows keeps torch's)"] if torch_nan else []
    notes = semantics if calls else ["no attention call was routed: the module calls no "
                                     "scaled_dot_product_attention and computes no softmax(q k^T) v"]
    notes += trace_notes
    notes += [f"routed: {f.kind} attention at {f.where}" for f in found if f.kind]
    notes += [f"not routed (MatMul+Softmax in the graph): attention at {f.where}: {f.reason}" for f in missed]
    static = [f"{n} axis {a}" for n, axes in t.dims[1].items() for a in axes if a not in kept.get(n, {})]
    if static:
        notes.append(f"fixed by the model (not symbolic): {', '.join(static)}")
    with U.phase("write"):
        path = None
        if staged is not None:
            path, size = staged.commit(), staged.size
        else:
            F.fits_one_message(model)
            data = model.SerializeToString(deterministic=True)
            size = len(data)
            if r.output is not None:
                path = Path(r.output)
                F.atomic_write(path, data)
            del data
    return ModuleExportResult(path, r.name, r.flavor, opset, r.dtype, op_name, len(calls), kept, checked, size,
                              notes, model, [o.name for o in model.graph.output], found)


class _ParamArrays(Mapping):
    """A module's parameters as NumPy arrays, each made when it is read (`weights.record` reads one
    at a time): a view of the tensor where NumPy has its dtype, a float32 copy of it else (bfloat16),
    so no copy of the whole model is held beside it."""

    def __init__(self, tensors: dict):
        self._tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        import torch
        t = self._tensors[name].detach()
        return (t if t.dtype in (torch.float32, torch.float16, torch.float64) else t.float()).numpy()

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _module_trace(module, example_inputs: tuple, r: ModuleExport) -> _ModuleTrace:
    """The module (in the export's dtype already: `_in_dtype`) with its names, dynamic axes and cache pairs checked
    against what forward takes and returns (one run of it, routed through the core: its target,
    `target.of_module`)."""
    tdtype = D.torch_dtype(r.dtype)
    kept = {i for i, n in enumerate(r.input_names or []) if n in r.float32_inputs}
    args = tuple(t.to(tdtype) if t.is_floating_point() and i not in kept else t for i, t in enumerate(example_inputs))
    target = T.of_module(module, args, r.name, r.input_names, r.output_names, r.cache, r.write_pos)
    names, cache = list(target.inputs), target.signature.pairs
    asked = r.dynamic
    if r.write_pos is not None:
        _check_write_pos(r, names, args, cache)
    if cache:  # a cache's positions axis: axis -2 (`past_len`) unless --dynamic names another
        asked = dict(r.dynamic) if r.dynamic is not None else _default_dynamic(names, args)
        for n, t in zip(names, args, strict=True):
            given = (r.dynamic or {}).get(n, {})
            if n in cache and t.dim() < 2:
                raise UsageError(f"--cache {n}: a cache has a positions axis, {n} has {t.dim()} axis")
            if n in cache and not any(a % t.dim() != 0 for a in given):
                batch = {0: given.get(0, "batch")} if r.dynamic is None or 0 in given else {}
                # A static cache's buffers keep their positions; a growing cache's are `past_len`.
                asked[n] = batch if r.write_pos is not None else {**batch, t.dim() - 2: "past_len"}
        if r.write_pos is not None and r.write_pos not in (r.dynamic or {}):
            asked.update(_write_pos_axes(r, names, args, cache, asked))
    dims = _dynamic_shapes(names, args, asked)
    out_names = list(target.outputs) or None
    return _ModuleTrace(module, args, names, dims, out_names, target, r)


def _check_write_pos(r: ModuleExport, names, args, cache) -> None:
    """A static cache's write position: an integer input of rank 0 or 1 beside buffers with a
    positions axis."""
    import torch
    if not cache:
        raise UsageError(f"--write-pos {r.write_pos}: the position a static cache is written at; name its buffers "
                         "with --cache INPUT:OUTPUT")
    if r.write_pos not in names:
        raise UsageError(f"--write-pos {r.write_pos}: not an input of {r.name} (inputs: {', '.join(names)})")
    if r.write_pos in cache:
        raise UsageError(f"--write-pos {r.write_pos}: a buffer of the cache cannot be its write position too")
    for n in cache:
        moving = [a for a in (r.dynamic or {}).get(n, {}) if a % args[names.index(n)].dim() != 0]
        if moving:
            raise UsageError(f"--cache {n} with --write-pos: a static cache's buffers keep their size; --dynamic "
                             f"makes {n}'s axis {moving[0]} symbolic")
    t = args[names.index(r.write_pos)]
    if t.is_floating_point() or t.dtype == torch.bool or t.dim() > 1:
        raise UsageError(f"--write-pos {r.write_pos}: an integer input of rank 0 or 1 (each sequence's first "
                         f"position, or the block's positions), got {str(t.dtype).replace('torch.', '')} of shape "
                         f"{list(t.shape)}")


def _write_pos_axes(r: ModuleExport, names, args, cache, asked) -> dict:
    """The write position's symbolic axis when --dynamic does not name it: the batch, where it
    holds each sequence's position (B,), or the block's length, where it holds the block's
    positions (T,); none for a scalar or (1,). Told apart by the example's sizes."""
    t = args[names.index(r.write_pos)]
    if t.dim() == 0:
        return {}
    batch = args[names.index(next(iter(cache)))].shape[0]
    blocks = [(n, a.shape[1], asked[n][1]) for n, a in zip(names, args, strict=True)
              if n not in cache and a.dim() >= 2 and 1 in asked.get(n, {})]
    size = t.shape[0]
    along = [(n, dim) for n, length, dim in blocks if length == size]
    if size == batch and not along:
        return {r.write_pos: {0: "batch"}}
    if along and size != batch:
        return {r.write_pos: {0: along[0][1]}}
    if size == 1:
        return {}
    raise UsageError(f"--write-pos {r.write_pos}: its {size} value(s) are neither one per sequence (batch {batch}) "
                     f"nor one per new position{' alone' if along else ''} ("
                     f"{', '.join(f'{n} has {length}' for n, length, _ in blocks) or 'no input runs along a sequence'}"
                     "); give the example different sizes, or name its axis with --dynamic")


def _write_pos_of(t: _ModuleTrace, kept: dict, name: str):
    """The module's WritePos (input `name`), its form read from the axis the export kept symbolic."""
    r = t.request
    arg = t.args[t.names.index(name)]
    dims = kept.get(name, {})
    batch_dim = kept.get(next(iter(t.cache)), {}).get(0)
    dtype = str(arg.dtype).replace("torch.", "")
    if not dims:
        if arg.numel() != 1:
            raise UsageError(f"--write-pos {name}: {r.name} fixes its size at {list(arg.shape)}; it must follow "
                             "the batch (each sequence's position) or the block (its positions)")
        return WritePos(name, "shared", tuple(arg.shape), dtype)
    dim = dims[0]
    if dim == batch_dim:
        return WritePos(name, "start", (), dtype)
    lengths = {d for n, axes in kept.items() if n not in t.cache and n != name for a, d in axes.items() if a}
    if dim in lengths:
        return WritePos(name, "positions", (), dtype)
    raise UsageError(f"--write-pos {name}: its axis {dim!r} is neither the batch ({batch_dim}) nor the block's "
                     f"length ({', '.join(sorted(lengths)) or 'none'})")


def static_probes(args, names, kept, cache: dict, write, seed: int) -> list:
    """Inputs at other sizes for a static cache's step: each symbolic axis at 1 and at the
    example's size + 3 (a block no longer than the buffers), the buffers drawn at random, each
    sequence's position drawn where its block fits (one for all but in the "start" form)."""
    import torch
    buffers = args[names.index(next(iter(cache)))]
    positions = buffers.shape[-2]
    blocks = {d for n, axes in kept.items() if n not in cache and n != write.name for a, d in axes.items() if a}
    rng = np.random.default_rng(seed)
    out = []
    for feed in probe_inputs(args, names, kept, seed, limits={d: positions for d in blocks}):
        by_name = dict(zip(names, feed, strict=True))
        batch = by_name[next(iter(cache))].shape[0]
        length = next((x.shape[a] for n, x in by_name.items() for a, d in kept.get(n, {}).items() if d in blocks), 1)
        by_name[write.name] = torch.from_numpy(write.drawn(rng, batch, length, positions))
        out.append(tuple(by_name[n] for n in names))
    return out


def _in_dtype(module, tdtype):
    """The module in `tdtype` and eval mode, the caller's left as it was: itself where it is so
    already (a whole model is not held twice), else a copy."""
    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    if not any(m.training for m in module.modules()) and all(t.dtype == tdtype for t in floats):
        return module
    return copy.deepcopy(module).to(tdtype).eval()


@dataclass
class _Traced:
    """What the trace gave: the attention found (`recognize.route`), the core's calls in order
    (tracing may run forward more than once), the ONNX model and what the notes say of the trace."""

    found: list
    calls: list
    model: Any
    notes: list


def _trace_to_onnx(t: _ModuleTrace, opset: int, scratch: Path | None = None,
                   early: W.Prewrite | None = None) -> _Traced:
    """torch.export's program of the module, its attention routed through the core (what was not
    recognized stops a fused flavour unless allowed), and the ONNX model of it; with `scratch` (a
    staging folder), its weights written there (`files.SCRATCH`) straight from the module's
    tensors, the model naming them as external data (no copy of them in memory), those `early`
    has been writing since before the trace named where it wrote them. A module whose
    layers are alike (`request.repeat`) is traced with three of them and stamped out
    (`attnexport.stamping`), or traced whole where its traced layers turn out not to be alike."""
    r = t.request
    notes = []
    everything = range(len(t.names))
    if r.repeat is not None:
        try:
            traced = _trace_stamped(t, opset)
        except ST.Unstampable as e:
            notes.append(f"traced with all {r.repeat.count} layers: the traced layers are not alike ({e})")
            traced = _trace(t, opset, everything, t.out_names)
    else:
        traced = _trace(t, opset, everything, t.out_names)
    if scratch is not None:
        with U.phase("write weights"):
            W.unload(traced.model, scratch, F.SCRATCH, F.EXTERNAL_MIN, F.EXTERNAL_ALIGN, beside=r.beside_write,
                     early=early)
    import onnx_ir as ir
    traced.model = ir.serde.serialize_model(traced.model)  # its weights named where `unload` wrote them
    traced.notes = notes + traced.notes
    return traced


def _trace(t: _ModuleTrace, opset: int, keep, out_names) -> _Traced:
    """The module traced with the inputs `keep` (positions in t.names) and the outputs `out_names`,
    and translated: a _Traced whose model is the onnx_ir model, not yet serialised."""
    import torch

    tracing = _tracing()
    recognize, torch_dead_rows = tracing.recognize, tracing.onnx_attention.torch_dead_rows
    r = t.request
    args, names = tuple(t.args[i] for i in keep), [t.names[i] for i in keep]
    shapes = tuple(t.dims[0][i] for i in keep)
    with M.routed(), (torch_dead_rows() if r.nan_rows else contextlib.nullcontext()):
        with export_errors(r.name), _quiet(), torch_sped_up(), U.phase("trace"):
            traced = torch.export.export(t.module, args, dynamic_shapes=_by_signature(t.module, shapes))
        found = recognize.route(traced)
        missed = [f for f in found if f.reason]
        if missed and FL.FLAVORS[r.flavor].fused and not r.allow_unfused:
            f = missed[0]
            raise ExportError(f"{r.name}: attention at {f.where} was not recognized ({f.reason}); the {r.flavor} "
                              "flavor would compute it with MatMul+Softmax outside its fused op. --allow-unfused "
                              "exports it so (--flavor primitives computes all attention that way)")
        with U.phase("to onnx"):
            program = to_onnx(traced, args, flavor=r.flavor, opset=opset, input_names=names,
                              output_names=out_names, what=r.name, optimize=not r.optimized_by_rewrite)
    return _Traced(found, recognize.routed_calls(traced), program.model, [])


def _trace_stamped(t: _ModuleTrace, opset: int) -> _Traced:
    """The module traced with its first `stamping.TRACED` layers (`repeat.shallow`), its graph
    stamped out to all of them. torch.onnx's optimizer, where it runs, runs on the shallow graph
    without merging equal initializers (layer 2 would read layer 0's), which is done after the stamp."""
    r = t.request
    keep = [i for i, n in enumerate(t.names) if r.repeat.kept(n)]
    out_names = None if t.out_names is None else [n for n in t.out_names if r.repeat.kept(n)]
    optimize = not r.optimized_by_rewrite
    with r.repeat.shallow(t.module), (ST.deduplication_off() if optimize else contextlib.nullcontext()):
        traced = _trace(t, opset, keep, out_names)
    with U.phase("stamp"):
        made = ST.stamp(traced.model, r.repeat, t.module)
        if optimize:
            ST.deduplicate(traced.model)
    traced.calls, traced.found = (_stamped_out(x, r.repeat.count) for x in (traced.calls, traced.found))
    traced.notes.append(f"traced with {ST.TRACED} of its {r.repeat.count} alike layers; the other "
                        f"{r.repeat.count - ST.TRACED} stamped from layer {ST.TEMPLATE}'s graph ({made} nodes)")
    return traced


def _stamped_out(per_call: list, count: int) -> list:
    """What the trace found a call at a time (the attention routed, the core's calls), the template
    layer's repeated for each stamped layer, where the traced layers have as many each."""
    per = len(per_call) // ST.TRACED if len(per_call) % ST.TRACED == 0 else 0
    return per_call + per_call[-per:] * (count - ST.TRACED) if per else per_call


def _by_signature(module, shapes: tuple) -> tuple:
    """The dynamic shapes, one per argument, in the structure torch.export matches against
    forward's signature: those of a `*args` parameter as one tuple."""
    import inspect
    params = list(inspect.signature(module.forward).parameters.values())
    for k, p in enumerate(params):
        if p.kind == p.VAR_POSITIONAL:
            return (*shapes[:k], tuple(shapes[k:]))
    return shapes


def _kept_axes(t: _ModuleTrace, kept: dict) -> dict:
    """Checks the symbolic axes the model kept against those asked for (--dynamic) and returns
    each cache input's positions axis."""
    r = t.request
    if r.dynamic is not None:
        fixed = [f"{n}:{a}={d}" for n, axes in t.dims[1].items() for a, d in axes.items() if a not in kept.get(n, {})]
        if fixed:
            raise UsageError(f"--dynamic {', '.join(fixed)}: {r.name} fixes that axis (the export would be static "
                             f"there)")
    cache_axes = {}
    for n in t.names:
        if n in t.cache and r.write_pos is not None:  # buffers: their positions stay as they are
            cache_axes[n] = t.args[t.names.index(n)].dim() - 2
        elif n in t.cache:
            axes = [a for a in kept.get(n, {}) if a != 0]
            if len(axes) != 1:
                raise UsageError(f"--cache {n}: {r.name} fixes the cache's positions axis (it must stay symbolic)")
            cache_axes[n] = axes[0]
    return cache_axes


def _default_dynamic(names, args) -> dict:
    """Axes 0 (`batch`) and 1 (`<input>_len`) of every input of rank 2 or more."""
    return {n: {0: "batch", 1: f"{n}_len"} for n, t in zip(names, args, strict=True) if t.dim() >= 2}


def _dynamic_shapes(names, args, dynamic):
    """(dynamic_shapes for torch.export, wanted {input: {axis: name}}). torch.export is asked to
    keep each wanted axis symbolic where the program allows (Dim.AUTO): axes the program needs
    equal share one symbol, and an axis the module fixes is reported by name afterwards."""
    import torch
    if dynamic is None:
        wanted = _default_dynamic(names, args)
    else:
        unknown = set(dynamic) - set(names)
        if unknown:
            raise UsageError(f"--dynamic names {', '.join(sorted(unknown))}, not an input (inputs: "
                             f"{', '.join(names)})")
        wanted = {}
        for n, t in zip(names, args, strict=True):
            for axis, dim in dynamic.get(n, {}).items():
                if not -t.dim() <= axis < t.dim():
                    raise UsageError(f"--dynamic {n}:{axis}={dim}: {n} has {t.dim()} axes")
                wanted.setdefault(n, {})[axis % t.dim()] = dim
    shapes = tuple({a: torch.export.Dim.AUTO for a in wanted.get(n, {})} for n in names)
    return shapes, wanted


def _name_dims(model, names, wanted):
    """Names the symbolic input axes as asked; returns those that stayed symbolic."""
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param.isdigit():  # a symbol torch.export specialized: a size, not a name
                d.dim_value = int(d.dim_param)
    kept, renames = {}, {}
    inputs = {i.name: i for i in model.graph.input}
    for n, axes in wanted.items():
        for axis, dim_name in axes.items():
            d = inputs[n].type.tensor_type.shape.dim[axis]
            if d.dim_param:
                dim_name = renames.setdefault(d.dim_param, dim_name)  # a symbol shared by inputs: one name
                d.dim_param = dim_name
                kept.setdefault(n, {})[axis] = dim_name
    rename_symbols(model, renames)
    return kept


def probe_inputs(args, names, kept, seed, empty=(), limits=None):
    """Inputs at other sizes: each symbolic axis 1, and the example's size + 3 (at most its
    `limits` size), and (given the names of axes that may be empty, a cache's) those 0; floats
    seeded, other inputs filled with the example's most common value (a mask mostly attends)."""
    import torch
    sizes = {}
    for n, t in zip(names, args, strict=True):
        for axis, d in kept.get(n, {}).items():
            sizes.setdefault(d, t.shape[axis])
    rng = np.random.default_rng(seed)
    out = []
    variants = [{d: 1 for d in sizes}, {d: min(s + 3, (limits or {}).get(d, s + 3)) for d, s in sizes.items()}]
    if empty:
        variants.append({d: 0 if d in empty else s for d, s in sizes.items()})
    for variant in variants:
        feed = []
        for n, t in zip(names, args, strict=True):
            shape = [variant.get(kept.get(n, {}).get(a), s) for a, s in enumerate(t.shape)]
            if t.is_floating_point():
                feed.append(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(t.dtype))
            else:
                feed.append(torch.full(shape, M.common_value(t), dtype=t.dtype))
        out.append(tuple(feed))
    return out


def _written_ends(t: _ModuleTrace, kept, write, feed) -> np.ndarray:
    """Each sequence's end of the written positions after a static step: where it wrote + the block."""
    length = next(x.shape[a] for n, x in feed.items() for a in kept.get(n, {})
                  if a and n not in t.cache and n != write.name)
    return write.ends(feed[write.name], length, feed[next(iter(t.cache))].shape[0])


def _check_other_sizes(t: _ModuleTrace, model, kept: dict, empty=frozenset(), write=None) -> list:
    """Runs the model on ONNX Runtime at other sizes against the module itself, under the export's
    semantics (a query with no key to attend to gives zeros, unless `nan_rows`); an ExportError
    (nothing written) when they differ. `empty`: the axes that may be 0 (a growing cache's);
    `write`: a static cache's WritePos."""

    if not kept:
        return []
    name, names = t.request.name, t.names
    session = R.prepare_onnx("ort-cpu", model)
    checked = []

    def compute(module, feed):
        with contextlib.nullcontext() if t.request.nan_rows else M.export_semantics():
            return M.call_forward(module, feed, name)
    probes = static_probes(t.args, names, kept, t.cache, write, 1) if write else \
        probe_inputs(t.args, names, kept, 1, empty)
    # GroupQueryAttention's buffers are undefined past each sequence's written positions.
    undefined_past = write is not None and ExportRecord.of(model).static_buffers is not None
    for feed in probes:
        want, tol = M.expected_of(t.module, feed, name, t.request.dtype, compute)
        if t.request.rtol is not None or t.request.atol is not None:
            tol = tolerance(t.request.dtype, t.request.rtol, t.request.atol)
        sizes = {n: list(x.shape) for n, x in zip(names, feed, strict=True)}
        want = [w.numpy() for w in want]
        try:
            got = session.run({n: x.numpy() for n, x in zip(names, feed, strict=True)})
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's reason, in one line
            raise UsageError(f"{name}: the export does not run at {sizes} on ONNX Runtime ({reason(e)[:300]}); "
                             "if the module fixes a size there, say which axes are "
                             "symbolic with --dynamic") from None
        if undefined_past:
            ends = _written_ends(t, kept, write, dict(zip(names, feed, strict=True)))
            got = past_ends_zeroed(got, t.cache.values(), ends)
            want = list(past_ends_zeroed(dict(zip(got, want, strict=True)), t.cache.values(), ends).values())
        for out_name, w in zip(list(got), want, strict=True):
            c = compare(out_name, got[out_name], w, tol)
            if not c:
                raise ExportError(f"{name}: the export differs from the module at {sizes}: {c}")
        checked.append(sizes)
    return checked
