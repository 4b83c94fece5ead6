"""Where an encoder graph's time goes on ONNX Runtime's CPU provider: each ONNX file run 5 times with
the session's profiler on (2 threads), its kernels' time summed by op, in ms a run (the mean of the runs).
docs/encoders.md's profile table is this script's output:

    python benchmarks/ort_profile.py 32x128 OUT_DIR model-a.onnx model-b.onnx ...

The inputs are random token ids (input_ids, attention_mask of ones, token_type_ids of zeros, each
where the graph takes it) of BATCHxSEQ; the profiler's JSON files go into OUT_DIR."""

import collections
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


def profile(path: str, batch: int, seq: int, out: Path, runs: int = 5) -> tuple[float, collections.Counter]:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    options.enable_profiling, options.profile_file_prefix = True, str(out / Path(path).stem)
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(1000, 20000, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64), "token_type_ids": np.zeros((batch, seq), np.int64)}
    feed = {i.name: feed[i.name] for i in session.get_inputs()}
    for _ in range(runs):
        session.run(None, feed)
    by_op: collections.Counter = collections.Counter()
    events = json.loads(Path(session.end_profiling()).read_text())
    seen = 0
    for e in events:
        if e.get("name") == "model_run":
            seen += 1
    # The profiler has no per-run marker on kernels: every run's kernels summed, divided by the runs.
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / 1e3
    return seen, by_op


def main() -> None:
    shape, out, *paths = sys.argv[1:]
    batch, seq = map(int, shape.split("x"))
    Path(out).mkdir(parents=True, exist_ok=True)
    for path in paths:
        runs, by_op = profile(path, batch, seq, Path(out))
        total = sum(by_op.values()) / runs
        ops = " ".join(f"{op} {ms / runs:.1f}" for op, ms in by_op.most_common(12))
        print(f"{Path(path).name}: {total:.1f} ms a run in kernels; {ops}")


if __name__ == "__main__":
    main()
