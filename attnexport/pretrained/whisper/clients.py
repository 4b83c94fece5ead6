"""Whisper's clients transcribing with its deployment folder, as their users run them: Optimum's
ORTModelForSpeechSeq2Seq (its feature extractor and Whisper generation) and transformers.js'
automatic-speech-recognition pipeline (Node); each clip alone, English, no timestamps."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from attnexport.errors import ProviderUnavailableError
from attnexport.pretrained import clients as CL
from attnexport.pretrained.clients import ClientRun
from attnexport.pretrained.whisper import ctranslate2

# The transformers.js script this family's Node client runs (beside this module).
SCRIPT = Path(__file__).with_name("transcribe.mjs")


def transcribe(client: str, folder: Path, clips: list, new_tokens: int, threads: int | None = None) -> ClientRun:
    """Greedy transcripts of `clips` (16 kHz float samples) by `client` from a Whisper deployment
    folder, each clip alone, as its users run it: the client's own feature extraction (the folder's
    preprocessor config) and Whisper generation (English, no timestamps); each clip's tokens after
    the start tokens, without the end token."""
    ok, why = CL.status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    if client == "optimum":
        return _optimum_transcripts(folder, clips, new_tokens, threads)
    answer = CL.node(SCRIPT, {"folder": CL.local(folder),
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
    model = ORTModelForSpeechSeq2Seq.from_pretrained(CL.local(folder), subfolder="onnx", use_cache=True,
                                                     use_merged=True, provider="CPUExecutionProvider",
                                                     session_options=options)
    extractor = AutoFeatureExtractor.from_pretrained(CL.local(folder))
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
