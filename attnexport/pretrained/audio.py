"""Speech for Whisper, as its clients prepare it: a WAV file read (16 kHz, mono, 16-bit PCM or
32-bit float), and the log-mel spectrogram the encoder takes, computed here in NumPy as a client
computes it (the exported graphs start at the features, as transformers.js' and Optimum's do):
30 s of audio (padded with silence or refused when longer), a 400-point short-time Fourier
transform every 160 samples with a periodic Hann window over the signal reflected at its ends, the
power spectrum through Slaney-style mel filters (0 to 8 kHz), log10 (floored at 1e-10), clipped to
8 below its maximum, then (x + 4) / 4.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from attnexport.errors import UsageError

RATE = 16000
SECONDS = 30
SAMPLES = RATE * SECONDS
N_FFT = 400
HOP = 160


def read_wav(path: str | Path) -> np.ndarray:
    """The samples of a 16 kHz mono WAV file as float32 in [-1, 1]; a UsageError saying what is
    wrong with any other (its rate, its channels, its sample format, a file that is not a WAV)."""
    path = Path(path)
    try:
        with wave.open(str(path), "rb") as w:
            rate, channels, width, frames = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            raw = w.readframes(frames)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (wave.Error, EOFError) as e:
        raise UsageError(f"{path}: not a WAV file this reads ({e}; 16-bit PCM, 16 kHz, mono)") from None
    if rate != RATE:
        raise UsageError(f"{path}: sampled at {rate} Hz; Whisper takes {RATE} Hz audio (resample it first, "
                         f"e.g. ffmpeg -i IN -ar {RATE} -ac 1 OUT.wav)")
    if channels != 1:
        raise UsageError(f"{path}: {channels} channels; Whisper takes mono audio (ffmpeg -i IN -ac 1 OUT.wav)")
    if width != 2:
        raise UsageError(f"{path}: {8 * width}-bit samples; this reads 16-bit PCM WAV files")
    return samples(np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0, str(path))


def samples(audio, what: str = "the audio") -> np.ndarray:
    """`audio` as one channel of float32 samples of at most 30 s; a UsageError otherwise."""
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise UsageError(f"{what}: shape {audio.shape}; one channel of samples (N,) is what Whisper takes")
    if not np.issubdtype(audio.dtype, np.floating):
        raise UsageError(f"{what}: {audio.dtype} samples; float samples in [-1, 1] are what this takes")
    if audio.size == 0 or audio.size > SAMPLES:
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
