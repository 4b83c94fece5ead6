"""A sentence encoder's verify rows (`attnexport.pretrained.check.verify_step` runs them): its
embeddings of real sentences as their users judge them (`encoders.measures`: each sentence's cosine
to the float64 embedding, top-k retrieval over the corpus) within the budget of the file's
precision, what each layer of a quantized file costs, and the clients embedding from the folder."""

from __future__ import annotations

import functools
import math

import numpy as np

from attnexport import runtimes as R
from attnexport.compare import Comparison
from attnexport.pretrained import check as C
from attnexport.pretrained import emulate
from attnexport.pretrained import precision as P
from attnexport.pretrained import retrieval as RT
from attnexport.pretrained.encoders import clients as CL
from attnexport.pretrained.encoders import measures as E
from attnexport.report import Row

EMBED_BATCH = 8  # sentences a run of the embeddings check embeds at once


def needs(layout, inputs, new_tokens: int, tokenizer) -> list[tuple[int, str]]:
    """The positions each of verify's checks runs through the step: its shapes, its sentences."""
    return [(max(past + block for _, _, block, past, _ in layout.cache_form.verify_checks), "verify --hf checks steps"),
            (max(len(ids) for ids in tokenizer(E.sentences())["input_ids"]), "verify --hf embeds sentences")]


def _encoded(ctx: C.Context, texts: list[str]) -> dict:
    """The model's inputs for `texts` (`measures.encoded`)."""
    return E.encoded(ctx.tokenizer, texts, ctx.layout.max_seq, ctx.layout.inputs)


def embedding_rows(ctx: C.Context) -> None:
    """A sentence encoder as its users judge it: the embeddings of real sentences on each runtime
    against the model's in float64, each sentence's cosine and top-k retrieval over the corpus,
    within the precision's budget."""
    texts = E.sentences()
    batches = [texts[i:i + EMBED_BATCH] for i in range(0, len(texts), EMBED_BATCH)]
    feeds = [_encoded(ctx, batch) for batch in batches]
    want = np.concatenate([ctx.reference.run64(f)["sentence_embedding"] for f in feeds])
    precision = ctx.precision
    budget = ctx.check.budget.for_precision(precision)
    label = f"embeddings: {len(texts)} sentences, cosine and top-{RT.TOP_K} retrieval of {len(E.QUERIES)} queries"

    for rt in ctx.used:
        row = ctx.row(label, rt, "the model's embeddings in float64")
        ctx.run(row, lambda run: np.concatenate([np.asarray(run(f)["sentence_embedding"]) for f in feeds]),
                functools.partial(_judge_embeddings, row, want, budget, precision, lambda got: got))
    if P.record_of(ctx.onnx_model) is not None:
        C.layer_cost_row(ctx, "embeddings", layer_costs(ctx.reference, ctx.onnx_model, feeds, want, budget),
                         "cost", "1 - lowest cosine", len(want), "the model's embeddings in float64")


def layer_costs(reference, onnx_model, feeds: list[dict], want: np.ndarray, budget) -> list[dict]:
    """Each group of quantized matrices made as the file holds it, alone, in the fp32 model
    (`emulate.each_group_alone`), and what that alone costs the embeddings of `feeds`
    (`measures.sentences()`) against the float64 model's `want`: 1 - the lowest cosine, and top-k
    agreement; most costly first."""
    out = []
    for group in emulate.each_group_alone(reference.model, onnx_model):
        got = np.concatenate([np.asarray(reference.run(f)["sentence_embedding"]) for f in feeds])
        cost = E.measure(got, want, budget)
        out.append({"group": group, "cost": float(1 - cost.cosines.min()), "cosine_min": float(cost.cosines.min()),
                    f"top{RT.TOP_K}_agreement": cost.agreement})
    out.sort(key=lambda d: -d["cost"])
    return out


def client_rows(ctx: C.Context) -> None:
    """Each client embedding the check's sentences from the deployment folder with its own
    tokenizer and pooling, against transformers' embeddings (the model in fp32 as the file holds
    it) within the file's precision's embedding budget."""
    texts = E.sentences()
    want = np.concatenate([ctx.reference.run(_encoded(ctx, texts[i:i + EMBED_BATCH]))["sentence_embedding"]
                           for i in range(0, len(texts), EMBED_BATCH)])
    precision = ctx.precision
    budget = ctx.check.budget.for_precision(precision)
    for client in ctx.check.clients:
        row = ctx.row(f"client: embed {len(texts)} sentences from the folder", client,
                      "transformers' embeddings of the same sentences")
        C.unavailable_client(row, client)
        ctx.executor.run(row, functools.partial(CL.embed, client, C.deployment(ctx), texts, R.cpu_threads()),
                         functools.partial(_judge_embeddings, row, want, budget, precision,
                                           lambda done: done.embeddings))


def _judge_embeddings(row: Row, want: np.ndarray, budget, precision: str, take, got) -> list[Comparison]:
    """`got`'s embeddings (`take(got)`) against `want` within `budget`: the row's detail, its error
    where over the budget, and its one comparison (1 - the lowest cosine)."""
    cost = E.measure(take(got), want, budget).judge(budget)
    row.detail = {"embeddings": cost.to_dict(), "budget": {**vars(budget), "text": budget.text()},
                  "summary": cost.text(), "measure": "embeddings"}
    if cost.failures:
        row.error = f"over the embedding budget: {'; '.join(cost.failures)} ({cost.text()})"
    distance = float(1 - cost.cosines.min()) if np.isfinite(cost.cosines).all() else math.inf
    return [Comparison("sentence_embedding: 1 - cosine", not cost.failures, distance, math.nan, 0, 0, 0.0,
                       1 - budget.cosine, distance, math.inf, compared=int(cost.cosines.size),
                       basis=f"the {precision} embedding budget: {budget.text()}")]
