"""`bench --hf ENCODER`: a sentence encoder's sentences a second at a few batch x sequence shapes,
per flavour and precision, beside transformers eager in the same run and beside the anchor its users
would otherwise take: Optimum's export of the same weights, that export passed through ONNX
Runtime's transformer optimizer at its highest level, and that one quantized by ONNX Runtime's
dynamic int8 (`quantize_dynamic`, as sentence-transformers' and fastembed's int8 models are).

Every engine reads the same weights on the same threads. A shape's feed is `batch` sequences of
`seq` tokens each (no padding). Each engine's time is the median of `iters` runs after `warmup`
untimed ones (with the 10th and 90th percentiles), the engines timed one after another at a
shape. Beside each time is its accuracy as an embedder's users judge it
(`attnexport.pretrained.embeddings`): the cosine of each of the check's sentences' embeddings to
the model's in float64, and top-5 retrieval, against the engine's precision's budget.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport import runtimes as R
from attnexport.errors import UsageError
from attnexport.pretrained import bench as B
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained import registry
from attnexport.pretrained.encoders import measures as E

SHAPES = ((1, 16), (32, 128), (8, 512))
EMBED_BATCH = 8  # the accuracy's sentences, embedded this many at a time


@dataclass(frozen=True)
class EmbedBenchRequest:
    """What `bench --hf ENCODER` measures: the model, its (batch, seq) shapes, attnexport's flavours
    and precisions, the anchors (Optimum's export, optimized, and its dynamic int8), and how long."""

    source: str | Path
    shapes: tuple = SHAPES
    flavors: tuple = ("ort", "attention")
    precisions: tuple = ("fp32", "int8")
    threads: int = 0  # 0: every core
    iters: int = 20
    warmup: int = 3
    seed: int | None = None  # a config-only folder's weights (None: such a folder is refused)
    anchors: bool = True


# A bench row (`bench.Row`: sentences a second) and an engine (`bench.Engine`: a feed -> the sentence embeddings).
EmbedBenchRow = B.Row
UNIT = "sentences"


def bench_embeddings(request: EmbedBenchRequest, said=lambda text: None) -> tuple[list[B.Row], dict]:
    """Every engine at every shape; returns (rows, what the run measured besides)."""
    import torch

    r = request if request.threads else dataclasses.replace(request, threads=os.cpu_count() or 1)
    if any(b < 1 or s < 1 for b, s in r.shapes):
        raise UsageError("--batch and --seq values are >= 1")
    model, _ = hf.load(r.source, r.seed)
    layout = hf.layout_of(model, None, 0, r.source)
    tokenizer = hf.tokenizer_of(r.source)
    hf.check_tokenizer(layout, tokenizer, r.source)
    longest = max(s for _, s in r.shapes)
    layout.cache_form.check_room(layout, longest, "bench --hf times sequences of --seq tokens")
    torch.set_num_threads(r.threads)
    reference = HR.Reference(model, layout)
    texts = E.sentences()
    # every engine's inputs (Optimum's export takes token_type_ids where the model has none); each takes its own
    names = ("input_ids", "attention_mask", "token_type_ids")
    feeds = [E.encoded(tokenizer, texts[i:i + EMBED_BATCH], layout.max_seq, names)
             for i in range(0, len(texts), EMBED_BATCH)]
    want = np.concatenate([reference.run64(f)["sentence_embedding"] for f in feeds])
    info: dict = {"skipped": {}, "threads": r.threads, "layers": layout.layers,
                  "parameters": int(sum(p.numel() for p in model.parameters())), "pooling": layout.pooling,
                  "normalize": layout.normalize}
    rows: list[B.Row] = []
    with tempfile.TemporaryDirectory(prefix="attnexport-embed-bench-") as tmp:
        weights = Path(tmp) / "weights"
        _save_weights(model, tokenizer, r.source, weights, layout.family)
        step = reference.step

        def eager(feed):
            with torch.no_grad():
                return step(*[torch.from_numpy(v) for v in feed.values()])[1].numpy()
        engine_of = functools.partial(_onnx_engine, threads=r.threads, pooling=layout.pooling,
                                      normalize=layout.normalize)
        engines = [B.Engine("transformers", "-", "fp32", eager, tuple(layout.inputs))]
        engines += B.attnexport_engines(weights, Path(tmp), r.flavors, r.precisions, rows, r.threads, UNIT,
                                        engine_of, said)
        if r.anchors:
            engines += B.optimum_anchors(weights, Path(tmp), layout.family.optimum_task, "bert", info, said, engine_of)
        accuracy = {(e.engine, e.flavor, e.precision): B.accuracy_of(e, feeds, want, E.measure) for e in engines}

        def feed_of(batch, seq):
            ids = np.random.default_rng(r.seed or 0).integers(max(layout.pad_token + 1, 3), layout.vocab, (batch, seq),
                                                             dtype=np.int64)
            return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        rows += B.time_engines(engines, r.shapes, feed_of, accuracy, r.warmup, r.iters, r.threads, UNIT, said)
    B.ratios(rows)
    return rows, info


def shapes(batches: list[int], seqs: list[int]) -> tuple:
    """The (batch, seq) shapes of --batch and --seq lists, paired as bench pairs them (a single value
    repeats); SHAPES when neither is given."""
    if not batches and not seqs:
        return SHAPES
    batches, seqs = batches or [1], seqs or [128]
    n = max(len(batches), len(seqs))
    if len(batches) not in (1, n) or len(seqs) not in (1, n):
        raise UsageError("--batch and --seq lists pair up: give them of equal length (or one value)")
    return tuple(zip(batches * n if len(batches) == 1 else batches, seqs * n if len(seqs) == 1 else seqs,
                     strict=True))


def _save_weights(model, tokenizer, source, folder: Path, family: registry.Family) -> None:
    """The model's weights, its tokenizer and its sentence-transformers files in one folder: what
    every engine reads."""
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    for f in family.deploy_files(source):
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(source) / f, folder / f)


def _onnx_engine(engine: str, flavor: str, precision: str, path: Path, threads: int, pooling: str = "mean",
                 normalize: bool = True) -> B.Engine:
    """An ONNX file on ONNX Runtime's CPU provider: its sentence_embedding output, or (an export
    without one, Optimum's) its token states pooled and normalised as the model's sentence-transformers
    files say (`pooling`, `normalize`), as its users pool them."""
    session = R.ort_session("ort-cpu", path, threads=threads)[0]
    inputs = tuple(i.name for i in session.get_inputs())
    outputs = [o.name for o in session.get_outputs()]

    def run(feed):
        if "sentence_embedding" in outputs:
            return session.run(["sentence_embedding"], feed)[0]
        states = session.run([outputs[0]], feed)[0]
        return E.pooled(states, feed["attention_mask"], pooling, normalize)
    return B.Engine(engine, flavor, precision, run, inputs)


def from_options(source, v, said) -> tuple[list[B.Row], dict]:
    """`bench --hf` of a sentence encoder from the command line's values `v` (`--batch` and `--seq`
    beside every family's)."""
    B.refuse_others(v, v.options, ("--batch", "--seq"), "a sentence encoder (beside transformers and Optimum)")
    request = B.request_of(EmbedBenchRequest, v, source=source, shapes=shapes(v.batches or [], v.seqs or []),
                           flavors=tuple(v.flavors) or EmbedBenchRequest.flavors, threads=v.threads or 0,
                           precisions=B.precisions(v.precisions_text, "--precision", P.PRECISIONS)
                           if v.precisions_text else EmbedBenchRequest.precisions)
    return bench_embeddings(request, said=said)


def lines(rows: list[B.Row], info: dict, path: str) -> list[str]:
    """What bench prints: each engine, precision and flavour at each shape, its time beside its
    embeddings' accuracy."""
    return B.lines(f"{path}: {info['layers']} layers, {info['parameters']:,} parameters, {info['pooling']} pooling"
                   f"{', normalised' if info['normalize'] else ''}, {info['threads']} thread(s)", rows, info)
