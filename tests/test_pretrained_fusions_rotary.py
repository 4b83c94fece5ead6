"""The rotary tables (`attnexport.pretrained.fusions.rotary`): the model's cos and sin at every
position against their formula in float64, and the rule that lets onnxscript's rotary rules see a
model in half computing what the graph did."""

import numpy as np
import pytest
from conftest import ort_as_written as _run
from onnx import TensorProto, helper, numpy_helper

from attnexport.compare import compare, tolerance

RNG = np.random.default_rng(44)


def test_the_rotary_tables_are_the_models_cos_and_sin_at_every_position():
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from attnexport.pretrained.fusions.rotary import rotary_tables
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, rope_theta=500.0)
    cos, sin = rotary_tables(LlamaForCausalLM(config), 64, np.float32)
    head = config.hidden_size // config.num_attention_heads
    angles = np.arange(64)[:, None] * 500.0 ** (-np.arange(0, head, 2) / head)  # position times frequency, float64
    assert cos.shape == sin.shape == (64, head // 2) and cos.dtype == np.float32
    assert compare("cos", cos, np.cos(angles), tolerance("fp32"))
    assert compare("sin", sin, np.sin(angles), tolerance("fp32"))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert rotary_tables(gpt2, 16, np.float32) is None  # learned positions: no rotary to freeze


def test_half_frequencies_cast_to_float_in_the_graph_become_a_float_constant():
    """transformers 5.17 in half: Cast(Expand(inv_freq in fp16), float32), which onnxscript's rotary
    rules do not match (SmolLM2's q4f16 step kept its rotary and three projections a layer); the
    rule makes it Expand of the float32 constant, computing the same."""
    import onnx_ir as ir

    from attnexport.pretrained.fusions.rotary import float_frequencies
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float16).reshape(1, 4, 1)
    nodes = [helper.make_node("Expand", ["inv_freq", "shape"], ["wide"]),
             helper.make_node("Cast", ["wide"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "frequencies", [helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(inv_freq, "inv_freq")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    shape = np.array([2, 4, 1], np.int64)
    before = _run(model, {"shape": shape})["y"]
    g = ir.from_proto(model)
    assert float_frequencies().apply_to_model(g) == 1
    after_model = ir.to_proto(g)
    assert [n.op_type for n in after_model.graph.node if n.op_type != "Constant"] == ["Expand"]
    after = _run(after_model, {"shape": shape})["y"]
    assert after.dtype == np.float32
    np.testing.assert_allclose(after, before, rtol=1e-7, atol=0)  # fp16 to fp32 is exact; no bitwise claim
    # an fp32 Cast of something computed, not a constant, is left alone
    nodes[0] = helper.make_node("Expand", ["x", "shape"], ["wide"])
    graph = helper.make_graph(nodes, "computed", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4, 1]),
                                                  helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    g = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    assert float_frequencies().apply_to_model(g) == 0
