"""One decoding step's attention over a static cache on CUDA: does its cost follow the context or the
buffer? Three ways side by side, each at every context in the same large buffer, with IO binding
on device memory and, where ONNX Runtime captures it, in a CUDA graph:

- `attention24`: the attention flavour's static step, TensorScatter (opset 24) writing the new
  key and value at write_pos into the buffers, then Attention-24 with nonpad_kv_seqlen (the valid
  keys) over the whole buffer; the buffers bound as inputs and as the outputs (in place).
- `gqa`: com.microsoft.GroupQueryAttention with past and present bound to the same buffers
  (its shared-buffer form) and seqlens_k: the new key and value are written by the kernel.
- `torch`: scaled_dot_product_attention over the valid prefix (a view of the buffer), the new
  key and value written with index_copy_ first; eager and in a CUDA graph.

Every way's output is compared with torch's over the valid prefix in float32. Run on a GPU machine
from the project root:
    python3 benchmarks/probes/cuda_static.py --batch 1,8 --context 128,1024,4096,8192 --buffer 8193 [--json FILE]
The step's least bytes (the valid prefix of keys and values, read once) over the GPU's read
bandwidth (attnexport.bench.cuda_read_bandwidth) is its fraction of the memory limit.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from onnx import TensorProto, helper

from attnexport import bench as B
from attnexport import runtimes as R

NP = {torch.float16: np.float16, torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


def attention24_model(b, h, hkv, s, d, elem):
    """TensorScatter + Attention-24 over the buffers (B, Hkv, S, d), one query position."""
    f = helper.make_tensor_value_info
    nodes = [helper.make_node("TensorScatter", ["key_cache", "key", "write_pos"], ["key_cache_out"], axis=2),
             helper.make_node("TensorScatter", ["value_cache", "value", "write_pos"], ["value_cache_out"], axis=2),
             helper.make_node("Add", ["write_pos", "one"], ["nonpad"]),
             helper.make_node("Attention", ["query", "key_cache_out", "value_cache_out", "", "", "", "nonpad"],
                              ["output"], q_num_heads=h, kv_num_heads=hkv)]
    g = helper.make_graph(nodes, "static_step",
                          [f("query", elem, [b, h, 1, d]), f("key", elem, [b, hkv, 1, d]),
                           f("value", elem, [b, hkv, 1, d]),
                           f("key_cache", elem, [b, hkv, s, d]), f("value_cache", elem, [b, hkv, s, d]),
                           f("write_pos", TensorProto.INT64, [b])],
                          [f("output", elem, [b, h, 1, d]), f("key_cache_out", elem, [b, hkv, s, d]),
                           f("value_cache_out", elem, [b, hkv, s, d])],
                          [helper.make_tensor("one", TensorProto.INT64, [], [1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)], ir_version=11)


def gqa_model(b, h, hkv, s, d, elem):
    """GroupQueryAttention, past and present of S positions (the shared-buffer form)."""
    f = helper.make_tensor_value_info
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "key_cache", "value_cache", "seqlens_k",
                                                    "total_sequence_length"],
                            ["output", "key_cache_out", "value_cache_out"], domain="com.microsoft",
                            num_heads=h, kv_num_heads=hkv)
    g = helper.make_graph([node], "gqa_step",
                          [f("query", elem, [b, 1, h * d]), f("key", elem, [b, 1, hkv * d]),
                           f("value", elem, [b, 1, hkv * d]),
                           f("key_cache", elem, [b, hkv, s, d]), f("value_cache", elem, [b, hkv, s, d]),
                           f("seqlens_k", TensorProto.INT32, [b]), f("total_sequence_length", TensorProto.INT32, [])],
                          [f("output", elem, [b, 1, h * d]), f("key_cache_out", elem, [b, hkv, s, d]),
                           f("value_cache_out", elem, [b, hkv, s, d])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def bound_session(model, tensors: dict, outputs: dict, cuda_graph: bool, cpu_inputs=()):
    """A CUDA session with every input and output bound to the given tensors (device memory; the
    names in cpu_inputs to host memory). Returns (run, the nodes it left on the CPU)."""
    session, placement, shapes = R.ort_session("ort-cuda", model, tf32=True, cuda_graph=cuda_graph)
    binding = session.io_binding()
    for name, t in tensors.items():
        where = "cpu" if name in cpu_inputs else "cuda"
        binding.bind_input(name, where, 0, NP[t.dtype], list(t.shape), t.data_ptr())
    for name, t in outputs.items():
        binding.bind_output(name, "cuda", 0, NP[t.dtype], list(t.shape), t.data_ptr())

    def run(keep=(tensors, outputs)):
        session.run_with_iobinding(binding)
    run()
    torch.cuda.synchronize()
    return run, R.cpu_nodes("ort-cuda", placement, shapes)


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ms = [R.time_call(fn, "cuda") for _ in range(iters)]
    return statistics.median(ms), float(np.percentile(ms, 90))


def step(a, b, ctx, bandwidth):
    h, hkv, d, s = a.heads, a.kv_heads, a.head_dim, a.buffer
    dt = torch.float16 if a.dtype == "fp16" else torch.float32
    elem = TensorProto.FLOAT16 if a.dtype == "fp16" else TensorProto.FLOAT
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)  # noqa: E731
    q, k, v = rnd(b, h, 1, d), rnd(b, hkv, 1, d), rnd(b, hkv, 1, d)
    kc0, vc0 = rnd(b, hkv, s, d), rnd(b, hkv, s, d)  # garbage past the context: must not be read
    pos = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
    # The expected output: float32 attention over the valid prefix with the new key written at ctx.
    kf, vf = kc0.float().clone(), vc0.float().clone()
    kf[:, :, ctx], vf[:, :, ctx] = k.float()[:, :, 0], v.float()[:, :, 0]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kf[:, :, :ctx + 1], vf[:, :, :ctx + 1], enable_gqa=hkv != h)
    nbytes = 2 * b * hkv * (ctx + 1) * d * (2 if a.dtype == "fp16" else 4)
    rows = []

    def add(way, mode, fn, out_of, cpu_nodes=(), note=""):
        med, p90 = timed(fn, a.warmup, a.iters)
        fn()
        torch.cuda.synchronize()
        err = float((out_of().float() - want).abs().max())
        rows.append({"way": way, "mode": mode, "batch": b, "context": ctx, "buffer": s, "dtype": a.dtype,
                     "median_ms": med, "p90_ms": p90, "max_abs_err": err, "bytes": nbytes,
                     "bandwidth_fraction": nbytes / (med / 1e3) / bandwidth, "cpu_nodes": list(cpu_nodes),
                     "note": note})
        print(f"{way:12} {mode:22} b{b} ctx {ctx:5} buf {s}: {med:.4f} ms (p90 {p90:.4f})  "
              f"{rows[-1]['bandwidth_fraction']:.3f} of the read bandwidth  err {err:.1e}", flush=True)

    def refused(way, mode, e):
        rows.append({"way": way, "mode": mode, "batch": b, "context": ctx, "buffer": s, "dtype": a.dtype,
                     "median_ms": None, "note": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        print(f"{way:12} {mode:22} b{b} ctx {ctx:5}: refused: {rows[-1]['note']}", flush=True)

    # torch: write the new positions, attend over the valid prefix (a view: no copy).
    kc, vc = kc0.clone(), vc0.clone()
    idx = torch.tensor([ctx], device="cuda")
    out_t = [None]

    def torch_step():
        kc.index_copy_(2, idx, k)
        vc.index_copy_(2, idx, v)
        out_t[0] = torch.nn.functional.scaled_dot_product_attention(q, kc[:, :, :ctx + 1], vc[:, :, :ctx + 1],
                                                                    enable_gqa=hkv != h)
    add("torch", "eager", torch_step, lambda: out_t[0])
    replay = B.cuda_graph_of(torch_step)[0].replay
    add("torch", "cuda-graph", replay, lambda: out_t[0])

    for cuda_graph in (False, True):
        mode = "in-place" + (" cuda-graph" if cuda_graph else "")
        kc, vc = kc0.clone(), vc0.clone()
        out = torch.empty(b, h, 1, d, dtype=dt, device="cuda")
        try:
            run, cpu = bound_session(attention24_model(b, h, hkv, s, d, elem),
                                     {"query": q, "key": k, "value": v, "key_cache": kc, "value_cache": vc,
                                      "write_pos": pos},
                                     {"output": out, "key_cache_out": kc, "value_cache_out": vc}, cuda_graph)
            add("attention24", mode, run, lambda out=out: out, cpu)
        except Exception as e:  # noqa: BLE001 - a kernel ONNX Runtime lacks, or no capture: said
            refused("attention24", mode, e)

        kc, vc = kc0.clone(), vc0.clone()
        out = torch.empty(b, 1, h * d, dtype=dt, device="cuda")
        seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")  # total length - 1
        total = torch.tensor(ctx + 1, dtype=torch.int32)  # host memory: the kernel reads it there
        try:
            run, cpu = bound_session(gqa_model(b, h, hkv, s, d, elem),
                                     {"query": q.transpose(1, 2).reshape(b, 1, h * d).contiguous(),
                                      "key": k.transpose(1, 2).reshape(b, 1, hkv * d).contiguous(),
                                      "value": v.transpose(1, 2).reshape(b, 1, hkv * d).contiguous(),
                                      "key_cache": kc, "value_cache": vc, "seqlens_k": seqlens,
                                      "total_sequence_length": total},
                                     {"output": out, "key_cache_out": kc, "value_cache_out": vc}, cuda_graph,
                                     cpu_inputs=("total_sequence_length",))
            add("gqa", mode, run, lambda out=out: out.view(b, 1, h, d).transpose(1, 2), cpu)
        except Exception as e:  # noqa: BLE001
            refused("gqa", mode, e)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", default="128,1024,4096,8192")
    ap.add_argument("--buffer", type=int, default=8193)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    bandwidth = B.cuda_read_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    for b in map(int, a.batch.split(",")):
        for ctx in map(int, a.context.split(",")):
            rows += step(a, b, ctx, bandwidth)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(0), "read_bandwidth_gbs": bandwidth / 1e9,
                       "args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
