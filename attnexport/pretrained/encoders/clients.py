"""A sentence encoder's clients embedding with its deployment folder, as their users run them:
sentence-transformers' `SentenceTransformer(folder, backend="onnx")`, Optimum's
ORTModelForFeatureExtraction (its token states pooled as the folder's sentence-transformers config
says, as its users write it) and transformers.js' feature-extraction pipeline (Node)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport.errors import ProviderUnavailableError
from attnexport.pretrained import clients as CL
from attnexport.pretrained.encoders.measures import pooled, pooling_of

# The transformers.js script this family's Node client runs (beside this module).
SCRIPT = Path(__file__).with_name("embed.mjs")


@dataclass
class ClientEmbedding:
    """A client's embeddings of the texts (N, D), and how long it took."""

    client: str
    embeddings: np.ndarray
    ms: float


def embed(client: str, folder: Path, texts: list[str], threads: int | None = None) -> ClientEmbedding:
    """The sentence embeddings `client` computes from the deployment folder of a sentence encoder,
    with its own tokenizer and its own pooling (the folder's sentence-transformers config says which)."""
    ok, why = CL.status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    pooling, normalize = pooling_of(folder)
    started = time.perf_counter()
    if client == "sentence-transformers":
        from sentence_transformers import SentenceTransformer
        model = SentenceTransformer(CL.local(folder), backend="onnx", device="cpu",
                                    model_kwargs={"provider": "CPUExecutionProvider"})
        started = time.perf_counter()
        got = model.encode(texts, batch_size=len(texts), convert_to_numpy=True)
    elif client == "optimum":
        got = _optimum_embeddings(folder, texts, pooling, normalize, threads)
    else:
        got = _transformers_js_embeddings(folder, texts, pooling, normalize, threads)
    return ClientEmbedding(client, np.asarray(got, np.float64), (time.perf_counter() - started) * 1e3)


def _optimum_embeddings(folder: Path, texts: list[str], pooling: str, normalize: bool, threads) -> np.ndarray:
    """ORTModelForFeatureExtraction's token states, pooled over the mask as sentence-transformers'
    model card tells its users to."""
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from transformers import AutoTokenizer

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    model = ORTModelForFeatureExtraction.from_pretrained(CL.local(folder), subfolder="onnx", file_name="model.onnx",
                                                         provider="CPUExecutionProvider", session_options=options)
    encoded = AutoTokenizer.from_pretrained(CL.local(folder))(texts, padding=True, truncation=True, return_tensors="pt")
    states = model(**encoded).last_hidden_state.detach().numpy()
    return pooled(states, encoded["attention_mask"].numpy(), pooling, normalize)


def _transformers_js_embeddings(folder: Path, texts: list[str], pooling: str, normalize: bool, threads) -> np.ndarray:
    if pooling not in ("mean", "cls"):
        raise RuntimeError(f"transformers.js' feature-extraction pipeline has no {pooling} pooling")
    answer = CL.node(SCRIPT, {"folder": CL.local(folder), "texts": list(texts), "pooling": pooling,
                                 "normalize": normalize, "threads": threads or 0})
    return np.asarray(answer["embeddings"], np.float64)
