"""Where a static-cache decoding step spends its time on ONNX Runtime's CPU provider: the mha step
(dim 512, 8 heads, batch 1) over buffers of --max-seq positions with --context of them written,
its buffers bound in place, profiled by ONNX Runtime (kernel time per op type, summed over runs).

    python benchmarks/probes/static_profile.py [--max-seq 8193] [--context 1024] [--runs 30]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import numpy as np


def main() -> None:
    import onnxruntime as ort

    from attnexport import export as E
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-seq", type=int, default=8193)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.onnx")
        E.export("mha", {"kv_cache": True, "max_seq": args.max_seq, "causal": True, "batch": 1, "dim": 512,
                         "heads": 8, "seq": 1, "past_seq": args.context}, "attention", output=path)
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "profile")
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        buffers = {n: ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, 8, args.max_seq, 64)).astype(np.float32))
                   for n in ("key_cache", "value_cache")}
        binding = session.io_binding()
        binding.bind_output("output", "cpu")
        for n, v in buffers.items():
            binding.bind_ortvalue_input(n, v)
            binding.bind_ortvalue_output(n + "_out", v)
        binding.bind_cpu_input("x", rng.standard_normal((1, 1, 512)).astype(np.float32))
        binding.bind_cpu_input("write_pos", np.array([args.context], np.int64))
        for _ in range(5):
            session.run_with_iobinding(binding)
        times = []
        for _ in range(args.runs):
            binding.bind_output("output", "cpu")
            t0 = time.perf_counter()
            session.run_with_iobinding(binding)
            times.append((time.perf_counter() - t0) * 1e3)
        events = json.load(open(session.end_profiling()))
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    total = sum(per_op.values())
    print(f"max_seq {args.max_seq}, context {args.context}: step median {np.median(times):.3f} ms "
          f"over {args.runs} runs")
    for op, us in per_op.most_common(6):
        print(f"  {op:14} {us / total:6.1%} of kernel time")


if __name__ == "__main__":
    main()
