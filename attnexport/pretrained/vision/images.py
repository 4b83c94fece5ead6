"""What a vision transformer's export is judged on: a set of images the project draws (shapes on
gradients, a few of them seen again shifted, brightened or noisy: the queries), made pixel values
by the model's own image processor as its users' pipelines make them, and embedded and retrieved as
an image embedder's users judge it (`attnexport.pretrained.retrieval`: each image's cosine to the
float64 embedding, the queries' top-k over the rest)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnexport.errors import UsageError
from attnexport.pretrained import retrieval as RT

CORPUS = 20  # images the queries retrieve from
QUERIES = 6  # of them seen again, changed
SIZES = ((40, 48), (64, 64), (36, 30), (50, 80))  # (height, width): the processor resizes each


def drawn(index: int, height: int, width: int) -> np.ndarray:
    """Image `index` of the set: (height, width, 3) uint8, a two-colour gradient with a disc and a
    bar whose colours and places the index seeds."""
    rng = np.random.default_rng(1000 + index)
    y, x = np.mgrid[0:height, 0:width] / np.array([height, width]).reshape(2, 1, 1)
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    image = a * (1 - x[..., None]) + b * x[..., None]
    cy, cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.3)
    image[(y - cy) ** 2 + (x - cx) ** 2 < r ** 2] = rng.uniform(0, 255, 3)
    top = rng.uniform(0, 0.8)
    image[(y > top) & (y < top + 0.1)] = rng.uniform(0, 255, 3)
    return np.clip(image, 0, 255).astype(np.uint8)


def image_set(size: tuple[int, int] | None = None) -> list[np.ndarray]:
    """The queries (changed copies of the first QUERIES images), then the corpus: at SIZES in turn,
    or all at `size` ((height, width): the model's own, which its processor leaves as it is)."""
    shape = [size] * (QUERIES + CORPUS) if size else [SIZES[i % len(SIZES)] for i in range(QUERIES + CORPUS)]
    corpus = [drawn(i, *shape[QUERIES + i]) for i in range(CORPUS)]
    rng = np.random.default_rng(7)
    queries = []
    for i in range(QUERIES):
        base = drawn(i, *shape[i]).astype(np.float64)
        change = (np.roll(base, 3, axis=1), base * 1.15 + 10, base + rng.normal(0, 12, base.shape))[i % 3]
        queries.append(np.clip(change, 0, 255).astype(np.uint8))
    return queries + corpus


def input_size(source, config) -> tuple[int, int]:
    """(height, width) of the pixel values the model's image processor makes (its preprocessor_config.json
    at `source`: the crop where it crops, else the resize), or the config's image size where there is no
    processor (or its resize keeps the aspect: then no one size is the model's)."""
    path = Path(str(source)) / "preprocessor_config.json" if source is not None else None
    own = int(config.image_size) if isinstance(config.image_size, int) else int(config.image_size[0])
    if path is None or not path.is_file():
        return own, own
    try:
        said = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"--hf {source}: preprocessor_config.json is not JSON ({e})") from None
    size = said.get("crop_size") if said.get("do_center_crop") else said.get("size")
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    return own, own


def processor(source):
    """The model's image processor (its preprocessor_config.json), as its users load it."""
    from transformers import AutoImageProcessor
    folder = Path(str(source))
    if not (folder / "preprocessor_config.json").is_file():
        raise UsageError(f"--hf {source}: a vision transformer needs its image processor beside it "
                         "(preprocessor_config.json): its embeddings are judged on real images")
    return AutoImageProcessor.from_pretrained(str(folder), use_fast=False)


def pixel_values(process, images: list[np.ndarray]) -> np.ndarray:
    """The images as the model takes them (float32 (N, C, height, width)), made by `process`."""
    return np.asarray(process(images=images, return_tensors="np")["pixel_values"], np.float32)


def check_feed(layout, batch: int, seed: int) -> dict:
    """A checked step's feed: `batch` of the set's images at the model's own size, normalised as
    ViT's processor does (by 0.5: the feed of a step's check needs no folder), float32 in every dtype."""
    images = [drawn(seed * 31 + i, layout.extra["height"], layout.extra["width"]) for i in range(batch)]
    values = (np.stack(images).transpose(0, 3, 1, 2).astype(np.float32) / 255.0 - 0.5) / 0.5
    return {"pixel_values": values}


def measure(got: np.ndarray, want: np.ndarray, budget: RT.EmbeddingBudget) -> RT.EmbeddingCost:
    """The cost of the embeddings `got` of `image_set()` against the float64 model's `want`."""
    return RT.measure(got, want, budget, QUERIES, item="image")
