"""Where the time of the MHA block goes on ONNX Runtime's CPU provider: per-node kernel times.

Exports `mha` (dim 512, 8 heads, fp32) in a flavour, runs it at batch x seq with ONNX Runtime's
profiler on, and prints (and writes with --json) the mean kernel time of every node over the
profiled runs and its share of the total.

    python benchmarks/probes/cpu_profile.py --flavor ort --batch 8 --seq 512 --runs 12 \
        --json benchmarks/results/2026-11-23-cpu/profile-ort-8x512.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict

import numpy as np
import onnxruntime as ort

from attnexport import export as E


def profile(flavor: str, batch: int, seq: int, runs: int, threads: int | None) -> dict:
    options = {"dim": 512, "heads": 8}
    model, _ = E.build_model("mha", options, flavor)
    ops = {node.name: node.op_type for node in model.graph.node}
    with tempfile.TemporaryDirectory() as folder:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(folder, "profile")
        if threads:
            so.intra_op_num_threads = threads
        session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((batch, seq, 512)).astype(np.float32)
        for _ in range(2):  # warm-up, profiled too: dropped below by run index
            session.run(None, {"x": x})
        for _ in range(runs):
            session.run(None, {"x": x})
        path = session.end_profiling()
        events = json.load(open(path))
    per_node = defaultdict(list)
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            per_node[ev["name"][: -len("_kernel_time")]].append(ev["dur"])
    nodes = []
    for name, durs in per_node.items():
        timed = durs[2:] if len(durs) == runs + 2 else durs  # the warm-up runs first
        mean_us = float(np.mean(timed))
        nodes.append({"node": name, "op": ops.get(name, "?"), "mean_us": round(mean_us, 1),
                      "runs": len(timed)})
    nodes.sort(key=lambda n: -n["mean_us"])
    total = sum(n["mean_us"] for n in nodes)
    return {"variant": "mha", "options": options, "flavor": flavor, "batch": batch, "seq": seq,
            "runs": runs, "threads": threads or os.cpu_count(), "onnxruntime": ort.__version__,
            "total_kernel_us": round(total, 1), "nodes": nodes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="ort")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="Also write the result here.")
    args = parser.parse_args()
    result = profile(args.flavor, args.batch, args.seq, args.runs, args.threads)
    for n in result["nodes"]:
        share = n["mean_us"] / result["total_kernel_us"]
        print(f"{n['op']:>28} {n['node']:<40} {n['mean_us'] / 1e3:8.2f} ms  {share:6.1%}")
    print(f"total kernel time {result['total_kernel_us'] / 1e3:.2f} ms per run over {args.runs} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
