"""What a sentence encoder's export is judged on: real sentences (the project's own documentation)
embedded and retrieved as its users judge an embedder (`attnexport.pretrained.retrieval`: each
sentence's cosine to the float64 embedding, top-k retrieval of the queries over the corpus), and
what a sentence encoder's folder says of its pooling and its longest input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnexport.errors import UsageError
from attnexport.pretrained import retrieval as RT

# Sentences from attnexport's documentation: the corpus retrieval ranks.
CORPUS = (
    "attnexport makes attention layers safe to ship as ONNX.",
    "Attention variants are defined as PyTorch modules and exported to ONNX graphs.",
    "Every export is checked against golden outputs computed by an independent float64 reference.",
    "verify runs the golden cases through every flavour and runtime and compares the outputs in float64.",
    "A run passes only when every output the variant declares was compared.",
    "NaN never passes a comparison.",
    "The attention flavour uses the standard ONNX Attention operator of opset 23.",
    "The primitives flavour spells attention out as MatMul, Softmax and MatMul for older runtimes.",
    "The ort flavour uses ONNX Runtime's fused contrib operators.",
    "A key/value cache lets a decoder reuse the keys and values of earlier tokens.",
    "A static cache keeps buffers of a fixed size and writes each step's keys in place.",
    "The concat form returns each present as its past with the new block appended.",
    "Grouped-query attention shares each key and value head among several query heads.",
    "Rotary position embeddings rotate queries and keys by an angle that grows with the position.",
    "The numerics policy gives each output a tolerance derived from torch's own error against float64.",
    "Padded positions are never compared: their values mean nothing.",
    "bench times every runtime and flavour beside PyTorch eager in the same run.",
    "A timing is a median over many runs after a warm-up, reported with its spread.",
    "Silent fallback to the CPU is reported: a compute node left on the CPU fails a strict check.",
    "int4 weights are stored in blocks of 32 values, each block with its own scale.",
    "Dynamic int8 quantization rounds the activations to eight bits at run time.",
    "Half precision halves the memory a model's weights take.",
    "The deployment folder holds the config, the tokenizer and the ONNX model that clients load.",
    "transformers.js runs the exported model in Node and in the browser.",
    "WebGPU runs the model on the graphics card from a web page.",
    "The command line prints one clear line and exits with code 2 on bad input.",
    "Nothing is half-written on disk: files are written to a temporary name, then renamed.",
    "Ctrl-C stops a run and exits with code 130.",
    "A sentence encoder turns text into an embedding for search and retrieval.",
    "Mean pooling averages the token states over the attention mask.",
    "Embeddings are normalised to unit length so that a dot product is their cosine.",
    "A localization names the first node of the graph whose output diverges.",
)
# Queries, each close to a few of the corpus's sentences.
QUERIES = (
    "How is an exported model checked for numerical errors?",
    "Which ONNX operator does the attention flavour use?",
    "How does the decoder keep earlier keys and values?",
    "How are weights quantized to four bits?",
    "What does a user load in a deployment?",
    "What happens on invalid input?",
    "How are sentences turned into vectors?",
    "How is speed measured?",
)
def sentences() -> list[str]:
    """The queries, then the corpus: what is embedded."""
    return [*QUERIES, *CORPUS]


def measure(got: np.ndarray, want: np.ndarray, budget: RT.EmbeddingBudget) -> RT.EmbeddingCost:
    """The cost of the embeddings `got` of `sentences()` against the float64 model's `want`
    (`retrieval.measure`: the queries first, then the corpus)."""
    return RT.measure(got, want, budget, len(QUERIES))


def encoded(tokenizer, texts: list[str], max_seq: int, names) -> dict:
    """The inputs `names` (of input_ids, attention_mask, token_type_ids) for `texts`, tokenized as
    the model's users' tokenizer does (padded on the right, cut at `max_seq`); token types the
    tokenizer leaves out are zeros."""
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_seq, return_tensors="np")
    return {n: np.asarray(batch[n], np.int64) if n in batch else np.zeros_like(batch["input_ids"], np.int64)
            for n in names}


POOLINGS = ("mean", "cls", "max")


def pooled(states: np.ndarray, mask: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """Token states (B, T, D) pooled over the attention mask (B, T) as sentence-transformers pools
    them (`mean`: the tokens' mean; `cls`: the first token's; `max`: each feature's largest over the
    tokens), then made unit length where `normalize`: what a client of a folder that returns only the
    token states computes (float64)."""
    states = np.asarray(states, np.float64)
    m = np.asarray(mask)[..., None].astype(np.float64)
    if pooling == "cls":
        out = states[:, 0]
    elif pooling == "max":
        out = np.where(m > 0, states, -np.inf).max(axis=1)
    elif pooling == "mean":
        out = (states * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    else:
        raise ValueError(f"no {pooling!r} pooling ({', '.join(POOLINGS)})")
    return RT.unit(out) if normalize else out


def pooling_of(source) -> tuple[str, bool]:
    """(pooling, normalised) as the sentence-transformers files in the folder `source` declare them
    (modules.json: a Pooling module's config, a Normalize module); mean pooling without
    normalisation where it has none (a plain transformers folder). A pooling attnexport does not
    compute is a one-line refusal."""
    folder = Path(source) if source is not None else None
    modules_file = folder / "modules.json" if folder is not None and folder.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return "mean", False
    try:
        modules = json.loads(modules_file.read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        pooling = "mean"
        if "Pooling" in kinds:
            config = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
            modes = [k[len("pooling_mode_"):].removesuffix("_token").removesuffix("_tokens")
                     for k, on in config.items() if k.startswith("pooling_mode_") and on]
            if len(modes) != 1 or modes[0] not in POOLINGS:
                raise UsageError(f"--hf {source}: its pooling ({', '.join(modes) or 'none'}) is not one attnexport "
                                 f"computes ({', '.join(POOLINGS)}, one of them)")
            pooling = modes[0]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--hf {source}: its sentence-transformers files are damaged ({e})") from None
    return pooling, "Normalize" in kinds


def max_length(source, positions: int) -> int:
    """The longest input a sentence encoder at `source` takes, as its own files say: its
    sentence-transformers `max_seq_length` (what its model card's users get), else its tokenizer's
    `model_max_length`, else the `positions` its position table holds (never more than those)."""
    folder = Path(str(source))
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = folder / name
        if folder.is_dir() and path.is_file():
            value = json.loads(path.read_text()).get(key)
            if isinstance(value, int | float) and 0 < value < 10**6:  # transformers' "no limit" is 1e30
                return min(int(value), positions)
    return positions


def state_max_length(folder: Path, length: int) -> None:
    """`length` written into each of the deployment folder's files that a client reads its longest
    input from, and tokenizer.json's fixed padding taken out (each client pads a batch to its longest)."""
    tokenizer = folder / "tokenizer.json"
    if tokenizer.is_file():
        data = json.loads(tokenizer.read_text())
        data["truncation"] = {"direction": "Right", "max_length": length, "strategy": "LongestFirst", "stride": 0}
        data["padding"] = None
        tokenizer.write_text(json.dumps(data, ensure_ascii=False) + "\n")
    for name, key in (("tokenizer_config.json", "model_max_length"), ("sentence_bert_config.json", "max_seq_length")):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            config[key] = length
            path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# What the integer int8 form is calibrated on (`calibration`): none of `sentences()`, and not about
# attnexport, but the kinds of text a search index holds (questions, support tickets, code and
# identifiers, numbers, short phrases), in batches as apps embed them.
CALIBRATION = (
    "How do I reset my password if I no longer have access to my email?",
    "The invoice dated 14 March 2024 lists 3 items totalling $1,249.50.",
    "Error: connection refused (ECONNREFUSED 127.0.0.1:5432) after upgrading PostgreSQL.",
    "def merge_sorted(a, b): return sorted(a + b)",
    "Shipping to Canada takes five to seven business days.",
    "Why does my laptop fan run at full speed while idle?",
    "The museum opens at 9 a.m. on weekdays and closes early on public holidays.",
    "kubectl get pods --namespace=prod shows two pods in CrashLoopBackOff.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "refund policy",
    "best hiking trails near Lake Geneva",
    "The quarterly report shows revenue up 12% year over year, driven by the EU market.",
    "Can I bring a stroller on the train during rush hour?",
    "Set the environment variable OMP_NUM_THREADS=4 before starting the service.",
    "The recipe calls for 200 g of flour, two eggs and a pinch of salt.",
    "GPU memory usage",
    "A rolling update replaces instances one at a time so the service stays available.",
    "She moved to Lisbon in 2019 and now teaches Portuguese to new arrivals.",
    "What is the difference between a mutex and a semaphore?",
    "The contract may be terminated by either party with 30 days' written notice.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10;",
    "Heavy rain is expected tonight, with winds gusting up to 80 km/h on the coast.",
    "my order never arrived",
    "The library's API returns a 429 status when the rate limit is exceeded.",
)
# The calibration's batches, as `check.EMBED_BATCH` embeds verify's sentences.
CALIBRATION_BATCH = 8
# The share of the int8 budget's 1 - cosine the integer form's calibration keeps its own text under:
# the calibration sentences are not the ones verify judges.
CALIBRATION_SHARE = 0.25


def calibration(layout, tokenizer) -> tuple[list[dict], object, float]:
    """The integer int8 form's calibration (`registry.Family.calibration`): `CALIBRATION`'s
    sentences in padded batches of `CALIBRATION_BATCH`. The cost: 1 - the lowest cosine of their
    sentence embeddings; the target: `CALIBRATION_SHARE` of the int8 budget's (the calibration text cost
    MiniLM about 0.4x what verify's sentences do: docs/encoders.md)."""
    texts = list(CALIBRATION)
    feeds = [encoded(tokenizer, texts[i:i + CALIBRATION_BATCH], layout.max_seq, layout.inputs)
             for i in range(0, len(texts), CALIBRATION_BATCH)]

    def cost(want: list[dict], got: list[dict]) -> float:
        a = np.concatenate([w["sentence_embedding"] for w in want]).astype(np.float64)
        b = np.concatenate([g["sentence_embedding"] for g in got]).astype(np.float64)
        cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
        return float(1 - cos.min()) if np.isfinite(cos).all() else float("inf")

    return feeds, cost, CALIBRATION_SHARE * (1 - RT.budget_for("int8").cosine)
