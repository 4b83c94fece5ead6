"""`localize.first_overflow`: where the NaN and infinities an output carries begin, on small fp16 graphs
written here (the whole models' rows that use it are in tests/test_pretrained_export.py)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attnexport import localize as L

HALF = TensorProto.FLOAT16


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _masked_and_scaled():
    """out = softmax(where(mask, x, -inf)) + x * 60000: the mask's -inf is made on purpose and the
    softmax takes it back to finite values; x * 60000 overflows fp16 where |x| > 1.09."""
    nodes = [helper.make_node("Where", ["mask", "x", "minus_inf"], ["masked"], name="mask_scores"),
             helper.make_node("Softmax", ["masked"], ["weights"], name="softmax"),
             helper.make_node("Mul", ["x", "big"], ["scaled"], name="scale"),
             helper.make_node("Add", ["weights", "scaled"], ["out"], name="sum")]
    inits = [numpy_helper.from_array(np.array(-np.inf, np.float16), "minus_inf"),
             numpy_helper.from_array(np.array(60000, np.float16), "big")]
    return _model(nodes, [helper.make_tensor_value_info("x", HALF, [4]),
                          helper.make_tensor_value_info("mask", TensorProto.BOOL, [4])],
                  [helper.make_tensor_value_info("out", HALF, [4])], inits)


def test_the_node_that_overflows_is_named_and_a_masks_minus_inf_is_not():
    model = _masked_and_scaled()
    mask = np.array([True, True, False, True])
    found = L.first_overflow(model, {"x": np.array([0.5, 2.0, 1.0, -3.0], np.float16), "mask": mask}, "ort-cpu")
    assert (found.kind, found.node, found.op_type, found.output) == ("overflow", "scale", "Mul", "scaled")
    assert found.before == 60000
    assert {i["name"]: i["kind"] for i in found.inputs} == {"x": "value", "big": "initializer"}
    assert "2 of 4 values not finite" in found.note and "float16's range of 65504" in found.note
    assert "first non-finite value at Mul node 'scale'" in found.describe()
    # every output finite: nothing to name
    quiet = L.first_overflow(model, {"x": np.array([0.5, 0.25, 1.0, -1.0], np.float16), "mask": mask}, "ort-cpu")
    assert not quiet.node and "every output is finite" in quiet.note


def test_non_finite_inputs_are_said_to_come_in_with_the_feed():
    model = _masked_and_scaled()
    found = L.first_overflow(model, {"x": np.array([np.inf, 0, 0, 0], np.float16), "mask": np.ones(4, bool)},
                             "ort-cpu")
    assert not found.node and "the inputs x" in found.note


def test_within_the_branch_an_if_took():
    """A merged decoder's If: the node named is the one inside the branch that ran."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "big"], ["hot"], name="scale_inside")], "then", [],
                             [helper.make_tensor_value_info("hot", HALF, [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["cool"], name="as_is")], "else", [],
                              [helper.make_tensor_value_info("cool", HALF, [2])])
    nodes = [helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other),
             helper.make_node("Relu", ["y"], ["out"], name="relu")]
    model = _model(nodes, [helper.make_tensor_value_info("x", HALF, [2]),
                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [1])],
                   [helper.make_tensor_value_info("out", HALF, [2])],
                   [numpy_helper.from_array(np.array(60000, np.float16), "big")])
    onnx.checker.check_model(model)
    x = np.array([3.0, 0.5], np.float16)
    found = L.first_overflow(model, {"x": x, "cond": np.array([True])}, "ort-cpu")
    assert (found.node, found.op_type) == ("scale_inside", "Mul") and "inside If node 'branch'" in found.note
    assert not L.first_overflow(model, {"x": x, "cond": np.array([False])}, "ort-cpu").node
