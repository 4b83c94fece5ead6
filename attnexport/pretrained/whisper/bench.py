"""`bench --hf WHISPER`: a speech model's transcription timed as its users run it, on one clip at a
time: the encoder over 30 s of features, the decoder a token, and the whole transcription (the
encoder once, then greedy decoding to the end token) as a real-time factor (its time over the clip's
length), beside transformers eager in the same run and the engines its users would otherwise take:
Optimum's export of the same weights on ONNX Runtime, and CTranslate2 (what faster-whisper runs; the
same model.bin, where the source is a CTranslate2 folder) in float32 and int8.

Every engine reads the same weights on the same threads and transcribes from the log-mel
features its users feed it (computed once, outside the times): transformers' WhisperFeatureExtractor
for transformers, Optimum and CTranslate2 (what their pipelines compute), attnexport's NumPy one
(`audio.log_mel`, within 3e-5 of it) for attnexport's folder; the transcript each is compared
with is transformers' own, from its own features. Each time is the median of `iters` runs after `warmup`
untimed ones (with the 10th and 90th percentiles). A decoder token's time is (the transcription's
time - the encoder's) / the tokens decoded (the end token counted), the same for every engine. Beside
each, its transcript against transformers' fp32 greedy one: equal token for token, or the share of
tokens that agree and the word error rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnexport import runtimes as R
from attnexport.bench import stats_of
from attnexport.errors import UsageError, reason
from attnexport.pretrained import bench as B
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import registry
from attnexport.pretrained.encdec import cost as COST
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import check as SC
from attnexport.pretrained.whisper import clients as WC
from attnexport.pretrained.whisper import ctranslate2 as CT
from attnexport.pretrained.whisper import export as S
from attnexport.pretrained.whisper import graphs as W


@dataclass(frozen=True)
class SpeechBenchRequest:
    source: str | Path
    audio: str | Path | None = None  # a 16 kHz mono WAV (None: the check's synthetic clip)
    flavors: tuple = ("attention", "ort")
    # speech.PRECISIONS: fp32 in every flavour, each other in the first flavour only
    precisions: tuple = ("fp32", "int8")
    threads: int = 0  # 0: every core
    iters: int = 10
    warmup: int = 2
    new_tokens: int = 128
    anchors: bool = True
    # int8's forms (`precision.KERNELS`), an export each; empty: the family's (`--precision int8` alone)
    int8_kernels: tuple = ()


@dataclass
class SpeechBenchRow:
    engine: str  # transformers, attnexport, optimum, ctranslate2
    flavor: str
    precision: str
    encoder_ms: float
    encoder_p10_ms: float
    encoder_p90_ms: float
    transcription_ms: float
    transcription_p10_ms: float
    transcription_p90_ms: float
    token_ms: float
    tokens: int
    real_time_factor: float
    threads: int
    kernel: str = ""  # attnexport int8's form (`--int8-kernel`, else the family's)
    equal: bool = False  # the transcript is transformers' fp32 one, token for token
    agreement: float = 0.0  # the share of transformers' tokens it has at their places
    word_error_rate: float = 0.0  # against transformers' fp32 transcript's words
    ratio_to_transformers: float | None = None  # transformers' transcription time over this one (> 1: faster)
    ratio_to_ctranslate2: float | None = None  # CTranslate2's at this precision over this one
    note: str = ""
    transcript: list = dataclasses.field(default_factory=list)  # the text tokens it said


@dataclass
class _Engine:
    engine: str
    flavor: str
    precision: str
    encode: Callable[[np.ndarray], object]  # features (1, mels, 3000) -> its encoder's output
    transcribe: Callable[[np.ndarray], list[int]]  # features -> the text tokens
    features: str = "transformers"  # whose log-mel its users feed it: transformers' extractor, or attnexport's
    loaded: str = ""  # what it loaded, in its own words (its row's note)
    kernel: str = ""  # attnexport int8's form


def transformers_features(clip: np.ndarray, mels: int) -> np.ndarray:
    """(1, mels, 3000): transformers' WhisperFeatureExtractor on the clip, as its pipeline computes them."""
    from transformers import WhisperFeatureExtractor
    extractor = WhisperFeatureExtractor(feature_size=mels)
    return np.asarray(extractor(clip, sampling_rate=AU.RATE, return_tensors="np").input_features, np.float32)


def is_speech(source) -> bool:
    """Whether `source` is a Whisper model's folder (CTranslate2's, or transformers' by its config)."""
    import json
    folder = Path(source)
    if CT.is_folder(folder):
        return CT.read_spec(folder / "model.bin") == CT.WHISPER
    config = folder / "config.json"
    if folder.is_dir() and config.is_file():
        try:
            return any(a.endswith("WhisperForConditionalGeneration")
                       for a in json.loads(config.read_text()).get("architectures") or [])
        except ValueError:
            return False
    return False


def bench_speech(request: SpeechBenchRequest, said=lambda text: None) -> tuple[list[SpeechBenchRow], dict]:
    """Every engine on the clip; returns (rows, what the run measured besides)."""
    import torch

    r = request if request.threads else dataclasses.replace(request, threads=os.cpu_count() or 1)
    clip = AU.read_wav(r.audio) if r.audio is not None else S.check_audio(3.0, 0)
    model, _ = hf.load(r.source, 0)
    speech = S.Speech.of(model, r.source)
    room = model.config.max_target_positions - len(speech.start)
    new_tokens = min(r.new_tokens, room)
    torch.set_num_threads(r.threads)
    features = {"transformers": transformers_features(clip, speech.mels),
                "attnexport": AU.log_mel(clip, speech.mels)[None]}
    want = SC.reference_transcripts(speech, features["transformers"], new_tokens)[0]
    seconds = clip.size / AU.RATE
    info: dict = {"skipped": {}, "threads": r.threads, "audio_s": seconds, "transcript": want,
                  "features": "transformers' WhisperFeatureExtractor (transformers, Optimum, CTranslate2); "
                              "attnexport's audio.log_mel (attnexport), max abs apart "
                              f"{float(np.abs(features['transformers'] - features['attnexport']).max()):.2g}",
                  "text": speech.decode(want), "layers": [model.config.encoder_layers, model.config.decoder_layers],
                  "width": model.config.d_model, "parameters": int(sum(p.numel() for p in model.parameters()))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnexport-speech-bench-") as tmp:
        engines = [_transformers(speech, new_tokens)]
        made = [(f, "fp32", "") for f in r.flavors if "fp32" in r.precisions]
        # int8 in each form asked, else in the family's (each row names its form)
        made += [(r.flavors[0], p, k) for p in r.precisions if p != "fp32"
                 for k in ((r.int8_kernels or (registry.of_model(model).int8_kernel,)) if p == "int8" else ("",))]
        for flavor, precision, kernel in made:
            label = f"{flavor} {precision}" + (f" {kernel}" if kernel else "")
            said(f"exporting attnexport {label}")
            out = Path(tmp) / f"attnexport-{label.replace(' ', '-')}"
            try:
                hf_export.export(hf_export.request(r.source, {"int8_kernel": kernel or None}, flavor=flavor,
                                                   deploy=out, precision=precision))
            except Exception as x:  # noqa: BLE001 - a flavour that cannot express the model: said in the info
                info["skipped"][f"attnexport {label}"] = f"export failed: {reason(x)[:200]}"
                continue
            engines.append(attnexport_engine(out, flavor, precision, speech, new_tokens, r.threads, kernel))
        if r.anchors:
            engines += _optimum(speech, Path(tmp), new_tokens, r.threads, info, said)
            engines += ctranslate2_engines(Path(r.source), speech, new_tokens, r.threads, info)
        for engine in engines:
            said(f"timing {engine.engine} {engine.flavor} {engine.precision}" + (f" {engine.kernel}" if engine.kernel
                                                                                  else ""))
            fed = features[engine.features]
            try:
                got = engine.transcribe(fed)
                enc = R.time_calls(functools.partial(engine.encode, fed), r.warmup, r.iters)
                whole = R.time_calls(functools.partial(engine.transcribe, fed), r.warmup, r.iters)
            except Exception as x:  # noqa: BLE001 - an engine failing: said in the info, the others go on
                info["skipped"][f"{engine.engine} {engine.precision}"] = reason(x)[:200]
                continue
            e50, e10, e90 = stats_of(enc)
            t50, t10, t90 = stats_of(whole)
            agree, wer = COST.agreement(got, want, speech.decode)
            rows.append(SpeechBenchRow(engine.engine, engine.flavor, engine.precision, e50, e10, e90, t50, t10, t90,
                                       (t50 - e50) / (len(got) + 1), len(got), t50 / (seconds * 1e3), r.threads,
                                       engine.kernel, got == want, agree, wer, note=engine.loaded, transcript=got))
    _ratios(rows)
    return rows, info


def _ratios(rows: list[SpeechBenchRow]) -> None:
    by = {(r.engine, r.precision): r.transcription_ms for r in rows}
    for row in rows:
        base, ct2 = by.get(("transformers", "fp32")), by.get(("ctranslate2", row.precision))
        row.ratio_to_transformers = base / row.transcription_ms if base else None
        row.ratio_to_ctranslate2 = ct2 / row.transcription_ms if ct2 else None


def _transformers(speech: S.Speech, new_tokens: int) -> _Engine:
    """transformers eager (its sdpa attention), fp32: the encoder, and `generate` greedy."""
    import torch
    model = speech.model

    def encode(features):
        with torch.no_grad():
            return model.model.encoder(torch.from_numpy(features)).last_hidden_state

    def transcribe(features):
        return SC.reference_transcripts(speech, features, new_tokens)[0]
    return _Engine("transformers", "-", "fp32", encode, transcribe)


def attnexport_engine(folder: Path, flavor: str, precision: str, speech: S.Speech, new_tokens: int, threads: int,
                      kernel: str = "") -> _Engine:
    """The deployment folder on ONNX Runtime's CPU provider, transcribed by the loop of `whisper.transcribe`."""
    encoder = R.ort_session("ort-cpu", folder / S.GRAPH_DIR / f"{W.ENCODER}.onnx", threads=threads)[0]
    decoder = R.ort_session("ort-cpu", folder / S.GRAPH_DIR / f"{W.MERGED}.onnx", threads=threads)[0]

    def runner(session):
        names = [o.name for o in session.get_outputs()]
        return lambda feed: dict(zip(names, session.run(None, feed), strict=True))
    run_encoder = W.typed(runner(encoder), encoder)
    first, later = G.merged_steps(W.typed(runner(decoder), decoder), speech.spec)

    def transcribe(features):
        return W.transcribe(run_encoder, first, later, features, speech.tokens, speech.layers, new_tokens)[0]
    return _Engine("attnexport", flavor, precision, lambda f: run_encoder({"input_features": f}), transcribe,
                   features="attnexport", kernel=kernel)


def _optimum(speech: S.Speech, tmp: Path, new_tokens: int, threads: int, info: dict, said) -> list[_Engine]:
    """Optimum's export of the same weights (its automatic-speech-recognition task, with past),
    loaded by ORTModelForSpeechSeq2Seq and transcribed by its `generate`."""
    try:
        from optimum.onnxruntime import ORTModelForSpeechSeq2Seq
    except Exception as e:  # noqa: BLE001 - not installed (or broken): said in the run's info
        info["skipped"]["optimum"] = f"optimum-onnx is not installed ({type(e).__name__}): pip install optimum-onnx"
        return []
    import onnxruntime as ort
    import torch
    said("exporting with optimum")
    out = tmp / "optimum"
    try:
        export_with_optimum(speech, tmp / "weights", out)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        model = ORTModelForSpeechSeq2Seq.from_pretrained(str(out), provider="CPUExecutionProvider",
                                                         session_options=options)
    except Exception as e:  # noqa: BLE001 - Optimum's own failure, said in one line
        info["skipped"]["optimum"] = f"Optimum's export failed: {reason(e)[:200]}"
        return []
    model.generation_config = speech.model.generation_config

    def encode(features):
        return model.encoder(input_features=torch.from_numpy(features), attention_mask=None)

    def transcribe(features):
        return WC.optimum_whisper_generate(model, torch.from_numpy(features), new_tokens)
    return [_Engine("optimum", "-", "fp32", encode, transcribe)]


def export_with_optimum(speech: S.Speech, weights: Path, out: Path) -> Path:
    """Optimum's export of `speech`'s model (its automatic-speech-recognition task, with past) into
    `out`: the model saved as transformers' folder in `weights` (with its feature extractor and
    tokenizer), then Optimum's exporter (optimum-cli's) run on it, quietly. Returns `out`."""
    from optimum.exporters.onnx import main_export
    S.write_transformers(speech, weights)
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(weights), output=str(out), task="automatic-speech-recognition-with-past")
    return out


def ctranslate2_engines(source: Path, speech: S.Speech, new_tokens: int, threads: int, info: dict) -> list[_Engine]:
    """CTranslate2 on the same model.bin, in float32 and int8 (its weights quantized as it loads
    them), greedy from the same start tokens."""
    if not CT.is_folder(source):
        info["skipped"]["ctranslate2"] = "the source is not a CTranslate2 folder (its model.bin is what it runs)"
        return []
    try:
        import ctranslate2
    except ImportError:
        info["skipped"]["ctranslate2"] = "ctranslate2 is not installed: pip install ctranslate2"
        return []
    engines = []
    positions = speech.model.config.max_target_positions
    for precision, compute in (("fp32", "float32"), ("int8", "int8")):
        try:
            model = ctranslate2.models.Whisper(str(source), device="cpu", compute_type=compute, intra_threads=threads)
        except Exception as e:  # noqa: BLE001 - CTranslate2's own refusal of the folder, said in one line
            info["skipped"][f"ctranslate2 {precision}"] = f"CTranslate2 cannot load the folder: {reason(e)[:200]}"
            continue

        def encode(features, model=model):
            return model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)))

        def transcribe(features, model=model):
            out = model.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)), [speech.start],
                                 beam_size=1, max_length=ctranslate2_length(new_tokens, len(speech.start), positions))
            return WC.spoken(out[0].sequences_ids[0], speech.end)[:new_tokens]
        capped = f"; decodes at most {positions // 2} tokens (its cap), {new_tokens} asked" \
            if 2 * new_tokens > positions else ""
        loaded = f"CTranslate2 {ctranslate2.__version__}, compute_type {model.compute_type}{capped}"
        engines.append(_Engine("ctranslate2", "-", precision, encode, transcribe, loaded=loaded))
    return engines


def ctranslate2_length(new_tokens: int, start: int, positions: int) -> int:
    """CTranslate2's Whisper `max_length` that lets it decode `new_tokens` text tokens after `start`
    start tokens: it decodes at most min(max_length / 2, max_length - start) of them (OpenAI's
    reference caps a window at half the decoder's positions, and CTranslate2 keeps that cap), so
    max_length is twice the tokens, or the start plus them where that is more, within the decoder's
    `positions` (then CTranslate2 says at most positions / 2: 224 for Whisper's 448)."""
    return min(positions, max(2 * new_tokens, start + new_tokens))


def to_json(rows: list[SpeechBenchRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def from_options(source, v, said) -> tuple[list[SpeechBenchRow], dict]:
    """`bench --hf` of a Whisper model from the command line's values `v` (`--audio` beside every
    family's)."""
    B.refuse_others(v, v.options, ("--audio", "--int8-kernel"),
                    "a Whisper model (beside transformers, Optimum and CTranslate2)")
    precisions = B.precisions(v.precisions_text, "--precision", S.PRECISIONS) if v.precisions_text else \
        SpeechBenchRequest.precisions
    kernels = B.precisions(v.int8_kernels_text, "--int8-kernel", P.KERNELS) if v.int8_kernels_text else ()
    if kernels and "int8" not in precisions:
        raise UsageError("--int8-kernel chooses int8's forms: it goes with --precision int8")
    request = B.request_of(SpeechBenchRequest, v, source=source, flavors=tuple(v.flavors) or SpeechBenchRequest.flavors,
                           precisions=precisions, threads=v.threads or 0, int8_kernels=kernels)
    return bench_speech(request, said=said)


def lines(rows: list[SpeechBenchRow], info: dict, path: str) -> list[str]:
    """What bench prints: each engine's encoder, decoder token and whole transcription, beside its
    transcript's agreement with transformers' fp32 one."""
    layers = "+".join(map(str, info["layers"]))
    out = [f"{path}: {layers} layers, width {info['width']}, {info['parameters']:,} parameters, "
           f"{info['threads']} thread(s); {info['audio_s']:.1f} s of audio, transformers says {info['text']!r} "
           f"({len(info['transcript'])} tokens)"]
    for row in rows:
        ratios = "".join(f", {v:.2f}x {k}" for k, v in (("transformers", row.ratio_to_transformers),
                                                         ("CTranslate2", row.ratio_to_ctranslate2)) if v)
        said = "the same transcript" if row.equal else \
            f"transcript: {row.agreement:.0%} of its tokens agree, WER {row.word_error_rate:.2f}"
        kernel = f" {row.kernel}" if row.kernel else ""
        out.append(f"{row.engine} {row.precision}{kernel} {row.flavor}: encoder {row.encoder_ms:.1f} ms (p10 "
                   f"{row.encoder_p10_ms:.1f}, p90 {row.encoder_p90_ms:.1f}), {row.token_ms:.2f} ms a token, "
                   f"transcription {row.transcription_ms:.1f} ms (p10 {row.transcription_p10_ms:.1f}, p90 "
                   f"{row.transcription_p90_ms:.1f}), real-time factor {row.real_time_factor:.3f}{ratios}; {said}")
    if info.get("features"):
        out.append(f"note: features: {info['features']}")
    return out + B.skipped_lines(info)
