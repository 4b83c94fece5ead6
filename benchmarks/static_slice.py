"""The attention flavour's static step two ways, in one process: `Attention`-24 over the whole
buffers (masking what lies past nonpad_kv_seqlen) and over the buffers sliced to the longest valid
prefix; and the ort flavour's GroupQueryAttention beside them. mha, dim 512, 8 heads, batch 1, one
token, buffers bound in place (IO binding), median ms of --runs after warm-up, alternating rounds.

    python benchmarks/static_slice.py [--max-seq 8193] [--context 128,1024,4096,8192] [--runs 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np


def _sliced_translation():
    from attnexport import onnx_attention as OA

    def attention_static_sliced(query, key, value, key_cache, value_cache, write_pos, valid, scale=None,
                                 is_causal=False, softcap=0.0, softmax_precision=None):
        """The attention flavour's static step over the buffers' longest valid prefix: TensorScatter
        writes the block (in place, when bound so), then `Attention`-24 reads the buffers sliced to
        max(valid) positions with `nonpad_kv_seqlen` = valid, so that ONNX Runtime's CPU kernel, which
        computes over every position it is given, is given the context instead of the buffer. The
        Slice copies the prefix it keeps (ONNX Runtime has no views): a step reads the context twice
        instead of the buffer once."""
        key_cache = OA._like(OA._tensor_scatter(key_cache, key, write_pos), key_cache)
        value_cache = OA._like(OA._tensor_scatter(value_cache, value, write_pos), value_cache)
        end = OA.op.ReduceMax(valid, keepdims=1)
        zero, axis = OA.op.Constant(value_ints=[0]), OA.op.Constant(value_ints=[2])
        keys, values = OA.op.Slice(key_cache, zero, end, axis), OA.op.Slice(value_cache, zero, end, axis)
        keys.type, values.type = key_cache.type, value_cache.type
        keys.shape = OA.ir.Shape([key_cache.shape[0], key_cache.shape[1], None, key_cache.shape[3]])
        values.shape = OA.ir.Shape([value_cache.shape[0], value_cache.shape[1], None, value_cache.shape[3]])
        core = OA.Core(scale, is_causal, softcap, OA.NO_WEIGHTS, softmax_precision)
        out = OA._with_weights_beside(OA._standard)(query, keys, values, None, None, valid, core)[0]
        return out, key_cache, value_cache

    return attention_static_sliced


def _step(model, context: int, max_seq: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    buffers = {n: ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, 8, max_seq, 64)).astype(np.float32))
               for n in ("key_cache", "value_cache")}
    binding = session.io_binding()
    binding.bind_output("output", "cpu")
    binding.bind_cpu_input("x", rng.standard_normal((1, 1, 512)).astype(np.float32))
    binding.bind_cpu_input("write_pos", np.array([context], np.int64))
    for n, b in buffers.items():
        binding.bind_ortvalue_input(n, b)
        binding.bind_ortvalue_output(n + "_out", b)
    return lambda: session.run_with_iobinding(binding)


def main() -> None:
    from attnexport import export as E
    from attnexport import onnx_attention as OA
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-seq", type=int, default=8193)
    parser.add_argument("--context", default="128,1024,4096,8192")
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    options = {"kv_cache": True, "max_seq": args.max_seq, "causal": True, "batch": 1, "dim": 512, "heads": 8,
               "seq": 1, "past_seq": 1}
    whole = E.build_model("mha", options, "attention", use_cache=False)[0]
    kept = OA.TRANSLATIONS["attention"]
    OA.TRANSLATIONS["attention"] = dataclasses.replace(kept, static_step=_sliced_translation())
    try:
        sliced = E.build_model("mha", options, "attention", use_cache=False)[0]
    finally:
        OA.TRANSLATIONS["attention"] = kept
    gqa = E.build_model("mha", options, "ort", use_cache=False)[0]
    rows = []
    for context in [int(c) for c in args.context.split(",")]:
        steps = {name: _step(m, context, args.max_seq) for name, m in
                 (("attention, whole buffer", whole), ("attention, sliced", sliced), ("ort, GroupQueryAttention", gqa))}
        times: dict = {name: [] for name in steps}
        for _ in range(5):  # rounds, alternating
            for name, fn in steps.items():
                fn()
                for _ in range(args.runs // 5):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        for name, ts in times.items():
            rows.append({"context": context, "graph": name, "median_ms": statistics.median(ts),
                         "p10_ms": float(np.percentile(ts, 10)), "p90_ms": float(np.percentile(ts, 90))})
            print(f"{context:>6} {name:<28} {rows[-1]['median_ms']:.3f} ms "
                  f"({rows[-1]['p10_ms']:.3f}-{rows[-1]['p90_ms']:.3f})", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
