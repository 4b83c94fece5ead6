"""Speech for Whisper, as its clients prepare it: a WAV file read (16 kHz, mono, integer PCM or
float samples), and the log-mel spectrogram the encoder takes, computed here in NumPy as a client
computes it (the exported graphs start at the features, as transformers.js' and Optimum's do):
30 s of audio (padded with silence or refused when longer), a 400-point short-time Fourier
transform every 160 samples with a periodic Hann window over the signal reflected at its ends, the
power spectrum through Slaney-style mel filters (0 to 8 kHz), log10 (floored at 1e-10), clipped to
8 below its maximum, then (x + 4) / 4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnexport.errors import UsageError

RATE = 16000
SECONDS = 30
SAMPLES = RATE * SECONDS
N_FFT = 400
HOP = 160


# WAVE format tags: integer PCM, IEEE float, and the extensible header that names either in its GUID.
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def read_wav(path: str | Path) -> np.ndarray:
    """The samples of a 16 kHz mono WAV file as float32 in [-1, 1] (integer PCM of 8, 16, 24 or 32
    bits, or 32- or 64-bit float, plain or extensible header); a UsageError saying what is wrong
    with any other: its rate, its channels, its sample format, no samples, a data chunk that the
    file ends inside (a truncated file: transcribing what is left would say less than was spoken),
    a file that is not a WAV."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: a folder, not a WAV file") from None
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise UsageError(f"{path}: not a WAV file (no RIFF/WAVE header)")
    fmt, body, at = None, None, 12
    while at + 8 <= len(data):
        kind, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        start = at + 8
        if kind == b"fmt ":
            fmt = data[start:start + size]
        elif kind == b"data":
            if start + size > len(data):
                raise UsageError(f"{path}: truncated: its data chunk holds {size} bytes, the file ends after "
                                 f"{len(data) - start}")
            body = data[start:start + size]
            break
        at = start + size + (size & 1)  # chunks are padded to an even length
    if fmt is None or len(fmt) < 16:
        raise UsageError(f"{path}: not a WAV file this reads (no format chunk)")
    if body is None:
        raise UsageError(f"{path}: no data chunk: it holds no samples")
    tag, channels, rate = (int.from_bytes(fmt[a:b], "little") for a, b in ((0, 2), (2, 4), (4, 8)))
    bits = int.from_bytes(fmt[14:16], "little")
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = int.from_bytes(fmt[24:26], "little")  # the sub-format GUID's first two bytes
    if rate != RATE:
        raise UsageError(f"{path}: sampled at {rate} Hz; Whisper takes {RATE} Hz audio (resample it first, "
                         f"e.g. ffmpeg -i IN -ar {RATE} -ac 1 OUT.wav)")
    if channels != 1:
        raise UsageError(f"{path}: {channels} channels; Whisper takes mono audio (ffmpeg -i IN -ac 1 OUT.wav)")
    width = bits // 8
    if (tag, bits) not in {(_PCM, 8), (_PCM, 16), (_PCM, 24), (_PCM, 32), (_FLOAT, 32), (_FLOAT, 64)}:
        named = {_PCM: "integer PCM", _FLOAT: "float"}.get(tag, f"format {tag}")
        raise UsageError(f"{path}: {bits}-bit {named} samples; this reads integer PCM of 8, 16, 24 or 32 bits and "
                         "32- or 64-bit float")
    body = body[:len(body) - len(body) % width]
    if not body:
        raise UsageError(f"{path}: holds no samples")
    if tag == _FLOAT:
        audio = np.frombuffer(body, "<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:  # unsigned, centred on 128
        audio = (np.frombuffer(body, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif bits == 24:
        raw = np.frombuffer(body, np.uint8).reshape(-1, 3).astype(np.int32)
        value = raw[:, 0] | raw[:, 1] << 8 | raw[:, 2] << 16
        audio = (np.where(value >= 1 << 23, value - (1 << 24), value) / float(1 << 23)).astype(np.float32)
    else:
        audio = (np.frombuffer(body, f"<i{width}").astype(np.float64) / float(1 << (bits - 1))).astype(np.float32)
    return samples(audio, str(path))


def samples(audio, what: str = "the audio") -> np.ndarray:
    """`audio` as one channel of float32 samples of at most 30 s; a UsageError otherwise."""
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise UsageError(f"{what}: shape {audio.shape}; one channel of samples (N,) is what Whisper takes")
    if not np.issubdtype(audio.dtype, np.floating):
        raise UsageError(f"{what}: {audio.dtype} samples; float samples in [-1, 1] are what this takes")
    if audio.size == 0:
        raise UsageError(f"{what}: holds no samples")
    if audio.size > SAMPLES:
        raise UsageError(f"{what}: {audio.size / RATE:.2f} s of audio; one window of Whisper is up to {SECONDS} s "
                         "(split longer audio)")
    if not np.isfinite(audio).all():
        raise UsageError(f"{what}: holds NaN or infinite samples")
    return audio.astype(np.float32)


def _hz_to_mel(hz):
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, np.float64)
    mel = 3.0 * hz / 200.0
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, mel)


def _mel_to_hz(mel):
    mel = np.asarray(mel, np.float64)
    hz = 200.0 * mel / 3.0
    log_part = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log_part, hz)


def mel_filters(mels: int) -> np.ndarray:
    """(N_FFT // 2 + 1, mels) triangular filters, evenly spaced on Slaney's mel scale from 0 to
    8 kHz, each scaled to unit area (Slaney's normalisation)."""
    bins = np.linspace(0, RATE / 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(RATE / 2), mels + 2))
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (bins[:, None] - lower) / (centre - lower)
    falling = (upper - bins[:, None]) / (upper - centre)
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (upper - lower))


def log_mel(audio, mels: int = 80) -> np.ndarray:
    """The encoder's input (mels, 3000) float32 for one clip (see the module's text)."""
    audio = samples(audio).astype(np.float64)
    padded = np.zeros(SAMPLES, np.float64)
    padded[:audio.size] = audio
    signal = np.pad(padded, N_FFT // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    frames = np.lib.stride_tricks.sliding_window_view(signal, N_FFT)[::HOP][:SAMPLES // HOP]
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    spectrum = np.log10(np.maximum(power @ mel_filters(mels), 1e-10))
    spectrum = np.maximum(spectrum, spectrum.max() - 8.0)
    return ((spectrum + 4.0) / 4.0).T.astype(np.float32)
