"""A language model exported with `export --hf` against transformers: its step graph at several
shapes, the decode property, and generation parity (greedy tokens equal to transformers'
`generate`) on every runtime, each divergence localized as any other."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnexport import hf, hf_export
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport.compare import (
    Tolerance,
    check_tolerance_values,
    compare,
    compare_outputs,
    past_ends_zeroed,
    tolerance,
)
from attnexport.errors import reason
from attnexport.export import STATIC_BUFFERS
from attnexport.inspect import load_model
from attnexport.localize import Localization, locate
from attnexport.report import Report, Row
from attnexport.verify.module_check import changed_params

# Generation parity: prompts of these lengths in one batch (left- or right-padded by the form's
# loop), this many new tokens.
PROMPT_LENGTHS = (5, 9, 2)
NEW_TOKENS = 32


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


@dataclass
class _Context:
    check: HFCheck
    onnx_model: Any
    layout: hf.Layout
    module: Any  # the step wrapper around transformers' model
    hf_model: Any
    dtype: str
    flavor: str
    used: list
    prepared: dict
    tol: Tolerance
    known_good: Any = None

    @property
    def name(self) -> str:
        return Path(self.check.model_path).name

    def row(self, case: str, runtime: str, kind: str) -> Row:
        return Row(case=case, variant=f"{self.layout.form} ({hf.TASK})", flavor="-" if runtime == "torch" else
                   self.flavor, runtime=runtime, dtype=self.dtype, model=self.name, tolerance=self.tol,
                   expected_kind=kind)

    def module_run(self, feed: dict) -> dict:
        """The step wrapper in eager torch, its attention through attnexport's core."""
        import torch
        with torch.no_grad(), M.export_semantics():
            out = self.module(*(torch.from_numpy(np.ascontiguousarray(v)) for v in feed.values()))
        return {n: t.detach().numpy() for n, t in zip(self.layout.outputs, M.outputs_of(out), strict=True)}

    def runner(self, runtime: str):
        return self.module_run if runtime == "torch" else self.prepared[runtime].run

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


def verify_hf(check: HFCheck) -> Report:
    """The rows of every check on every selected runtime (see the module docstring)."""
    check_tolerance_values(check.rtol, check.atol)
    model = load_model(check.model_path)
    layout = hf.Layout.of(model)
    meta = {p.key: p.value for p in model.metadata_props}
    dtype, flavor = meta.get("attnexport.dtype", "fp32"), meta.get("attnexport.flavor", "-")
    seed = check.seed if check.seed is not None else int(meta.get("attnexport.seed", 0))
    check = HFCheck(**{**vars(check), "seed": seed})
    hf_model, _ = hf.load(check.source, seed)
    module = hf.step_module(hf_model, layout)
    used, table = R.select(check.runtimes, check.skip_unavailable)
    ctx = _Context(check, model, layout, module, hf_model, dtype, flavor, used,
                   {rt: R.prepare_onnx(rt, model) for rt in used if rt in R.ONNX_RUNTIMES},
                   tolerance(dtype, check.rtol, check.atol))
    changed = changed_params(module, json.loads(meta.get("attnexport.params", "{}")), dtype)
    with np.errstate(all="ignore"):
        if changed:
            row = ctx.row("parameters", "-", "the model's record")
            row.error = (f"the model's parameters differ from {check.source}'s: {', '.join(changed[:3])} "
                         "(sha256 in the metadata; --seed for a folder with a config only)")
            rows = [row]
        else:
            rows = _shape_rows(ctx) + _decode_rows(ctx) + _generation_rows(ctx)
    return Report(rows, R.described(table), dtype, [flavor], [str(check.model_path)])


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


def _shape_rows(ctx: _Context) -> list[Row]:
    rows = []
    buffers = ctx.layout.cache_names("present") if STATIC_BUFFERS in {p.key for p in ctx.onnx_model.metadata_props} \
        else []
    for label, batch, block, past, padded in _shapes(ctx.layout):
        feed = hf.example_feed(ctx.layout, batch, block, past, seed=2, padded=padded)
        expected = ctx.module_run(feed)
        ends = feed.get("write_pos", np.zeros(batch, np.int64)) + block
        expected = past_ends_zeroed(expected, buffers, ends)
        for rt in ctx.used:
            if rt == "torch":  # the expected values are the torch module's own: torch's rows are the generation
                continue
            row = ctx.row(label, rt, "the model in transformers, its attention through attnexport's core")
            row.inputs, row.expected = feed, expected
            rows.append(row)
            got = _timed_on(ctx, row, lambda run, feed=feed: run(feed))
            if got is None:
                continue
            got = past_ends_zeroed(got, buffers, ends)
            row.comparisons = compare_outputs(ctx.layout.outputs, got, expected, ctx.tol)
            row.passed = bool(row.comparisons) and all(c.passed for c in row.comparisons)
            if not row.passed and rt != "onnx-ref":
                row.localization = ctx.localize(feed, rt)
    return rows


def _stepped_logits(run, layout: hf.Layout, ids: np.ndarray, first: int, chunk: int) -> np.ndarray:
    """The logits of every position of `ids` from a prefill of `first` tokens, then blocks of `chunk`."""
    batch, total = ids.shape
    pairs = layout.cache_pairs
    positions = layout.max_seq if layout.form == "static" else 0
    state = {n: np.zeros((batch, layout.kv_heads, positions, layout.head_dim), np.float32) for n in pairs}
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
    give the logits of one forward over the whole sequence (the module's, empty cache)."""
    if ctx.layout.form == "none":
        return []
    rows = []
    rng = np.random.default_rng(3)
    for batch, chunk, total in ((2, 1, 8), (1, 3, 10)):
        ids = rng.integers(0, ctx.layout.vocab, (batch, total), dtype=np.int64)
        whole = _stepped_logits(ctx.module_run, ctx.layout, ids, total, chunk)
        label = f"decode: batch {batch}, prefill 4, then blocks of {chunk} to {total}"
        for rt in ctx.used:
            row = ctx.row(label, rt, "the module's logits of one forward over the whole sequence")
            rows.append(row)
            got = _timed_on(ctx, row, lambda run, ids=ids, chunk=chunk: _stepped_logits(run, ctx.layout, ids, 4, chunk))
            if got is None:
                continue
            row.comparisons = [compare("logits", got, whole, ctx.tol)]
            row.passed = row.comparisons[0].passed
    return rows


def _generation_rows(ctx: _Context) -> list[Row]:
    """Greedy generation on each runtime against transformers' `generate(do_sample=False)`."""
    layout, n = ctx.layout, ctx.check.new_tokens
    prompts = hf.prompts_for(layout, PROMPT_LENGTHS, seed=4)
    want = hf.reference_generation(ctx.hf_model, layout, prompts, n)
    label = f"generate {n} tokens, prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens"
    rows = []
    for rt in ctx.used:
        row = ctx.row(label, rt, "transformers' generate(do_sample=False), its logits at each step")
        rows.append(row)
        got = _timed_on(ctx, row, lambda run: hf.generate(run, layout, prompts, n, keep_feeds=True))
        if got is None:
            continue
        steps = [compare(f"logits of step {i}", g, w, ctx.tol) for i, (g, w) in enumerate(zip(got.logits, want.logits,
                                                                                               strict=True))]
        row.comparisons = [compare("logits", np.stack(got.logits), np.stack(want.logits), ctx.tol)]
        row.detail = {"tokens": got.tokens.tolist(), "transformers_tokens": want.tokens.tolist(),
                      "logits_max_abs_per_step": [c.max_abs for c in steps]}
        differ = np.argwhere(got.tokens != want.tokens)
        if differ.size:
            step = int(differ[:, 1].min())
            seq = int(differ[differ[:, 1] == step][0, 0])
            row.error = (f"sequence {seq}, step {step}: transformers generated token {want.tokens[seq, step]}, the "
                         f"model {got.tokens[seq, step]} (logits there: {steps[step]})")
            if rt in ctx.prepared and rt != "onnx-ref":
                row.localization = ctx.localize(got.feeds[step], rt)
            continue
        row.passed = row.comparisons[0].passed
        if not row.passed:
            worst = max(range(len(steps)), key=lambda i: steps[i].max_abs)
            row.error = f"same tokens; the logits past tolerance, worst at step {worst}: {steps[worst]}"
    return rows
