"""Five spoken sentences as 16 kHz mono WAV clips, for measuring what a quantized Whisper export
costs in transcripts beyond one clip (docs/whisper.md): Debian's espeak-ng speaks each sentence
(22050 Hz), resampled here to Whisper's 16 kHz by linear interpolation.

    apt-get install -y espeak-ng
    python benchmarks/probes/speech_clips.py CLIPS_FOLDER
    attnexport verify whisper-int8 --hf $W --audio beckett.wav --audio CLIPS_FOLDER/clip1.wav ... --runtimes ort-cpu
"""

import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np

SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is cloudy with a chance of rain in the afternoon.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Our meeting starts at ten o'clock on Monday morning in the second floor conference room.",
)
RATE = 16000


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, sentence in enumerate(SENTENCES, 1):
            spoken = Path(tmp) / f"{i}.wav"
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(spoken), sentence], check=True)
            with wave.open(str(spoken)) as w:
                rate = w.getframerate()
                x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float64)
            t = np.arange(int(len(x) * RATE / rate)) * rate / RATE
            y = np.clip(np.interp(t, np.arange(len(x)), x), -32768, 32767).astype(np.int16)
            with wave.open(str(out / f"clip{i}.wav"), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(RATE)
                w.writeframes(y.tobytes())
            print(out / f"clip{i}.wav", f"{len(y) / RATE:.1f} s")


if __name__ == "__main__":
    main()
