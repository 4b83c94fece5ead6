"""Whisper, speech recognition: an encoder over 30 s of log-mel features (`audio`: the client's
features in NumPy), a decoder whose cross-attention reads the encoder's output as a cache computed
once and whose self cache grows a token a step; its graphs as torch modules (`graphs`), exported as
the folder Optimum and transformers.js load (`export`), verified with its transcripts (`check`),
judged by what a lossy folder costs in them (`cost`), timed beside CTranslate2 (`bench`),
transcribed with by its clients (`clients`). It reads CTranslate2's folders itself (`ctranslate2`).
The family registers itself.

The package's modules are imported when first read from it (most import torch and transformers)."""

from __future__ import annotations

from pathlib import Path

from attnexport.pretrained import registry
from attnexport.pretrained.whisper import ctranslate2 as CT


class Whisper(registry.Family):
    """Whisper's encoder-decoder."""

    task = "automatic-speech-recognition"
    what = "speech recognition model (Whisper)"
    architectures = ("WhisperForConditionalGeneration",)
    auto_class = "AutoModelForSpeechSeq2Seq"
    gguf_mapping = "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"
    forms = ()
    tested = ("whisper",)
    precisions = ("fp32", "fp16", "int8", "int4")
    clients = ("optimum", "transformers.js")
    optimum_task = "automatic-speech-recognition-with-past"
    own_source = "a CTranslate2 Whisper folder (model.bin)"
    verify_options = ("audio",)
    # int8's encoder on ONNX Runtime's integer GEMM, its decoder blockwise (`encdec.export.Model.integer_graphs`;
    # docs/whisper.md: 1.2-1.3x faster a transcription than the blockwise form, within the speech budget)
    int8_kernel = "integer"

    def reads(self, path: Path) -> bool:
        """A CTranslate2 folder (a model.bin beside a config.json): read here, never by transformers."""
        return CT.is_folder(path)

    def load(self, path: Path):
        return CT.load(path)

    def export(self, request, model, params_source: str):
        return self.module("export").export_speech(request, model, params_source)

    def exported(self, path: Path) -> bool:
        """A folder whose config.json is a Whisper's: attnexport's deployment folder, or another
        tool's export (Optimum's), whichever graphs it holds (its verify names those it lacks)."""
        config = registry.config_of(path) if path.is_dir() else None
        return config is not None and self.accepts(config)

    def verify(self, check):
        return self.module("check").verify_speech(check)

    def budget(self, text):
        return self.module("cost").SpeechBudget().with_overrides(text)

    def bench(self, source, told, said):
        return self.module("bench").from_options(source, told, said)

    def bench_lines(self, rows, info, title):
        return self.module("bench").lines(rows, info, title)


registry.register(Whisper())
__getattr__ = registry.lazy(__name__)
