"""`bench --hf WHISPER` on a small random model written as a CTranslate2 folder: every engine here
timed on the clip (encoder, a token, the whole transcription as a real-time factor), each with its
transcript against transformers' fp32 one; engines that are not installed said, not hidden.

The [hf] extra (transformers)."""

import json
import math

import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402
from test_pretrained_whisper_audio import wav  # noqa: E402

from attnexport.pretrained.whisper import bench as SB  # noqa: E402
from attnexport.pretrained.whisper import export as S  # noqa: E402


def test_bench_times_each_engine_beside_its_transcript(whisper_folder, tmp_path):
    clip = wav(tmp_path / "clip.wav", S.check_audio(2.0, seed=5))
    r = cli("bench", "--hf", whisper_folder(), "--audio", clip, "--flavor", "attention", "--precision", "fp32,int8",
            "--int8-kernel", "integer", "--iters", "2", "--warmup", "0", "--threads", "1", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index('{"rows"'):])  # after what Optimum's exporter logs
    rows = {(row["engine"], row["precision"]): row for row in doc["rows"]}
    assert {("transformers", "fp32"), ("attnexport", "fp32"), ("attnexport", "int8")} <= set(rows)
    assert rows[("attnexport", "int8")]["kernel"] == "integer" and rows[("attnexport", "fp32")]["kernel"] == ""
    ours = rows[("attnexport", "fp32")]
    assert ours["equal"] and ours["agreement"] == 1.0 and ours["word_error_rate"] == 0.0
    for row in rows.values():
        assert row["encoder_p10_ms"] <= row["encoder_ms"] <= row["encoder_p90_ms"]
        assert row["transcription_ms"] > row["encoder_ms"] > 0 and math.isfinite(row["token_ms"])
        assert row["real_time_factor"] == pytest.approx(row["transcription_ms"] / 2000.0)
    assert ours["ratio_to_transformers"] == pytest.approx(rows[("transformers", "fp32")]["transcription_ms"]
                                                          / ours["transcription_ms"])
    for engine in ("optimum", "ctranslate2"):  # timed where installed, else said why
        assert any(k[0] == engine for k in rows) or any(engine in k for k in doc["info"]["skipped"])
    # Each engine is fed the features its users feed it, and compared with transformers' own transcript
    # from transformers' own features (its WhisperFeatureExtractor, not attnexport's log-mel).
    assert doc["info"]["features"].startswith("transformers' WhisperFeatureExtractor (transformers, Optimum, "
                                              "CTranslate2); attnexport's audio.log_mel (attnexport)")
    from attnexport.pretrained.whisper import audio as AU
    from attnexport.pretrained.whisper import check as SC
    from attnexport.pretrained.whisper import ctranslate2 as CT
    speech = S.Speech.of(CT.load(whisper_folder())[0], whisper_folder())
    features = SB.transformers_features(AU.read_wav(clip), speech.mels)
    import transformers
    extractor = transformers.WhisperFeatureExtractor(feature_size=speech.mels)
    assert (features == extractor(AU.read_wav(clip), sampling_rate=16000, return_tensors="np").input_features).all()
    assert doc["info"]["transcript"] == SC.reference_transcripts(speech, features, 64 - len(speech.start))[0]


def test_bench_refuses_what_a_speech_model_does_not_take(whisper_folder):
    r = cli("bench", "--hf", whisper_folder(), "--decode")
    assert r.exit_code == 2 and "--decode: bench --hf of a Whisper model" in r.output and "takes --audio" in r.output
    assert SB.is_speech(whisper_folder()) and not SB.is_speech(whisper_folder().parent)
    for args, said in ((("--precision", "fp32", "--int8-kernel", "integer"), "goes with --precision int8"),
                       (("--precision", "int8", "--int8-kernel", "fast"), "--int8-kernel takes blockwise, integer")):
        r = cli("bench", "--hf", whisper_folder(), *args)
        assert r.exit_code == 2 and said in r.output and len(r.output.strip().splitlines()) == 1
