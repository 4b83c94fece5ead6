"""Whisper's int8 forms timed beside each other and CTranslate2's int8, on one clip, as bench times
them (`whisper.bench`: its engines, the encoder over 30 s and the whole greedy transcription, a median
of `iters` after 2 warm-up runs), in rounds that take turns so that a drift of the machine falls on
every folder alike; each transcript compared with the first folder's. Then each folder's encoder
under ONNX Runtime's profiler (`PROFILE_RUNS` runs of one 30 s window, its kernel time by op type:
where the encoder's time goes). docs/whisper.md, "int8's two forms", for the folders:

    attnexport export --hf $TINY_EN --deploy int8-blockwise --precision int8 --int8-kernel blockwise
    attnexport export --hf $TINY_EN --deploy int8-integer --precision int8 --int8-kernel integer
    # every graph integer, the decoder's too: the same export with Speech.integer_graphs = all three
    python benchmarks/probes/whisper_int8_kernels.py $TINY_EN beckett.wav OUT.json int8-blockwise int8-integer ...
"""

import collections
import functools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from attnexport import runtimes as R
from attnexport.bench import stats_of
from attnexport.pretrained import model as hf
from attnexport.pretrained.whisper import audio as AU
from attnexport.pretrained.whisper import bench as WB
from attnexport.pretrained.whisper import export as S

ROUNDS, ITERS, THREADS, NEW_TOKENS = 2, 10, 2, 128
PROFILE_RUNS = 5


def encoder_profile(folder: Path, features: np.ndarray) -> dict:
    """{op type: kernel ms a run} of the folder's encoder under ONNX Runtime's profiler, the first
    (warm-up) run left out."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = THREADS
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "encoder")
        session = ort.InferenceSession(str(folder / "onnx" / "encoder_model.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        for _ in range(PROFILE_RUNS + 1):
            session.run(None, {"input_features": features})
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"])
    warm = runs[0]["ts"] + runs[0]["dur"]
    by: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= warm:
            by[e["args"]["op_name"]] += e["dur"] / 1e3 / PROFILE_RUNS
    return {op: round(ms, 2) for op, ms in by.most_common()}


def main() -> None:
    source, clip_path, out, *folders = sys.argv[1:]
    model, _ = hf.load(source, 0)
    speech = S.Speech.of(model, source)
    clip = AU.read_wav(clip_path)
    features = {"transformers": WB.transformers_features(clip, speech.mels),
                "attnexport": AU.log_mel(clip, speech.mels)[None]}
    info: dict = {"skipped": {}}
    # each folder's row named for its folder (the form it holds)
    engines = [WB.attnexport_engine(Path(f), "attention", "int8", speech, NEW_TOKENS, THREADS, Path(f).name)
               for f in folders]
    engines += [e for e in WB.ctranslate2_engines(Path(source), speech, NEW_TOKENS, THREADS, info)
                if e.precision == "int8"]
    want = None
    runs: dict = {}
    for round_ in range(ROUNDS):
        for e in engines:
            fed = features[e.features]
            got = e.transcribe(fed)
            want = want if want is not None else got
            enc = R.time_calls(functools.partial(e.encode, fed), 2, ITERS)
            whole = R.time_calls(functools.partial(e.transcribe, fed), 2, ITERS)
            (e50, e10, e90), (t50, t10, t90) = stats_of(enc), stats_of(whole)
            row = {"encoder_ms": e50, "encoder_p10_ms": e10, "encoder_p90_ms": e90, "transcription_ms": t50,
                   "transcription_p10_ms": t10, "transcription_p90_ms": t90, "token_ms": (t50 - e50) / (len(got) + 1),
                   "tokens": len(got), "transcript": got, "equal_to_first": got == want}
            runs.setdefault(e.kernel or f"{e.engine} {e.precision}", []).append(row)
            print(f"round {round_ + 1} {e.kernel or e.engine}: encoder {e50:.1f} ms ({e10:.1f}-{e90:.1f}), "
                  f"{row['token_ms']:.2f} ms a token, transcription {t50:.1f} ms ({t10:.1f}-{t90:.1f}), "
                  f"{len(got)} tokens", flush=True)
    profiles = {Path(f).name: encoder_profile(Path(f), features["attnexport"]) for f in folders}
    for name, ops in profiles.items():
        total = sum(ops.values())
        print(f"{name} encoder, kernel time a run: {total:.1f} ms; "
              + ", ".join(f"{op} {ms:.1f} ({ms / total:.0%})" for op, ms in list(ops.items())[:4]))
    Path(out).write_text(json.dumps({"source": str(source), "clip": str(clip_path), "threads": THREADS,
                                     "encoder_profiles": profiles,
                                     "iters": ITERS, "rounds": runs, "info": info,
                                     "median_transcription_ms": {k: float(np.median([r["transcription_ms"] for r in v]))
                                                                 for k, v in runs.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
