"""GELU's tanh approximation written as its formula, not as ONNX's Gelu(approximate="tanh").

onnxruntime-web's WebGPU kernel for Gelu(approximate="tanh") errs by up to 4.7e-4 against float64
(over [-12, 12], on Chromium's software adapter), while its Tanh errs by 1.3e-7 and ONNX Runtime's
CPU kernel for the same Gelu by 7e-7 (`python benchmarks/webgpu_ops.py ops`; tests/test_js_runtimes.py
pins them). In Gemma-3-270M's fp32 step graph that one kernel, 18 nodes, put the logits 0.02-0.04 off
on WebGPU against budgets of about 2e-4 (the first departing node, named by `localize.locate_bounded`,
is the first layer's Gelu); written as 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) they are
1.2e-4 off the CPU provider's, and on the CPU provider the formula's nine ops cost what the kernel
does (`python benchmarks/webgpu_ops.py model MODEL --webgpu`; docs/language-models.md).

torch's exporter writes the Gelu op only at opset 20 and above: the `attention` flavour's graphs
(opset 23; a deployment folder's, which transformers.js may run on WebGPU) have it, the `primitives`
and `ort` flavours' (opset 18) spell it with Tanh already. Rewritten only in an fp32 graph (float
activations: int4 and int8 too): in fp16, x^3 leaves fp16's range above |x| = 40, and the kernel's
error is below fp16's own rounding at 1 (9.8e-4).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

_CONSTANTS = {"attnexport.gelu.cubic": 0.044715, "attnexport.gelu.scale": math.sqrt(2.0 / math.pi),
              "attnexport.gelu.half": 0.5, "attnexport.gelu.one": 1.0}


def _approximate(node) -> str:
    for a in node.attribute:
        if a.name == "approximate":
            return helper.get_attribute_value(a).decode()
    return "none"


def spell_out(model: onnx.ModelProto) -> int:
    """Each Gelu(approximate="tanh") of `model`'s graph (an fp32 one) replaced, in place, by the ops of
    its formula, its output's name kept; the number replaced."""
    nodes, count = [], 0
    for node in model.graph.node:
        if node.op_type != "Gelu" or node.domain not in ("", "ai.onnx") or _approximate(node) != "tanh":
            nodes.append(node)
            continue
        count += 1
        x, p = node.input[0], node.output[0]  # a value's name is the graph's only once: its parts' names too
        c = {k.rsplit(".", 1)[1]: k for k in _CONSTANTS}
        nodes += [helper.make_node("Mul", [x, x], [f"{p}.x2"], name=f"{p}.x2"),
                  helper.make_node("Mul", [f"{p}.x2", x], [f"{p}.x3"], name=f"{p}.x3"),
                  helper.make_node("Mul", [f"{p}.x3", c["cubic"]], [f"{p}.cubic"], name=f"{p}.cubic"),
                  helper.make_node("Add", [x, f"{p}.cubic"], [f"{p}.inner"], name=f"{p}.inner"),
                  helper.make_node("Mul", [f"{p}.inner", c["scale"]], [f"{p}.scaled"], name=f"{p}.scaled"),
                  helper.make_node("Tanh", [f"{p}.scaled"], [f"{p}.tanh"], name=f"{p}.tanh"),
                  helper.make_node("Add", [f"{p}.tanh", c["one"]], [f"{p}.sum"], name=f"{p}.sum"),
                  helper.make_node("Mul", [x, c["half"]], [f"{p}.half"], name=f"{p}.half"),
                  helper.make_node("Mul", [f"{p}.half", f"{p}.sum"], [node.output[0]], name=node.name or p)]
    if count:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        have = {i.name for i in model.graph.initializer}
        model.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.float32), k)
                                       for k, v in _CONSTANTS.items() if k not in have)
    return count
