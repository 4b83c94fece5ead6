"""The client's side of Whisper: WAV files read (or refused in one line, saying what is wrong), and
the log-mel features the encoder takes, against transformers' WhisperFeatureExtractor.

The [hf] extra (transformers)."""

import wave
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import audio as AU  # noqa: E402
from attnexport.pretrained import speech as S  # noqa: E402


def wav(path: Path, samples: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> Path:
    """A WAV file of `samples` (in [-1, 1]) at `rate`, each sample repeated on `channels`, 8- or 16-bit."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        kind = {1: np.uint8, 2: np.int16}[width]
        scaled = (samples * 100 + 128) if width == 1 else samples * 32767
        w.writeframes(np.repeat(scaled.astype(kind), channels).tobytes())
    return path


@pytest.mark.parametrize("mels", [80, 128])
def test_the_log_mel_features_are_transformers_whisper_features(mels):
    clip = S.check_audio(4.0, seed=3)
    extractor = transformers.WhisperFeatureExtractor(feature_size=mels)
    want = extractor(clip, sampling_rate=16000, return_tensors="np").input_features[0]
    got = AU.log_mel(clip, mels)
    assert got.shape == want.shape == (mels, 3000)
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(AU.mel_filters(mels) - extractor.mel_filters).max() < 1e-6


def test_a_wav_file_reads_as_its_samples(tmp_path):
    clip = S.check_audio(1.0, seed=2) * 0.5
    got = AU.read_wav(wav(tmp_path / "clip.wav", clip))
    assert got.dtype == np.float32 and got.shape == clip.shape
    assert np.abs(got - clip).max() < 1 / 16000  # 16-bit rounding


@pytest.mark.parametrize("how,text", [
    ({"rate": 8000}, "sampled at 8000 Hz; Whisper takes 16000 Hz audio"),
    ({"channels": 2}, "2 channels"),
    ({"width": 1}, "8-bit samples"),
    ({"seconds": 31}, "31.00 s of audio"),
])
def test_audio_of_the_wrong_rate_shape_or_length_is_refused_saying_why(tmp_path, how, text):
    seconds = how.pop("seconds", 1)
    clip = np.tile(np.sin(np.linspace(0, 100, 16000)).astype(np.float32) * 0.3, seconds)
    with pytest.raises(UsageError, match=text):
        AU.read_wav(wav(tmp_path / "clip.wav", clip, **how))


def test_what_is_not_one_channel_of_float_samples_is_refused(tmp_path):
    (tmp_path / "text.wav").write_text("not audio")
    with pytest.raises(UsageError, match="not a WAV file"):
        AU.read_wav(tmp_path / "text.wav")
    with pytest.raises(UsageError, match="no such file"):
        AU.read_wav(tmp_path / "absent.wav")
    with pytest.raises(UsageError, match="one channel"):
        AU.samples(np.zeros((2, 100), np.float32))
    with pytest.raises(UsageError, match="int16 samples"):
        AU.samples(np.zeros(100, np.int16))
    with pytest.raises(UsageError, match="NaN"):
        AU.samples(np.full(100, np.nan, np.float32))
