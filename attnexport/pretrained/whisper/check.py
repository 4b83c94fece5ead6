"""A Whisper deployment folder (`export --hf --deploy`) against the model it came from, on every
runtime, by the encoder-decoder core's verify (`attnexport.pretrained.encdec.check`: each graph
against the model in float64, the decode property, greedy transcripts equal to transformers'
`generate` in fp32 token for token, a lossy folder's cost in transcripts, the clients' transcripts):
what Whisper gives it is its clips (`--audio`, or a synthetic one) as log-mel features,
transformers' Whisper generation, and its clients (Optimum's ORTModelForSpeechSeq2Seq,
transformers.js' pipeline).
"""

from __future__ import annotations

import numpy as np
import torch

from attnexport.pretrained import model as hf
from attnexport.pretrained import registry
from attnexport.pretrained.encdec import check as EC
from attnexport.pretrained.whisper import Whisper
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import clients as WC
from attnexport.pretrained.whisper import ctranslate2 as CT
from attnexport.pretrained.whisper import export as S
from attnexport.report import Report

graph_files = EC.graph_files
missing_graphs = EC.missing_graphs


class _Verify(EC.Verify):
    what = "a Whisper"

    def __init__(self):
        self.family = registry.of_task(Whisper.task)

    def model_of(self, model, source):
        return S.Speech.of(model, source)

    def inputs(self, m, check):
        clips = [AU.read_wav(p) for p in check.audio] if check.audio else [S.check_audio(3.0, 0)]
        return clips, {"input_features": np.stack([AU.log_mel(c, m.mels) for c in clips])}

    def reference(self, m, feed, new_tokens):
        return reference_transcripts(m, feed["input_features"], new_tokens)

    def client_answers(self, client, folder, inputs, new_tokens, threads):
        return WC.transcribe(client, folder, inputs, new_tokens, threads)


def verify_speech(check) -> Report:
    """The rows of every check on every selected runtime (`check`: the verify request, an
    `attnexport.pretrained.check.HFCheck` whose model_path is the deployment folder)."""
    return EC.verify_graphs(check, _Verify())


def reference_transcripts(speech: S.Speech, features: np.ndarray, new_tokens: int) -> list[list[int]]:
    """transformers' own greedy `generate` in fp32 (its Whisper generation: the model's generation
    config's suppression), from the start tokens: each clip's tokens, without the end token."""
    model = speech.model
    language = {"language": "en", "task": "transcribe"} if CT.multilingual(model.config.vocab_size) else {}
    with torch.no_grad(), hf.quiet_transformers():
        out = model.generate(torch.from_numpy(features), max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                             **language)
    for row in out.tolist():  # its answers begin with the start tokens (the first of them left out, or not)
        special = [t for t in row[:len(speech.start)] if t >= speech.end]
        if any(t not in speech.start for t in special):
            raise RuntimeError(f"transformers' generate started with {row[:len(speech.start)]}, not {speech.start}")
    return [WC.spoken(row, speech.end) for row in out.tolist()]
