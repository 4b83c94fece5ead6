"""Where a quantized export goes wrong on ONNX Runtime's CUDA provider, against float64 NumPy.

The H100 run of 2026-11-26 found a random Llama's static int4 export (MatMulNBits, fp32
activations) answering KL 0.94 on the CUDA provider against 0.062 on the CPU. This probe looks
for the node at fault two ways:

- **ops**: MatMulNBits alone over a grid of what an export decides (bits 4 and 8, zero points
  given or left to the default, fp32 or fp16 activations, accuracy_level 0 and 4, K a multiple
  of the block or not, one row or several), each answer against the weights dequantized in
  float64 and multiplied in NumPy, on every provider asked for. Whether the node stayed on the
  provider is read from a session that refuses the CPU fallback.
- **models**: each quantized node of each given export alone, with its own initializers, at 1 and
  8 rows, against float64 NumPy on every provider; and the export's logits after an 8-token
  prompt on each provider with ONNX Runtime's optimizations on and off, against the CPU provider's
  unoptimized run. (Exposing every node output of a whole export failed on CUDA, "Unsupported
  OrtValue type", H100 2026-11-26; a node alone is the clean test.) `--providers` also takes node,
  wasm and webgpu.

    python benchmarks/probes/int4_cuda_probe.py [MODEL.onnx ...] [--json FILE] [--providers cpu,cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


RUNTIME = {"cpu": "ort-cpu", "cuda": "ort-cuda", "node": "ort-node", "wasm": "ort-wasm", "webgpu": "ort-webgpu"}


def unpack(codes: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(rows, ...) packed uint8 codes, low bits first, as (rows, count) integers."""
    flat = codes.reshape(codes.shape[0], -1)
    if bits == 8:
        return flat[:, :count].astype(np.int64)
    both = np.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(flat.shape[0], -1)
    return both[:, :count].astype(np.int64)


def dequantize(codes, scales, zeros, n: int, k: int, bits: int, block: int) -> np.ndarray:
    """The (N, K) float64 matrix MatMulNBits's data, scales and zero points stand for."""
    blocks = -(-k // block)
    q = unpack(codes, bits, blocks * block).reshape(n, blocks, block)
    s = np.asarray(scales, np.float64).reshape(n, blocks)
    if zeros is None:
        z = np.full((n, blocks), 2.0 ** (bits - 1))
    elif zeros.dtype == np.uint8:
        z = unpack(zeros.reshape(n, -1), bits, blocks).astype(np.float64)
    else:
        z = np.asarray(zeros, np.float64).reshape(n, blocks)
    return ((q - z[:, :, None]) * s[:, :, None]).reshape(n, blocks * block)[:, :k]


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return q.astype(np.uint8)
    q = q.reshape(*q.shape[:-1], -1, 2)
    return (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)


def error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not np.all(np.isfinite(got) == np.isfinite(want)):
        return float("inf")
    fin = np.isfinite(want)
    if not fin.any():
        return 0.0
    return float(np.abs(got[fin] - want[fin]).max() / max(1.0, np.abs(want[fin]).max()))


def op_case(bits, zero_points, fp16, level, k, m, n=48, block=32, seed=0):
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    q = rng.integers(0, 2 ** bits, (n, blocks, block))
    scales = (rng.random((n, blocks)) * 0.02 + 0.005).astype(np.float16 if fp16 else np.float32)
    zeros = rng.integers(0, 2 ** bits, (n, blocks)) if zero_points else None
    zero_arr = None
    if zeros is not None:
        zero_arr = pack(np.pad(zeros, ((0, 0), (0, blocks % 2 if bits == 4 else 0))), bits).reshape(-1)
    act = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    inits = [numpy_helper.from_array(pack(q, bits), "B"), numpy_helper.from_array(scales.reshape(-1), "scales")]
    inputs = ["A", "B", "scales"]
    if zero_arr is not None:
        inits.append(numpy_helper.from_array(zero_arr, "zeros"))
        inputs.append("zeros")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", act, [m, k])],
                              [helper.make_tensor_value_info("Y", act, [m, n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    a = rng.standard_normal((m, k)).astype(np.float16 if fp16 else np.float32)
    w = dequantize(pack(q, bits), scales, zero_arr, n, k, bits, block)
    return model, {"A": a}, a.astype(np.float64) @ w.T


def stays_on(model, provider: str) -> bool | str:
    import onnxruntime as ort
    if provider == "cpu":
        return True
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CUDAExecutionProvider"])
        return True
    except Exception as e:  # noqa: BLE001 - the refusal is the answer
        return str(e).splitlines()[0][:160]


def ops(providers) -> list[dict]:
    from attnexport import runtimes as R
    rows = []
    for bits, zp, fp16, level, k, m in itertools.product((4, 8), (False, True), (False, True), (0, 4),
                                                       (512, 576, 99), (1, 5)):
        model, feed, want = op_case(bits, zp, fp16, level, k, m)
        row = {"bits": bits, "zero_points": zp, "activations": "fp16" if fp16 else "fp32", "accuracy_level": level,
               "K": k, "M": m}
        for p in providers:
            try:
                got = R.prepare_onnx(RUNTIME[p], model, optimize=False).run(feed)["Y"]
                row[p] = error(got, want)
            except Exception as e:  # noqa: BLE001 - a refused case is reported, not fatal
                row[p] = f"failed: {str(e).splitlines()[0][:160]}"
            if p == "cuda":
                row[f"{p}_placement"] = stays_on(model, p)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def inits_of(model) -> dict:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def own_reference(node, inits, values):
    """float64 NumPy's answer for a quantized node over the inputs it was given, or None."""
    def get(name):
        return inits[name] if name in inits else np.asarray(values[name])

    if node.op_type == "MatMulNBits":
        k, n, bits, block = (attr(node, a) for a in ("K", "N", "bits", "block_size"))
        zeros = get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        w = dequantize(get(node.input[1]), get(node.input[2]), zeros, n, k, bits, block)
        a = np.asarray(values[node.input[0]], np.float64)
        return a @ w.T
    if node.op_type == "GatherBlockQuantized" and attr(node, "gather_axis", 0) == 0:
        data, idx, scales = get(node.input[0]), get(node.input[1]), get(node.input[2])
        bits, block = attr(node, "bits", 4), attr(node, "block_size", 128)
        zeros = get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        rows, width = data.shape[0], data.reshape(data.shape[0], -1).shape[1] * (8 // bits)
        table = dequantize(data.reshape(rows, -1), scales, zeros, rows, width, bits, block)
        return table[idx].reshape(*idx.shape, *data.shape[1:-1], -1)
    return None


def feeds(model, rng) -> list[dict]:
    out = []
    for step, (pos, length) in enumerate(((0, 8), (8, 1))):
        feed = {}
        for i in model.graph.input:
            dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
            if i.name == "input_ids":
                feed[i.name] = rng.integers(3, 500, (1, length)).astype(np.int64)
            elif i.name == "write_pos":
                feed[i.name] = np.array([pos], np.int64)
            else:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                shape = [1] + dims[1:]
                fill = rng.standard_normal(shape) * 0.5 if step else np.zeros(shape)
                feed[i.name] = fill.astype(dtype)
        out.append(feed)
    return out


def single(node, inits, model) -> onnx.ModelProto:
    """`node` alone, its initializers carried and its one activation input a graph input."""
    act = node.input[0] if node.op_type == "MatMulNBits" else node.input[1]
    elem = TensorProto.FLOAT if node.op_type == "MatMulNBits" else TensorProto.INT64
    for i in list(model.graph.input) + list(model.graph.value_info):
        if node.op_type == "MatMulNBits" and i.name == act:
            elem = i.type.tensor_type.elem_type
    if node.op_type == "MatMulNBits" and any(i.data_type == TensorProto.FLOAT16 for i in model.graph.initializer
                                             if i.name == node.input[2]):
        elem = TensorProto.FLOAT16
    kept = [numpy_helper.from_array(inits[x], x) for x in node.input if x in inits]
    missing = [x for x in node.input[1:] if x and x not in inits and x != act]
    if missing:
        return None
    graph = helper.make_graph([node], "node", [helper.make_tensor_value_info(act, elem, None)],
                              [helper.make_tensor_value_info(node.output[0], elem if node.op_type == "MatMulNBits"
                                                             else TensorProto.FLOAT, None)], kept)
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    return out


def node_probe(path: Path, providers) -> list[dict]:
    """Each quantized node of the export alone, with its own initializers, at 1 and 8 rows."""
    from attnexport import runtimes as R
    model = onnx.load(str(path))
    inits = inits_of(model)
    rng = np.random.default_rng(1)
    rows = []
    for node in model.graph.node:
        if node.op_type not in ("MatMulNBits", "GatherBlockQuantized"):
            continue
        alone = single(node, inits, model)
        if alone is None:
            continue
        elem = alone.graph.input[0].type.tensor_type.elem_type
        for length in (1, 8):
            if node.op_type == "MatMulNBits":
                a = rng.standard_normal((1, length, attr(node, "K"))).astype(helper.tensor_dtype_to_np_dtype(elem))
            else:
                a = rng.integers(0, inits[node.input[0]].shape[0], (1, length)).astype(np.int64)
            feed = {alone.graph.input[0].name: a}
            want = own_reference(node, inits, feed)
            row = {"model": path.name, "node": node.name, "op": node.op_type, "rows": length,
                   **{x: attr(node, x) for x in ("K", "N", "bits", "block_size", "accuracy_level") if attr(node, x)}}
            for p in providers:
                try:
                    got = R.prepare_onnx(RUNTIME[p], alone, optimize=False).run(feed)[node.output[0]]
                    row[p] = error(got, want)
                except Exception as e:  # noqa: BLE001 - reported
                    row[p] = f"failed: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def whole(path: Path, providers) -> dict:
    """The export's logits after an 8-token prompt: each provider with ONNX Runtime's graph
    optimizations and without, against the CPU provider's unoptimized run."""
    from attnexport import runtimes as R
    model = onnx.load(str(path))
    feed = feeds(model, np.random.default_rng(0))[0]
    runs = {}
    for p in providers:
        for optimize in (False, True):
            key = f"{p}{'-optimized' if optimize else ''}"
            try:
                runs[key] = np.asarray(R.prepare_onnx(RUNTIME[p], model, optimize=optimize).run(feed)["logits"])
            except Exception as e:  # noqa: BLE001 - reported
                runs[key] = f"failed: {str(e).splitlines()[0][:200]}"
    base = runs.get("cpu")
    out = {k: (v if isinstance(v, str) else error(v, base)) for k, v in runs.items()} if base is not None else {}
    print(path.name, "logits against the CPU provider's:", json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--providers", default="cpu,cuda")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-ops", action="store_true", help="skip the single-op grid")
    args = ap.parse_args(argv)
    import onnxruntime as ort
    ort.set_default_logger_severity(3)  # a refused fallback is a row of the report, not a screenful
    providers = args.providers.split(",")
    result = {"ops": [] if args.no_ops else ops(providers)}
    present = [p for p in args.models if p.exists()]
    result["whole"] = {p.name: whole(p, providers) for p in present}
    result["nodes"] = [row for p in present for row in node_probe(p, providers)]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
