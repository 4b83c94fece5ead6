"""How a sentence encoder's deployment folder embeds a text longer than its clients' limits, client
by client: the plain ONNX Runtime loop over the folder's tokenizer.json (the `tokenizers` package),
sentence-transformers' ONNX backend, Optimum's ORTModelForFeatureExtraction and transformers.js, each
against sentence-transformers on the source folder in torch (what the model's users get). A text of
about 300 words (the project's check sentences joined), and the check sentences themselves.

    python benchmarks/probes/encoder_long_text.py all-MiniLM-L6-v2 minilm-onnx

Prints each client's tokens kept and its cosine to sentence-transformers' embedding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def plain_loop(folder: Path, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """The loop docs/encoders.md shows: the folder's tokenizer.json as it is, padded to the batch's longest."""
    import onnxruntime as ort
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding()  # to the batch's longest; the truncation is the file's
    encoded = tokenizer.encode_batch(texts)
    session = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feed = {"input_ids": np.array([e.ids for e in encoded], np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], np.int64)}
    (embedding,) = session.run(["sentence_embedding"], {k: v for k, v in feed.items() if k in names})
    return embedding, [int(sum(e.attention_mask)) for e in encoded]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("folder")
    a = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    from attnexport.pretrained import clients
    from attnexport.pretrained.encoders import SentenceEncoder
    from attnexport.pretrained.encoders import clients as encoder_clients
    from attnexport.pretrained.encoders import measures as embeddings
    sentences = embeddings.sentences()
    long_text = " ".join(sentences * 2)
    texts = [long_text, *sentences[:4]]
    print(f"the long text: {len(long_text.split())} words")
    want = SentenceTransformer(a.source, device="cpu").encode(texts, convert_to_numpy=True)
    folder = Path(a.folder)
    got = {"plain ONNX Runtime loop": plain_loop(folder, texts)[0]}
    for client in SentenceEncoder.clients:
        if clients.status(client)[0]:
            got[client] = encoder_clients.embed(client, folder, texts).embeddings
    limits = {f: json.loads((folder / f).read_text()).get(k) for f, k in (
        ("tokenizer_config.json", "model_max_length"), ("sentence_bert_config.json", "max_seq_length"))
        if (folder / f).is_file()}
    limits["tokenizer.json"] = (json.loads((folder / "tokenizer.json").read_text()).get("truncation") or {}).get(
        "max_length")
    print(f"the folder's limits: {limits}; tokens the plain loop kept: {plain_loop(folder, texts)[1]}")
    for who, e in got.items():
        e = np.asarray(e, np.float64)
        cos = (e * want).sum(-1) / np.linalg.norm(e, axis=-1) / np.linalg.norm(want, axis=-1)
        print(f"{who:>24}: cosine to sentence-transformers (torch, source): long text {cos[0]:.6f}, "
              f"sentences {cos[1:].min():.6f}")


if __name__ == "__main__":
    main()
