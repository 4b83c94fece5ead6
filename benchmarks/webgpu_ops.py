"""What WebGPU computes wrong, and what writing the tanh GELU out costs and buys (docs/runtimes.md,
docs/language-models.md: the figures there are this script's).

    python benchmarks/webgpu_ops.py ops
        each op's largest error against float64 on ort-cpu and ort-webgpu: Gelu(tanh), Tanh, the formula
        `pretrained.tanh_gelu` writes, and float16's Add, Relu and Gather
    python benchmarks/webgpu_ops.py model MODEL.onnx [--webgpu]
        a language model's step graph (a concat form, batch 1, no past) as it is and with its tanh GELUs
        written out: ort-cpu's time (a prefill of 64 tokens, a step after 64 positions: median and
        p10-p90 of 15 runs after 3, 2 threads, the two graphs alternated); with --webgpu, each graph's
        logits on WebGPU against ort-cpu's, and the bounded localization (`localize.locate_bounded`) of
        the graph as it is, timed
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attnexport import runtimes as R
from attnexport.localize import locate_bounded
from attnexport.pretrained.tanh_gelu import spell_out
from attnexport.reading import load_model


def _one(op, dtype=TensorProto.FLOAT, inputs=("x",), opset=20, table=None, **attrs):
    """A one-node model of `op` over `inputs` (a Gather's over the initializer `table` first)."""
    inits = [numpy_helper.from_array(table, "table")] if table is not None else []
    fed = [helper.make_tensor_value_info(n, dtype if n != "ids" else TensorProto.INT64, None) for n in inputs]
    graph = helper.make_graph([helper.make_node(op, [*(i.name for i in inits), *inputs], ["y"], **attrs)], op, fed,
                              [helper.make_tensor_value_info("y", dtype, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def ops() -> None:
    x = np.linspace(-12, 12, 24001, dtype=np.float32)
    xd = x.astype(np.float64)
    tanh_gelu = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    written = _one("Gelu", approximate="tanh")
    spell_out(written)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 64)).astype(np.float16) for _ in range(2))
    table = rng.standard_normal((1000, 64)).astype(np.float16)
    ids = np.array([[2, 818, 57, 7], [1, 0, 3, 999]], np.int64)
    cases = [("Gelu(tanh)", _one("Gelu", approximate="tanh"), {"x": x}, tanh_gelu),
             ("Tanh", _one("Tanh"), {"x": x}, np.tanh(xd)),
             ("Gelu(tanh) written out", written, {"x": x}, tanh_gelu),
             ("float16 Add", _one("Add", TensorProto.FLOAT16, ("x", "b"), 17), {"x": a, "b": b},
              a.astype(np.float64) + b),
             ("float16 Relu", _one("Relu", TensorProto.FLOAT16, opset=17), {"x": a}, np.maximum(a, 0)),
             ("float16 Gather", _one("Gather", TensorProto.FLOAT16, ("ids",), 17, table), {"ids": ids},
              table[ids].astype(np.float64))]
    print(f"{'op':24s} {'ort-cpu':>10s} {'ort-webgpu':>10s}")
    for name, model, feed, want in cases:
        errs = []
        for rt in ("ort-cpu", "ort-webgpu"):
            got = R.prepare_onnx(rt, model).run(feed)["y"].astype(np.float64)
            errs.append(float(np.abs(got - want).max()))
        print(f"{name:24s} {errs[0]:10.3g} {errs[1]:10.3g}")
    from attnexport.runtimes import js
    print("adapter:", js.describe_adapter(js.bridge().adapter or {}))


def _feed(model: onnx.ModelProto, tokens: int, past: int) -> dict:
    feed = {"input_ids": np.full((1, tokens), 818, np.int64), "attention_mask": np.ones((1, past + tokens), np.int64),
            "position_ids": np.arange(past, past + tokens, dtype=np.int64)[None]}
    for i in model.graph.input:
        if i.name.startswith("past_key_values"):
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            rng = np.random.default_rng(len(feed))
            feed[i.name] = rng.standard_normal((1, dims[1], past, dims[3])).astype(np.float32)
    return feed


def model(path: str, webgpu: bool) -> None:
    graph = load_model(path)
    written = onnx.ModelProto()
    written.CopyFrom(graph)
    print(f"tanh GELUs written out: {spell_out(written)}")
    graphs = {"as exported": graph, "written out": written}
    sessions = {name: R.ort_session("ort-cpu", g, threads=2)[0] for name, g in graphs.items()}
    for label, tokens, past in (("prefill of 64", 64, 0), ("a step after 64", 1, 64)):
        feed = _feed(graph, tokens, past)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for r in range(18):
            for name, s in sessions.items():
                t = time.perf_counter()
                s.run(["logits"], feed)
                if r >= 3:
                    times[name].append((time.perf_counter() - t) * 1e3)
        for name, ms in times.items():
            p10, p50, p90 = np.percentile(ms, [10, 50, 90])
            print(f"ort-cpu {label:16s} {name:12s} {p50:7.1f} ms ({p10:.1f}-{p90:.1f})")
    del sessions
    if not webgpu:
        return
    feed = _feed(graph, 8, 0)
    for name, g in graphs.items():
        cpu = R.prepare_onnx("ort-cpu", g).run(feed)["logits"].astype(np.float64)
        gpu = R.prepare_onnx("ort-webgpu", g).run(feed)["logits"]
        print(f"ort-webgpu logits {name:12s}: {np.abs(gpu - cpu).max():.3g} off ort-cpu's "
              f"(scale {np.abs(cpu).max():.3g})")
    t = time.perf_counter()
    found = locate_bounded(graph, feed, "ort-webgpu", "ort-cpu", "fp32")
    print(f"bounded localization of the graph as exported, {time.perf_counter() - t:.1f} s: {found.describe()}")
    print(f"  {found.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("ops")
    m = sub.add_parser("model")
    m.add_argument("path")
    m.add_argument("--webgpu", action="store_true")
    args = parser.parse_args()
    ops() if args.what == "ops" else model(args.path, args.webgpu)


if __name__ == "__main__":
    main()
