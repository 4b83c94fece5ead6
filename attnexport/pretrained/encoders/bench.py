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

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnexport import runtimes as R
from attnexport.bench import stats_of
from attnexport.errors import UsageError, reason
from attnexport.pretrained import bench as B
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained import registry
from attnexport.pretrained import retrieval as RT
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


@dataclass
class EmbedBenchRow:
    engine: str  # transformers, attnexport, optimum, optimum+optimizer, optimum+optimizer+int8
    flavor: str
    precision: str
    batch: int
    seq: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    sentences_per_s: float
    threads: int
    ratio_to_transformers: float | None = None  # transformers' median over this one (> 1: faster)
    ratio_to_anchor: float | None = None  # the anchor of its precision's median over this one
    accuracy: dict | None = None  # embeddings.EmbeddingCost.to_dict(), with the budget and whether within it
    note: str = ""


@dataclass
class _Engine:
    engine: str
    flavor: str
    precision: str
    run: Callable[[dict], np.ndarray]  # a feed -> the sentence embeddings (B, D)
    inputs: tuple[str, ...]


def bench_embeddings(request: EmbedBenchRequest, said=lambda text: None) -> tuple[list[EmbedBenchRow], dict]:
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
    rows: list[EmbedBenchRow] = []
    with tempfile.TemporaryDirectory(prefix="attnexport-embed-bench-") as tmp:
        weights = Path(tmp) / "weights"
        _save_weights(model, tokenizer, r.source, weights, layout.family)
        step = reference.step

        def eager(feed):
            with torch.no_grad():
                return step(*[torch.from_numpy(v) for v in feed.values()])[1].numpy()
        engines = [_Engine("transformers", "-", "fp32", eager, tuple(layout.inputs))]
        for precision in r.precisions:
            for flavor in r.flavors:
                said(f"exporting attnexport {flavor} {precision}")
                path = Path(tmp) / f"{flavor}-{precision}.onnx"
                try:
                    hf_export.export_hf(hf_export.HFExport(weights, flavor=flavor, precision=precision, output=path))
                except Exception as x:  # noqa: BLE001 - a flavour that cannot express the model: a row saying why
                    rows.append(EmbedBenchRow("attnexport", flavor, precision, 0, 0, float("nan"), float("nan"),
                                              float("nan"), 0.0, r.threads, note=f"export failed: {reason(x)}"))
                    continue
                engines.append(_onnx_engine("attnexport", flavor, precision, path, r.threads))
        if r.anchors:
            engines += _anchor_engines(weights, Path(tmp), r, info, said, layout.pooling, layout.normalize)
        accuracy = {(e.engine, e.flavor, e.precision): _accuracy(e, feeds, want) for e in engines}
        for batch, seq in r.shapes:
            said(f"batch {batch} x {seq} tokens")
            rng = np.random.default_rng(r.seed or 0)
            ids = rng.integers(max(layout.pad_token + 1, 3), layout.vocab, (batch, seq), dtype=np.int64)
            full = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
            for engine in engines:
                feed = {n: full[n] for n in engine.inputs}
                median, p10, p90 = stats_of(R.time_calls(functools.partial(engine.run, feed), r.warmup, r.iters))
                rows.append(EmbedBenchRow(engine.engine, engine.flavor, engine.precision, batch, seq, median, p10, p90,
                                          batch * 1e3 / median, r.threads,
                                          accuracy=accuracy[(engine.engine, engine.flavor, engine.precision)]))
    _ratios(rows)
    return rows, info


def _accuracy(engine: _Engine, feeds: list[dict], want: np.ndarray) -> dict:
    """The engine's embeddings of the check's sentences against the float64 model's, in its
    precision's budget (or what kept it from embedding them)."""
    try:
        got = np.concatenate([engine.run({n: f[n] for n in engine.inputs}) for f in feeds])
    except Exception as x:  # noqa: BLE001 - an engine failing to embed: said beside its times
        return {"error": reason(x)}
    budget = RT.budget_for(engine.precision)
    cost = E.measure(got, want, budget).judge(budget)
    return {**cost.to_dict(), "budget": budget.text(), "within": not cost.failures}


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


def _ratios(rows: list[EmbedBenchRow]) -> None:
    """Each row's time against transformers' and against the anchor of its precision at its shape
    (fp32: Optimum's export through the optimizer; int8: that one's dynamic int8)."""
    anchors = {"fp32": "optimum+optimizer", "int8": "optimum+optimizer+int8"}
    by = {(r.engine, r.precision, r.batch, r.seq): r.median_ms for r in rows}
    for row in rows:
        base = by.get(("transformers", "fp32", row.batch, row.seq))
        row.ratio_to_transformers = base / row.median_ms if base and row.median_ms == row.median_ms else None
        anchor = by.get((anchors.get(row.precision, ""), row.precision, row.batch, row.seq))
        row.ratio_to_anchor = anchor / row.median_ms if anchor and row.median_ms == row.median_ms else None


def _save_weights(model, tokenizer, source, folder: Path, family: registry.Family) -> None:
    """The model's weights, its tokenizer and its sentence-transformers files in one folder: what
    every engine reads."""
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    for f in family.deploy_files(source):
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(source) / f, folder / f)


def _onnx_engine(engine: str, flavor: str, precision: str, path: Path, threads: int, pooling: str = "mean",
                 normalize: bool = True) -> _Engine:
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
    return _Engine(engine, flavor, precision, run, inputs)


def _anchor_engines(weights: Path, tmp: Path, r: EmbedBenchRequest, info: dict, said, pooling: str,
                    normalize: bool) -> list[_Engine]:
    """Optimum's feature-extraction export of the same weights; it through ONNX Runtime's transformer
    optimizer (opt_level 99, its highest); and that one in ONNX Runtime's dynamic int8: each one's
    token states pooled as the model's own files say."""
    try:
        from optimum.exporters.onnx import main_export
    except Exception as e:  # noqa: BLE001 - not installed (or broken): said in the run's info
        info["skipped"]["optimum"] = f"optimum-onnx is not installed ({type(e).__name__}): pip install optimum-onnx"
        return []
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer
    said("exporting with optimum, optimizing and quantizing it")
    out = tmp / "optimum"
    try:
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            main_export(str(weights), output=str(out), task="feature-extraction")
            optimized = optimizer.optimize_model(str(out / "model.onnx"), model_type="bert", opt_level=99,
                                                 use_gpu=False)
            optimized.save_model_to_file(str(out / "model-optimized.onnx"))
            # The optimizer's fused ops have no type the quantizer's shape inference knows: float, as they are.
            quantize_dynamic(str(out / "model-optimized.onnx"), str(out / "model-int8.onnx"),
                             weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    except Exception as e:  # noqa: BLE001 - Optimum's or the optimizer's own failure, said in one line
        info["skipped"]["optimum"] = f"Optimum's export, the optimizer or the quantizer failed: {reason(e)[:200]}"
        return []
    files = (("optimum", "fp32", "model.onnx"), ("optimum+optimizer", "fp32", "model-optimized.onnx"),
             ("optimum+optimizer+int8", "int8", "model-int8.onnx"))
    return [_onnx_engine(engine, "-", precision, out / file, r.threads, pooling, normalize)
            for engine, precision, file in files]


def accuracy_text(a: dict | None) -> str:
    """An engine's accuracy in a few words."""
    if not a:
        return ""
    if "error" in a:
        return f"no embeddings: {a['error']}"
    verdict = "within" if a["within"] else "OVER"
    return (f"1 - cosine max {1 - a['cosine_min']:.2g}, top-{RT.TOP_K} {a[f'top{RT.TOP_K}_agreement']:.2f} "
            f"({verdict} {a['budget']})")


def to_json(rows: list[EmbedBenchRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def from_options(source, v, said) -> tuple[list[EmbedBenchRow], dict]:
    """`bench --hf` of a sentence encoder from the command line's values `v` (`--batch` and `--seq`
    beside every family's)."""
    B.refuse_others(v, v.options, ("--batch", "--seq"), "a sentence encoder (beside transformers and Optimum)")
    request = B.request_of(EmbedBenchRequest, v, source=source, shapes=shapes(v.batches or [], v.seqs or []),
                           flavors=tuple(v.flavors) or EmbedBenchRequest.flavors, threads=v.threads or 0,
                           precisions=B.precisions(v.precisions_text, "--precision", P.PRECISIONS)
                           if v.precisions_text else EmbedBenchRequest.precisions)
    return bench_embeddings(request, said=said)


def lines(rows: list[EmbedBenchRow], info: dict, path: str) -> list[str]:
    """What bench prints: each engine, precision and flavour at each shape, its time beside its
    embeddings' accuracy."""
    out = [f"{path}: {info['layers']} layers, {info['parameters']:,} parameters, {info['pooling']} pooling"
           f"{', normalised' if info['normalize'] else ''}, {info['threads']} thread(s)"]
    for row in rows:
        if row.median_ms != row.median_ms:  # NaN: the export failed
            out.append(f"{row.engine} {row.precision} {row.flavor}: {row.note}")
            continue
        ratios = "".join(f", {v:.2f}x {k}" for k, v in (("transformers", row.ratio_to_transformers),
                                                         ("the anchor", row.ratio_to_anchor)) if v)
        accuracy = accuracy_text(row.accuracy)
        out.append(f"{row.batch:>3d} x {row.seq:<4d} {row.engine} {row.precision} {row.flavor}: {row.median_ms:.2f} ms "
                   f"(p10 {row.p10_ms:.2f}, p90 {row.p90_ms:.2f}), {row.sentences_per_s:,.1f} sentences/s{ratios}"
                   + (f"; {accuracy}" if accuracy else ""))
    return out + B.skipped_lines(info)
