"""An encoder-decoder's export (`export --hf` of a family whose model is an encoder and a decoder):
its three graphs (`graphs`) through the module path, each checked before anything is written
against the same graph of the model in float64 (the whole-model numerics policy,
`attnexport.pretrained.reference`: each output within the factor of torch's own error), fed what
the model itself computes: the encoder the family's check inputs, the first decoder step the
encoder's output, the later step the caches the first step wrote; quantized a matrix group at a
time with each graph checked again; the decoder's two steps merged; written as the folder Optimum
and transformers.js load (config.json, generation_config.json, the family's files, the graphs in
onnx/).

A family fills `Model`'s hooks: its graphs as torch modules, its check inputs, its sizes and words.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
import torch

from attnexport import dtypes as D
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import localize as L
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport.compare import compare, failed
from attnexport.errors import ExportError, UsageError, reason
from attnexport.export import ModuleExport, ModuleExportResult, export_module
from attnexport.pretrained import model as HM
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained import registry
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.fusions import tied_head

# The deployment folder's subfolder of graphs (Optimum's `subfolder`, transformers.js' place for them).
GRAPH_DIR = "onnx"


@dataclass
class Model:
    """An encoder-decoder model and what its graphs need beside it: the start tokens of its answers,
    the end token, the tokens never picked (`suppress`) or not first (`suppress_first`), and the
    folder it came from. A family's subclass fills the hooks and the words its rows use."""

    model: Any
    source: Path
    start: list[int]
    end: int
    suppress: list[int]
    suppress_first: list[int]

    # What messages call the model ("whisper"), and in a sentence ("Whisper").
    name: ClassVar[str] = "encoder-decoder"
    title: ClassVar[str] = "an encoder-decoder"
    # What verify's rows call an input (a clip) and the answers (transcripts).
    item: ClassVar[str] = "input"
    answers: ClassVar[str] = "outputs"
    # What verify takes beside SOURCE to measure a lossy folder's cost on the user's own inputs.
    cost_hint: ClassVar[str] = ""
    # The graphs whose matrices the integer int8 form (`--int8-kernel integer`) runs on
    # DynamicQuantizeMatMul, uncalibrated (Whisper's encoder: a clip's 1500 frames a run); none: the
    # family's int8 is the blockwise form alone.
    integer_graphs: ClassVar[tuple[str, ...]] = ()
    # What a client does with an input, in verify's rows ("transcribe"), and the name of the budget.
    verb: ClassVar[str] = "answer"
    budget_name: ClassVar[str] = "the accuracy budget"

    @property
    def spec(self) -> G.Spec:
        raise NotImplementedError

    @property
    def layers(self) -> int:
        return self.spec.layers

    @property
    def tokens(self) -> G.Tokens:
        return G.Tokens(tuple(self.start), self.end, tuple(self.suppress), tuple(self.suppress_first))

    def positions(self) -> int | None:
        """The decoder's positions (None: as many as asked, relative positions)."""
        return None

    def modules(self, model, static: bool = False) -> dict[str, torch.nn.Module]:
        """The three graphs' torch modules over `model` (transformers' model, in any dtype)."""
        raise NotImplementedError

    def check_inputs(self) -> dict:
        """The encoder's feed the export's checks run (a batch of 2)."""
        raise NotImplementedError

    def check_tokens(self) -> list[int]:
        """The tokens the checks feed the decoder after the start tokens."""
        raise NotImplementedError

    def decode(self, tokens: list[int]) -> str:
        raise NotImplementedError

    def write_files(self, staging: Path) -> None:
        """The family's files of a deployment folder beside config.json and generation_config.json
        (the tokenizer's, a feature extractor's)."""

    def notes(self, static: bool, max_seq: int) -> list[str]:
        """What export says of the folder beyond its checks."""
        return []


class Checked:
    """The three graphs of a model in torch as exported (in `dtype`, fp32 or fp16), in fp32 and in
    float64, and the feeds their checks run: each graph's feed computed by the fp32 graph before it
    (given to a half graph in half). The float64 reference of the encoder's states and of the
    decoder's logits is transformers' own forward (its encoder; the whole model over every token so
    far, teacher-forced), and their budget its own error in `dtype`: a mistake in how the graphs are
    written (a mask, a scale, a position) is in neither. The caches' keys and values, which
    transformers keeps inside its cache object, are the modules' in float64. `max_seq`: the
    decoder's self cache static, buffers of that many positions (its later step's check feeds one
    token: ONNX Runtime's GroupQueryAttention takes a block over written positions at batch 1 only)."""

    def __init__(self, m: Model, dtype: str = "fp32", max_seq: int | None = None):
        self.m, self.dtype, self.max_seq = m, dtype, max_seq
        static = max_seq is not None
        self.fp32 = m.modules(m.model, static)
        self.model_dtype = m.model if dtype == "fp32" else copy.deepcopy(m.model).to(D.torch_dtype(dtype))
        self.exported = self.fp32 if dtype == "fp32" else m.modules(self.model_dtype, static)
        self.model64 = copy.deepcopy(m.model).double()
        self.fp64 = m.modules(self.model64, static)
        layers = m.layers
        inputs = m.check_inputs()
        batch = next(iter(inputs.values())).shape[0]
        ids = np.tile(np.asarray(m.start + m.check_tokens(), np.int64), (batch, 1))
        self.feeds = {G.ENCODER: inputs}
        states = self.run(G.ENCODER, self.feeds[G.ENCODER])["last_hidden_state"]
        later = 1 if static else 2
        mask = G.mask_of(inputs)
        self.feeds[G.DECODER] = self.first_feed(ids[:, :-later], states, mask)
        first = self.run(G.DECODER, self.feeds[G.DECODER])
        caches = {n.replace("present", "past_key_values"): first[n] for n in G.both_names(layers, "present")}
        written = {G.WRITE_POS: np.full(batch, ids.shape[1] - later, np.int64)} if static else {}
        self.feeds[G.DECODER_WITH_PAST] = {"input_ids": ids[:, -later:], **mask, **written, **caches}

    def first_feed(self, ids: np.ndarray, states: np.ndarray, mask: dict | None = None) -> dict:
        """The first step's feed of `ids` over the encoder's `states` (`mask`: the decoder's
        encoder_attention_mask, where it takes one): a static cache's empty buffers written from 0."""
        feed = {"input_ids": ids, "encoder_hidden_states": states, **(mask or {})}
        if self.max_seq is None:
            return feed
        spec = self.m.spec
        empty = np.zeros((ids.shape[0], spec.heads, self.max_seq, spec.head_dim), np.float32)
        return {**feed, G.WRITE_POS: np.zeros(ids.shape[0], np.int64),
                **{n: empty for n in G.self_names(spec.layers, "past_key_values")}}

    def _torch(self, module, feed: dict, dtype, mode) -> list:
        args = [torch.from_numpy(np.ascontiguousarray(v)) for v in feed.values()]
        args = [a.to(dtype) if a.is_floating_point() else a for a in args]
        with torch.no_grad(), M.export_semantics(), mode:
            return M.outputs_of(module(*args))

    def run(self, graph: str, feed: dict) -> dict:
        """The graph's outputs in torch in fp32."""
        out = self._torch(self.fp32[graph], feed, torch.float32, contextlib.nullcontext())
        return {n: t.numpy() for n, t in zip(G.outputs(graph, self.m.layers), out, strict=True)}

    def run_exported(self, graph: str, feed: dict) -> dict:
        """The graph's outputs in torch in the export's dtype (as float32 arrays)."""
        out = self._torch(self.exported[graph], feed, D.torch_dtype(self.dtype), contextlib.nullcontext())
        return {n: t.float().numpy() for n, t in zip(G.outputs(graph, self.m.layers), out, strict=True)}

    def transformers(self, graph: str, feed: dict, dtype) -> dict:
        """The graph's encoder states or logits as transformers' own forward computes them (its
        encoder; the whole model teacher-forced over every token so far), in `dtype`."""
        model = self.model64 if dtype == torch.float64 else self.model_dtype if dtype != torch.float32 else \
            self.m.model
        mode = HR.float64_everywhere() if dtype == torch.float64 else contextlib.nullcontext()

        def tensor(v):
            t = torch.from_numpy(np.ascontiguousarray(v))
            return t.to(dtype) if t.is_floating_point() else t
        with torch.no_grad(), mode:
            if graph == G.ENCODER:
                states = model.get_encoder()(**{k: tensor(v) for k, v in feed.items()}).last_hidden_state
                return {"last_hidden_state": states.float().numpy()}
            ids, states, mask = self.history(graph, feed)
            logits = model(encoder_outputs=(tensor(states),), attention_mask=None if mask is None else tensor(mask),
                           decoder_input_ids=torch.from_numpy(ids), use_cache=False).logits
            return {"logits": logits[:, -feed["input_ids"].shape[1]:].float().numpy()}

    def expected(self, graph: str, feed: dict) -> tuple[dict, dict]:
        """(each output of the graph in float64, its budget). The encoder's states and the logits:
        transformers' own forward in float64, within 4x the error of its own forward in the export's
        dtype; the caches' keys and values: the graph's modules in float64, within 4x their error in
        that dtype. Never a budget from the graphs' modules against transformers: a mistake in the
        modules would widen the budget that is to catch it."""
        ours = self.run_exported(graph, feed)
        out = self._torch(self.fp64[graph], feed, torch.float64, HR.float64_everywhere())
        ours64 = {n: t.double().numpy() for n, t in zip(G.outputs(graph, self.m.layers), out, strict=True)}
        t64 = self.transformers(graph, feed, torch.float64)
        t_dtype = self.transformers(graph, feed, D.torch_dtype(self.dtype))
        tolerances = {n: HR.budget(ours[n], ours64[n], self.dtype) for n in ours64}
        tolerances.update({n: HR.budget(t_dtype[n], t64[n], self.dtype) for n in t64})
        return {**ours64, **t64}, tolerances

    def history(self, graph: str, feed: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(every token up to the step's last, the encoder states, the encoder's padding mask or None)
        of a decoder step's feed: a first step's are its own; a later step's, those of the check's
        first step before its own (its pasts were written from them)."""
        if graph == G.DECODER:
            return feed["input_ids"], feed["encoder_hidden_states"], feed.get(G.ENCODER_MASK)
        first = self.feeds[G.DECODER]
        past = int(feed[G.WRITE_POS][0]) if G.WRITE_POS in feed else \
            feed[G.self_names(self.m.layers, "past_key_values")[0]].shape[2]
        if past != first["input_ids"].shape[1]:
            raise ValueError(f"a step with past of {past} positions is not one the check's first step wrote")
        return (np.concatenate([first["input_ids"], feed["input_ids"]], axis=1), first["encoder_hidden_states"],
                first.get(G.ENCODER_MASK))

    def check(self, graph: str, onnx_model) -> list:
        """The graph on ONNX Runtime's CPU provider against float64, every declared output within its
        derived budget; an ExportError naming the first that is not."""
        try:
            got = G.typed(R.prepare_onnx("ort-cpu", onnx_model).run, onnx_model)(self.feeds[graph])
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's reason, in one line
            raise ExportError(f"{self.m.name} {graph}: the export does not run on ONNX Runtime "
                              f"({reason(e)[:300]})") from None
        return self.compared(graph, got, graph, _overflow(onnx_model, self.feeds[graph]))

    def comparisons(self, graph: str, got: dict) -> list:
        """`got`, the outputs of `graph` on its check feed, against float64: each declared output
        within its budget (`expected`)."""
        feed, names = self.feeds[graph], G.outputs(graph, self.m.layers)
        want, tolerances = self.expected(graph, feed)
        out = []
        for n in names:
            tol = tolerances[n]
            if n not in got:
                out.append(failed(n, "output missing", tol))
            elif np.shape(got[n]) != want[n].shape:
                out.append(failed(n, f"shape {np.shape(got[n])} != expected {want[n].shape}", tol))
            else:
                out.append(compare(n, np.asarray(got[n], np.float64), want[n], tol))
        return out

    def compared(self, graph: str, got: dict, label: str, overflow=None) -> list:
        """`comparisons`, or an ExportError naming the first output over its budget (where the outputs
        hold a NaN or an infinity, `overflow()` says where they begin); returns what was checked (the
        worst output against its budget)."""
        comparisons = self.comparisons(graph, got)
        bad = [c for c in comparisons if not c]
        if bad and overflow is not None and L.nonfinite(got):
            raise ExportError(f"{self.m.name} {label}: the export overflows: {overflow()}")
        if bad:
            raise ExportError(f"{self.m.name} {label}: the export differs from the model in float64: {bad[0]}")
        worst = max(comparisons, key=lambda c: c.max_abs / max(c.atol, 1e-30))
        return [{"graph": label, "compared": len(comparisons), "worst": {"output": worst.name, "max_abs": worst.max_abs,
                                                                         "atol": worst.atol, "rtol": worst.rtol,
                                                                         "basis": worst.basis}}]

    def check_merged(self, decoder, first: ModuleExportResult) -> ModuleExportResult:
        """The merged decoder checked as the two it joins were: each branch fed as a client feeds it
        (the first step: empty pasts, use_cache_branch false; a later one: an empty
        encoder_hidden_states, true, its cross presents empty), against float64 (a quantized decoder
        with float activations, against the model with its weights); returns its result (the first
        step's, with what was checked)."""
        spec, checked = self.m.spec, []
        # a quantized one with float activations: its weights against the model with them (an fp32
        # or fp16 decoder is checked as it is, not copied)
        twin = P.float_activations(decoder) if P.record_of(decoder) is not None else decoder
        run = G.typed(R.prepare_onnx("ort-cpu", twin).run, twin)
        for graph, use_cache in ((G.DECODER, False), (G.DECODER_WITH_PAST, True)):
            feed = G.merged_feed(self.feeds[graph], spec)
            got = run(feed)
            if use_cache:  # its cross presents empty: the clients keep the first step's
                empty = (feed["input_ids"].shape[0], spec.heads, 0, spec.head_dim)
                shapes = {np.shape(got[c]) for c in G.cross_names(spec.layers, "present")}
                if shapes != {empty}:
                    raise ExportError(f"{self.m.name} {G.MERGED}: the step with past returns cross presents of "
                                      f"shapes {sorted(shapes)}, not empty ones {empty}")
                got = {n: got[n] for n in G.outputs(graph, spec.layers)}
            checked += self.compared(graph, got, f"{G.MERGED} ({G.USE_CACHE}={str(use_cache).lower()})",
                                     _overflow(twin, feed))
        return replace(first, checked=checked, model=decoder)


def _overflow(onnx_model, feed: dict):
    """What says, for an ExportError, where the non-finite outputs of `onnx_model` on `feed` begin
    (`localize.first_overflow` on ONNX Runtime's CPU provider, within an If's branch too)."""
    def where() -> str:
        return G.typed(lambda f: L.overflow_said(onnx_model, f), onnx_model)(feed)
    return where


def _examples(checked: Checked) -> dict:
    """Each graph's trace example: the checks' feeds (batch 2, so that the batch axis stays symbolic;
    a static later step's, which checks one token, traced with two, so that its block stays symbolic)."""
    feeds = dict(checked.feeds)
    later = feeds[G.DECODER_WITH_PAST]
    if G.WRITE_POS in later and later["input_ids"].shape[1] == 1:
        feeds[G.DECODER_WITH_PAST] = {**later, "input_ids": np.tile(later["input_ids"], (1, 2)),
                                      G.WRITE_POS: later[G.WRITE_POS] - 1}
    return {g: tuple(torch.from_numpy(np.ascontiguousarray(v)) for v in feeds[g].values()) for g in G.GRAPHS}


@dataclass
class GraphsExport:
    """An encoder-decoder's export: the graphs written ({stem: result}) into the folder, and every
    check made before writing (the three graphs traced, then the merged decoder's two branches)."""

    folder: Path
    graphs: dict[str, ModuleExportResult]
    checked: list
    notes: list = field(default_factory=list)
    name: str = "encoder-decoder"

    @property
    def path(self) -> Path:
        return self.folder

    def summary(self) -> str:
        r = self.graphs[G.ENCODER]
        lines = [f"{self.folder}: {self.name}, flavor {r.flavor}, opset {r.opset}, attention op {r.attention_op}"]
        lines += [f"  {GRAPH_DIR}/{g}.onnx: {x.routed} attention call(s) routed, {F.human_size(x.size)}"
                  for g, x in self.graphs.items()]
        for c in self.checked:
            w = c["worst"]
            lines.append(f"note: {c['graph']} checked against the model in float64 ({c['compared']} outputs): worst "
                         f"{w['output']} max abs {w['max_abs']:.3g}, budget atol {w['atol']:.3g} ({w['basis']})")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict:
        return {"path": str(self.folder), "graphs": {g: r.to_dict() for g, r in self.graphs.items()},
                "checked": self.checked, "notes": self.notes}


def export_graphs(request, m: Model, params_source: str, precisions: tuple) -> GraphsExport:
    """`export --hf` of an encoder-decoder (`request`: `attnexport.pretrained.export.HFExport`, `m`:
    the family's model): the three graphs exported, each checked against float64, written as a
    deployment folder (--deploy) only: the model is three graphs, not one file."""
    r = request
    if r.deploy is None:
        raise UsageError(f"{m.title} model is three graphs (encoder, decoder, decoder with past): write them with "
                         "--deploy FOLDER")
    if r.form not in (None, "concat", "static"):
        raise UsageError(f"--kv-cache {r.form}: {m.title} export's decoder takes its self cache concat (the default) "
                         "or static (--kv-cache static --max-seq N)")
    static = r.form == "static"
    positions = m.positions()
    if static and positions is not None and not r.max_seq <= positions:
        raise UsageError(f"--max-seq {r.max_seq}: {m.title}'s decoder holds {positions} positions: at most {positions}")
    dtype = "fp16" if r.precision == "fp16" else r.dtype
    both = r.precision != "fp32" and r.dtype != "fp32"  # --precision and --dtype together
    if dtype not in ("fp32", "fp16") or r.precision not in precisions or both:
        raise UsageError(f"{m.title} model exports in {', '.join(precisions[:-1])} or {precisions[-1]} (--precision), "
                         f"not {r.precision if r.dtype == 'fp32' else r.dtype}")
    plan = (r.plan or P.TABLE[r.precision].plan) if r.precision in P.QUANTIZED else None
    if plan is not None and plan.kernel is None:  # the family's int8 form
        plan = replace(plan, kernel=registry.of_model(m.model).int8_kernel if plan.bits == 8 else "blockwise")
    if plan is not None and plan.kernel == "integer" and not m.integer_graphs:
        raise UsageError(f"--int8-kernel integer: {m.title} model's int8 is the blockwise form (MatMulNBits): its "
                         "integer form is neither calibrated nor measured")
    deploy = F.deploy_target(Path(r.deploy))
    if static and len(m.start) + len(m.check_tokens()) > r.max_seq:
        raise UsageError(f"--max-seq {r.max_seq}: the export's checks write "
                         f"{len(m.start) + len(m.check_tokens())} positions: give more")
    checked = Checked(m, dtype, r.max_seq if static else None)
    examples = _examples(checked)
    flavor = r.flavor or FL.DEFAULT
    opset = FL.opset_for(flavor, r.opset, ["--kv-cache static"] if static else [])
    spec, results = m.spec, {}
    for g, module in checked.fp32.items():
        cached = g == G.DECODER_WITH_PAST or static and g == G.DECODER
        request = ModuleExport(
            flavor=flavor, opset=opset, dtype=dtype, dynamic=G.dynamic_axes(g, spec, static), output=None,
            input_names=G.inputs(g, spec, static), output_names=G.outputs(g, spec.layers), name=f"{m.name} {g}",
            seed=r.seed if params_source == "seed" else None, record={"params_source": params_source},
            cache=G.cache_pairs(spec.layers) if cached else None,
            write_pos=G.WRITE_POS if static and g != G.ENCODER else None,
            rewrite=_tied_head if g != G.ENCODER else None, check=functools.partial(checked.check, g))
        results[g] = export_module(module, examples[g], request)
    notes = [HM.random_note(r.source, r.seed)] if params_source == "seed" else []
    if plan is not None:
        checked, done = quantize_graphs(m, results, plan)
        how = f"block {plan.block}, accuracy level {plan.accuracy}"
        if plan.kernel == "integer":
            how = (f"{', '.join(m.integer_graphs)}: int8 per output column, uint8 activations per tensor, "
                   f"DynamicQuantizeMatMul, not calibrated (attnexport owns no {m.item}s to calibrate {m.title} "
                   f"on); the rest MatMulNBits, {how}")
        notes.append(f"{r.precision}: " + "; ".join(f"{g} {d.summary()}" for g, d in done.items())
                     + f" ({how}); what it costs in {m.answers}: attnexport verify FOLDER --hf SOURCE{m.cost_hint}")
    decoder = G.merged(results[G.DECODER].model, results[G.DECODER_WITH_PAST].model, spec,
                       f"{m.name}_decoder_merged")
    written = {G.ENCODER: results[G.ENCODER],
               G.MERGED_STATIC if static else G.MERGED: checked.check_merged(decoder, results[G.DECODER])}
    write_deployment(deploy, {g: x.model for g, x in written.items()}, m)
    for g, result in written.items():
        result.path = deploy / GRAPH_DIR / f"{g}.onnx"
        result.size = result.path.stat().st_size
    notes += m.notes(static, r.max_seq)
    merged = written[G.MERGED_STATIC if static else G.MERGED]
    return GraphsExport(deploy, written, [c for x in results.values() for c in x.checked] + merged.checked, notes,
                        m.name)


def _tied_head(onnx_model):
    """A decoder's vocabulary matrix kept once, as its head reads it (Whisper's head reads the table
    through a Transpose, T5's through a copy the exporter folded)."""
    tied_head.tied_head(onnx_model)
    tied_head.folded_head(onnx_model)
    return onnx_model


def file_model(m: Model, graphs: dict):
    """A copy of transformers' model computing with the weights the quantized `graphs` ({graph:
    ModelProto}) hold: each Linear whose matrix a graph quantized gets its dequantized value (a
    parameter of its own: a tied head's embedding keeps the float table, as the graph's Gather does)."""
    held = copy.deepcopy(m.model)
    modules = m.modules(held)
    for g, onnx_model in graphs.items():
        for name, value in P.dequantized_params(onnx_model).items():
            path, attribute = name.rsplit(".", 1)
            owner = modules[g].get_submodule(path)
            if isinstance(owner, torch.nn.Linear) and attribute == "weight":
                owner.weight = torch.nn.Parameter(torch.from_numpy(value), requires_grad=False)
    return held


def quantize_graphs(m: Model, results: dict, plan: P.Plan) -> tuple[Checked, dict]:
    """The weight matrices of the three fp32 graphs (`results`: {graph: ModuleExportResult}, their
    models changed in place) quantized by `plan` (`precision.quantize`: ONNX Runtime's blockwise
    quantizer, MatMulNBits; the integer form in the family's `integer_graphs`), each checked before
    writing: every matrix a quantization of the model's
    (`precision.unfaithful`); each graph with float activations against the model with the file's
    weights (`file_model`) in float64, within fp32's budget; each graph as written finite on the
    checks' feeds. Returns (the checks of the file's weights, for the merged decoder; what was done
    to each graph)."""
    vocab, done = m.model.config.vocab_size, {}
    for g, x in results.items():
        inits = {i.name: i for i in x.model.graph.initializer}
        before = {s.weight: onnx.numpy_helper.to_array(inits[s.weight]) for s in P.sites(x.model, vocab)}
        done[g] = P.quantize(x.model, plan if g in m.integer_graphs else replace(plan, kernel="blockwise"), m.layers,
                             vocab)
        bad = P.unfaithful(before, x.model)
        if bad:
            raise ExportError(f"{m.name} {g}: the quantized weights are not a quantization of the model's: {bad[0]}")
    held = Checked(replace(m, model=file_model(m, {g: x.model for g, x in results.items()})))
    for g, x in results.items():
        x.checked = held.check(g, P.float_activations(x.model))
        got = R.prepare_onnx("ort-cpu", x.model).run(held.feeds[g])
        bad = [n for n in G.outputs(g, m.layers) if not np.isfinite(got[n]).all()]
        if bad:
            raise ExportError(f"{m.name} {g}: the quantized export gives {bad[0]} not finite on the check's feed")
    return held, done


def write_deployment(folder: Path, graphs: dict, m: Model) -> None:
    """config.json, generation_config.json, the family's files (`Model.write_files`) and `graphs`
    ({file stem: ModelProto}) in onnx/ with a copy of generation_config.json, as `files.write_folder`
    writes a folder (nothing half-written)."""
    model = m.model

    def fill(staging: Path) -> None:
        m.write_files(staging)
        config = model.config.to_dict()
        config["use_cache"] = True
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = json.dumps(model.generation_config.to_dict(), indent=2, sort_keys=True) + "\n"
        (staging / "generation_config.json").write_text(generation)
        (staging / GRAPH_DIR).mkdir()
        # Optimum's seq2seq models read the generation config from the graphs' folder (its `subfolder`),
        # transformers.js from the top: without this copy Optimum generates with none of the model's own
        # settings (Whisper's suppression and its <|notimestamps|> start token).
        (staging / GRAPH_DIR / "generation_config.json").write_text(generation)
        for g, model_proto in graphs.items():
            onnx.save_model(model_proto, str(staging / GRAPH_DIR / f"{g}.onnx"))
    F.write_folder(folder, fill)
