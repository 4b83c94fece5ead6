"""A sentence encoder's verify rows (`attnexport.pretrained.check.verify_step` runs them): its
embeddings of real sentences as their users judge them (`encoders.measures`: each sentence's cosine
to the float64 embedding, top-k retrieval over the corpus) within the budget of the file's
precision, what each layer of a quantized file costs, and the clients embedding from the folder."""

from __future__ import annotations

import functools

import numpy as np

from attnexport import runtimes as R
from attnexport.compare import Comparison
from attnexport.pretrained import check as C
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
        C.embedding_layer_costs(ctx, feeds, "sentence_embedding", want, budget, E.measure)


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
    """`got`'s embeddings (`take(got)`) against `want` within `budget` (`check.embedding_judge`)."""
    return C.embedding_judge(row, E.measure(take(got), want, budget), budget, precision, "sentence_embedding")
