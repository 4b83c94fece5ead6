"""A language model exported with `export --hf` against the model it came from: its step graph at
several shapes, the decode property, and generation parity (greedy tokens equal to transformers'
`generate`) on every runtime, each divergence localized as any other.

Every number is compared with the same model run in float64, each output within a budget derived
from what fp32 torch does against that run (`attnexport.hf_reference`): a step's from the step in
torch on the same feed, the decode property's from torch's one forward over the whole sequence,
generation's from transformers' own `generate`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnexport import clients, hf, hf_export
from attnexport import hf_reference as HR
from attnexport import runtimes as R
from attnexport import weights as W
from attnexport.compare import Tolerance, check_tolerance_values, compare
from attnexport.errors import UsageError, reason
from attnexport.inspect import load_model
from attnexport.localize import Localization, locate
from attnexport.report import Report, Row
from attnexport.verify.module_check import changed_params

# Generation parity without a tokenizer: seeded prompts of these lengths in one batch (left- or
# right-padded by the form's loop); with one, hf_reference.PROMPTS. This many new tokens.
PROMPT_LENGTHS = (5, 9, 2)
NEW_TOKENS = 48
# The decode property: (batch, blocks after a prefill of DECODE_PREFILL, total tokens).
DECODE = ((2, 1, 8), (1, 3, 10))
DECODE_PREFILL = 4


@dataclass(frozen=True)
class HFCheck:
    """What `verify MODEL --hf PATH` checks: the model file against the model at `source`."""

    model_path: str | Path
    source: str | Path
    runtimes: list[str] | None = None
    rtol: float | None = None
    atol: float | None = None
    skip_unavailable: bool = False
    seed: int | None = None
    new_tokens: int = NEW_TOKENS
    clients: tuple = ()  # with a deployment folder: the clients that load it (attnexport.clients)


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
    known_good: Any = None

    @property
    def name(self) -> str:
        return Path(self.check.model_path).name

    def row(self, case: str, runtime: str, kind: str, tol: Tolerance | None = None) -> Row:
        return Row(case=case, variant=f"{self.layout.form} ({hf.TASK})", flavor="-" if runtime == "torch" else
                   self.flavor, runtime=runtime, dtype=self.dtype, model=self.name, tolerance=tol,
                   expected_kind=kind)

    def runner(self, runtime: str):
        """The step on `runtime`: the ONNX model, or torch's `reference.run` (the model in torch,
        its attention through attnexport's core)."""
        return self.reference.run if runtime == "torch" else self.prepared[runtime].run

    def localize(self, feed: dict, runtime: str) -> Localization:
        """The first diverging node against the model exported afresh (once) from the same source."""
        try:
            if self.known_good is None:
                request = hf_export.HFExport(self.check.source, self.layout.form, self.layout.max_seq, self.flavor,
                                             dtype=self.dtype, seed=self.check.seed or 0)
                self.known_good = hf_export.export_hf(request)[0].model
            return locate(self.onnx_model, self.known_good, feed, runtime, self.dtype)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            return Localization(note=f"localization failed: {reason(e)}")


def model_file(path: str | Path) -> tuple[Path, Path | None]:
    """(the model file, the deployment folder it is in or None) of verify's MODEL: a .onnx file, or a
    folder written by `export --hf --deploy` (its onnx/model.onnx or onnx/model_static.onnx)."""
    path = Path(path)
    if path.is_dir():
        found = [path / f for f in dict.fromkeys(hf_export.DEPLOY_FILES.values()) if (path / f).is_file()]
        if len(found) != 1:
            raise UsageError(f"{path}: a folder MODEL is a deployment folder (export --hf --deploy) holding one of "
                             f"{', '.join(dict.fromkeys(hf_export.DEPLOY_FILES.values()))}; it holds "
                             f"{len(found)}")
        return found[0], path
    folder = path.parent.parent
    in_folder = path.parent.name == "onnx" and (folder / "config.json").is_file()
    return path, folder if in_folder else None


def verify_hf(check: HFCheck) -> Report:
    """The rows of every check on every selected runtime (see the module docstring)."""
    check_tolerance_values(check.rtol, check.atol)
    path, folder = model_file(check.model_path)
    if check.clients and folder is None:
        raise UsageError(f"--clients load a deployment folder (export --hf --deploy FOLDER); {check.model_path} "
                         "is not in one")
    check = HFCheck(**{**vars(check), "model_path": path})
    model = load_model(check.model_path)
    layout = hf.Layout.of(model)
    meta = {p.key: p.value for p in model.metadata_props}
    dtype, flavor = meta.get("attnexport.dtype", "fp32"), meta.get("attnexport.flavor", "-")
    seed = check.seed if check.seed is not None else int(meta.get("attnexport.seed", 0))
    check = HFCheck(**{**vars(check), "seed": seed})
    hf_model, _ = hf.load(check.source, seed)
    tokenizer = hf.tokenizer_of(check.source)
    prompts = HR.prompts(tokenizer, layout, PROMPT_LENGTHS, seed=4)
    _check_room(layout, prompts, check.new_tokens)
    reference = HR.Reference(hf_model, layout, dtype, check.rtol, check.atol)
    used, table = R.select(check.runtimes, check.skip_unavailable)
    ctx = _Context(check, model, layout, reference, tokenizer, dtype, flavor, used,
                   {rt: R.prepare_onnx(rt, model) for rt in used if rt in R.ONNX_RUNTIMES})
    record = json.loads(meta.get("attnexport.params", "{}"))
    changed = changed_params(reference.step, record, dtype)
    damaged = W.read(model, record)[1] if record else []  # the file's own initializers against the record
    with np.errstate(all="ignore"):
        if changed or damaged:
            row = ctx.row("parameters", "-", "the model's record")
            row.error = (f"the model's parameters differ from {check.source}'s: {', '.join(changed[:3])} "
                         "(sha256 in the metadata; --seed for a folder with a config only)") if changed else \
                (f"the model file's parameters differ from the sha256 recorded at its export: "
                 f"{', '.join(damaged[:3])} (the file was changed after the export)")
            rows = [row]
        else:
            rows = _shape_rows(ctx) + _decode_rows(ctx) + _generation_rows(ctx, prompts)
            if check.clients:
                rows += _client_rows(ctx, folder, prompts)
    runtimes = R.described(table) + [{"name": c, "available": ok, "reason": why, "used": ok}
                                     for c in check.clients for ok, why in [clients.status(c)]]
    return Report(rows, runtimes, dtype, [flavor], [str(check.model_path)])


def _shapes(layout: hf.Layout):
    """(label, batch, block, past, padded) the step graph is checked at."""
    if layout.form == "static":
        return [("batch 2, block 3 into empty buffers", 2, 3, 0, 0), ("batch 1, one token", 1, 1, 0, 0),
                ("batch 3, one token after 5", 3, 1, 5, 0), ("batch 1, block 3 after 7", 1, 3, 7, 0)]
    if layout.form == "none":
        return [("batch 2, 5 tokens", 2, 5, 0, 0), ("batch 1, 1 token", 1, 1, 0, 0),
                ("batch 3, 7 tokens, sequence 0 left-padded by 3", 3, 7, 0, 3)]
    return [("batch 2, block 5 after 3", 2, 5, 3, 0), ("batch 1, one token after 1", 1, 1, 1, 0),
            ("batch 3, block 6 after 4, sequence 0 left-padded by 2", 3, 6, 4, 2),
            ("batch 2, block 4, no past", 2, 4, 0, 0)]


def _check_room(layout: hf.Layout, prompts, new_tokens: int) -> None:
    """A static model's buffers must hold every check's positions: a one-line refusal otherwise."""
    if layout.form != "static":
        return
    needs = max(max(past + block for _, _, block, past, _ in _shapes(layout)), max(t for _, _, t in DECODE),
                max(len(p) for p in prompts) + new_tokens)
    if layout.max_seq < needs:
        raise UsageError(f"verify --hf runs prompts of up to {max(len(p) for p in prompts)} tokens and "
                         f"{new_tokens} new ones (--new-tokens) through the static cache: it needs buffers of "
                         f"{needs} positions, the model's hold {layout.max_seq} (export with --max-seq {needs} "
                         "or more)")


def _shape_rows(ctx: _Context) -> list[Row]:
    """The step at each shape, its caches written by the model from a prefix of text, against the
    float64 model on the same feed."""
    rows = []
    for label, batch, block, past, padded in _shapes(ctx.layout):
        ids = HR.token_rows(ctx.tokenizer, ctx.layout.vocab, batch, past + block, seed=2)
        feed = HR.prefilled_feed(ctx.reference, ids, past, padded)
        expected = ctx.reference.expect(feed)
        for rt in ctx.used:
            if rt == "torch":  # the budget is torch's own error on this feed: torch's rows are the generation's
                continue
            row = ctx.row(label, rt, "the model in float64, caches written by it in fp32",
                          expected.tolerances["logits"])
            row.inputs, row.expected = feed, expected.outputs
            rows.append(row)
            got = _timed_on(ctx, row, lambda run, feed=feed: run(feed))
            if got is None:
                continue
            row.comparisons = expected.compare(got, ctx.layout.outputs)
            row.passed = bool(row.comparisons) and all(c.passed for c in row.comparisons)
            if not row.passed and rt != "onnx-ref":
                row.localization = ctx.localize(feed, rt)
    return rows


def _stepped_logits(run, layout: hf.Layout, ids: np.ndarray, first: int, chunk: int, dtype) -> np.ndarray:
    """The logits of every position of `ids` from a prefill of `first` tokens, then blocks of `chunk`."""
    batch, total = ids.shape
    pairs = layout.cache_pairs
    positions = layout.max_seq if layout.form == "static" else 0
    state = {n: np.zeros((batch, layout.kv_heads, positions, layout.head_dim), dtype) for n in pairs}
    logits, start = [], 0
    while start < total:
        end = first if start == 0 else min(start + chunk, total)
        block = ids[:, start:end]
        if layout.form == "static":
            feed = {"input_ids": block, "write_pos": np.full(batch, start, np.int64), **state}
        else:
            feed = {"input_ids": block, "attention_mask": np.ones((batch, end), np.int64),
                    "position_ids": np.broadcast_to(np.arange(start, end), block.shape).copy(), **state}
        out = run(feed)
        logits.append(np.asarray(out["logits"], np.float64))
        state = {past: out[present] for past, present in pairs.items()}
        start = end
    return np.concatenate(logits, axis=1)


def _timed_on(ctx: _Context, row: Row, work):
    """`work(run)` with the row's runtime's step function, its time in the row; None (the row
    says why) when the runtime runs no ONNX model or the work fails."""
    if row.runtime != "torch" and row.runtime not in ctx.prepared:
        row.skipped = f"{row.runtime} runs no ONNX model"
        return None
    started = time.perf_counter()
    try:
        done = work(ctx.runner(row.runtime))
    except Exception as e:  # noqa: BLE001 - a runtime failing on the model fails verification
        row.error = reason(e)
        return None
    row.median_ms = (time.perf_counter() - started) * 1e3
    return done


def _decode_rows(ctx: _Context) -> list[Row]:
    """The decode property: a prefill of 4 tokens, then blocks of 1 (batch 2) or of 3 (batch 1),
    give the logits of one forward over the whole sequence in float64; the budget is torch's error
    in that one forward (its fp32 step over the whole sequence), so torch's stepped run is checked
    as any runtime's."""
    if ctx.layout.form == "none":
        return []
    rows = []
    dtype, ref = ctx.reference.numpy_dtype, ctx.reference
    for i, (batch, chunk, total) in enumerate(DECODE):
        ids = HR.token_rows(ctx.tokenizer, ctx.layout.vocab, batch, total, seed=3 + i)
        whole = _stepped_logits(ref.run64, ctx.layout, ids, total, chunk, np.float64)
        tol = HR.budget(_stepped_logits(ref.run, ctx.layout, ids, total, chunk, dtype), whole, ctx.dtype,
                        ctx.check.rtol, ctx.check.atol)
        label = f"decode: batch {batch}, prefill {DECODE_PREFILL}, then blocks of {chunk} to {total}"
        for rt in ctx.used:
            row = ctx.row(label, rt, "the model's logits in float64, one forward over the whole sequence", tol)
            rows.append(row)
            got = _timed_on(ctx, row, lambda run, ids=ids, chunk=chunk: _stepped_logits(
                run, ctx.layout, ids, DECODE_PREFILL, chunk, dtype))
            if got is None:
                continue
            row.comparisons = [compare("logits", got, whole, tol)]
            row.passed = row.comparisons[0].passed
    return rows


def _generation_rows(ctx: _Context, prompts) -> list[Row]:
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
    rows = []
    for rt in ctx.used:
        row = ctx.row(label, rt, "transformers' generate(do_sample=False); its logits at each step in float64", tol)
        rows.append(row)
        got = _timed_on(ctx, row, lambda run: hf.generate(run, layout, prompts, n, watch=want.tokens,
                                                          dtype=ctx.reference.numpy_dtype))
        if got is None:
            continue
        steps = [compare(f"logits of step {i}", g, w, tol) for i, (g, w) in enumerate(zip(got.logits, want64,
                                                                                         strict=True))]
        row.comparisons = [compare("logits", np.stack(got.logits), np.stack(want64), tol)]
        row.detail = {"tokens": got.tokens.tolist(), "transformers_tokens": want.tokens.tolist(),
                      "logits_max_abs_per_step": [c.max_abs for c in steps]}
        if ctx.tokenizer is not None:
            row.detail["prompts"] = list(HR.PROMPTS)
            row.detail["text"] = [ctx.tokenizer.decode(t) for t in got.tokens]
        differ = np.argwhere(got.tokens != want.tokens)
        if differ.size:
            step = int(differ[:, 1].min())
            seq = int(differ[differ[:, 1] == step][0, 0])
            row.error = (f"sequence {seq}, step {step}: transformers generated token {want.tokens[seq, step]}, the "
                         f"model {got.tokens[seq, step]} (logits there: {steps[step]})")
            if rt in ctx.prepared and rt != "onnx-ref" and got.diverged_feed is not None:
                row.localization = ctx.localize(got.diverged_feed, rt)
            continue
        row.passed = row.comparisons[0].passed
        if not row.passed:
            worst = max(range(len(steps)), key=lambda i: steps[i].max_abs)
            row.error = f"same tokens; the logits past tolerance, worst at step {worst}: {steps[worst]}"
    return rows


def _client_rows(ctx: _Context, folder, prompts) -> list[Row]:
    """Each client generating from the deployment folder, prompt by prompt (batch 1), against
    transformers' `generate` on the same prompt: the same tokens, and where the folder has a
    tokenizer, the client's encoding of each prompt equal to transformers'."""
    n = ctx.check.new_tokens
    want = np.concatenate([hf.reference_generation(ctx.reference.model, ctx.layout, [p], n).tokens for p in prompts])
    given = list(HR.PROMPTS) if ctx.tokenizer is not None else [p.tolist() for p in prompts]
    exact = Tolerance(0.0, 0.0, "exact: token ids")
    rows = []
    for client in ctx.check.clients:
        row = ctx.row(f"client: generate {n} tokens from the folder, {len(prompts)} prompts, one at a time", client,
                      "transformers' generate(do_sample=False), one prompt at a time", exact)
        row.flavor = "-"
        rows.append(row)
        if (client, ctx.layout.form) in clients.CANNOT:
            row.error = f"{client} cannot run the {ctx.layout.form} form: {clients.CANNOT[client, ctx.layout.form]}"
            continue
        ok, why = clients.status(client)
        if not ok:
            row.error = f"{client} is not available: {why}"
            continue
        started = time.perf_counter()
        try:
            done = clients.generate(client, folder, given, n, R.DEFAULT_CPU_THREADS)
        except Exception as e:  # noqa: BLE001 - a client failing on the folder fails verification
            row.error = reason(e)
            continue
        row.median_ms = (time.perf_counter() - started) * 1e3
        got = np.array([t[:n] + [-1] * (n - len(t[:n])) for t in done.tokens])
        row.comparisons = [compare("tokens", got, want, exact)]
        encoded = [list(map(int, p)) for p in prompts]
        row.detail = {"tokens": got.tolist(), "transformers_tokens": want.tolist(), "prompt_ids": done.prompt_ids}
        if done.prompt_ids != encoded:
            bad = next(i for i, (a, b) in enumerate(zip(done.prompt_ids, encoded, strict=True)) if a != b)
            row.error = (f"prompt {bad}: {client}'s tokenizer encodes {given[bad]!r} as {done.prompt_ids[bad][:12]}, "
                         f"transformers' as {encoded[bad][:12]}")
            continue
        differ = np.argwhere(got != want)
        if differ.size:
            seq, step = (int(v) for v in differ[np.argmin(differ[:, 1])])
            row.error = (f"prompt {seq}, step {step}: transformers generated token {want[seq, step]}, {client} "
                         f"{got[seq, step]}")
            continue
        row.passed = row.comparisons[0].passed
    return rows
