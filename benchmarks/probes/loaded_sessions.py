"""What a shared machine costs Whisper's transcription on ONNX Runtime, session option by session
option, beside CTranslate2: each engine transcribes one clip (greedy) on a quiet machine and under
`attnexport.load`'s fixed background load (N busy processes, one core each), with ONNX Runtime's
intra-op pool spinning or not between runs, on 2 threads or 1, with and without
`session.dynamic_block_base` (work handed out in shrinking blocks, so that a thread the scheduler
took away holds up less). docs/whisper.md's table of session settings is this script's output:

    attnexport export --hf TINY_EN --deploy tiny-fp32
    attnexport export --hf TINY_EN --deploy tiny-int8 --precision int8
    python benchmarks/probes/loaded_sessions.py TINY_EN beckett.wav tiny-fp32 tiny-int8 --load 0,1,2 --out F.json

A cell is the median of 10 transcriptions after 2 (p10-p90 beside it), every engine timed back to back
under the same load."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from attnexport import load as background_load
from attnexport.pretrained import model as hf
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import bench as WB
from attnexport.pretrained.whisper import export as S
from attnexport.pretrained.whisper import graphs as W

# (threads, spinning, dynamic_block_base) of each ONNX Runtime session tried
SETTINGS = [(2, True, 0), (2, True, 4), (2, False, 0), (2, False, 4), (1, True, 0), (1, False, 0)]
NEW_TOKENS = 64


def attnexport_engine(folder: Path, speech, threads: int, spinning: bool, block_base: int):
    def session(path: Path) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if block_base:
            options.add_session_config_entry("session.dynamic_block_base", str(block_base))
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    encoder, decoder = (session(folder / S.GRAPH_DIR / f"{g}.onnx") for g in (W.ENCODER, W.MERGED))

    def runner(s):
        names = [o.name for o in s.get_outputs()]
        return lambda feed: dict(zip(names, s.run(None, feed), strict=True))
    run_encoder = W.typed(runner(encoder), encoder)
    first, later = G.merged_steps(W.typed(runner(decoder), decoder), speech.spec)
    return lambda f: W.transcribe(run_encoder, first, later, f, speech.tokens, speech.layers, NEW_TOKENS)[0]


def ctranslate2_engine(source: str, speech, compute: str, threads: int):
    import ctranslate2
    model = ctranslate2.models.Whisper(source, device="cpu", compute_type=compute, intra_threads=threads)
    length = WB.ctranslate2_length(NEW_TOKENS, len(speech.start), speech.model.config.max_target_positions)
    return lambda f: model.generate(ctranslate2.StorageView.from_array(np.ascontiguousarray(f)), [speech.start],
                                    beam_size=1, max_length=length)


def timed(fn, features, iters: int = 10, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn(features)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(features)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": round(statistics.median(times), 1), "p10_ms": round(float(np.percentile(times, 10)), 1),
            "p90_ms": round(float(np.percentile(times, 90)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("audio", type=Path)
    parser.add_argument("fp32", type=Path)
    parser.add_argument("int8", type=Path)
    parser.add_argument("--load", default="0,1,2")
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    clip = AU.read_wav(a.audio)
    model, _ = hf.load(a.source, 0)
    speech = S.Speech.of(model, a.source)
    ours, theirs = AU.log_mel(clip, speech.mels)[None], WB.transformers_features(clip, speech.mels)
    rows = []
    for load in (int(n) for n in a.load.split(",")):
        with background_load.background(load):
            time.sleep(1)
            for precision, folder, compute in (("fp32", a.fp32, "float32"), ("int8", a.int8, "int8")):
                for threads, spinning, base in SETTINGS:
                    cell = timed(attnexport_engine(folder, speech, threads, spinning, base), ours)
                    rows.append({"load": load, "engine": "attnexport", "precision": precision, "threads": threads,
                                 "spinning": spinning, "dynamic_block_base": base, **cell})
                    print(json.dumps(rows[-1]), flush=True)
                for threads in (2, 1):
                    cell = timed(ctranslate2_engine(a.source, speech, compute, threads), theirs)
                    rows.append({"load": load, "engine": "ctranslate2", "precision": precision, "threads": threads,
                                 **cell})
                    print(json.dumps(rows[-1]), flush=True)
    a.out.write_text(json.dumps({"load": background_load.describe(1), "new_tokens": NEW_TOKENS, "rows": rows},
                                indent=1) + "\n")


if __name__ == "__main__":
    main()
