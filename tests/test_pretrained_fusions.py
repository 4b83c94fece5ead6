"""The ort flavour's graph rewrites (`attnexport.pretrained.fusions`) on small graphs built here, each run on
ONNX Runtime against a float64 NumPy reference: the skip RMS norm fused, the plain one given back
as ONNX ops, a tied vocabulary matrix kept once, and the rotary tables against their formula. The
static form's rotary inside GroupQueryAttention and its packed projections are tested on whole
models in test_pretrained_export.py (the [hf] extra)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnexport.compare import compare, tolerance
from attnexport.pretrained.fusions import _unfuse_plain_rms, fuse_for_ort, tied_head

D, EPS = 8, 1e-5
RNG = np.random.default_rng(41)


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph as written
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def _rms64(x, gamma):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * gamma.astype(np.float64)


def _rms_nodes(x, gamma, name):
    """An RMS norm as torch exports transformers' LlamaRMSNorm: x * 1/sqrt(mean(x^2) + eps), times gamma."""
    return [helper.make_node("Pow", [x, "two"], [f"{name}.sq"]),
            helper.make_node("ReduceMean", [f"{name}.sq", "axes"], [f"{name}.mean"], keepdims=1,
                             noop_with_empty_axes=0),
            helper.make_node("Add", [f"{name}.mean", "eps"], [f"{name}.plus"]),
            helper.make_node("Sqrt", [f"{name}.plus"], [f"{name}.root"]),
            helper.make_node("Reciprocal", [f"{name}.root"], [f"{name}.inv"]),
            helper.make_node("Mul", [x, f"{name}.inv"], [f"{name}.normed"]),
            helper.make_node("Mul", [gamma, f"{name}.normed"], [f"{name}.out"])]


def _two_norms():
    """first = rms(x) * g1; sum = first + r; second = rms(sum) * g2: a plain norm, then one after a residual add."""
    g1, g2 = RNG.random(D).astype(np.float32), RNG.random(D).astype(np.float32)
    nodes = [*_rms_nodes("x", "g1", "first"), helper.make_node("Add", ["first.out", "r"], ["sum"]),
             *_rms_nodes("sum", "g2", "second")]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(EPS, np.float32), "eps"),
             numpy_helper.from_array(g1, "g1"), numpy_helper.from_array(g2, "g2")]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, D]) for n in ("x", "r", "second.out", "sum")]
    graph = helper.make_graph(nodes, "norms", io[:2], io[2:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), g1, g2


def test_a_norm_after_a_residual_add_becomes_one_fused_op_and_a_plain_one_stays_onnx_ops():
    model, g1, g2 = _two_norms()
    fused = fuse_for_ort(model, None, static=False, what="two norms")
    onnx.checker.check_model(fused)  # no SimplifiedLayerNormalization in ONNX's own domain is left
    kinds = [(n.domain, n.op_type) for n in fused.graph.node]
    assert kinds.count(("com.microsoft", "SkipSimplifiedLayerNormalization")) == 1
    assert not any(op == "SimplifiedLayerNormalization" for _, op in kinds)
    x, r = RNG.standard_normal((2, 3, D)).astype(np.float32), RNG.standard_normal((2, 3, D)).astype(np.float32)
    got = _run(fused, {"x": x, "r": r})
    first = _rms64(x, g1)
    want = {"sum": first + r, "second.out": _rms64(first + r, g2)}
    assert sorted(got) == sorted(want)
    for name in want:
        assert compare(name, got[name], want[name], tolerance("fp32")), name


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMean's axes: an attribute before 18, an input from 18
def test_a_plain_rms_norm_goes_back_to_the_ops_it_stands_for(opset):
    gamma = RNG.random(D).astype(np.float32)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], "norm", axis=-1, epsilon=EPS)
    graph = helper.make_graph([node], "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, D])],
                              [numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    _unfuse_plain_rms(model)
    onnx.checker.check_model(model)
    assert "SimplifiedLayerNormalization" not in {n.op_type for n in model.graph.node}
    x = RNG.standard_normal((2, 5, D)).astype(np.float32) * 3
    assert compare("y", _run(model, {"x": x})["y"], _rms64(x, gamma), tolerance("fp32"))


def _tied(vocab=11, dim=D, read_by_head=True):
    """hidden = W[ids]; logits = hidden @ W^T (the head reading the embedding's matrix), or no head."""
    w = RNG.standard_normal((vocab, dim)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["W", "ids"], ["hidden"], "embed", axis=0)]
    outputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [2, 3, dim])]
    if read_by_head:
        nodes += [helper.make_node("Transpose", ["W"], ["W.T"], "head_t", perm=[1, 0]),
                  helper.make_node("MatMul", ["hidden", "W.T"], ["logits"], "head")]
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, vocab]))
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              outputs, [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), w


def test_a_tied_vocabulary_matrix_is_stored_once_as_the_head_reads_it_and_the_embedding_gathers_its_columns():
    model, w = _tied()
    tied_head(model)
    onnx.checker.check_model(model)
    assert [tuple(i.dims) for i in model.graph.initializer] == [(D, 11)]  # once, transposed
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    assert helper.get_attribute_value(next(a for a in gather.attribute if a.name == "axis")) == 1
    assert not any(n.op_type == "Transpose" and n.input[0] in {"W", "W.transposed"} for n in model.graph.node)
    ids = RNG.integers(0, 11, (2, 3)).astype(np.int64)
    got = _run(model, {"ids": ids})
    hidden = w.astype(np.float64)[ids]
    want = {"hidden": hidden, "logits": hidden @ w.astype(np.float64).T}
    assert sorted(got) == sorted(want)
    for name in want:
        assert compare(name, got[name], want[name], tolerance("fp32")), name


def test_a_matrix_only_the_embedding_reads_is_left_as_it_is():
    model, _ = _tied(read_by_head=False)
    before = model.SerializeToString()
    tied_head(model)
    assert model.SerializeToString() == before


def test_the_rotary_tables_are_the_models_cos_and_sin_at_every_position():
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from attnexport.pretrained.fusions import rotary_tables
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

    from attnexport.pretrained.fusions import _float_frequencies
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
    assert _float_frequencies().apply_to_model(g) == 1
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
    assert _float_frequencies().apply_to_model(g) == 0
