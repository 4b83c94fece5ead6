"""The clients that load a deployment folder (`export --hf --deploy`), each with its own tokenizer,
loader and loop. A causal language model's generate greedily from it: Optimum's ORTModelForCausalLM
(Python, `optimum-onnx`) and transformers.js (`@huggingface/transformers` in Node, one of
attnexport's pinned npm packages); what `verify FOLDER --hf PATH --clients ...` compares with
transformers' `generate`. A sentence encoder's embed sentences with it: sentence-transformers'
`SentenceTransformer(folder, backend="onnx")`, Optimum's ORTModelForFeatureExtraction (its token
states pooled as the folder's sentence-transformers config says, as its users write it) and
transformers.js' feature-extraction pipeline; compared with transformers' embeddings.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport.errors import ProviderUnavailableError, UsageError, reason
from attnexport.pretrained import ctranslate2
from attnexport.pretrained.embeddings import pooled, pooling_of
from attnexport.runtimes import js

CLIENTS = ("optimum", "transformers.js")  # a causal language model's (and a speech model's)
EMBEDDERS = ("sentence-transformers", "optimum", "transformers.js")  # a sentence encoder's
KNOWN = tuple(dict.fromkeys(CLIENTS + EMBEDDERS))
SECONDS = 1800  # a client that takes longer has hung


@dataclass
class ClientRun:
    """A client's greedy generation, prompt by prompt (batch 1: no padding for a client to handle its
    own way): how it encoded each prompt and the new tokens, and how long it took in all."""

    client: str
    prompt_ids: list
    tokens: list
    ms: float


def parse(text: str | None) -> list[str]:
    """`--clients a,b` -> the clients' names (`all`: ["all"], the model family's own, which verify
    knows once it has read the model); an unknown one is a UsageError naming them."""
    if not text:
        return []
    if text.strip() == "all":
        return ["all"]
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise UsageError(f"--clients: unknown {', '.join(unknown)} (the clients: {', '.join(KNOWN)}, or all)")
    return names


def of_family(names, family) -> list[str]:
    """`parse`'s names for a model of `family` (`all`: its clients); a client that does not load its
    models is a UsageError."""
    wanted = list(family.clients) if list(names) == ["all"] else list(names)
    foreign = [n for n in wanted if n not in family.clients]
    if foreign:
        raise UsageError(f"--clients {', '.join(foreign)}: a {family.what}'s clients are {', '.join(family.clients)}")
    return wanted


def select(names, skip_unavailable: bool = False) -> list[dict]:
    """Each client of `names` with its status ({name, available, reason, used}), as verify reports
    its runtimes: one that cannot run here is a ProviderUnavailableError (exit 2, a broken setup, not
    a mismatch) unless `skip_unavailable`, when its row is skipped with the reason."""
    table = []
    for name in names:
        ok, why = status(name)
        if not ok and not skip_unavailable:
            raise ProviderUnavailableError(f"client {name} is not available: {why} (use --skip-unavailable to skip it)")
        table.append({"name": name, "available": ok, "reason": why, "used": ok})
    return table


def skipped(client: str) -> str:
    """Why a client's row is skipped ("" when the client is available)."""
    ok, why = status(client)
    return "" if ok else f"{client} is not available: {why}"


def status(client: str) -> tuple[bool, str]:
    """(available, what it is or why not)."""
    from importlib.metadata import version
    if client == "optimum":
        try:
            import optimum.onnxruntime  # noqa: F401
            return True, f"Optimum's ORTModel classes (optimum-onnx {version('optimum-onnx')})"
        except ImportError as e:
            return False, f"optimum-onnx is not installed (pip install optimum-onnx): {reason(e)}"
    if client == "sentence-transformers":
        try:
            import optimum.onnxruntime  # noqa: F401
            import sentence_transformers  # noqa: F401
            return True, f"sentence-transformers {version('sentence-transformers')} (backend onnx)"
        except ImportError as e:
            return False, ("sentence-transformers' ONNX backend is not installed (pip install "
                           f"'sentence-transformers<6' optimum-onnx): {reason(e)}")
    node, why = js.find_node()
    if node is None:
        return False, why
    ok, missing = js.packages()  # installed on first use, as the runtimes' are
    if not ok:
        return False, missing
    return True, f"transformers.js (@huggingface/transformers {js.pins()['@huggingface/transformers']}), Node {why}"


def generate(client: str, folder: Path, prompts: list, new_tokens: int, threads: int | None = None) -> ClientRun:
    """Greedy generation of `new_tokens` tokens after each prompt (texts, encoded by the client's
    tokenizer from the folder; conversations, encoded by its chat template; or token id lists) by
    `client` from `folder`; no end-of-sequence stop."""
    ok, why = status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    if client == "optimum":
        return _optimum(folder, prompts, new_tokens, threads)
    return _transformers_js(folder, prompts, new_tokens, threads)


def _optimum(folder: Path, prompts: list, new_tokens: int, threads: int | None) -> ClientRun:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoTokenizer

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    use_cache = bool(json.loads((Path(folder) / "config.json").read_text()).get("use_cache", True))
    model = ORTModelForCausalLM.from_pretrained(_local(folder), subfolder="onnx", file_name="model.onnx",
                                                provider="CPUExecutionProvider", session_options=options,
                                                use_cache=use_cache)
    texts = all(isinstance(p, str) or _is_chat(p) for p in prompts)
    tokenizer = AutoTokenizer.from_pretrained(_local(folder)) if texts else None
    started = time.perf_counter()
    encoded, tokens = greedy_each(model, tokenizer, prompts, new_tokens)
    return ClientRun("optimum", encoded, tokens, (time.perf_counter() - started) * 1e3)


def greedy_each(model, tokenizer, prompts: list, new_tokens: int) -> tuple[list, list]:
    """(each prompt's ids, the `new_tokens` tokens `model.generate` gives after it), one prompt at a
    time with no end-of-sequence stop: the loop of the Optimum client, whose model generates with
    transformers' own `generate` (so transformers' model runs it the same way, without Optimum).
    `tokenizer` encodes text prompts; without one the prompts are token ids."""
    import torch
    from transformers import GenerationConfig

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=pad)
    encoded, tokens = [], []
    for p in prompts:
        if _is_chat(p):  # as its users encode a conversation: the chat template, with the generation prompt
            ids = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]  # transformers 5 gives an encoding
        else:
            ids = tokenizer(p)["input_ids"] if tokenizer is not None else [int(t) for t in p]
        encoded.append(list(ids))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), generation_config=config,
                                 attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
        tokens.append(out[0, len(ids):].tolist())
    return encoded, tokens


def _transformers_js(folder: Path, prompts: list, new_tokens: int, threads: int | None) -> ClientRun:
    texts = all(isinstance(p, str) for p in prompts)
    chats = all(_is_chat(p) for p in prompts)
    request = {"folder": _local(folder), "prompts": list(prompts) if texts else None,
               "chats": list(prompts) if chats else None,
               "ids": None if texts or chats else [[int(t) for t in p] for p in prompts], "new_tokens": new_tokens,
               "threads": threads or 0}
    answer = _node("generate.mjs", request)
    return ClientRun("transformers.js", answer["prompt_ids"], answer["tokens"], float(answer["ms"]))


def _local(folder) -> str:
    """A deployment folder as the clients are given it: its absolute path. A relative one that reads
    as a model id ("whisper-onnx") is looked up by transformers' loaders as one first, and Optimum then
    takes its files from the subfolder alone (measured: the Whisper folder's generation config missed,
    so Optimum generated without the model's suppression and <|notimestamps|>)."""
    return str(Path(folder).resolve())


def _is_chat(prompt) -> bool:
    """Whether a prompt is a conversation ([{role, content}, ...]), encoded with the chat template."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _node(script: str, request: dict) -> dict:
    """The answer of one of attnexport's transformers.js scripts (js/`script`) to `request`."""
    node, _ = js.find_node()
    js.install()  # the pinned npm packages, once (nothing to do when they are there)
    with tempfile.TemporaryDirectory(prefix="attnexport-client-") as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        env = {**os.environ, "ATTNEXPORT_JS_HOME": str(js.home())}
        try:
            done = subprocess.run([str(node), str(js.PACKAGE / script), str(path)], capture_output=True,
                                  text=True, env=env, timeout=SECONDS)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"transformers.js took more than {SECONDS} s") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    answer: dict = json.loads(lines[-1]) if lines else \
        {"error": (done.stderr.strip().splitlines() or ["no answer"])[-1]}
    if "error" in answer:
        raise RuntimeError(f"transformers.js: {answer['error'][:300]}")
    return answer


@dataclass
class ClientEmbedding:
    """A client's embeddings of the texts (N, D), and how long it took."""

    client: str
    embeddings: np.ndarray
    ms: float


def embed(client: str, folder: Path, texts: list[str], threads: int | None = None) -> ClientEmbedding:
    """The sentence embeddings `client` computes from the deployment folder of a sentence encoder,
    with its own tokenizer and its own pooling (the folder's sentence-transformers config says which)."""
    ok, why = status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    pooling, normalize = pooling_of(folder)
    started = time.perf_counter()
    if client == "sentence-transformers":
        from sentence_transformers import SentenceTransformer
        model = SentenceTransformer(_local(folder), backend="onnx", device="cpu",
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
    model = ORTModelForFeatureExtraction.from_pretrained(_local(folder), subfolder="onnx", file_name="model.onnx",
                                                         provider="CPUExecutionProvider", session_options=options)
    encoded = AutoTokenizer.from_pretrained(_local(folder))(texts, padding=True, truncation=True, return_tensors="pt")
    states = model(**encoded).last_hidden_state.detach().numpy()
    return pooled(states, encoded["attention_mask"].numpy(), pooling, normalize)


def _transformers_js_embeddings(folder: Path, texts: list[str], pooling: str, normalize: bool, threads) -> np.ndarray:
    if pooling not in ("mean", "cls"):
        raise RuntimeError(f"transformers.js' feature-extraction pipeline has no {pooling} pooling")
    answer = _node("embed.mjs", {"folder": _local(folder), "texts": list(texts), "pooling": pooling,
                                 "normalize": normalize, "threads": threads or 0})
    return np.asarray(answer["embeddings"], np.float64)


def transcribe(client: str, folder: Path, clips: list, new_tokens: int, threads: int | None = None) -> ClientRun:
    """Greedy transcripts of `clips` (16 kHz float samples) by `client` from a Whisper deployment
    folder, each clip alone, as its users run it: the client's own feature extraction (the folder's
    preprocessor config) and Whisper generation (English, no timestamps); each clip's tokens after
    the start tokens, without the end token."""
    ok, why = status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    if client == "optimum":
        return _optimum_transcripts(folder, clips, new_tokens, threads)
    answer = _node("transcribe.mjs", {"folder": _local(folder),
                                      "clips": [np.asarray(c).tolist() for c in clips], "max_new_tokens": new_tokens,
                                      "threads": threads or 0})
    return ClientRun("transformers.js", [], answer["tokens"], float(answer["ms"]))


def _optimum_transcripts(folder: Path, clips: list, new_tokens: int, threads) -> ClientRun:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForSpeechSeq2Seq
    from transformers import AutoFeatureExtractor

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    model = ORTModelForSpeechSeq2Seq.from_pretrained(_local(folder), subfolder="onnx", use_cache=True, use_merged=True,
                                                     provider="CPUExecutionProvider", session_options=options)
    extractor = AutoFeatureExtractor.from_pretrained(_local(folder))
    started = time.perf_counter()
    tokens = []
    for clip in clips:
        features = extractor(np.asarray(clip), sampling_rate=16000, return_tensors="pt").input_features
        tokens.append(optimum_whisper_generate(model, features, new_tokens))
    return ClientRun("optimum", [], tokens, (time.perf_counter() - started) * 1e3)


def optimum_whisper_generate(model, features, new_tokens: int) -> list[int]:
    """Up to `new_tokens` text tokens from Optimum's ORTModelForSpeechSeq2Seq `model` (English, no
    timestamps, greedy), without the end token: its `generate` is transformers' Whisper generation,
    driven by the generation config it read (a deployment folder's copy beside the graphs)."""
    import torch
    config = model.generation_config
    language = {"language": "en", "task": "transcribe"} if ctranslate2.multilingual(model.config.vocab_size) else {}
    with torch.no_grad():
        out = model.generate(features, max_new_tokens=new_tokens, do_sample=False, num_beams=1, **language)
    return spoken(out[0].tolist(), config.eos_token_id)


def spoken(ids: list, end: int) -> list[int]:
    """A Whisper answer's text tokens: those below its end token (every special token, the start
    tokens among them, is the end token or above)."""
    return [int(t) for t in ids if t < end]
