"""A Whisper deployment folder (`export --hf --deploy`) against the model it came from, on every
runtime: each graph against the model in float64 (the encoder on two clips, the merged decoder's
first step and its step with past, each output within the factor of torch's own fp32 error), the
decode property (the decoder stepped a token at a time through its self cache gives the logits of
one first step over the whole sequence: within the budget of that forward), greedy transcripts of
the clips equal to transformers' `generate` in fp32 token for token, and, with --clients, the
transcripts Optimum's ORTModelForSpeechSeq2Seq and transformers.js' pipeline make from the folder.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnexport import runtimes as R
from attnexport.compare import Comparison, Tolerance, check_tolerance_values, compare
from attnexport.errors import UsageError
from attnexport.pretrained import clients, registry
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained.whisper import Whisper
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import clients as WC
from attnexport.pretrained.whisper import cost as SCOST
from attnexport.pretrained.whisper import ctranslate2 as CT
from attnexport.pretrained.whisper import export as S
from attnexport.pretrained.whisper import graphs as W
from attnexport.reading import load_model
from attnexport.record import ExportRecord
from attnexport.report import Report, Row
from attnexport.verify.executor import Executor
from attnexport.verify.module_check import changed_params

EXACT = Tolerance(0.0, 0.0, "exact: token ids")


def graph_files(path) -> dict[str, Path] | None:
    """The encoder and merged decoder of a Whisper folder ({graph: file}): in its onnx/ (attnexport's
    and transformers.js' layout) or at its top (Optimum's exporter writes them there); None if neither."""
    folder = Path(path)
    for where in (folder / S.GRAPH_DIR, folder):
        for merged in (W.MERGED, W.MERGED_STATIC):  # the concat self cache, or attnexport's static one
            files = {W.ENCODER: where / f"{W.ENCODER}.onnx", W.MERGED: where / f"{merged}.onnx"}
            if folder.is_dir() and all(f.is_file() for f in files.values()):
                return files
    return None


def missing_graphs(folder: Path) -> list[str]:
    """The graph files a Whisper folder lacks (in onnx/ or at its top): the encoder, and the merged
    decoder (its static form's where the folder holds that one)."""
    wanted = [f"{W.ENCODER}.onnx", f"{W.MERGED}.onnx"]
    present = [f for f in wanted + [f"{W.MERGED_STATIC}.onnx"] for where in (folder / S.GRAPH_DIR, folder)
               if (where / f).is_file()]
    if f"{W.MERGED_STATIC}.onnx" in present:
        wanted[1] = f"{W.MERGED_STATIC}.onnx"
    return [f for f in wanted if f not in present]


@dataclass
class _Context:
    folder: Path
    speech: S.Speech
    checked: S.Checked
    graphs: dict
    prepared: dict
    executor: Executor
    flavor: str
    precision: str = "fp32"

    def row(self, case: str, runtime: str, kind: str, tol: Tolerance | None = None) -> Row:
        flavor = self.flavor if runtime in R.ONNX_RUNTIMES else "-"
        return Row(case=case, variant=f"concat ({Whisper.task})", flavor=flavor, runtime=runtime,
                   dtype=self.precision, model=self.folder.name, tolerance=tol, expected_kind=kind)

    def steps(self, runtime: str, raw: bool = False):
        """(encoder, first decoder step, later step) on `runtime`, each `feed -> {output: array}`: as
        the concat form's graphs take and return them (a static cache's through `whisper.static_steps`),
        or (`raw`) as the folder's own do."""
        config = self.speech.model.config
        if R.runs_module(runtime):
            encoder, first, later = (functools.partial(self.checked.run, g) for g in W.GRAPHS)
        else:
            graphs = self.prepared[runtime]
            encoder = W.typed(graphs[W.ENCODER].run, self.graphs[W.ENCODER])
            first, later = W.merged_steps(W.typed(graphs[W.MERGED].run, self.graphs[W.MERGED]), config)
        if self.checked.max_seq is not None and not raw:
            first, later = W.static_steps(first, later, config, self.checked.max_seq)
        return encoder, first, later

    def able(self, row: Row) -> bool:
        if not R.runs_module(row.runtime) and row.runtime not in self.prepared:
            row.skipped = f"{row.runtime} runs no ONNX model"
        return not row.skipped


def verify_speech(check) -> Report:
    """The rows of every check on every selected runtime (`check`: the verify request, an
    `attnexport.pretrained.check.HFCheck` whose model_path is the deployment folder)."""
    check_tolerance_values(check.rtol, check.atol)
    if check.rtol is not None or check.atol is not None:
        raise UsageError("a Whisper folder's outputs are judged by budgets derived from torch's fp32 error: "
                         "--rtol/--atol do not apply")
    folder = Path(check.model_path)
    files = graph_files(folder)
    if files is None:
        raise UsageError(f"{folder}: a Whisper folder holds {S.GRAPH_DIR}/{W.ENCODER}.onnx and {S.GRAPH_DIR}/"
                         f"{W.MERGED}.onnx (export --hf --deploy); it lacks {' and '.join(missing_graphs(folder))}")
    graphs = {g: load_model(f) for g, f in files.items()}
    # Another tool's export (Optimum's) carries no record of attnexport's: judged by its outputs alone.
    foreign = ExportRecord.of(graphs[W.ENCODER]).params is None
    if check.clients and files[W.ENCODER].parent == folder:
        raise UsageError(f"--clients load a deployment folder whose graphs are in {S.GRAPH_DIR}/ (as transformers.js "
                         f"reads them); {folder.name} holds them at its top")
    buffers = {i.name: i for i in graphs[W.MERGED].graph.input}
    max_seq = None
    if W.WRITE_POS in buffers:  # the static self cache: its buffers' positions
        max_seq = buffers[W.self_names(1, "past_key_values")[0]].type.tensor_type.shape.dim[2].dim_value
        if check.clients:
            raise UsageError(f"--clients: {files[W.MERGED].name}'s inputs (write_pos, fixed buffers) are attnexport's "
                             "own, which Optimum and transformers.js do not feed; export the concat form for them")
    recorded = ExportRecord.of(graphs[W.ENCODER]).number("seed")  # a config-only source's weights' seed
    model, _ = hf.load(check.source, check.seed if check.seed is not None else recorded)
    family = registry.of_model(model)
    if family.task != Whisper.task:
        raise UsageError(f"{folder.name} is a Whisper export; --hf {check.source} is a {family.what}: give the model "
                         "it was exported from")
    speech = S.Speech.of(model, check.source)
    clips = [AU.read_wav(p) for p in check.audio] if check.audio else [S.check_audio(3.0, 0)]
    positions = max_seq or model.config.max_target_positions
    room = positions - len(speech.start)
    if check.new_tokens > room:
        raise UsageError(f"--new-tokens {check.new_tokens}: the decoder holds {positions} positions, "
                         f"{len(speech.start)} of them the start tokens: at most {room}")
    wanted = clients.of_family(check.clients, family) if check.clients else []
    client_table = clients.select(wanted, check.skip_unavailable)
    checked = S.Checked(speech, "fp32", max_seq)
    used, table = R.select(check.runtimes, check.skip_unavailable)
    quantized = P.record_of(graphs[W.MERGED])
    dtype = ExportRecord.of(graphs[W.ENCODER]).dtype or "fp32"
    for graph in graphs.values():
        used, table = P.able_runtimes(graph, used, table, check.runtimes, quantized)
    lossy = quantized is not None or dtype != "fp32"  # judged by the speech budget
    if dtype != "fp32" and "torch" in used:
        used.remove("torch")
        table = [{**t, "used": False, "reason": f"torch runs the source model, which this {dtype} folder's cost is "
                  "measured against"} if t["name"] == "torch" else t for t in table]
    executor = Executor(check.checking)
    prepared = {rt: {g: R.prepare_onnx(rt, m) for g, m in graphs.items()} for rt in used if rt in R.ONNX_RUNTIMES}
    flavor = "foreign" if foreign else ExportRecord.of(graphs[W.ENCODER]).flavor
    precision = f"int{quantized['plan']['bits']}" if quantized is not None else dtype
    ctx = _Context(folder, speech, checked, graphs, prepared, executor, flavor, precision)
    changed = [n for g, m, module in ((W.ENCODER, graphs[W.ENCODER], checked.fp32[W.ENCODER]),
                                      (W.MERGED, graphs[W.MERGED], checked.fp32[W.DECODER]))
               for n in changed_params(module, ExportRecord.of(m).parsed("params", {}), dtype)] if not foreign else []
    if changed:
        row = ctx.row("parameters", "-", "the model's record")
        row.error = f"the folder's parameters differ from {check.source}'s: {', '.join(changed[:3])}"
        executor.record(row)
    else:
        features = np.stack([AU.log_mel(c, speech.mels) for c in clips])
        want = reference_transcripts(speech, features, check.new_tokens)
        if lossy:
            reference = SCOST.reference_logits(speech, features, want)
        for rt in used:
            if lossy:
                _cost_row(ctx, rt, features, want, reference, check)
                continue
            _graph_rows(ctx, rt)
            _decode_row(ctx, rt)
            _transcript_row(ctx, rt, features, want, check.new_tokens, len(clips))
        for client in wanted:
            _client_row(ctx, client, clips, want, check.new_tokens, not lossy, check.budget.margin)
    return executor.report(R.described(table) + client_table, ctx.precision, [flavor], [str(folder)])


def reference_transcripts(speech: S.Speech, features: np.ndarray, new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` in fp32 (its Whisper generation: the model's generation
    config's suppression), from the start tokens: each clip's tokens, without the end token."""
    model = speech.model
    language = {"language": "en", "task": "transcribe"} if CT.multilingual(model.config.vocab_size) else {}
    with torch.no_grad(), hf.quiet_transformers():
        out = model.generate(torch.from_numpy(features), max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                             **language)
    for row in out.tolist():  # its answers begin with the start tokens (the first of them left out, or not)
        special = [t for t in row[:len(speech.start)] if t >= speech.end]
        if any(t not in speech.start for t in special):
            raise RuntimeError(f"transformers' generate started with {row[:len(speech.start)]}, not {speech.start}")
    return [WC.spoken(row, speech.end) for row in out.tolist()]


def _graph_rows(ctx: _Context, runtime: str) -> None:
    feeds = ctx.checked.feeds
    for graph, case in ((W.ENCODER, "encoder_model: 2 clips' features"),
                        (W.DECODER, f"{W.MERGED}: first step, {feeds[W.DECODER]['input_ids'].shape[1]} tokens"),
                        (W.DECODER_WITH_PAST, f"{W.MERGED}: step with past, "
                                              f"{feeds[W.DECODER_WITH_PAST]['input_ids'].shape[1]} tokens")):
        row = ctx.row(case, runtime, "the model in float64")
        if not ctx.able(row):
            ctx.executor.record(row)
            continue
        step = ctx.steps(runtime, raw=True)[W.GRAPHS.index(graph)]
        ctx.executor.run(row, functools.partial(step, feeds[graph]), functools.partial(_judge_graph, ctx, row, graph))


def _judge_graph(ctx: _Context, row: Row, graph: str, got: dict) -> list[Comparison]:
    """The graph's outputs against float64 (`Checked.comparisons`); the first output over its budget
    as the data flows (a layer's caches before the next layer's, the logits last) named as the row's
    error: where another tool's graph first departs from the model."""
    comparisons = ctx.checked.comparisons(graph, got)
    bad = sorted((c for c in comparisons if not c), key=lambda c: _layer_of(c.name))
    if bad:
        row.error = f"the first output that departs from the model in float64: {bad[0]}"
    return comparisons


def _layer_of(output: str) -> float:
    """The decoder layer an output comes from (present.I....), the logits after every layer."""
    found = re.search(r"\.(\d+)\.", output)
    return int(found.group(1)) if found else math.inf


def _decode_row(ctx: _Context, runtime: str) -> None:
    """The decode property: the start tokens, then the check's text a token at a time through the
    self cache, each position's logits against the float64 decoder's over the whole sequence at once."""
    feed = ctx.checked.feeds[W.DECODER]
    ids = np.concatenate([feed["input_ids"], ctx.checked.feeds[W.DECODER_WITH_PAST]["input_ids"]], axis=1)
    first = len(ctx.speech.start)
    whole = ctx.checked.first_feed(ids, feed["encoder_hidden_states"])
    expected, tolerances = ctx.checked.expected(W.DECODER, whole)
    want, tol = expected["logits"], tolerances["logits"]
    row = ctx.row(f"decode: {first} start tokens, then {ids.shape[1] - first} one at a time", runtime,
                  "transformers' decoder in float64 over the whole sequence", tol)
    if not ctx.able(row):
        ctx.executor.record(row)
        return

    def stepped():
        _, run_first, run_later = ctx.steps(runtime)
        return W.stepped(run_first, run_later, ids, feed["encoder_hidden_states"], first, ctx.speech.layers)
    ctx.executor.run(row, stepped, lambda got: [compare("logits", got, want, tol)])


def _judge_tokens(row: Row, want: list, who: str, got: list, by: str = "transformers") -> list[Comparison]:
    """Each clip's tokens against transformers': the row's detail, the first departure as its error,
    one exact comparison of the tokens (padded with -1 to the longer)."""
    width = max([len(t) for t in want + got] + [1])
    pad = [t + [-1] * (width - len(t)) for t in want]
    mine = [t + [-1] * (width - len(t)) for t in got]
    row.detail = {"tokens": got, f"{by}_tokens": want}
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            step = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            said = a[step] if step < len(a) else "the end"
            wanted = b[step] if step < len(b) else "the end"
            row.error = f"clip {i}, token {step}: {by} said {wanted}, {who} {said}"
            break
    return [compare("tokens", np.array(mine), np.array(pad), EXACT)]


def _transcript_row(ctx: _Context, runtime: str, features, want, new_tokens: int, clips: int) -> None:
    row = ctx.row(f"transcripts: {clips} clip(s), greedy, up to {new_tokens} tokens", runtime,
                  "transformers' generate in fp32", EXACT)
    if not ctx.able(row):
        ctx.executor.record(row)
        return
    s = ctx.speech

    def transcribe():
        return W.transcribe(*ctx.steps(runtime), features, s.tokens, s.layers, new_tokens)
    ctx.executor.run(row, transcribe, functools.partial(_judge_tokens, row, want, runtime))


def _client_row(ctx: _Context, client: str, clips, want, new_tokens: int, exact: bool = True,
                margin: float = 1.0) -> None:
    """The client's transcripts from the folder: token for token transformers' (fp32), or (a
    quantized folder, `exact` false) those of the folder's graphs on ONNX Runtime's CPU provider:
    the client loads and runs the file as attnexport's loop does. For a quantized folder a clip that
    departs where the folder's graphs are undecided (their token ahead of the next by less than
    `margin` logits, teacher-forced: a near tie, which the client's own features may turn) is
    compared up to the tie and the tie reported, as the accuracy budget's rule does."""
    mine: list = []
    leads: list = []
    if not exact and not clients.skipped(client):
        ctx.prepared.setdefault("ort-cpu", {g: R.prepare_onnx("ort-cpu", m) for g, m in ctx.graphs.items()})
        features = np.stack([AU.log_mel(c, ctx.speech.mels) for c in clips])
        steps = ctx.steps("ort-cpu")
        encoder, first_step, later = steps
        mine = W.transcribe(encoder, first_step, later, features, ctx.speech.tokens, ctx.speech.layers, new_tokens)
        s, first = ctx.speech, len(ctx.speech.start)
        for i, tokens in enumerate(mine):
            logits = SCOST.teacher_forced(steps, features[i:i + 1], [*s.start, *tokens, s.end], first, s.layers)
            leads.append([SCOST.lead(logits[t], ([*tokens, s.end])[t], set(s.suppress) |
                                     (set(s.suppress_first) if t == 0 else set())) for t in range(len(tokens) + 1)])
    row = ctx.row(f"client: transcribe {len(clips)} clip(s) from the folder", client,
                  "transformers' generate in fp32" if exact else "the folder's graphs on ort-cpu", EXACT)
    row.flavor = "-"
    row.skipped = clients.skipped(client)

    def judge(done):
        got, ties = list(done.tokens), []
        if not exact:
            reference = list(mine)
            for i, (a, b) in enumerate(zip(got, reference, strict=True)):
                at = SCOST.first_departure(a, b)
                if at is not None and at < len(leads[i]) and leads[i][at] < margin:
                    ties.append(f"clip {i} token {at} (lead {leads[i][at]:.3g})")
                    got[i], reference[i] = a[:at], b[:at]
            comparisons = _judge_tokens(row, reference, client, got, "ort-cpu")
            row.detail = {"tokens": done.tokens, "ort-cpu_tokens": mine, "near_ties": ties}
            return comparisons
        return _judge_tokens(row, want, client, got, "transformers")
    ctx.executor.run(row, functools.partial(WC.transcribe, client, ctx.folder, clips, new_tokens,
                                            R.cpu_threads()), judge)


def _cost_row(ctx: _Context, runtime: str, features, want, reference, check) -> None:
    """A quantized folder's cost in transcripts on `runtime` (`speech_cost`) against the budget."""
    budget = check.budget
    row = ctx.row(f"accuracy: {len(want)} clip(s), teacher-forced KL and top-1, greedy transcripts' tokens and WER",
                  runtime, "transformers in fp32 (its logits along its greedy transcripts)")
    if not ctx.able(row):
        ctx.executor.record(row)
        return

    def judge(cost):
        row.detail = {"accuracy": cost.to_dict(), "budget": {**vars(budget), "text": budget.text()},
                      "summary": cost.text(), "transformers_tokens": want}
        if cost.failures:
            row.error = f"over the accuracy budget: {'; '.join(cost.failures)} ({cost.text()})"
        return cost.comparisons(budget)
    ctx.executor.run(row, lambda: SCOST.measure(ctx.steps(runtime), ctx.speech, features, want, reference,
                                                check.new_tokens, budget), judge)
