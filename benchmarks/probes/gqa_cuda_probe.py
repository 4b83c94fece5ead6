"""com.microsoft.GroupQueryAttention alone on ONNX Runtime's CUDA provider, against float64 NumPy.

The ort flavour's static step is one GroupQueryAttention over the buffers. On an H200 (2026-11-26)
its fp16 answers were wrong when a batch's sequences sat at different positions, and no static step
could be captured in a CUDA graph. This probe takes the operator alone, one token a sequence at
ragged positions, and varies what the graph decides:

- total_sequence_length: the largest valid count (what the export computed from the positions up to
  2026-11-26) or the buffers' length (shape arithmetic, what it computes since);
- the buffers: separate past and present (plain runs) or one buffer bound as both (IO binding, in
  place, the deployment's way);
- what the buffers hold past each sequence's valid positions: random values or zeros;

and prints each combination's worst error against the oracle, at head sizes 16 and 64.

    python benchmarks/probes/gqa_cuda_probe.py [--json FILE] [--provider cuda|cpu]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

CASES = [  # (batch, heads, kv heads, head size, buffer length, write positions)
    (3, 4, 2, 16, 8, [6, 5, 4]),
    (2, 4, 4, 16, 10, [4, 3]),
    (3, 4, 2, 64, 64, [40, 17, 3]),
    (2, 9, 3, 64, 8193, [1000, 5]),
]


def gqa_model(heads: int, kv_heads: int, d: int, total_from_shape: bool) -> onnx.ModelProto:
    f16 = TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info("q", f16, ["B", 1, heads * d]),
              helper.make_tensor_value_info("k", f16, ["B", 1, kv_heads * d]),
              helper.make_tensor_value_info("v", f16, ["B", 1, kv_heads * d]),
              helper.make_tensor_value_info("key_cache", f16, ["B", kv_heads, "L", d]),
              helper.make_tensor_value_info("value_cache", f16, ["B", kv_heads, "L", d]),
              helper.make_tensor_value_info("write_pos", TensorProto.INT64, ["B"])]
    nodes = [helper.make_node("Add", ["write_pos", "one"], ["valid"]),
             helper.make_node("Cast", ["write_pos"], ["seqlens"], to=TensorProto.INT32)]
    if total_from_shape:
        nodes += [helper.make_node("Shape", ["key_cache"], ["len"], start=2, end=3),
                  helper.make_node("Cast", ["len"], ["total"], to=TensorProto.INT32)]
    else:
        nodes += [helper.make_node("ReduceMax", ["valid"], ["max"], keepdims=0),
                  helper.make_node("Cast", ["max"], ["total"], to=TensorProto.INT32)]
    gqa_inputs = ["q", "k", "v", "key_cache", "value_cache", "seqlens", "total"]
    nodes.append(helper.make_node("GroupQueryAttention", gqa_inputs,
                                  ["out", "key_cache_out", "value_cache_out"], domain="com.microsoft",
                                  num_heads=heads, kv_num_heads=kv_heads))
    outputs = [helper.make_tensor_value_info("out", f16, ["B", 1, heads * d]),
               helper.make_tensor_value_info("key_cache_out", f16, ["B", kv_heads, "L", d]),
               helper.make_tensor_value_info("value_cache_out", f16, ["B", kv_heads, "L", d])]
    graph = helper.make_graph(nodes, "gqa", inputs, outputs,
                              [helper.make_tensor("one", TensorProto.INT64, [], [1])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def oracle(feed: dict, heads: int, kv_heads: int, d: int) -> np.ndarray:
    """Query b attends the cached positions 0 .. write_pos[b] - 1 and the new key at write_pos[b]."""
    q, k, v = (feed[n].astype(np.float64) for n in ("q", "k", "v"))
    kc, vc = feed["key_cache"].astype(np.float64), feed["value_cache"].astype(np.float64)
    out = np.zeros((q.shape[0], 1, heads * d))
    for b, w in enumerate(feed["write_pos"]):
        keys = np.concatenate([kc[b, :, :w], k[b, 0].reshape(kv_heads, 1, d)], axis=1)
        values = np.concatenate([vc[b, :, :w], v[b, 0].reshape(kv_heads, 1, d)], axis=1)
        for h in range(heads):
            g = h // (heads // kv_heads)
            s = keys[g] @ q[b, 0, h * d:(h + 1) * d] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[b, 0, h * d:(h + 1) * d] = (p / p.sum()) @ values[g]
    return out


def run_once(session, feed: dict, in_place: bool, provider: str) -> np.ndarray:
    import onnxruntime as ort
    if not in_place:
        return session.run(["out"], feed)[0].astype(np.float64)
    device = "cuda" if provider == "cuda" else "cpu"
    binding = session.io_binding()
    for n in ("q", "k", "v", "write_pos"):
        binding.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(feed[n], device, 0))
    for n in ("key_cache", "value_cache"):
        buffer = ort.OrtValue.ortvalue_from_numpy(feed[n], device, 0)
        binding.bind_ortvalue_input(n, buffer)
        binding.bind_ortvalue_output(n + "_out", buffer)
    binding.bind_output("out", device)
    session.run_with_iobinding(binding)
    return binding.get_outputs()[-1].numpy().astype(np.float64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args(argv)
    import onnxruntime as ort
    providers = ["CUDAExecutionProvider"] if a.provider == "cuda" else ["CPUExecutionProvider"]
    rows = []
    print(f"onnxruntime {ort.__version__}, {providers[0]}, fp16")
    print(f"{'B H KVH d L':>16} {'write_pos':>14} {'total':>6} {'buffers':>9} {'tail':>6} {'max abs err':>12}")
    for (batch, heads, kv_heads, d, length, written), from_shape in itertools.product(CASES, (False, True)):
        model = gqa_model(heads, kv_heads, d, from_shape)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
        assert session.get_providers()[0] == providers[0], session.get_providers()
        for in_place, tail in itertools.product((False, True), ("random", "zeros")):
            rng = np.random.default_rng(0)
            feed = {"q": rng.standard_normal((batch, 1, heads * d)),
                    "k": rng.standard_normal((batch, 1, kv_heads * d)),
                    "v": rng.standard_normal((batch, 1, kv_heads * d)),
                    "key_cache": rng.standard_normal((batch, kv_heads, length, d)),
                    "value_cache": rng.standard_normal((batch, kv_heads, length, d))}
            feed = {n: x.astype(np.float16) for n, x in feed.items()}
            feed["write_pos"] = np.array(written, np.int64)
            if tail == "zeros":
                for n in ("key_cache", "value_cache"):
                    for b, w in enumerate(written):
                        feed[n][b, :, w:] = 0
            want = oracle(feed, heads, kv_heads, d)
            try:
                got = run_once(session, feed, in_place, a.provider)
                err = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("nan")
                per_seq = [float(np.abs(got[b] - want[b]).max()) for b in range(batch)]
                note = ""
            except Exception as e:  # noqa: BLE001 - the runtime's refusal is a result here
                err, per_seq, note = float("nan"), [], str(e).splitlines()[0][:160]
            row = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_size": d, "buffer": length,
                   "write_pos": written, "total": "buffer length" if from_shape else "max valid",
                   "buffers": "in place" if in_place else "separate", "tail": tail, "max_abs_err": err,
                   "per_sequence": per_seq, "note": note}
            rows.append(row)
            print(f"{batch:>3} {heads:>2} {kv_heads:>2} {d:>3} {length:>5} {str(written):>14} "
                  f"{'L' if from_shape else 'max':>6} {row['buffers']:>9} {tail:>6} {err:12.3g} "
                  f"{' '.join(f'{e:.2g}' for e in per_seq)} {note}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"onnxruntime": ort.__version__, "provider": providers[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
