"""A language model exported with `export --hf` against the model it came from: its step graph at
several shapes, the decode property, and generation parity (greedy tokens equal to transformers'
`generate`) on every runtime, each divergence localized as any other.

Every number is compared with the same model run in float64, each output within a budget derived
from what fp32 torch does against that run (`attnexport.pretrained.reference`): a step's from the step in
torch on the same feed, the decode property's from torch's one forward over the whole sequence,
generation's from transformers' own `generate`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnexport import runtimes as R
from attnexport import weights as W
from attnexport.compare import Comparison, Tolerance, check_tolerance_values, compare
from attnexport.errors import AttnExportError, UsageError, reason
from attnexport.localize import Localization, locate
from attnexport.pretrained import accuracy as A
from attnexport.pretrained import clients, families, forms, speech_check
from attnexport.pretrained import embeddings as E
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.reading import load_model
from attnexport.record import ExportRecord
from attnexport.report import Report, Row
from attnexport.verify.executor import Executor
from attnexport.verify.module_check import changed_params
from attnexport.verify.request import Checking

# Generation parity without a tokenizer: seeded prompts of these lengths in one batch (left- or
# right-padded by the form's loop); with one, hf_reference.PROMPTS. This many new tokens.
PROMPT_LENGTHS = (5, 9, 2)
NEW_TOKENS = 48
EMBED_BATCH = 8  # sentences a run of the embeddings check embeds at once
# The decode property: (batch, blocks after a prefill of DECODE_PREFILL, total tokens).
DECODE = ((2, 1, 8), (1, 3, 10))
DECODE_PREFILL = 4


@dataclass(frozen=True)
class HFCheck(Checking):
    """What `verify MODEL --hf PATH` checks: the model file against the model at `source`, with the
    Checking fields (where and how strictly)."""

    model_path: str | Path
    source: str | Path
    seed: int | None = None
    new_tokens: int = NEW_TOKENS
    clients: tuple = ()  # with a deployment folder: the clients that load it (attnexport.pretrained.clients)
    budget: A.Budget = A.Budget()  # what a quantized or fp16 model may cost in answers
    audio: tuple = ()  # a speech model's clips (16 kHz mono WAV files) its transcripts are checked on


@dataclass
class _Context:
    check: HFCheck
    onnx_model: Any
    layout: hf.Layout
    reference: HR.Reference
    tokenizer: Any
    dtype: str
    flavor: str
    used: list
    prepared: dict
    executor: Executor
    known_good: Any = None
    precision: str = "fp32"  # the file's: its dtype, or int8/int4 when quantized

    @property
    def name(self) -> str:
        return Path(self.check.model_path).name

    def row(self, case: str, runtime: str, kind: str, tol: Tolerance | None = None) -> Row:
        flavor = self.flavor if runtime in R.ONNX_RUNTIMES else "-"
        return Row(case=case, variant=f"{self.layout.form} ({self.layout.task})", flavor=flavor, runtime=runtime,
                   dtype=self.dtype, model=self.name, tolerance=tol, expected_kind=kind)

    def runner(self, runtime: str):
        """The step on `runtime`: the ONNX model, or torch's `reference.run` (the model in torch,
        its attention through attnexport's core)."""
        return self.reference.run if R.runs_module(runtime) else self.prepared[runtime].run

    def run(self, row: Row, work, judge, locate=None) -> Any:
        """`work(step)` with the row's runtime's step function, run and judged by the executor;
        what it returned, or None (the row says why)."""
        rt = row.runtime
        if not R.runs_module(rt) and rt not in self.prepared:
            row.skipped = f"{rt} runs no ONNX model"
        can_locate = locate is not None and rt in self.prepared and rt != "onnx-ref"
        return self.executor.run(row, lambda: work(self.runner(rt)), judge,
                                 cpu_nodes=self.prepared[rt].cpu_nodes if rt in self.prepared else (),
                                 locate=locate if can_locate else None)

    def localize(self, feed: dict, runtime: str) -> Localization:
        """The first diverging node against the model exported afresh (once) from the same source."""
        try:
            if self.known_good is None:
                # --max-seq is the static buffers' (an encoder's max_seq is its position table's, not asked for)
                max_seq = self.layout.max_seq if self.layout.cache_form.writes_in_place else 0
                request = hf_export.HFExport(self.check.source, self.layout.form, max_seq, self.flavor,
                                             dtype=self.dtype, seed=self.check.seed)
                self.known_good = hf_export.export_hf(request)[0].model
            return locate(self.onnx_model, self.known_good, feed, runtime, self.dtype)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            return Localization(note=f"localization failed: {reason(e)}")


def model_file(path: str | Path) -> tuple[Path, Path | None]:
    """(the model file, the deployment folder it is in or None) of verify's MODEL: a .onnx file, or a
    folder written by `export --hf --deploy` (its onnx/model.onnx or onnx/model_static.onnx)."""
    path = Path(path)
    if path.is_dir():
        found = [path / f for f in dict.fromkeys(f.deploy_file for f in forms.FORMS.values()) if (path / f).is_file()]
        if len(found) != 1:
            raise UsageError(f"{path}: a folder MODEL is a deployment folder (export --hf --deploy) holding one of "
                             f"{', '.join(dict.fromkeys(f.deploy_file for f in forms.FORMS.values()))}; it holds "
                             f"{len(found)}")
        return found[0], path
    folder = path.parent.parent
    in_folder = path.parent.name == "onnx" and (folder / "config.json").is_file()
    return path, folder if in_folder else None


def verify_hf(check: HFCheck) -> Report:
    """The rows of every check on every selected runtime (see the module docstring)."""
    check_tolerance_values(check.rtol, check.atol)
    if speech_check.is_deployment(check.model_path):
        return speech_check.verify_speech(check)
    speech_check.refuse_incomplete(check.model_path)
    if check.audio:
        raise UsageError("--audio goes with a Whisper deployment folder as MODEL (export --hf --deploy)")
    path, folder = model_file(check.model_path)
    if check.clients and folder is None:
        raise UsageError(f"--clients load a deployment folder (export --hf --deploy FOLDER); {check.model_path} "
                         "is not in one")
    check = HFCheck(**{**vars(check), "model_path": path})
    model = load_model(check.model_path)
    layout = hf.Layout.of(model)
    if check.clients:
        check = HFCheck(**{**vars(check), "clients": tuple(clients.of_family(check.clients, layout.family))})
    client_table = clients.select(check.clients, check.skip_unavailable)
    meta = ExportRecord.of(model)
    dtype, flavor = meta.dtype, meta.flavor
    seed = check.seed if check.seed is not None else meta.number("seed")  # a config-only source's weights
    check = HFCheck(**{**vars(check), "seed": seed})
    hf_model, _ = hf.load(check.source, seed)
    source_family = families.of_model(hf_model)
    if source_family is not layout.family:
        raise UsageError(f"{path.name} is a {layout.family.what}'s export; --hf {check.source} is a "
                         f"{source_family.what}: give the model it was exported from")
    tokenizer = hf.tokenizer_of(check.source)
    hf.check_tokenizer(layout, tokenizer, check.source)
    prompts = HR.prompts(tokenizer, layout, PROMPT_LENGTHS, seed=4)
    _check_room(layout, prompts, check.new_tokens, tokenizer)
    reference = HR.Reference(hf_model, layout, dtype, check.rtol, check.atol)
    quantized = P.record_of(model)
    used, table = R.select(check.runtimes, check.skip_unavailable)
    used, table = P.able_runtimes(model, used, table, check.runtimes, quantized)
    executor = Executor(check.checking)
    ctx = _Context(check, model, layout, reference, tokenizer, dtype, flavor, used,
                   {rt: _prepared(rt, model) for rt in used if rt in R.ONNX_RUNTIMES}, executor,
                   precision=P.precision_name(model, quantized))
    record = meta.parsed("params", {})
    changed = changed_params(reference.step, record, dtype)
    damaged = W.read(model, record)[1] if record else []  # the file's own initializers against the record
    damaged += P.damaged(model, quantized)
    with np.errstate(all="ignore"):
        if changed or damaged:
            row = ctx.row("parameters", "-", "the model's record")
            row.error = (f"the model's parameters differ from {check.source}'s: {', '.join(changed[:3])} "
                         "(sha256 in the metadata; --seed for a folder with a config only)") if changed else \
                (f"the model file's parameters differ from the sha256 recorded at its export: "
                 f"{', '.join(damaged[:3])} (the file was changed after the export)")
            executor.record(row)
        elif quantized is not None:  # its answers are judged by the accuracy budget, its weights by their source
            _weights_rows(ctx, quantized)
            _ROWS[layout.family.answers[1]](ctx, prompts)
        else:  # half precision: each step within fp16's budget, its answers by the accuracy budget
            for name in layout.family.checks:
                _ROWS[name](ctx, prompts)
            _ROWS[layout.family.answers[dtype != "fp32"]](ctx, prompts)
        if not changed and not damaged:
            if check.clients:
                _ROWS[layout.family.client_rows](ctx, prompts, folder)
    return executor.report(R.described(table) + client_table, dtype, [flavor], [str(check.model_path)])


def _prepared(runtime: str, model) -> R.Prepared:
    """The model ready on `runtime`; a runtime that cannot even load it is a UsageError in one line."""
    try:
        return R.prepare_onnx(runtime, model)
    except AttnExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the runtime's own reason, in one line
        raise UsageError(f"{runtime} cannot load the model: {reason(e)[:300]}") from None


def _weights_rows(ctx: _Context, quantized: dict) -> None:
    """One row: every quantized matrix against the source model's float matrix it stands for (a
    carried grid bit for bit, ONNX Runtime's rounding within a step of its block's scale)."""
    # The source's float32 weights (float64 holds them exactly), also for a graph in half: a grid is
    # carried from these, not from their fp16 rounding.
    state = {k: v.detach().float().numpy() for k, v in ctx.reference.step64.state_dict().items()}
    before = {}
    for e in quantized["matrices"]:
        if not e["bits"]:
            continue
        w = np.zeros((e["k"], e["n"]), np.float32)
        for name, columns in e["params"].items():
            if name in state and state[name].ndim == 2:
                block = state[name].T
                if columns is None:
                    w = block
                else:
                    w[:, columns[0]:columns[1]] = block
        before[e["weight"]] = w
    row = ctx.row("weights: each quantized matrix against the source's", "-",
                  "the source model's weights; exact for a carried grid, a step for ONNX Runtime's rounding")
    bad = P.unfaithful(before, ctx.onnx_model, quantized)
    counts: dict[str, int] = {}
    for e in quantized["matrices"]:
        key = "kept" if not e["bits"] else f"{e['how']} {e['bits']}-bit"
        counts[key] = counts.get(key, 0) + 1
    row.detail = {"matrices": counts, "unfaithful": bad}
    if bad:
        row.error = f"{len(bad)} quantized matrix(es) are not a quantization of the source's: {bad[0]}"
    else:
        moved = _largest_move(before, ctx.onnx_model, quantized)
        for how in ("folded", "float"):  # how far a grid's minimums held this way moved its weights
            folds = [e["fold"] for e in quantized["matrices"] if e.get("how") == how]
            if folds:
                row.detail[how] = {"max_steps": max(f["max_steps"] for f in folds),
                                   "rms_steps": float(np.sqrt(np.mean([f["rms_steps"] ** 2 for f in folds])))}
        row.comparisons = [Comparison("quantized matrices faithful to the source", True, moved, 0.0, 0, 0, 0.0, 0.0,
                                      0.0, 0.0, compared=sum(1 for e in quantized["matrices"] if e["bits"]),
                                      basis="exact grids bit for bit; folded ones within half a residual step; "
                                            "float zero points within their rounding; ORT's rounding within one step")]
        row.passed = True
    ctx.executor.record(row)


def _largest_move(before: dict, model, record: dict) -> float:
    """The largest difference between a weight the file computes with and the source's."""
    inits = {i.name: i for i in model.graph.initializer}
    largest = 0.0
    for e in record["matrices"]:
        got = P.matrix(model, e, inits) if e["bits"] else None
        if got is not None and e["weight"] in before:
            largest = max(largest, float(np.abs(got.astype(np.float64) - before[e["weight"]]).max()))
    return largest


def _accuracy_rows(ctx: _Context, prompts) -> None:
    """The accuracy cost on each runtime (`attnexport.pretrained.accuracy`) against the budget, and (one row,
    torch) which layers cost most when quantized alone."""
    budget = ctx.check.budget
    base = A.baseline(ctx.reference, ctx.tokenizer, prompts, ctx.check.new_tokens)

    def judge(row, cost):
        row.detail = {"accuracy": cost.to_dict(), "budget": {**vars(budget), "text": budget.text()},
                      "summary": cost.text()}
        if cost.failures:
            row.error = f"over the accuracy budget: {'; '.join(cost.failures)} ({cost.text()})"
        return cost.comparisons(budget)
    for rt in ctx.used:
        row = ctx.row("accuracy: teacher-forced KL and top-1, perplexity, greedy first tokens", rt,
                      "the source model in fp32 (and float64), transformers' greedy tokens")
        ctx.run(row, lambda run: A.measure(run, ctx.layout, base, budget, ctx.reference.numpy_dtype),
                functools.partial(judge, row))
    if P.record_of(ctx.onnx_model) is not None:
        _layer_cost_row(ctx, "accuracy", A.layer_costs(ctx.reference, ctx.onnx_model, base), "kl_mean", "mean KL",
                        int(base.eval_ids.size), "the source model in fp32")


def _layer_cost_row(ctx: _Context, what: str, costs: list[dict], key: str, measure: str, compared: int,
                    against: str) -> None:
    """One informational row (runtime "-"): which of a quantized file's layers cost most, each alone
    (`costs`, most costly first, `key` its value), the three costliest as its comparisons."""
    row = ctx.row(f"{what}: the cost of each layer quantized alone (weights as the file holds them, "
                  "activations rounded as its kernels do, emulated in torch)", "-", against)
    row.flavor = "-"
    row.detail = {"layer_costs": costs}
    row.comparisons = [Comparison(f"{measure}, {c['group']} alone", True, c[key], math.nan, 0, 0, 0.0, math.inf,
                                  c[key], math.inf, compared=compared, basis="informational: which layers cost most")
                       for c in costs[:3]]
    row.passed = bool(costs)
    ctx.executor.record(row)


def _check_room(layout: hf.Layout, prompts, new_tokens: int, tokenizer) -> None:
    """The model's step must hold every check's positions (a static model's buffers, an encoder's
    position table): a one-line refusal otherwise."""
    longest = max(len(p) for p in prompts)
    needs = {"shapes": (max(past + block for _, _, block, past, _ in layout.cache_form.verify_checks),
                        "verify --hf checks steps"),
             "decode": (max(t for _, _, t in DECODE), "verify --hf decodes"),
             "generation": (longest + new_tokens, f"verify --hf runs prompts of up to {longest} tokens and "
                                                  f"{new_tokens} new ones (--new-tokens)"),
             "accuracy": (longest + new_tokens, f"verify --hf runs prompts of up to {longest} tokens and "
                                                f"{new_tokens} new ones (--new-tokens)")}
    if tokenizer is not None:
        needs["embeddings"] = (max(len(ids) for ids in tokenizer(E.sentences())["input_ids"]),
                               "verify --hf embeds sentences")
    layout.cache_form.check_room(layout, *max(needs[n] for n in (*layout.family.checks, *layout.family.answers)
                                              if n in needs))


def _shape_rows(ctx: _Context, prompts=None) -> None:
    """The step at each shape, its caches written by the model from a prefix of text, against the
    float64 model on the same feed."""
    for label, batch, block, past, padded in ctx.layout.cache_form.verify_checks:
        ids = HR.token_rows(ctx.tokenizer, ctx.layout.vocab, batch, past + block, seed=2)
        feed = HR.prefilled_feed(ctx.reference, ids, past, padded)
        expected = ctx.reference.expect(feed)
        for rt in ctx.used:
            if R.runs_module(rt):  # the budget is torch's own error on this feed: torch's rows are the generation's
                continue
            row = ctx.row(label, rt, "the model in float64" + (", caches written by it in fp32" if past else ""),
                          expected.tolerances[ctx.layout.outputs[0]])
            row.inputs, row.expected = feed, expected.outputs
            ctx.run(row, functools.partial(_called, feed=feed),
                    functools.partial(expected.compare, names=ctx.layout.outputs),
                    locate=functools.partial(_located, ctx, feed, rt))


def _called(run, feed: dict):
    return run(feed)


def _located(ctx: _Context, feed: dict, runtime: str, _result=None) -> Localization:
    return ctx.localize(feed, runtime)


def _decode_rows(ctx: _Context, prompts=None) -> None:
    """The decode property: a prefill of 4 tokens, then blocks of 1 (batch 2) or of 3 (batch 1),
    give the logits of one forward over the whole sequence in float64; the budget is torch's error
    in that one forward (its fp32 step over the whole sequence), so torch's stepped run is checked
    as any runtime's."""
    if not ctx.layout.cache_form.caches:  # one forward over the whole sequence is all it does
        return
    dtype, ref = ctx.reference.numpy_dtype, ctx.reference
    for i, (batch, chunk, total) in enumerate(DECODE):
        ids = HR.token_rows(ctx.tokenizer, ctx.layout.vocab, batch, total, seed=3 + i)
        whole = hf.stepped_logits(ref.run64, ctx.layout, ids, total, chunk, np.float64)
        tol = HR.budget(hf.stepped_logits(ref.run, ctx.layout, ids, total, chunk, dtype), whole, ctx.dtype,
                        ctx.check.rtol, ctx.check.atol)
        label = f"decode: batch {batch}, prefill {DECODE_PREFILL}, then blocks of {chunk} to {total}"
        for rt in ctx.used:
            row = ctx.row(label, rt, "the model's logits in float64, one forward over the whole sequence", tol)
            ctx.run(row, lambda run, ids=ids, chunk=chunk: {"logits": hf.stepped_logits(
                run, ctx.layout, ids, DECODE_PREFILL, chunk, dtype)},
                lambda got, whole=whole, tol=tol: [compare("logits", got["logits"], whole, tol)])


def _generation_rows(ctx: _Context, prompts) -> None:
    """Greedy generation on each runtime against transformers' `generate(do_sample=False)`: the
    same tokens, and each step's logits within the budget of transformers' own fp32 logits against
    the model in float64 over the same tokens."""
    layout, n = ctx.layout, ctx.check.new_tokens
    want = hf.reference_generation(ctx.reference.model, layout, prompts, n)
    want64 = HR.generation_logits64(ctx.reference, prompts, want.tokens)
    tol = HR.budget(np.stack(want.logits), np.stack(want64), ctx.dtype, ctx.check.rtol, ctx.check.atol)
    lengths = ", ".join(map(str, PROMPT_LENGTHS))
    what = "from the tokenizer" if ctx.tokenizer is not None else f"of {lengths} tokens"
    label = f"generate {n} tokens, {len(prompts)} prompts {what}"

    def judge(row, got):
        steps = [compare(f"logits of step {i}", g, w, tol) for i, (g, w) in enumerate(zip(got.logits, want64,
                                                                                         strict=True))]
        row.arrays = {"logits": np.stack(got.logits)}
        row.detail = {"tokens": got.tokens.tolist(), "transformers_tokens": want.tokens.tolist(),
                      "logits_max_abs_per_step": [c.max_abs for c in steps]}
        if ctx.tokenizer is not None:
            row.detail["prompts"] = list(HR.PROMPTS)
            row.detail["text"] = [ctx.tokenizer.decode(t) for t in got.tokens]
        logits = compare("logits", np.stack(got.logits), np.stack(want64), tol)
        differ = np.argwhere(got.tokens != want.tokens)
        if differ.size:
            step = int(differ[:, 1].min())
            seq = int(differ[differ[:, 1] == step][0, 0])
            row.error = (f"sequence {seq}, step {step}: transformers generated token {want.tokens[seq, step]}, the "
                         f"model {got.tokens[seq, step]} (logits there: {steps[step]})")
        elif not logits.passed:
            worst = max(range(len(steps)), key=lambda i: steps[i].max_abs)
            row.error = f"same tokens; the logits past tolerance, worst at step {worst}: {steps[worst]}"
        return [logits]

    def locate(rt, got):  # the step where the tokens part, if they do
        return None if got is None or got.diverged_feed is None else ctx.localize(got.diverged_feed, rt)
    for rt in ctx.used:
        row = ctx.row(label, rt, "transformers' generate(do_sample=False); its logits at each step in float64", tol)
        ctx.run(row, lambda run: hf.generate(run, layout, prompts, n, watch=want.tokens,
                                             dtype=ctx.reference.numpy_dtype),
                functools.partial(judge, row), locate=functools.partial(locate, rt))


def _embedding_rows(ctx: _Context, prompts=None) -> None:
    """A sentence encoder as its users judge it (`attnexport.pretrained.embeddings`): the
    embeddings of real sentences on each runtime against the model's in float64, each sentence's
    cosine and top-k retrieval over the corpus, within the precision's budget."""
    texts = E.sentences()
    batches = [texts[i:i + EMBED_BATCH] for i in range(0, len(texts), EMBED_BATCH)]
    feeds = [_encoded(ctx, batch) for batch in batches]
    want = np.concatenate([ctx.reference.run64(f)["sentence_embedding"] for f in feeds])
    precision = ctx.precision
    budget = E.budget_for(precision)
    label = f"embeddings: {len(texts)} sentences, cosine and top-{E.TOP_K} retrieval of {len(E.QUERIES)} queries"

    for rt in ctx.used:
        row = ctx.row(label, rt, "the model's embeddings in float64")
        ctx.run(row, lambda run: np.concatenate([np.asarray(run(f)["sentence_embedding"]) for f in feeds]),
                functools.partial(_judge_embeddings, row, want, budget, precision, lambda got: got))
    if P.record_of(ctx.onnx_model) is not None:
        _layer_cost_row(ctx, "embeddings", A.layer_costs_embeddings(ctx.reference, ctx.onnx_model, feeds, want, budget),
                        "cost", "1 - lowest cosine", len(want), "the model's embeddings in float64")


def _embedding_client_rows(ctx: _Context, prompts, folder) -> None:
    """Each client embedding the check's sentences from the deployment folder with its own
    tokenizer and pooling, against transformers' embeddings (the model in fp32 as the file holds
    it) within the file's precision's embedding budget."""
    texts = E.sentences()
    want = np.concatenate([ctx.reference.run(_encoded(ctx, texts[i:i + EMBED_BATCH]))["sentence_embedding"]
                           for i in range(0, len(texts), EMBED_BATCH)])
    precision = ctx.precision
    budget = E.budget_for(precision)
    for client in ctx.check.clients:
        row = ctx.row(f"client: embed {len(texts)} sentences from the folder", client,
                      "transformers' embeddings of the same sentences")
        row.flavor = "-"
        row.skipped = clients.skipped(client)
        ctx.executor.run(row, functools.partial(clients.embed, client, folder, texts, R.cpu_threads()),
                         functools.partial(_judge_embeddings, row, want, budget, precision,
                                           lambda done: done.embeddings))


def _judge_embeddings(row: Row, want: np.ndarray, budget, precision: str, take, got) -> list[Comparison]:
    """`got`'s embeddings (`take(got)`) against `want` within `budget`: the row's detail, its error
    where over the budget, and its one comparison (1 - the lowest cosine)."""
    cost = E.measure(take(got), want, budget)
    row.detail = {"embeddings": cost.to_dict(), "budget": {**vars(budget), "text": budget.text()},
                  "summary": cost.text(), "measure": "embeddings"}
    failures = cost.failures(budget)
    if failures:
        row.error = f"over the embedding budget: {'; '.join(failures)} ({cost.text()})"
    distance = float(1 - cost.cosines.min()) if np.isfinite(cost.cosines).all() else math.inf
    return [Comparison("sentence_embedding: 1 - cosine", not failures, distance, math.nan, 0, 0, 0.0,
                       1 - budget.cosine, distance, math.inf, compared=int(cost.cosines.size),
                       basis=f"the {precision} embedding budget: {budget.text()}")]


def _encoded(ctx: _Context, texts: list[str]) -> dict:
    """The model's inputs for `texts` (`embeddings.encoded`)."""
    return E.encoded(ctx.tokenizer, texts, ctx.layout.max_seq, ctx.layout.inputs)


def _client_rows(ctx: _Context, prompts, folder) -> None:
    """Each client generating from the deployment folder, prompt by prompt (batch 1), against
    transformers' `generate` on the same prompt: the same tokens, and where the folder has a
    tokenizer, the client's encoding of each prompt equal to transformers'."""
    n = ctx.check.new_tokens
    want = np.concatenate([hf.reference_generation(ctx.reference.model, ctx.layout, [p], n).tokens for p in prompts])
    given = list(HR.PROMPTS) if ctx.tokenizer is not None else [p.tolist() for p in prompts]
    exact = Tolerance(0.0, 0.0, "exact: token ids")
    encoded = [list(map(int, p)) for p in prompts]

    def judge(row, client, done):
        got = np.array([t[:n] + [-1] * (n - len(t[:n])) for t in done.tokens])
        row.detail = {"tokens": got.tolist(), "transformers_tokens": want.tolist(), "prompt_ids": done.prompt_ids}
        if done.prompt_ids != encoded:
            bad = next(i for i, (a, b) in enumerate(zip(done.prompt_ids, encoded, strict=True)) if a != b)
            row.error = (f"prompt {bad}: {client}'s tokenizer encodes {given[bad]!r} as {done.prompt_ids[bad][:12]}, "
                         f"transformers' as {encoded[bad][:12]}")
        else:
            differ = np.argwhere(got != want)
            if differ.size:
                seq, step = (int(v) for v in differ[np.argmin(differ[:, 1])])
                row.error = (f"prompt {seq}, step {step}: transformers generated token {want[seq, step]}, {client} "
                             f"{got[seq, step]}")
        return [compare("tokens", got, want, exact)]
    for client in ctx.check.clients:
        row = ctx.row(f"client: generate {n} tokens from the folder, {len(prompts)} prompts, one at a time", client,
                      "transformers' generate(do_sample=False), one prompt at a time", exact)
        row.flavor = "-"
        row.skipped = clients.skipped(client)
        cannot = ctx.layout.cache_form.cannot
        if client in cannot and not row.skipped:
            row.error = f"{client} cannot run the {ctx.layout.form} form: {cannot[client]}"
        ctx.executor.run(row, functools.partial(clients.generate, client, folder, given, n, R.cpu_threads()),
                         functools.partial(judge, row, client))


# The row makers, by the names a family's `checks`, `answers` and `client_rows` give.
_ROWS: dict[str, Callable[..., None]] = {
    "shapes": _shape_rows, "decode": _decode_rows, "generation": _generation_rows, "accuracy": _accuracy_rows,
    "embeddings": _embedding_rows, "generating clients": _client_rows, "embedding clients": _embedding_client_rows}
