"""An encoder-decoder's deployment folder (`export --hf --deploy`) against the model it came from, on
every runtime: each graph against the model in float64 (the encoder on the checks' inputs, the
merged decoder's first step and its step with past, each output within the factor of torch's own
fp32 error), the decode property (the decoder stepped a token at a time through its self cache
gives the logits of one first step over the whole sequence: within the budget of that forward),
greedy answers equal to transformers' `generate` in fp32 token for token, a lossy folder's cost in
answers against its budget (`cost`), and, with --clients, the answers each client makes from the
folder. A family fills `Verify`'s hooks: its inputs, transformers' answers, its clients.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport import runtimes as R
from attnexport.compare import Comparison, Tolerance, check_tolerance_values, compare
from attnexport.errors import UsageError
from attnexport.pretrained import clients, registry
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained.encdec import cost as COST
from attnexport.pretrained.encdec import export as ED
from attnexport.pretrained.encdec import graphs as G
from attnexport.reading import load_model
from attnexport.record import ExportRecord
from attnexport.report import Report, Row
from attnexport.verify.executor import Executor
from attnexport.verify.module_check import changed_params

EXACT = Tolerance(0.0, 0.0, "exact: token ids")


def graph_files(path) -> dict[str, Path] | None:
    """The encoder and merged decoder of an encoder-decoder folder ({graph: file}): in its onnx/
    (attnexport's and transformers.js' layout) or at its top (Optimum's exporter writes them there);
    None if neither."""
    folder = Path(path)
    for where in (folder / ED.GRAPH_DIR, folder):
        for merged in (G.MERGED, G.MERGED_STATIC):  # the concat self cache, or attnexport's static one
            files = {G.ENCODER: where / f"{G.ENCODER}.onnx", G.MERGED: where / f"{merged}.onnx"}
            if folder.is_dir() and all(f.is_file() for f in files.values()):
                return files
    return None


def missing_graphs(folder: Path) -> list[str]:
    """The graph files an encoder-decoder folder lacks (in onnx/ or at its top): the encoder, and the
    merged decoder (its static form's where the folder holds that one)."""
    wanted = [f"{G.ENCODER}.onnx", f"{G.MERGED}.onnx"]
    present = [f for f in wanted + [f"{G.MERGED_STATIC}.onnx"] for where in (folder / ED.GRAPH_DIR, folder)
               if (where / f).is_file()]
    if f"{G.MERGED_STATIC}.onnx" in present:
        wanted[1] = f"{G.MERGED_STATIC}.onnx"
    return [f for f in wanted if f not in present]


class Verify:
    """What a family's verify of its folder needs beside the core: its model (`model_of`), the
    inputs the answers are made from (`inputs`: the encoder's feed of them, a batch), transformers'
    fp32 answers (`reference`), a client's answers from the folder (`client_answers`), and the
    words its rows use. `family`: the registered family."""

    family: registry.Family
    # What the family's refusals call its folder ("a Whisper folder").
    what: str = "an encoder-decoder"

    def model_of(self, model, source) -> ED.Model:
        raise NotImplementedError

    def inputs(self, m: ED.Model, check) -> tuple[list, dict]:
        """(the inputs as the user gave them or the project's own, the encoder's feed of them)."""
        raise NotImplementedError

    def reference(self, m: ED.Model, feed: dict, new_tokens: int) -> list[list[int]]:
        """transformers' own greedy `generate` in fp32 of the encoder feed's inputs: each one's
        tokens after the start tokens, without the end token."""
        raise NotImplementedError

    def client_answers(self, client: str, folder: Path, inputs: list, new_tokens: int, threads):
        """A client's answers (`clients.ClientRun`: its `.tokens`) from the folder."""
        raise NotImplementedError

    def refuse(self, check) -> None:
        """A one-line refusal of an option this family's verify does not take."""


@dataclass
class Context:
    folder: Path
    m: ED.Model
    checked: ED.Checked
    graphs: dict
    prepared: dict
    executor: Executor
    flavor: str
    precision: str = "fp32"
    task: str = ""

    def row(self, case: str, runtime: str, kind: str, tol: Tolerance | None = None) -> Row:
        flavor = self.flavor if runtime in R.ONNX_RUNTIMES else "-"
        return Row(case=case, variant=f"concat ({self.task})", flavor=flavor, runtime=runtime,
                   dtype=self.precision, model=self.folder.name, tolerance=tol, expected_kind=kind)

    def steps(self, runtime: str, raw: bool = False):
        """(encoder, first decoder step, later step) on `runtime`, each `feed -> {output: array}`: as
        the concat form's graphs take and return them (a static cache's through `graphs.static_steps`),
        or (`raw`) as the folder's own do."""
        spec = self.m.spec
        if R.runs_module(runtime):
            encoder, first, later = (functools.partial(self.checked.run, g) for g in G.GRAPHS)
        else:
            graphs = self.prepared[runtime]
            encoder = G.typed(graphs[G.ENCODER].run, self.graphs[G.ENCODER])
            first, later = G.merged_steps(G.typed(graphs[G.MERGED].run, self.graphs[G.MERGED]), spec)
        if self.checked.max_seq is not None and not raw:
            first, later = G.static_steps(first, later, spec, self.checked.max_seq)
        return encoder, first, later

    def able(self, row: Row) -> bool:
        if not R.runs_module(row.runtime) and row.runtime not in self.prepared:
            row.skipped = f"{row.runtime} runs no ONNX model"
        return not row.skipped


def verify_graphs(check, how: Verify) -> Report:
    """The rows of every check on every selected runtime (`check`: the verify request, an
    `attnexport.pretrained.check.HFCheck` whose model_path is the deployment folder)."""
    family = how.family
    check_tolerance_values(check.rtol, check.atol)
    if check.rtol is not None or check.atol is not None:
        raise UsageError(f"{how.what} folder's outputs are judged by budgets derived from torch's fp32 error: "
                         "--rtol/--atol do not apply")
    how.refuse(check)
    folder = Path(check.model_path)
    files = graph_files(folder)
    if files is None:
        raise UsageError(f"{folder}: {how.what} folder holds {ED.GRAPH_DIR}/{G.ENCODER}.onnx and "
                         f"{ED.GRAPH_DIR}/{G.MERGED}.onnx (export --hf --deploy); it lacks "
                         f"{' and '.join(missing_graphs(folder))}")
    graphs = {g: load_model(f) for g, f in files.items()}
    # Another tool's export (Optimum's) carries no record of attnexport's: judged by its outputs alone.
    foreign = ExportRecord.of(graphs[G.ENCODER]).params is None
    if check.clients and files[G.ENCODER].parent == folder:
        raise UsageError(f"--clients load a deployment folder whose graphs are in {ED.GRAPH_DIR}/ (as transformers.js "
                         f"reads them); {folder.name} holds them at its top")
    buffers = {i.name: i for i in graphs[G.MERGED].graph.input}
    max_seq = None
    if G.WRITE_POS in buffers:  # the static self cache: its buffers' positions
        max_seq = buffers[G.self_names(1, "past_key_values")[0]].type.tensor_type.shape.dim[2].dim_value
        if check.clients:
            raise UsageError(f"--clients: {files[G.MERGED].name}'s inputs (write_pos, fixed buffers) are attnexport's "
                             "own, which Optimum and transformers.js do not feed; export the concat form for them")
    recorded = ExportRecord.of(graphs[G.ENCODER]).number("seed")  # a config-only source's weights' seed
    model, _ = hf.load(check.source, check.seed if check.seed is not None else recorded)
    source_family = registry.of_model(model)
    if source_family is not family:
        raise UsageError(f"{folder.name} is {how.what} export; --hf {check.source} is a {source_family.what}: "
                         "give the model it was exported from")
    m = how.model_of(model, check.source)
    inputs, feed = how.inputs(m, check)
    positions = max_seq or m.positions()
    if positions is not None:
        room = positions - len(m.start)
        if check.new_tokens > room:
            raise UsageError(f"--new-tokens {check.new_tokens}: the decoder holds {positions} positions, "
                             f"{len(m.start)} of them the start tokens: at most {room}")
    wanted = clients.of_family(check.clients, family) if check.clients else []
    client_table = clients.select(wanted, check.skip_unavailable)
    checked = ED.Checked(m, "fp32", max_seq)
    used, table = R.select(check.runtimes, check.skip_unavailable)
    quantized = P.record_of(graphs[G.MERGED])
    dtype = ExportRecord.of(graphs[G.ENCODER]).dtype or "fp32"
    for graph in graphs.values():
        used, table = P.able_runtimes(graph, used, table, check.runtimes, quantized)
    lossy = quantized is not None or dtype != "fp32"  # judged by the budget
    if dtype != "fp32" and "torch" in used:
        used.remove("torch")
        table = [{**t, "used": False, "reason": f"torch runs the source model, which this {dtype} folder's cost is "
                  "measured against"} if t["name"] == "torch" else t for t in table]
    executor = Executor(check.checking)
    prepared = {rt: {g: R.prepare_onnx(rt, x) for g, x in graphs.items()} for rt in used if rt in R.ONNX_RUNTIMES}
    flavor = "foreign" if foreign else ExportRecord.of(graphs[G.ENCODER]).flavor
    precision = f"int{quantized['plan']['bits']}" if quantized is not None else dtype
    ctx = Context(folder, m, checked, graphs, prepared, executor, flavor, precision, family.task)
    changed = [n for g, x, module in ((G.ENCODER, graphs[G.ENCODER], checked.fp32[G.ENCODER]),
                                      (G.MERGED, graphs[G.MERGED], checked.fp32[G.DECODER]))
               for n in changed_params(module, ExportRecord.of(x).parsed("params", {}), dtype)] if not foreign else []
    if changed:
        row = ctx.row("parameters", "-", "the model's record")
        row.error = f"the folder's parameters differ from {check.source}'s: {', '.join(changed[:3])}"
        executor.record(row)
    else:
        want = how.reference(m, feed, check.new_tokens)
        if lossy:
            reference = COST.reference_logits(m, feed, want)
        for rt in used:
            if lossy:
                _cost_row(ctx, rt, feed, want, reference, check)
                continue
            _graph_rows(ctx, rt)
            _decode_row(ctx, rt)
            _answer_row(ctx, rt, feed, want, check.new_tokens, len(inputs))
        for client in wanted:
            _client_row(ctx, how, client, inputs, feed, want, check.new_tokens, not lossy, check.budget.margin)
    return executor.report(R.described(table) + client_table, ctx.precision, [flavor], [str(folder)])


def _graph_rows(ctx: Context, runtime: str) -> None:
    feeds = ctx.checked.feeds
    inputs = f"{len(next(iter(feeds[G.ENCODER].values())))} {ctx.m.item}s' " + \
        ("features" if "input_features" in feeds[G.ENCODER] else "tokens")
    for graph, case in ((G.ENCODER, f"encoder_model: {inputs}"),
                        (G.DECODER, f"{G.MERGED}: first step, {feeds[G.DECODER]['input_ids'].shape[1]} tokens"),
                        (G.DECODER_WITH_PAST, f"{G.MERGED}: step with past, "
                                              f"{feeds[G.DECODER_WITH_PAST]['input_ids'].shape[1]} tokens")):
        row = ctx.row(case, runtime, "the model in float64")
        if not ctx.able(row):
            ctx.executor.record(row)
            continue
        step = ctx.steps(runtime, raw=True)[G.GRAPHS.index(graph)]
        ctx.executor.run(row, functools.partial(step, feeds[graph]), functools.partial(_judge_graph, ctx, row, graph))


def _judge_graph(ctx: Context, row: Row, graph: str, got: dict) -> list[Comparison]:
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


def _decode_row(ctx: Context, runtime: str) -> None:
    """The decode property: the start tokens, then the check's text a token at a time through the
    self cache, each position's logits against the float64 decoder's over the whole sequence at once."""
    feed = ctx.checked.feeds[G.DECODER]
    ids = np.concatenate([feed["input_ids"], ctx.checked.feeds[G.DECODER_WITH_PAST]["input_ids"]], axis=1)
    first = len(ctx.m.start)
    mask = feed.get(G.ENCODER_MASK)
    whole = ctx.checked.first_feed(ids, feed["encoder_hidden_states"], {G.ENCODER_MASK: mask} if mask is not None
                                   else None)
    expected, tolerances = ctx.checked.expected(G.DECODER, whole)
    want, tol = expected["logits"], tolerances["logits"]
    row = ctx.row(f"decode: {first} start tokens, then {ids.shape[1] - first} one at a time", runtime,
                  "transformers' decoder in float64 over the whole sequence", tol)
    if not ctx.able(row):
        ctx.executor.record(row)
        return

    def stepped():
        _, run_first, run_later = ctx.steps(runtime)
        return G.stepped(run_first, run_later, ids, feed["encoder_hidden_states"], first, ctx.m.layers, mask)
    ctx.executor.run(row, stepped, lambda got: [compare("logits", got, want, tol)])


def judge_tokens(row: Row, want: list, who: str, got: list, by: str = "transformers",
                 item: str = "input") -> list[Comparison]:
    """Each input's tokens against transformers': the row's detail, the first departure as its
    error, one exact comparison of the tokens (padded with -1 to the longer)."""
    width = max([len(t) for t in want + got] + [1])
    pad = [t + [-1] * (width - len(t)) for t in want]
    mine = [t + [-1] * (width - len(t)) for t in got]
    row.detail = {"tokens": got, f"{by}_tokens": want}
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            step = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            said = a[step] if step < len(a) else "the end"
            wanted = b[step] if step < len(b) else "the end"
            row.error = f"{item} {i}, token {step}: {by} said {wanted}, {who} {said}"
            break
    return [compare("tokens", np.array(mine), np.array(pad), EXACT)]


def _answer_row(ctx: Context, runtime: str, feed: dict, want, new_tokens: int, count: int) -> None:
    row = ctx.row(f"{ctx.m.answers}: {count} {ctx.m.item}(s), greedy, up to {new_tokens} tokens", runtime,
                  "transformers' generate in fp32", EXACT)
    if not ctx.able(row):
        ctx.executor.record(row)
        return
    m = ctx.m

    def answer():
        encoder, first, later = ctx.steps(runtime)
        return G.greedy(encoder, first, later, feed, m.tokens, m.layers, new_tokens)
    ctx.executor.run(row, answer, functools.partial(judge_tokens, row, want, runtime, item=m.item))


def _client_row(ctx: Context, how: Verify, client: str, inputs: list, feed: dict, want, new_tokens: int,
                exact: bool = True, margin: float = 1.0) -> None:
    """The client's answers from the folder: token for token transformers' (fp32), or (a quantized
    folder, `exact` false) those of the folder's graphs on ONNX Runtime's CPU provider: the client
    loads and runs the file as attnexport's loop does. For a quantized folder an input that departs
    where the folder's graphs are undecided (their token ahead of the next by less than `margin`
    logits, teacher-forced: a near tie, which the client's own preprocessing may turn) is compared up
    to the tie and the tie reported, as the accuracy budget's rule does."""
    mine: list = []
    leads: list = []
    m = ctx.m
    if not exact and not clients.skipped(client):
        ctx.prepared.setdefault("ort-cpu", {g: R.prepare_onnx("ort-cpu", x) for g, x in ctx.graphs.items()})
        steps = ctx.steps("ort-cpu")
        mine = G.greedy(steps[0], steps[1], steps[2], feed, m.tokens, m.layers, new_tokens)
        first = len(m.start)
        for i, tokens in enumerate(mine):
            logits = G.teacher_forced(steps, G.row_of(feed, i), [*m.start, *tokens, m.end], first, m.layers)
            leads.append([COST.lead(logits[t], ([*tokens, m.end])[t], set(m.suppress) |
                                    (set(m.suppress_first) if t == 0 else set())) for t in range(len(tokens) + 1)])
    row = ctx.row(f"client: {m.verb} {len(inputs)} {m.item}(s) from the folder", client,
                  "transformers' generate in fp32" if exact else "the folder's graphs on ort-cpu", EXACT)
    row.flavor = "-"
    row.skipped = clients.skipped(client)

    def judge(done):
        got = list(done.tokens)
        if not exact:
            reference, ties = list(mine), []
            for i, (a, b) in enumerate(zip(got, reference, strict=True)):
                at = COST.first_departure(a, b)
                if at is not None and at < len(leads[i]) and leads[i][at] < margin:
                    ties.append(f"{m.item} {i} token {at} (lead {leads[i][at]:.3g})")
                    got[i], reference[i] = a[:at], b[:at]
            comparisons = judge_tokens(row, reference, client, got, "ort-cpu", m.item)
            row.detail = {"tokens": done.tokens, "ort-cpu_tokens": mine, "near_ties": ties}
            return comparisons
        return judge_tokens(row, want, client, got, "transformers", m.item)
    ctx.executor.run(row, functools.partial(how.client_answers, client, ctx.folder, inputs, new_tokens,
                                            R.cpu_threads()), judge)


def _cost_row(ctx: Context, runtime: str, feed: dict, want, reference, check) -> None:
    """A lossy folder's cost in answers on `runtime` (`cost`) against the budget."""
    budget, m = check.budget, ctx.m
    answer = m.answers.rstrip("s")
    row = ctx.row(f"accuracy: {len(want)} {m.item}(s), teacher-forced KL and top-1, greedy {m.answers}' tokens and WER",
                  runtime, f"transformers in fp32 (its logits along its greedy {m.answers})")
    if not ctx.able(row):
        ctx.executor.record(row)
        return

    def judge(cost):
        row.detail = {"accuracy": cost.to_dict(), "budget": {**vars(budget), "text": budget.text(answer)},
                      "summary": cost.text(m.item, answer), "transformers_tokens": want}
        if cost.failures:
            row.error = f"over the accuracy budget: {'; '.join(cost.failures)} ({cost.text(m.item, answer)})"
        return cost.comparisons(budget, m.budget_name)
    ctx.executor.run(row, lambda: COST.measure(ctx.steps(runtime), m, feed, want, reference, check.new_tokens, budget),
                     judge)
