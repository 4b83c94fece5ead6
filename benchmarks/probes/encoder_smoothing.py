"""Smoothing an encoder's activations before ONNX Runtime's dynamic int8 (DynamicQuantizeMatMul,
QAttention: per-tensor uint8 activations, per-channel int8 weights): what each matrix costs
quantized alone with and without a smoothing scale, and the whole graph with the choice each
matrix's own measurement makes. A matrix's smoothing divides its input's channel j by
s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) (an explicit Mul before the op) and multiplies its
weight's row j by s_j: the product is unchanged, the activations' outlier channels narrower, the
weights' rows wider. The activations' maxima come from calibration text the project owns
(`reference.PASSAGE`'s sentences), and so does each matrix's choice (its cost alone, 1 - the lowest
cosine of the calibration sentences' embeddings against the fp32 graph's): the whole graph is then
judged on the 40 sentences verify reads, never used to choose (1 - the lowest cosine of their
embeddings against the fp32 graph's, the int8 budget 0.01). Time: the 40
sentences padded to the longest, median of 10 runs after 2, 2 threads, beside the fp32 graph.

    attnexport export --hf MINILM_FOLDER --flavor ort -o minilm-ort.onnx
    python benchmarks/probes/encoder_smoothing.py minilm-ort.onnx MINILM_FOLDER OUT_DIR
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from encoder_int8 import cost, embed, timed  # the sibling probe's measures, this folder's
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from attnexport.pretrained import model as hf
from attnexport.pretrained.encoders import measures as EM
from attnexport.pretrained.reference import PASSAGE

ALPHAS = (0.0, 0.5, 0.8)  # 0: not smoothed
NAMES = ("input_ids", "attention_mask", "token_type_ids")


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def targets(model: onnx.ModelProto) -> list:
    inits = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if (n.op_type == "MatMul" and n.input[1] in inits) or n.op_type == "Attention"]


def channel_maxima(model: onnx.ModelProto, feed: dict, out: Path) -> dict[str, np.ndarray]:
    """Each target's input's max |value| per channel over the calibration tokens (padding left out)."""
    probe = copy.deepcopy(model)
    acts = sorted({n.input[0] for n in targets(model)})
    for a in acts:
        probe.graph.output.append(helper.make_tensor_value_info(a, onnx.TensorProto.FLOAT, None))
    onnx.save(probe, out / "calibration.onnx")
    s = session(out / "calibration.onnx")
    got = s.run(acts, {i.name: feed[i.name] for i in s.get_inputs()})
    mask = feed["attention_mask"].astype(bool)
    return {a: np.abs(g[mask]).max(0) for a, g in zip(acts, got, strict=True)}


def smoothed(model: onnx.ModelProto, maxima: dict, alphas: dict[str, float]) -> onnx.ModelProto:
    """A copy with each named target's input divided by its scales and its weight's rows multiplied."""
    m = copy.deepcopy(model)
    inits = {i.name: i for i in m.graph.initializer}
    nodes = []
    for n in m.graph.node:
        alpha = alphas.get(n.name, 0.0)
        if alpha:
            w = numpy_helper.to_array(inits[n.input[1]]).astype(np.float64)
            x = np.maximum(maxima[n.input[0]].astype(np.float64), 1e-5)
            s = x ** alpha / np.maximum(np.abs(w).max(1), 1e-5) ** (1 - alpha)
            inits[n.input[1]].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), n.input[1]))
            m.graph.initializer.append(numpy_helper.from_array((1 / s).astype(np.float32), f"{n.name}_smooth"))
            nodes.append(helper.make_node("Mul", [n.input[0], f"{n.name}_smooth"], [f"{n.name}_smoothed"],
                                          name=f"{n.name}_smooth"))
            n.input[0] = f"{n.name}_smoothed"
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def main() -> None:
    logging.disable(logging.WARNING)
    src, folder, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = hf.tokenizer_of(folder)
    feed = EM.encoded(tokenizer, EM.sentences(), 256, NAMES)
    calibration = EM.encoded(tokenizer, [s.strip() + "." for s in PASSAGE.split(".") if s.strip()], 256, NAMES)
    model = onnx.load(src)
    maxima = channel_maxima(model, calibration, out)
    fp32 = session(src)
    want, base = embed(fp32, feed), timed(fp32, feed, 10, 2)
    want_calibration = embed(fp32, calibration)

    def quantized(m: onnx.ModelProto, choosing: bool = False, **options) -> tuple[float, float]:
        onnx.save(m, out / "float.onnx")
        with contextlib.redirect_stdout(io.StringIO()):
            quantize_dynamic(out / "float.onnx", out / "int8.onnx", weight_type=QuantType.QInt8, per_channel=True,
                             **options)
        s = session(out / "int8.onnx")
        if choosing:  # on the calibration text, untimed
            return cost(embed(s, calibration), want_calibration), float("nan")
        return cost(embed(s, feed), want), timed(s, feed, 10, 2) / base

    table = []
    for n in targets(model):
        row = {"node": n.name, "op": n.op_type, "input": n.input[0]}
        for alpha in ALPHAS:
            row[f"alpha {alpha}"] = quantized(smoothed(model, maxima, {n.name: alpha}), True,
                                              nodes_to_quantize=[n.name])[0]
        row["best"] = min(ALPHAS, key=lambda a: row[f"alpha {a}"])
        table.append(row)
        print(json.dumps(row), flush=True)
    chosen = {r["node"]: r["best"] for r in table}
    ways = {"not smoothed": ({}, []), "alpha 0.5 everywhere": ({r["node"]: 0.5 for r in table}, []),
            "each matrix's best alpha": (chosen, [])}
    by_cost = sorted(table, key=lambda r: -r[f"alpha {r['best']}"])
    for keep in (1, 2):
        ways[f"each's best, its {keep} costliest kept float"] = (chosen, [r["node"] for r in by_cost[:keep]])
    whole = {}
    for name, (alphas, kept) in ways.items():
        c, t = quantized(smoothed(model, maxima, alphas), nodes_to_exclude=kept)
        whole[name] = {"cost": c, "time_x_fp32": t, "kept_float": kept}
        print(f"{name:45s} 1 - lowest cosine {c:.4f}   time {t:.2f}x fp32", flush=True)
    (out / "smoothing.json").write_text(json.dumps({"fp32_ms": base, "per_matrix": table, "whole": whole}, indent=1))


if __name__ == "__main__":
    main()
