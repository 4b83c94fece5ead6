"""Whisper's export (`export --hf` of a speech model): its three graphs (`graphs`) through the
encoder-decoder core (`attnexport.pretrained.encdec.export`: each checked before anything is written
against the same graph of the model in float64, quantized, the decoder's two steps merged), fed a
clip's log-mel features and the start tokens of an English transcription; written as the folder
Optimum's ORTModelForSpeechSeq2Seq and transformers.js load: config.json, generation_config.json,
preprocessor_config.json, the tokenizer, and the graphs in onnx/.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport import files as F
from attnexport.pretrained import model as HM
from attnexport.pretrained.encdec import export as ED
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import ctranslate2 as CT
from attnexport.pretrained.whisper import graphs as W

# What a Whisper export is made in (`--precision`): q4f16, int4's weights in a half graph, is not built for it.
PRECISIONS = ("fp32", "fp16", "int8", "int4")
GRAPH_DIR = ED.GRAPH_DIR
# A sentence the checks feed the decoder (after the start tokens), tokenized by the model's tokenizer.
CHECK_TEXT = " Ever tried, ever failed. No matter."


@dataclass
class Speech(ED.Model):
    """A Whisper model and what its graphs need beside it (`encdec.export.Model`): the start tokens
    of an English transcription without timestamps, the end token, the tokens never picked
    (`suppress`) or not first (`suppress_first`), and where its tokenizer.json is."""

    name = "whisper"
    title = "a Whisper"
    item = "clip"
    answers = "transcripts"
    cost_hint = " --audio CLIP"
    verb = "transcribe"
    budget_name = "the speech accuracy budget"
    # int8's encoder on integer GEMM, its decoder blockwise (docs/whisper.md#int8s-two-forms: a decoder step's
    # token gains no time there, and its transcripts lose)
    integer_graphs = (G.ENCODER,)

    @property
    def spec(self) -> G.Spec:
        return W.spec(self.model.config)

    @property
    def mels(self) -> int:
        return self.model.config.num_mel_bins

    @classmethod
    def of(cls, model, source) -> Speech:
        folder = Path(source)
        tokens = CT.special_tokens(folder)
        g = model.generation_config
        return cls(model, folder, CT.start_tokens(tokens, model.config.vocab_size), int(model.config.eos_token_id),
                   [int(t) for t in (g.suppress_tokens or [])], [int(t) for t in (g.begin_suppress_tokens or [])])

    def positions(self) -> int:
        return self.model.config.max_target_positions

    def modules(self, model, static: bool = False):
        return W.modules(model, static)

    def check_inputs(self) -> dict:
        """Two clips' log-mel features (`check_audio`: 3 s and 1.5 s)."""
        clips = (check_audio(3.0, 0), check_audio(1.5, 1))
        return {"input_features": np.stack([AU.log_mel(clip, self.mels) for clip in clips])}

    def check_tokens(self) -> list[int]:
        return self.text_tokens(CHECK_TEXT)

    @functools.cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(self.source / "tokenizer.json"))

    def text_tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def write_files(self, staging: Path) -> None:
        """The tokenizer (tokenizer.json, tokenizer_config.json) and the feature extractor's
        preprocessor_config.json."""
        from transformers import WhisperFeatureExtractor
        shutil.copyfile(self.source / "tokenizer.json", staging / "tokenizer.json")
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(self), indent=2) + "\n")
        WhisperFeatureExtractor(feature_size=self.mels).to_json_file(str(staging / "preprocessor_config.json"))

    def notes(self, static: bool, max_seq: int) -> list[str]:
        if not static:
            return [f"the decoder's two steps are one graph ({W.MERGED}.onnx: an If on {W.USE_CACHE}, their weights "
                    "kept once), as transformers.js and Optimum load Whisper; the log-mel features are the client's "
                    "(attnexport.pretrained.whisper.audio.log_mel computes them as transformers does)"]
        return [f"the decoder's two steps are one graph ({W.MERGED_STATIC}.onnx), its self cache buffers of "
                f"{max_seq} positions written at {W.WRITE_POS} (attnexport's own inputs: Optimum and "
                "transformers.js load the concat form, the default)"]


def check_audio(seconds: float = 3.0, seed: int = 0) -> np.ndarray:
    """A clip the export's checks feed when no speech is given: three gliding tones (a voice's
    formants' range) with a little noise, seeded."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * AU.RATE)) / AU.RATE
    audio = sum(0.2 * np.sin(2 * np.pi * (f0 + 80 * t) * t) for f0 in (220.0, 700.0, 2400.0))
    return (audio + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def export_speech(request, model, params_source: str) -> ED.GraphsExport:
    """`export --hf` of a Whisper model (`request`: `attnexport.pretrained.export.HFExport`): the three
    graphs through the encoder-decoder core, written as a deployment folder (--deploy) only."""
    return ED.export_graphs(request, Speech.of(model, request.source), params_source, PRECISIONS)


def save_transformers(source, out) -> Path:
    """The Whisper model at `source` (a CTranslate2 folder, or transformers') written as transformers'
    own folder at `out` (nothing half-written): config.json, generation_config.json and
    model.safetensors (`save_pretrained`), tokenizer.json with its tokenizer_config.json, and the
    feature extractor's preprocessor_config.json: what transformers' `from_pretrained`, Optimum's
    exporter and `export --hf` read. Returns `out`."""
    model, _ = HM.load(source)
    return write_transformers(Speech.of(model, source), out)


def write_transformers(speech: Speech, out) -> Path:
    """`save_transformers` of a model already loaded (`speech`)."""
    folder = F.deploy_target(Path(out), "the folder")

    def fill(staging: Path) -> None:
        speech.model.save_pretrained(str(staging))
        speech.write_files(staging)
    F.write_folder(folder, fill)
    return folder


def tokenizer_config(speech: Speech) -> dict:
    """The tokenizer_config.json Whisper's clients read beside tokenizer.json."""
    return {"tokenizer_class": "WhisperTokenizer", "model_max_length": speech.model.config.max_target_positions,
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": True,
            "errors": "replace", "add_prefix_space": False}
