"""A vision transformer's clients embedding images with its deployment folder, as their users run
them: Optimum's ORTModelForFeatureExtraction (its image processor's pixel values; the pooled
embedding read from the graph's `pooler_output` through the session it holds: its `forward` keeps
`last_hidden_state` alone) and transformers.js' image-feature-extraction pipeline (Node, `pool: true`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport.errors import ProviderUnavailableError
from attnexport.pretrained import clients as CL

# The transformers.js script this family's Node client runs (beside this module).
SCRIPT = Path(__file__).with_name("embed_image.mjs")


@dataclass
class ClientEmbedding:
    """A client's embeddings of the images (N, D), and how long it took."""

    client: str
    embeddings: np.ndarray
    ms: float


def embed(client: str, folder: Path, images: list[np.ndarray], threads: int | None = None) -> ClientEmbedding:
    """The pooled embeddings `client` computes from the folder for `images` ((H, W, 3) uint8 each),
    with its own image processor."""
    ok, why = CL.status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    started = time.perf_counter()
    if client == "optimum":
        got = _optimum(folder, images, threads)
    else:
        answer = CL.node(SCRIPT, {"folder": CL.local(folder), "threads": threads or 0,
                                             "images": [{"height": int(i.shape[0]), "width": int(i.shape[1]),
                                                         "data": i.reshape(-1).tolist()} for i in images]})
        got = np.asarray(answer["embeddings"], np.float64)
    return ClientEmbedding(client, np.asarray(got, np.float64), (time.perf_counter() - started) * 1e3)


def _optimum(folder: Path, images: list[np.ndarray], threads) -> np.ndarray:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from transformers import AutoImageProcessor

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    model = ORTModelForFeatureExtraction.from_pretrained(CL.local(folder), subfolder="onnx", file_name="model.onnx",
                                                         provider="CPUExecutionProvider", session_options=options)
    values = AutoImageProcessor.from_pretrained(CL.local(folder), use_fast=False)(images=images, return_tensors="np")
    (pooled,) = model.session.run(["pooler_output"], {"pixel_values": values["pixel_values"].astype(np.float32)})
    return pooled
