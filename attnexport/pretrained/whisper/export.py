"""Whisper's export (`export --hf` of a speech model): its three graphs (`attnexport.pretrained.whisper`)
through the module path, each checked before anything is written against the same graph of the model
in float64 (the whole-model numerics policy, `attnexport.pretrained.reference`: each output within
the factor of torch's own fp32 error), fed what the model itself computes: the encoder a clip's
log-mel features, the first decoder step the encoder's output, the later step the caches the first
step wrote. Written as the folder Optimum's ORTModelForSpeechSeq2Seq and transformers.js load:
config.json, generation_config.json, preprocessor_config.json, the tokenizer, and the graphs in onnx/.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from attnexport import dtypes as D
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport.compare import compare, failed
from attnexport.errors import ExportError, UsageError, reason
from attnexport.export import ModuleExport, ModuleExportResult, export_module
from attnexport.pretrained import model as HM
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained.fusions import tied_head
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import ctranslate2 as CT
from attnexport.pretrained.whisper import graphs as W

# What a Whisper export is made in (`--precision`): q4f16, int4's weights in a half graph, is not built for it.
PRECISIONS = ("fp32", "fp16", "int8", "int4")
# The deployment folder's subfolder of graphs (Optimum's `subfolder`, transformers.js' place for them).
GRAPH_DIR = "onnx"
# A sentence the checks feed the decoder (after the start tokens), tokenized by the model's tokenizer.
CHECK_TEXT = " Ever tried, ever failed. No matter."


@dataclass
class Speech:
    """A Whisper model and what its graphs need beside it: its decoder's layers, the start tokens
    of an English transcription without timestamps, the end token, the tokens never picked
    (`suppress`) or not first (`suppress_first`), and where its tokenizer.json is."""

    model: Any
    source: Path
    start: list[int]
    end: int
    suppress: list[int]
    suppress_first: list[int]

    @property
    def layers(self) -> int:
        return self.model.config.decoder_layers

    @property
    def tokens(self) -> W.Tokens:
        return W.Tokens(tuple(self.start), self.end, tuple(self.suppress), tuple(self.suppress_first))

    @property
    def mels(self) -> int:
        return self.model.config.num_mel_bins

    @classmethod
    def of(cls, model, source) -> Speech:
        folder = Path(source)
        tokens = CT.special_tokens(folder)
        g = model.generation_config
        return cls(model, folder, CT.start_tokens(tokens, model.config.vocab_size), int(model.config.eos_token_id),
                   [int(t) for t in (g.suppress_tokens or [])], [int(t) for t in (g.begin_suppress_tokens or [])])

    @functools.cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(self.source / "tokenizer.json"))

    def text_tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)


def check_audio(seconds: float = 3.0, seed: int = 0) -> np.ndarray:
    """A clip the export's checks feed when no speech is given: three gliding tones (a voice's
    formants' range) with a little noise, seeded."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * AU.RATE)) / AU.RATE
    audio = sum(0.2 * np.sin(2 * np.pi * (f0 + 80 * t) * t) for f0 in (220.0, 700.0, 2400.0))
    return (audio + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


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

    def __init__(self, speech: Speech, dtype: str = "fp32", max_seq: int | None = None):
        self.speech, self.dtype, self.max_seq = speech, dtype, max_seq
        static = max_seq is not None
        self.fp32 = W.modules(speech.model, static)
        self.model_dtype = speech.model if dtype == "fp32" else copy.deepcopy(speech.model).to(D.torch_dtype(dtype))
        self.exported = self.fp32 if dtype == "fp32" else W.modules(self.model_dtype, static)
        self.model64 = copy.deepcopy(speech.model).double()
        self.fp64 = W.modules(self.model64, static)
        layers = speech.layers
        clips = (check_audio(3.0, 0), check_audio(1.5, 1))
        features = np.stack([AU.log_mel(clip, speech.mels) for clip in clips])
        ids = np.tile(np.asarray(speech.start + speech.text_tokens(CHECK_TEXT), np.int64), (2, 1))
        self.feeds = {W.ENCODER: {"input_features": features}}
        states = self.run(W.ENCODER, self.feeds[W.ENCODER])["last_hidden_state"]
        later = 1 if static else 2
        self.feeds[W.DECODER] = self.first_feed(ids[:, :-later], states)
        first = self.run(W.DECODER, self.feeds[W.DECODER])
        caches = {n.replace("present", "past_key_values"): first[n] for n in W.both_names(layers, "present")}
        written = {W.WRITE_POS: np.full(2, ids.shape[1] - later, np.int64)} if static else {}
        self.feeds[W.DECODER_WITH_PAST] = {"input_ids": ids[:, -later:], **written, **caches}

    def first_feed(self, ids: np.ndarray, states: np.ndarray) -> dict:
        """The first step's feed of `ids` over the encoder's `states`: a static cache's empty
        buffers written from 0."""
        feed = {"input_ids": ids, "encoder_hidden_states": states}
        if self.max_seq is None:
            return feed
        config = self.speech.model.config
        heads = config.decoder_attention_heads
        empty = np.zeros((ids.shape[0], heads, self.max_seq, config.d_model // heads), np.float32)
        return {**feed, W.WRITE_POS: np.zeros(ids.shape[0], np.int64),
                **{n: empty for n in W.self_names(self.speech.layers, "past_key_values")}}

    def _torch(self, module, feed: dict, dtype, mode) -> list:
        args = [torch.from_numpy(np.ascontiguousarray(v)) for v in feed.values()]
        args = [a.to(dtype) if a.is_floating_point() else a for a in args]
        with torch.no_grad(), M.export_semantics(), mode:
            return M.outputs_of(module(*args))

    def run(self, graph: str, feed: dict) -> dict:
        """The graph's outputs in torch in fp32."""
        out = self._torch(self.fp32[graph], feed, torch.float32, contextlib.nullcontext())
        return {n: t.numpy() for n, t in zip(W.outputs(graph, self.speech.layers), out, strict=True)}

    def run_exported(self, graph: str, feed: dict) -> dict:
        """The graph's outputs in torch in the export's dtype (as float32 arrays)."""
        out = self._torch(self.exported[graph], feed, D.torch_dtype(self.dtype), contextlib.nullcontext())
        return {n: t.float().numpy() for n, t in zip(W.outputs(graph, self.speech.layers), out, strict=True)}

    def transformers(self, graph: str, feed: dict, dtype) -> dict:
        """The graph's encoder states or logits as transformers' own forward computes them (its
        encoder; the whole model teacher-forced over every token so far), in `dtype`."""
        model = self.model64 if dtype == torch.float64 else self.model_dtype if dtype != torch.float32 else \
            self.speech.model
        mode = HR.float64_everywhere() if dtype == torch.float64 else contextlib.nullcontext()
        with torch.no_grad(), mode:
            if graph == W.ENCODER:
                features = torch.from_numpy(feed["input_features"]).to(dtype)
                return {"last_hidden_state": model.model.encoder(input_features=features).last_hidden_state.float()
                        .numpy()}
            ids, states = self.history(graph, feed)
            logits = model(encoder_outputs=(torch.from_numpy(states).to(dtype),),
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
        ours64 = {n: t.double().numpy() for n, t in zip(W.outputs(graph, self.speech.layers), out, strict=True)}
        t64 = self.transformers(graph, feed, torch.float64)
        t_dtype = self.transformers(graph, feed, D.torch_dtype(self.dtype))
        tolerances = {n: HR.budget(ours[n], ours64[n], self.dtype) for n in ours64}
        tolerances.update({n: HR.budget(t_dtype[n], t64[n], self.dtype) for n in t64})
        return {**ours64, **t64}, tolerances

    def history(self, graph: str, feed: dict) -> tuple[np.ndarray, np.ndarray]:
        """(every token up to the step's last, the encoder states) of a decoder step's feed: a first
        step's are its own; a later step's, those of the check's first step before its own (its
        pasts were written from them)."""
        if graph == W.DECODER:
            return feed["input_ids"], feed["encoder_hidden_states"]
        first = self.feeds[W.DECODER]
        past = int(feed[W.WRITE_POS][0]) if W.WRITE_POS in feed else \
            feed[W.self_names(self.speech.layers, "past_key_values")[0]].shape[2]
        if past != first["input_ids"].shape[1]:
            raise ValueError(f"a step with past of {past} positions is not one the check's first step wrote")
        return np.concatenate([first["input_ids"], feed["input_ids"]], axis=1), first["encoder_hidden_states"]

    def check(self, graph: str, onnx_model) -> list:
        """The graph on ONNX Runtime's CPU provider against float64, every declared output within its
        derived budget; an ExportError naming the first that is not."""
        try:
            got = W.typed(R.prepare_onnx("ort-cpu", onnx_model).run, onnx_model)(self.feeds[graph])
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's reason, in one line
            raise ExportError(f"whisper {graph}: the export does not run on ONNX Runtime ({reason(e)[:300]})") from None
        return self.compared(graph, got, graph)

    def comparisons(self, graph: str, got: dict) -> list:
        """`got`, the outputs of `graph` on its check feed, against float64: each declared output
        within its budget (`expected`)."""
        feed, names = self.feeds[graph], W.outputs(graph, self.speech.layers)
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

    def compared(self, graph: str, got: dict, label: str) -> list:
        """`comparisons`, or an ExportError naming the first output over its budget; returns what
        was checked (the worst output against its budget)."""
        comparisons = self.comparisons(graph, got)
        bad = [c for c in comparisons if not c]
        if bad:
            raise ExportError(f"whisper {label}: the export differs from the model in float64: {bad[0]}")
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
        layers, checked = self.speech.layers, []
        # a quantized one with float activations: its weights against the model with them (an fp32
        # or fp16 decoder is checked as it is, not copied)
        twin = P.float_activations(decoder) if P.record_of(decoder) is not None else decoder
        run = W.typed(R.prepare_onnx("ort-cpu", twin).run, twin)
        for graph, use_cache in ((W.DECODER, False), (W.DECODER_WITH_PAST, True)):
            feed = W.merged_feed(self.feeds[graph], self.speech.model.config)
            got = run(feed)
            if use_cache:  # its cross presents empty: the clients keep the first step's
                batch, heads = feed["input_ids"].shape[0], self.speech.model.config.decoder_attention_heads
                empty = (batch, heads, 0, self.speech.model.config.d_model // heads)
                shapes = {np.shape(got[c]) for c in W.cross_names(layers, "present")}
                if shapes != {empty}:
                    raise ExportError(f"whisper decoder_model_merged: the step with past returns cross presents of "
                                      f"shapes {sorted(shapes)}, not empty ones {empty}")
                got = {n: got[n] for n in W.outputs(graph, layers)}
            checked += self.compared(graph, got, f"{W.MERGED} ({W.USE_CACHE}={str(use_cache).lower()})")
        return replace(first, checked=checked, model=decoder)


def _examples(speech: Speech, checked: Checked) -> dict:
    """Each graph's trace example: the checks' feeds (batch 2, so that the batch axis stays symbolic;
    a static later step's, which checks one token, traced with two, so that its block stays symbolic)."""
    feeds = dict(checked.feeds)
    later = feeds[W.DECODER_WITH_PAST]
    if W.WRITE_POS in later and later["input_ids"].shape[1] == 1:
        feeds[W.DECODER_WITH_PAST] = {**later, "input_ids": np.tile(later["input_ids"], (1, 2)),
                                      W.WRITE_POS: later[W.WRITE_POS] - 1}
    return {g: tuple(torch.from_numpy(np.ascontiguousarray(v)) for v in feeds[g].values()) for g in W.GRAPHS}


@dataclass
class SpeechExport:
    """A Whisper export: the graphs written ({stem: result}) into the folder, and every check made
    before writing (the three graphs traced, then the merged decoder's two branches)."""

    folder: Path
    graphs: dict[str, ModuleExportResult]
    checked: list
    notes: list = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.folder

    def summary(self) -> str:
        r = self.graphs[W.ENCODER]
        lines = [f"{self.folder}: whisper, flavor {r.flavor}, opset {r.opset}, attention op {r.attention_op}"]
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


def export_speech(request, model, params_source: str) -> SpeechExport:
    """`export --hf` of a Whisper model (`request`: `attnexport.pretrained.export.HFExport`): the three
    graphs exported, each checked against float64, written as a deployment folder (--deploy) only:
    a speech model is three graphs, not one file."""
    r = request
    if r.deploy is None:
        raise UsageError("a Whisper model is three graphs (encoder, decoder, decoder with past): write them with "
                         "--deploy FOLDER")
    if r.form not in (None, "concat", "static"):
        raise UsageError(f"--kv-cache {r.form}: a Whisper export's decoder takes its self cache concat (the default) "
                         "or static (--kv-cache static --max-seq N)")
    static = r.form == "static"
    positions = model.config.max_target_positions
    if static and not r.max_seq <= positions:
        raise UsageError(f"--max-seq {r.max_seq}: Whisper's decoder holds {positions} positions: at most {positions}")
    dtype = "fp16" if r.precision == "fp16" else r.dtype
    both = r.precision != "fp32" and r.dtype != "fp32"  # --precision and --dtype together
    if dtype not in ("fp32", "fp16") or r.precision not in PRECISIONS or both:
        raise UsageError(f"a Whisper model exports in fp32, fp16, int8 or int4 (--precision), not "
                         f"{r.precision if r.dtype == 'fp32' else r.dtype}")
    plan = (r.plan or P.TABLE[r.precision].plan) if r.precision in P.QUANTIZED else None
    deploy = F.deploy_target(Path(r.deploy))
    speech = Speech.of(model, r.source)
    if static and len(speech.start) + len(speech.text_tokens(CHECK_TEXT)) > r.max_seq:
        raise UsageError(f"--max-seq {r.max_seq}: the export's checks write "
                         f"{len(speech.start) + len(speech.text_tokens(CHECK_TEXT))} positions: give more")
    checked = Checked(speech, dtype, r.max_seq if static else None)
    examples = _examples(speech, checked)
    flavor = r.flavor or FL.DEFAULT
    opset = FL.opset_for(flavor, r.opset, ["--kv-cache static"] if static else [])
    layers, results = speech.layers, {}
    for g, module in checked.fp32.items():
        cached = g == W.DECODER_WITH_PAST or static and g == W.DECODER
        request = ModuleExport(
            flavor=flavor, opset=opset, dtype=dtype, dynamic=W.dynamic_axes(g, layers, static), output=None,
            input_names=W.inputs(g, layers, static), output_names=W.outputs(g, layers), name=f"whisper {g}",
            seed=r.seed if params_source == "seed" else None, record={"params_source": params_source},
            cache=W.cache_pairs(layers) if cached else None,
            write_pos=W.WRITE_POS if static and g != W.ENCODER else None,
            rewrite=_tied_head if g != W.ENCODER else None, check=functools.partial(checked.check, g))
        results[g] = export_module(module, examples[g], request)
    notes = [HM.random_note(r.source, r.seed)] if params_source == "seed" else []
    if plan is not None:
        checked, done = quantize_graphs(speech, results, plan)
        notes.append(f"{r.precision}: " + "; ".join(f"{g} {d.summary()}" for g, d in done.items())
                     + f" (block {plan.block}, accuracy level {plan.accuracy}); what it costs in transcripts: "
                       "attnexport verify FOLDER --hf SOURCE --audio CLIP")
    decoder = W.merged(results[W.DECODER].model, results[W.DECODER_WITH_PAST].model, layers)
    written = {W.ENCODER: results[W.ENCODER],
               W.MERGED_STATIC if static else W.MERGED: checked.check_merged(decoder, results[W.DECODER])}
    write_deployment(deploy, {g: r.model for g, r in written.items()}, speech)
    for g, result in written.items():
        result.path = deploy / GRAPH_DIR / f"{g}.onnx"
        result.size = result.path.stat().st_size
    notes.append(f"the decoder's two steps are one graph ({W.MERGED}.onnx: an If on {W.USE_CACHE}, their weights "
                 "kept once), as transformers.js and Optimum load Whisper; the log-mel features are the client's "
                 "(attnexport.pretrained.audio.log_mel computes them as transformers does)" if not static else
                 f"the decoder's two steps are one graph ({W.MERGED_STATIC}.onnx), its self cache buffers of "
                 f"{r.max_seq} positions written at {W.WRITE_POS} (attnexport's own inputs: Optimum and "
                 "transformers.js load the concat form, the default)")
    merged = written[W.MERGED_STATIC if static else W.MERGED]
    return SpeechExport(deploy, written, [c for x in results.values() for c in x.checked] + merged.checked, notes)


def _tied_head(onnx_model):
    tied_head.tied_head(onnx_model)
    return onnx_model


def file_model(model, graphs: dict):
    """A copy of transformers' `model` computing with the weights the quantized `graphs` ({graph:
    ModelProto}) hold: each Linear whose matrix a graph quantized gets its dequantized value (a
    parameter of its own: the tied head's embedding keeps the float table, as the graph's Gather does)."""
    held = copy.deepcopy(model)
    modules = W.modules(held)
    for g, onnx_model in graphs.items():
        for name, value in P.dequantized_params(onnx_model).items():
            path, attribute = name.rsplit(".", 1)
            owner = modules[g].get_submodule(path)
            if isinstance(owner, torch.nn.Linear) and attribute == "weight":
                owner.weight = torch.nn.Parameter(torch.from_numpy(value), requires_grad=False)
    return held


def quantize_graphs(speech: Speech, results: dict, plan: P.Plan) -> tuple[Checked, dict]:
    """The weight matrices of the three fp32 graphs (`results`: {graph: ModuleExportResult}, their
    models changed in place) quantized by `plan` (`precision.quantize`: ONNX Runtime's blockwise
    quantizer, MatMulNBits), each checked before writing: every matrix a quantization of the model's
    (`precision.unfaithful`); each graph with float activations against the model with the file's
    weights (`file_model`) in float64, within fp32's budget; each graph as written finite on the
    checks' feeds. Returns (the checks of the file's weights, for the merged decoder; what was done
    to each graph)."""
    vocab, done = speech.model.config.vocab_size, {}
    for g, r in results.items():
        inits = {i.name: i for i in r.model.graph.initializer}
        before = {s.weight: onnx.numpy_helper.to_array(inits[s.weight]) for s in P.sites(r.model, vocab)}
        done[g] = P.quantize(r.model, plan, speech.layers, vocab)
        bad = P.unfaithful(before, r.model)
        if bad:
            raise ExportError(f"whisper {g}: the quantized weights are not a quantization of the model's: {bad[0]}")
    held = Checked(replace(speech, model=file_model(speech.model, {g: r.model for g, r in results.items()})))
    for g, r in results.items():
        r.checked = held.check(g, P.float_activations(r.model))
        got = R.prepare_onnx("ort-cpu", r.model).run(held.feeds[g])
        bad = [n for n in W.outputs(g, speech.layers) if not np.isfinite(got[n]).all()]
        if bad:
            raise ExportError(f"whisper {g}: the quantized export gives {bad[0]} not finite on the check's feed")
    return held, done


def write_deployment(folder: Path, graphs: dict, speech: Speech) -> None:
    """config.json, generation_config.json, preprocessor_config.json, the tokenizer and `graphs`
    ({file stem: ModelProto}) in onnx/ with a copy of generation_config.json, as `files.write_folder`
    writes a folder (nothing half-written)."""
    from transformers import WhisperFeatureExtractor

    model = speech.model

    def fill(staging: Path) -> None:
        shutil.copyfile(speech.source / "tokenizer.json", staging / "tokenizer.json")
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(speech), indent=2) + "\n")
        config = model.config.to_dict()
        config["use_cache"] = True
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = json.dumps(model.generation_config.to_dict(), indent=2, sort_keys=True) + "\n"
        (staging / "generation_config.json").write_text(generation)
        WhisperFeatureExtractor(feature_size=speech.mels).to_json_file(str(staging / "preprocessor_config.json"))
        (staging / GRAPH_DIR).mkdir()
        # Optimum's ORTModelForSpeechSeq2Seq reads the generation config from the graphs' folder (its
        # `subfolder`), transformers.js from the top: without this copy Optimum generates with none of the
        # model's suppression and no <|notimestamps|> start token.
        (staging / GRAPH_DIR / "generation_config.json").write_text(generation)
        for g, model_proto in graphs.items():
            onnx.save_model(model_proto, str(staging / GRAPH_DIR / f"{g}.onnx"))
    F.write_folder(folder, fill)


def save_transformers(source, out) -> Path:
    """The Whisper model at `source` (a CTranslate2 folder, or transformers') written as transformers'
    own folder at `out` (nothing half-written): config.json, generation_config.json and
    model.safetensors (`save_pretrained`), tokenizer.json with its tokenizer_config.json, and the
    feature extractor's preprocessor_config.json: what transformers' `from_pretrained`, Optimum's
    exporter and `export --hf` read. Returns `out`."""
    model, _ = HM.load(source)
    return write_transformers(Speech.of(model, source), out)


def write_transformers(speech: Speech, out) -> Path:
    """`save_transformers` of a model already loaded (`speech`)."""
    from transformers import WhisperFeatureExtractor
    folder = F.deploy_target(Path(out), "the folder")

    def fill(staging: Path) -> None:
        speech.model.save_pretrained(str(staging))
        shutil.copyfile(speech.source / "tokenizer.json", staging / "tokenizer.json")
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(speech), indent=2) + "\n")
        WhisperFeatureExtractor(feature_size=speech.mels).to_json_file(str(staging / "preprocessor_config.json"))
    F.write_folder(folder, fill)
    return folder


def tokenizer_config(speech: Speech) -> dict:
    """The tokenizer_config.json Whisper's clients read beside tokenizer.json."""
    return {"tokenizer_class": "WhisperTokenizer", "model_max_length": speech.model.config.max_target_positions,
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": True,
            "errors": "replace", "add_prefix_space": False}
