"""A language model's verify rows (`attnexport.pretrained.check.verify_step` runs them): the decode
property, generation parity (greedy tokens equal to transformers' `generate`, each step's logits
within the budget of transformers' own fp32 logits against float64), a lossy file's accuracy cost
(`causal.accuracy`) with what each layer costs, and the clients generating from the folder."""

from __future__ import annotations

import functools

import numpy as np

from attnexport import runtimes as R
from attnexport.compare import Tolerance, compare
from attnexport.pretrained import check as C
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained.causal import accuracy as A
from attnexport.pretrained.causal import clients as CL
from attnexport.pretrained.causal import generation as G

# Generation parity without a tokenizer: seeded prompts of these lengths in one batch (left- or
# right-padded by the form's loop); with one, generation.PROMPTS.
PROMPT_LENGTHS = (5, 9, 2)
# The decode property: (batch, blocks after a prefill of DECODE_PREFILL, total tokens).
DECODE = ((2, 1, 8), (1, 3, 10))
DECODE_PREFILL = 4


def inputs(tokenizer, layout) -> list[np.ndarray]:
    """The prompts of generation parity (and of the accuracy cost's first tokens)."""
    return G.prompts(tokenizer, layout, PROMPT_LENGTHS, seed=4)


def needs(layout, prompts, new_tokens: int, tokenizer) -> list[tuple[int, str]]:
    """The positions each of verify's checks runs through the step: its shapes, the decode property,
    the prompts with their new tokens."""
    longest = max(len(p) for p in prompts)
    return [(max(past + block for _, _, block, past, _ in layout.cache_form.verify_checks), "verify --hf checks steps"),
            (max(t for _, _, t in DECODE), "verify --hf decodes"),
            (longest + new_tokens, f"verify --hf runs prompts of up to {longest} tokens and {new_tokens} new ones "
                                   "(--new-tokens)")]


def decode_rows(ctx: C.Context) -> None:
    """The decode property: a prefill of 4 tokens, then blocks of 1 (batch 2) or of 3 (batch 1),
    give the logits of one forward over the whole sequence in float64; the budget is torch's error
    in that one forward (its fp32 step over the whole sequence), so torch's stepped run is checked
    as any runtime's."""
    if not ctx.layout.cache_form.caches:  # one forward over the whole sequence is all it does
        return
    dtype, ref = ctx.reference.numpy_dtype, ctx.reference
    for i, (batch, chunk, total) in enumerate(DECODE):
        ids = HR.token_rows(ctx.tokenizer, ctx.layout.vocab, batch, total, seed=3 + i)

        def expect(ids=ids, chunk=chunk, total=total):
            whole = G.stepped_logits(ref.run64, ctx.layout, ids, total, chunk, np.float64)
            return whole, HR.budget(G.stepped_logits(ref.run, ctx.layout, ids, total, chunk, dtype), whole,
                                    ctx.dtype, ctx.check.rtol, ctx.check.atol)
        whole, tol = ctx.expect(("decode", i), expect)
        label = f"decode: batch {batch}, prefill {DECODE_PREFILL}, then blocks of {chunk} to {total}"
        for rt in ctx.used:
            row = ctx.row(label, rt, "the model's logits in float64, one forward over the whole sequence", tol)
            ctx.run(row, lambda run, ids=ids, chunk=chunk: {"logits": G.stepped_logits(
                run, ctx.layout, ids, DECODE_PREFILL, chunk, dtype)},
                lambda got, whole=whole, tol=tol: [compare("logits", got["logits"], whole, tol)])


def generation_rows(ctx: C.Context) -> None:
    """Greedy generation on each runtime against transformers' `generate(do_sample=False)`: the
    same tokens, and each step's logits within the budget of transformers' own fp32 logits against
    the model in float64 over the same tokens."""
    layout, n, prompts = ctx.layout, ctx.check.new_tokens, ctx.prompts

    def expect():
        want = G.reference_generation(ctx.reference.model, layout, prompts, n)
        whole64 = np.stack(G.generation_logits64(ctx.reference, prompts, want.tokens))  # (steps, B, V), once
        tol = HR.budget(np.stack(want.logits), whole64, ctx.dtype, ctx.check.rtol, ctx.check.atol)
        want.logits = []  # its fp32 logits made the budget; the rows read its tokens
        return want, whole64, tol
    want, whole64, tol = ctx.expect("generation", expect)
    lengths = ", ".join(map(str, PROMPT_LENGTHS))
    what = "from the tokenizer" if ctx.tokenizer is not None else f"of {lengths} tokens"
    label = f"generate {n} tokens, {len(prompts)} prompts {what}"

    def judge(row, got):
        steps = [compare(f"logits of step {i}", g, w, tol) for i, (g, w) in enumerate(zip(got.logits, whole64,
                                                                                         strict=True))]
        row.arrays = {"logits": np.stack(got.logits)}
        row.detail = {"tokens": got.tokens.tolist(), "transformers_tokens": want.tokens.tolist(),
                      "logits_max_abs_per_step": [c.max_abs for c in steps]}
        if ctx.tokenizer is not None:
            row.detail["prompts"] = list(G.PROMPTS)
            row.detail["text"] = [ctx.tokenizer.decode(t) for t in got.tokens]
        logits = compare("logits", row.arrays["logits"], whole64, tol)
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
        ctx.run(row, lambda run: G.generate(run, layout, prompts, n, watch=want.tokens,
                                            dtype=ctx.reference.numpy_dtype),
                functools.partial(judge, row), locate=functools.partial(locate, rt))


def accuracy_rows(ctx: C.Context) -> None:
    """The accuracy cost on each runtime (`causal.accuracy`) against the budget, and (one row,
    torch) which layers cost most when quantized alone."""
    budget = ctx.check.budget
    base = ctx.expect("accuracy", lambda: A.baseline(ctx.reference, ctx.tokenizer, ctx.prompts,
                                                     ctx.check.new_tokens))

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
        C.layer_cost_row(ctx, "accuracy", A.layer_costs(ctx.reference, ctx.onnx_model, base), "kl_mean", "mean KL",
                         int(base.eval_ids.size), "the source model in fp32")


def client_rows(ctx: C.Context) -> None:
    """Each client generating from the deployment folder, prompt by prompt (batch 1), against
    transformers' `generate` on the same prompt: the same tokens, and where the folder has a
    tokenizer, the client's encoding of each prompt equal to transformers'."""
    n, prompts = ctx.check.new_tokens, ctx.prompts
    want = ctx.expect("clients", lambda: np.concatenate([
        G.reference_generation(ctx.reference.model, ctx.layout, [p], n).tokens for p in prompts]))
    if ctx.expecting:  # the clients run from the folder in the second pass
        return
    given = list(G.PROMPTS) if ctx.tokenizer is not None else [p.tolist() for p in prompts]
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
        C.unavailable_client(row, client)
        cannot = ctx.layout.cache_form.cannot
        if client in cannot and not row.skipped:
            row.error = f"{client} cannot run the {ctx.layout.form} form: {cannot[client]}"
        ctx.executor.run(row, functools.partial(CL.generate, client, C.deployment(ctx), given, n, R.cpu_threads()),
                         functools.partial(judge, row, client))
