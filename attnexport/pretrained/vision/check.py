"""A vision transformer's verify rows (`attnexport.pretrained.check.verify_step` runs them): its
embeddings of the project's images (`images`, made pixel values by the model's own processor) on
every runtime against the model's in float64, each image's cosine and top-k retrieval, within the
budget of the file's precision; what each layer of a quantized file costs; and the clients embedding
from the folder."""

from __future__ import annotations

import functools

import numpy as np

from attnexport import runtimes as R
from attnexport.pretrained import check as C
from attnexport.pretrained import precision as P
from attnexport.pretrained.vision import clients as CL
from attnexport.pretrained.vision import images as I

BATCH = 8  # images a run embeds at once
OUTPUT = "pooler_output"


def _feeds(ctx: C.Context, images: list[np.ndarray]) -> list[dict]:
    values = I.pixel_values(I.processor(ctx.check.source), images)
    return [{"pixel_values": values[i:i + BATCH]} for i in range(0, len(values), BATCH)]


def embedding_rows(ctx: C.Context) -> None:
    """The project's images embedded on each runtime against the model in float64."""
    feeds = _feeds(ctx, I.image_set())
    want = np.concatenate([ctx.reference.run64(f)[OUTPUT] for f in feeds])
    budget = ctx.check.budget.for_precision(ctx.precision)
    label = f"embeddings: {len(want)} images, cosine and top-5 retrieval of {I.QUERIES} queries"
    for rt in ctx.used:
        row = ctx.row(label, rt, "the model's embeddings in float64")
        ctx.run(row, lambda run: np.concatenate([np.asarray(run(f)[OUTPUT]) for f in feeds]),
                lambda got, row=row: C.embedding_judge(row, I.measure(got, want, budget), budget, ctx.precision,
                                                       OUTPUT))
    if P.record_of(ctx.onnx_model) is not None:
        C.embedding_layer_costs(ctx, feeds, OUTPUT, want, budget, I.measure)


def client_rows(ctx: C.Context) -> None:
    """Each client embedding the images from the deployment folder with its own image processor,
    against transformers' embeddings (the model in fp32 as the file holds it) within the file's
    precision's budget. The images are at the model's own size (the processors' resizing differs
    between clients: bilinear with and without antialiasing), so each client normalises them alone."""
    images = I.image_set((ctx.layout.extra["height"], ctx.layout.extra["width"]))
    want = np.concatenate([ctx.reference.run(f)[OUTPUT] for f in _feeds(ctx, images)])
    budget = ctx.check.budget.for_precision(ctx.precision)
    for client in ctx.check.clients:
        row = ctx.row(f"client: embed {len(images)} images from the folder", client,
                      "transformers' embeddings of the same images")
        C.unavailable_client(row, client)
        ctx.executor.run(row, functools.partial(CL.embed, client, C.deployment(ctx), images, R.cpu_threads()),
                         functools.partial(_judge, row, want, budget, ctx.precision))


def _judge(row, want: np.ndarray, budget, precision: str, done: CL.ClientEmbedding) -> list:
    """A client's embeddings against transformers' `want` within `budget` (`check.embedding_judge`)."""
    return C.embedding_judge(row, I.measure(done.embeddings, want, budget), budget, precision, OUTPUT)
