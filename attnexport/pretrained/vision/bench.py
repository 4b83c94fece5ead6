"""`bench --hf VISION`: a vision transformer's images a second at a few batch sizes (at the size its
image processor makes), per flavour and precision, beside transformers eager in the same run and
beside the anchor its users would otherwise take: Optimum's export of the same weights, it through
ONNX Runtime's transformer optimizer (as a ViT) and that one in dynamic int8 (`attnexport.pretrained.bench`'s
skeleton: every engine on the same threads, medians with their spread).

Beside each time is its accuracy: the class token's state (`last_hidden_state[:, 0]`, what every
engine computes: Optimum's export has no pooled output) of the project's images (`images`, made
pixel values by the model's own processor) against the model's in float64, each image's cosine and
top-5 retrieval, in the engine's precision's budget.
"""

from __future__ import annotations

import dataclasses
import functools
import os
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
from attnexport.pretrained.vision import images as I

BATCHES = (1, 8, 32)
UNIT = "images"


@dataclass(frozen=True)
class ImageBenchRequest:
    """What `bench --hf VISION` measures: the model, its batch sizes, attnexport's flavours and
    precisions, the anchors (Optimum's export, optimized, and its dynamic int8), and how long."""

    source: str | Path
    batches: tuple = BATCHES
    flavors: tuple = ("attention",)
    precisions: tuple = ("fp32", "int8")
    threads: int = 0  # 0: every core
    iters: int = 20
    warmup: int = 3
    seed: int | None = None  # a config-only folder's weights (None: such a folder is refused)
    anchors: bool = True


def _onnx_engine(engine: str, flavor: str, precision: str, path: Path, threads: int) -> B.Engine:
    """An ONNX file on ONNX Runtime's CPU provider: its class token's state, in float32."""
    session = R.ort_session("ort-cpu", path, threads=threads)[0]
    (states,) = [o.name for o in session.get_outputs() if o.name == "last_hidden_state"]
    real = np.float16 if "float16" in session.get_inputs()[0].type else np.float32

    def run(feed):
        values = np.asarray(feed["pixel_values"], real)
        return np.asarray(session.run([states], {"pixel_values": values})[0][:, 0], np.float32)
    return B.Engine(engine, flavor, precision, run, ("pixel_values",))


def bench_images(request: ImageBenchRequest, said=lambda text: None) -> tuple[list[B.Row], dict]:
    """Every engine at every batch size; returns (rows, what the run measured besides)."""
    import torch

    r = request if request.threads else dataclasses.replace(request, threads=os.cpu_count() or 1)
    if any(b < 1 for b in r.batches):
        raise UsageError("--batch values are >= 1")
    model, _ = hf.load(r.source, r.seed)
    layout = hf.layout_of(model, None, 0, r.source)
    torch.set_num_threads(r.threads)
    reference = HR.Reference(model, layout)
    process = I.processor(r.source)
    values = I.pixel_values(process, I.image_set())
    feeds = [{"pixel_values": values[i:i + 8]} for i in range(0, len(values), 8)]
    want = np.concatenate([reference.run64(f)["last_hidden_state"][:, 0] for f in feeds])
    x = layout.extra
    info: dict = {"skipped": {}, "threads": r.threads, "layers": layout.layers, "height": x["height"],
                  "width": x["width"], "parameters": int(sum(p.numel() for p in model.parameters()))}
    rows: list[B.Row] = []
    with tempfile.TemporaryDirectory(prefix="attnexport-image-bench-") as tmp:
        weights = Path(tmp) / "weights"
        model.save_pretrained(str(weights))
        process.save_pretrained(str(weights))
        step = reference.step

        def eager(feed):
            with torch.no_grad():
                return step(torch.from_numpy(feed["pixel_values"]))[0][:, 0].numpy()
        engine_of = functools.partial(_onnx_engine, threads=r.threads)
        engines = [B.Engine("transformers", "-", "fp32", eager, ("pixel_values",))]
        engines += B.attnexport_engines(weights, Path(tmp), r.flavors, r.precisions, rows, r.threads, UNIT,
                                        engine_of, said)
        if r.anchors:
            engines += B.optimum_anchors(weights, Path(tmp), layout.family.optimum_task, "vit", info, said, engine_of)
        accuracy = {(e.engine, e.flavor, e.precision): B.accuracy_of(e, feeds, want, I.measure) for e in engines}

        def feed_of(batch, _):
            shape = (batch, x["channels"], x["height"], x["width"])
            return {"pixel_values": np.random.default_rng(r.seed or 0).standard_normal(shape).astype(np.float32)}
        rows += B.time_engines(engines, [(b, 0) for b in r.batches], feed_of, accuracy, r.warmup, r.iters, r.threads,
                               UNIT, said)
    B.ratios(rows)
    return rows, info


def from_options(source, v, said) -> tuple[list[B.Row], dict]:
    """`bench --hf` of a vision transformer from the command line's values `v` (`--batch` beside
    every family's)."""
    B.refuse_others(v, v.options, ("--batch",), "a vision transformer (beside transformers and Optimum)")
    request = B.request_of(ImageBenchRequest, v, source=source, batches=tuple(v.batches or BATCHES),
                           flavors=tuple(v.flavors) or ImageBenchRequest.flavors, threads=v.threads or 0,
                           precisions=B.precisions(v.precisions_text, "--precision", P.PRECISIONS)
                           if v.precisions_text else ImageBenchRequest.precisions)
    return bench_images(request, said=said)


def lines(rows: list[B.Row], info: dict, path: str) -> list[str]:
    """What bench prints: each engine, precision and flavour at each batch size, its time beside its
    accuracy."""
    return B.lines(f"{path}: {info['layers']} layers, {info['parameters']:,} parameters, {info['height']} x "
                   f"{info['width']} images, {info['threads']} thread(s)", rows, info)
