"""The RMS norms onnxscript fuses without a residual add before them, back as the ops they stand
for (ONNX Runtime's SimplifiedLayerNormalization is in ONNX's own domain, which onnx's checker
refuses); the norms after a residual add stay fused (SkipSimplifiedLayerNormalization)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from attnexport.pretrained.fusions.graph import attr


def unfuse_plain_rms(model: onnx.ModelProto) -> None:
    """SimplifiedLayerNormalization (an RMS norm with no residual add before it) is ONNX Runtime's
    op in ONNX's own domain, which onnx's checker refuses: each such node back as the ops it
    stands for, x / sqrt(mean(x^2) + eps) * gamma (the norms after a residual add stay fused)."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    types = {i.name: i.data_type for i in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        eps = float(attr(node, "epsilon", 1e-5))
        x, gamma = node.input[0], node.input[1]
        t = [f"{node.name or node.output[0]}_{k}" for k in ("sq", "mean", "eps", "plus", "root", "normed", "axes")]
        if opset >= 18:  # ReduceMean's axes: an input from opset 18, an attribute before
            mean = [helper.make_node("Constant", [], [t[6]], value_ints=[-1]),
                    helper.make_node("ReduceMean", [t[0], t[6]], [t[1]], keepdims=1)]
        else:
            mean = [helper.make_node("ReduceMean", [t[0]], [t[1]], axes=[-1], keepdims=1)]
        kind = types.get(gamma, onnx.TensorProto.FLOAT)  # eps in the norm's own type (an fp16 model's is fp16)
        value = helper.make_tensor(t[2], kind, [], [np.array(eps, helper.tensor_dtype_to_np_dtype(kind)).item()])
        nodes += [helper.make_node("Constant", [], [t[2]], value=value),
                  helper.make_node("Mul", [x, x], [t[0]]), *mean,
                  helper.make_node("Add", [t[1], t[2]], [t[3]]),
                  helper.make_node("Sqrt", [t[3]], [t[4]]),
                  helper.make_node("Div", [x, t[4]], [t[5]]),
                  helper.make_node("Mul", [t[5], gamma], [node.output[0]])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
