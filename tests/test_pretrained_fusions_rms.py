"""A plain RMS norm given back as the ONNX ops it stands for
(`attnexport.pretrained.fusions.rms`), against a float64 NumPy reference, at both forms of
ReduceMean's axes."""

import numpy as np
import onnx
import pytest
from conftest import ort_as_written as _run
from onnx import TensorProto, helper, numpy_helper

from attnexport.compare import compare, tolerance
from attnexport.pretrained.fusions.rms import unfuse_plain_rms

D, EPS = 8, 1e-5
RNG = np.random.default_rng(42)


def _rms64(x, gamma):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * gamma.astype(np.float64)


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMean's axes: an attribute before 18, an input from 18
def test_a_plain_rms_norm_goes_back_to_the_ops_it_stands_for(opset):
    gamma = RNG.random(D).astype(np.float32)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], "norm", axis=-1, epsilon=EPS)
    graph = helper.make_graph([node], "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, D])],
                              [numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    unfuse_plain_rms(model)
    onnx.checker.check_model(model)
    assert "SimplifiedLayerNormalization" not in {n.op_type for n in model.graph.node}
    x = RNG.standard_normal((2, 5, D)).astype(np.float32) * 3
    assert compare("y", _run(model, {"x": x})["y"], _rms64(x, gamma), tolerance("fp32"))
