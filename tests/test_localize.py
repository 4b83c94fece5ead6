"""attnexport.localize on small hand-built graphs: each kind of damage is named at its node."""

import numpy as np
import onnx
import pytest
from conftest import cli
from onnx import TensorProto, helper, numpy_helper

from attnexport.localize import intermediates, locate

RUNTIMES = ["ort-cpu", "onnx-ref"]


def _graph(scale=2.0, softmax_axis=-1, second_op="Relu", rename=False, drop_last=False) -> onnx.ModelProto:
    """x (2, 3) -> Mul(scale) -> <second_op> -> Add(bias) -> Softmax(axis) -> y."""
    names = ["m", "r", "a"] if not rename else ["v0", "v1", "v2"]
    nodes = [helper.make_node("Mul", ["x", "scale"], [names[0]], name="mul"),
             helper.make_node(second_op, [names[0]], [names[1]], name="act"),
             helper.make_node("Add", [names[1], "bias"], [names[2]], name="add"),
             helper.make_node("Softmax", [names[2]], ["y"], name="softmax", axis=softmax_axis)]
    if drop_last:
        nodes[-1] = helper.make_node("Identity", [names[2]], ["y"], name="softmax")
    inits = [numpy_helper.from_array(np.full((3,), scale, np.float32), "scale"),
             numpy_helper.from_array(np.array([0.1, -0.2, 0.3], np.float32), "bias")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


FEED = {"x": np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], np.float32)}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_same_graph_diverges_nowhere(runtime):
    loc = locate(_graph(), _graph(), FEED, runtime, "fp32")
    assert not loc.diverged
    assert loc.compared == 4  # every node output, the graph output included
    assert loc.describe().startswith("no intermediate value diverges (4 compared)")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_changed_initializer_is_named_and_the_first_node_reading_it(runtime):
    loc = locate(_graph(scale=2.5), _graph(), FEED, runtime, "fp32")
    assert loc.changed_initializers == ["scale"]
    assert (loc.node, loc.op_type, loc.output) == ("mul", "Mul", "m")
    # Its graph input agrees; its initializer is where the error comes from.
    kinds = {i["name"]: (i["kind"], i["error"]) for i in loc.inputs}
    assert kinds["x"] == ("graph input", 0.0)
    assert kinds["scale"][0] == "initializer" and kinds["scale"][1] == pytest.approx(0.5)
    assert loc.error == pytest.approx(1.0)  # |2.5 - 2.0| x max |x| = 0.5 x 2.0


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_changed_attribute_is_named_with_both_values(runtime):
    loc = locate(_graph(softmax_axis=0), _graph(), FEED, runtime, "fp32")
    assert loc.changed_attributes == ["Softmax 'softmax' axis=0 (export: -1)"]
    assert loc.node == "softmax"
    assert loc.before == 0.0  # its input agrees: the node itself is at fault


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_changed_op_is_named_and_later_nodes_are_not_blamed(runtime):
    loc = locate(_graph(second_op="Sigmoid"), _graph(), FEED, runtime, "fp32")
    assert "act: op Sigmoid, export has Relu" in loc.changed_attributes
    assert (loc.node, loc.output) == ("act", "r")
    assert loc.before == 0.0
    assert "first divergence at Sigmoid node 'act'" in loc.describe()


def test_renamed_values_are_matched_by_position():
    loc = locate(_graph(rename=True, scale=3.0), _graph(), FEED, "onnx-ref", "fp32")
    assert loc.matched_by == "position"
    assert (loc.node, loc.output) == ("mul", "v0")


def test_a_graph_of_other_names_and_ops_compares_only_what_it_shares():
    model = _graph(rename=True, second_op="Sigmoid", drop_last=True)
    loc = locate(model, _graph(), FEED, "onnx-ref", "fp32")
    assert loc.matched_by == "name" and "only same-named values were compared" in loc.note
    assert "Mul:mul" in loc.missing_nodes


def test_intermediates_expose_every_node_output_on_each_runtime():
    values = {rt: intermediates(_graph(), rt, FEED) for rt in RUNTIMES}
    for rt, v in values.items():
        assert {"m", "r", "a", "y"} <= set(v), rt
    np.testing.assert_allclose(values["ort-cpu"]["m"], 2 * FEED["x"], rtol=1e-6)
    np.testing.assert_allclose(values["ort-cpu"]["y"], values["onnx-ref"]["y"], rtol=1e-5)


def test_a_nan_the_known_good_graph_lacks_diverges():
    loc = locate(_graph(scale=float("nan")), _graph(), FEED, "onnx-ref", "fp32")
    assert loc.node == "mul" and loc.error == float("inf")
    # The same NaN on both sides is the same behaviour: localization looks for a difference.
    feed = {"x": np.array([[np.nan, 0, 0], [0, 0, 0]], np.float32)}
    assert not locate(_graph(), _graph(), feed, "onnx-ref", "fp32").diverged


def test_damage_to_a_module_export_is_named(tmp_path):
    """verify --module names what changed in the file: a parameter, by its sha256 recorded at the
    export against the file's own initializer; anything else, by the first diverging node of the
    module exported afresh."""
    import json

    spec = "examples/causal_self_attention.py:example"
    path = tmp_path / "block.onnx"
    assert cli("export", "--module", spec, "-o", str(path)).exit_code == 0
    model = onnx.load(path)
    entries = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    init = next(i for i in model.graph.initializer if i.name == entries["c_attn.weight"]["initializer"])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
    onnx.save(model, tmp_path / "weight.onnx")
    model = onnx.load(path)
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    attention.attribute.append(helper.make_attribute("scale", 0.3))
    onnx.save(model, tmp_path / "attribute.onnx")
    verify = ["verify", "--module", spec, "--runtimes", "ort-cpu"]
    r = cli(*verify, str(tmp_path / "weight.onnx"))
    assert r.exit_code == 1
    assert "the model file's parameters differ from the sha256 recorded at its export: c_attn.weight" in r.output
    r = cli(*verify, str(tmp_path / "attribute.onnx"))
    assert r.exit_code == 1
    where = [line for line in r.output.splitlines() if line.startswith("  where:")]
    assert where and f"first divergence at Attention node {attention.name!r}" in where[0], r.output
    assert "scale=0.30000001192092896 (export: None)" in where[0]
