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
    # Numbers, said as a reader says them (Whisper writes some as digits, some as words).
    "The invoice came to 4,582 dollars and 37 cents, due on March 12, 2027, account 90210.",
    "Take 2 tablets every 8 hours, no more than 6 in 24 hours, and call 555 0134 if the fever stays above 39 degrees.",
    # Long clips (about 20 to 28 seconds): the decoder's later positions and the self cache's reach.
    "When the committee met again in the autumn, it found that the new library had drawn more readers than any "
    "year before it, that the children's room was full every afternoon, and that the old reading room, which "
    "many had thought too quiet to last, now held a waiting list of students who came for its long tables and "
    "its silence.",
    "In 1969 the first crew landed on the moon, in 1971 a fourth crew drove a rover for 27 kilometres, and by "
    "1972 twelve people had walked there; the missions cost about 25 billion dollars, and brought back 382 "
    "kilograms of rock and dust.",
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
