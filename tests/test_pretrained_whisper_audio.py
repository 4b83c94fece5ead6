"""The client's side of Whisper: WAV files read (or refused in one line, saying what is wrong), and
the log-mel features the encoder takes, against transformers' WhisperFeatureExtractor.

The [hf] extra (transformers)."""

import wave
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained.whisper import audio as AU  # noqa: E402
from attnexport.pretrained.whisper import export as S  # noqa: E402


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


def riff(path: Path, body: bytes, tag: int, bits: int, rate: int = 16000, channels: int = 1,
         extensible: bool = False, claimed: int | None = None) -> Path:
    """A WAV file written byte by byte: a format chunk (`tag` 1 integer PCM, 3 float; `extensible`:
    tag 0xFFFE naming `tag` in its sub-format), a list chunk a reader must skip, then a data chunk
    holding `body` whose header claims `claimed` bytes (default: its length)."""
    import struct
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * block, block, bits)
    if extensible:  # cbSize, valid bits, channel mask, then the sub-format GUID (its first two bytes the tag)
        fmt += struct.pack("<HHI", 22, bits, 4) + struct.pack("<H", tag) + bytes.fromhex("000000001000800000aa00389b71")
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\0"
    chunks += b"data" + struct.pack("<I", len(body) if claimed is None else claimed) + body
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)
    return path


def test_every_sample_format_a_recorder_writes_reads_as_its_samples(tmp_path):
    """Hand-made files of the same four samples, 0, 0.5, -0.5, -1, in each format: 8-bit PCM
    (unsigned, centred on 128), 16-, 24- and 32-bit PCM, 32- and 64-bit float, plain and extensible."""
    want = np.array([0.0, 0.5, -0.5, -1.0], np.float32)
    files = {
        "pcm8": riff(tmp_path / "a.wav", bytes([128, 192, 64, 0]), 1, 8),
        "pcm16": riff(tmp_path / "b.wav", np.array([0, 16384, -16384, -32768], "<i2").tobytes(), 1, 16),
        "pcm24": riff(tmp_path / "c.wav", bytes([0, 0, 0, 0, 0, 0x40, 0, 0, 0xC0, 0, 0, 0x80]), 1, 24),
        "pcm32": riff(tmp_path / "d.wav", np.array([0, 2**30, -2**30, -2**31], "<i4").tobytes(), 1, 32),
        "float32": riff(tmp_path / "e.wav", want.astype("<f4").tobytes(), 3, 32),
        "float64": riff(tmp_path / "f.wav", want.astype("<f8").tobytes(), 3, 64),
        "float32, extensible": riff(tmp_path / "g.wav", want.astype("<f4").tobytes(), 3, 32, extensible=True),
        "pcm16, extensible": riff(tmp_path / "h.wav", np.array([0, 16384, -16384, -32768], "<i2").tobytes(), 1, 16,
                                  extensible=True),
    }
    for name, path in files.items():
        got = AU.read_wav(path)
        assert got.dtype == np.float32 and np.array_equal(got, want), (name, got)


@pytest.mark.parametrize("make,text", [
    (lambda p: riff(p, b"\0\0" * 100, 1, 16, claimed=400), "truncated: its data chunk holds 400 bytes, the file "
                                                              "ends after 200"),
    (lambda p: riff(p, b"", 1, 16), "holds no samples"),
    (lambda p: riff(p, b"\0" * 300, 6, 8), "8-bit format 6 samples; this reads integer PCM"),
    (lambda p: riff(p, b"\0" * 300, 1, 12), "12-bit integer PCM samples"),
])
def test_a_truncated_empty_or_foreign_wav_is_refused_saying_why(tmp_path, make, text):
    with pytest.raises(UsageError, match=text):
        AU.read_wav(make(tmp_path / "clip.wav"))


@pytest.mark.parametrize("how,text", [
    ({"rate": 8000}, "sampled at 8000 Hz; Whisper takes 16000 Hz audio"),
    ({"channels": 2}, "2 channels"),
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
