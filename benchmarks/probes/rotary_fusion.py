"""The Llama layer's attention-flavour export with rotary embeddings fused into RotaryEmbedding
(what attnexport ships, cos and sin expanded to the batch) against the same export unfused, on
ONNX Runtime's CPU provider. The README's fused/unfused timings quote what this prints.

    pip install -e ".[hf]"
    python benchmarks/probes/rotary_fusion.py [--batch 4] [--seq 512] [--rounds 3] [--iters 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import numpy as np


def build(fused: bool):
    from attnexport import export as E
    from attnexport import modules as M
    module, example = M.load("examples/transformers_modules.py:llama")
    if not fused:  # onnxscript's rotary fusion off for this process: the unfused graph
        from onnxscript.rewriter.rules.fusion import _rotary_embedding
        _rotary_embedding.fuse_rotary_embedding = lambda model, debug=False: 0
    return E.export_module(module, example, flavor="attention", name="llama").model


def main() -> None:
    from attnexport import runtimes as R
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    models = {"fused": build(True), "unfused": build(False)}
    for name, model in models.items():
        print(f"{name}: {Counter(n.op_type for n in model.graph.node).get('RotaryEmbedding', 0)} RotaryEmbedding "
              f"nodes, {len(model.graph.node)} nodes")
    feed = {"hidden_states": np.random.default_rng(0).standard_normal((args.batch, args.seq, 64)).astype(np.float32)}
    medians = {name: [] for name in models}
    for _ in range(args.rounds):  # alternating, so that a slow spell of the machine hits both
        for name, model in models.items():
            session = R.prepare_onnx("ort-cpu", model)
            for _ in range(5):
                session.run(feed)
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                session.run(feed)
                times.append((time.perf_counter() - t0) * 1e3)
            medians[name].append(statistics.median(times))
    for name, ms in medians.items():
        print(f"{name}: median ms per round {', '.join(f'{m:.2f}' for m in ms)}")


if __name__ == "__main__":
    main()
