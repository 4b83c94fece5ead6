"""What the log-mel features a Whisper engine is fed do to its transcripts: CTranslate2 in float32
and int8 on the same model.bin, fed transformers' WhisperFeatureExtractor features (what its users
compute) and attnexport's `audio.log_mel` (at most 3.5e-5 away), each transcript against
transformers' fp32 greedy one from transformers' features: the share of its tokens at their places
and the word error rate, clip by clip.

    pip install ctranslate2
    python benchmarks/probes/speech_clips.py clips
    python benchmarks/probes/ctranslate2_features.py TINY_EN beckett.wav clips/clip*.wav
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def main() -> None:
    import ctranslate2

    from attnexport.pretrained import model as hf
    from attnexport.pretrained.encdec import cost as COST
    from attnexport.pretrained.whisper import audio as AU
    from attnexport.pretrained.whisper import bench as SB
    from attnexport.pretrained.whisper import check as SC
    from attnexport.pretrained.whisper import clients as whisper_clients
    from attnexport.pretrained.whisper import export as S
    source, clips = sys.argv[1], sys.argv[2:]
    model, _ = hf.load(source)
    speech = S.Speech.of(model, source)
    engines = {p: ctranslate2.models.Whisper(source, device="cpu", compute_type=c, intra_threads=2)
               for p, c in (("fp32", "float32"), ("int8", "int8"))}
    for clip in clips:
        audio = AU.read_wav(clip)
        fed = {"transformers'": SB.transformers_features(audio, speech.mels),
               "attnexport's": AU.log_mel(audio, speech.mels)[None]}
        want = SC.reference_transcripts(speech, fed["transformers'"], 200)[0]
        apart = float(np.abs(fed["transformers'"] - fed["attnexport's"]).max())
        line = [f"{Path(clip).name} (features {apart:.1e} apart)"]
        for precision, engine in engines.items():
            for who, features in fed.items():
                out = engine.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(features)),
                                      [speech.start], beam_size=1, max_length=len(speech.start) + 200)
                agree, wer = COST.agreement(whisper_clients.spoken(out[0].sequences_ids[0], speech.end), want,
                                             speech.decode)
                line.append(f"{precision} fed {who}: {agree:.0%} of the tokens, WER {wer:.2f}")
        print("; ".join(line))


if __name__ == "__main__":
    main()
