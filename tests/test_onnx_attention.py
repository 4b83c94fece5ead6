"""attnexport.onnx_attention: each flavour's translation of the attention core, read as a graph.

The other tests run the graphs and compare numbers; these read what each translation wrote for
each of the core's options (the fused node and its attributes, or the primitives it is built
from), so a translation that computes the right numbers through the wrong graph (a causal mask
built beside a fused op that could take it, a scale folded away, a lost Cast) is caught too."""

from collections import Counter

import onnx
import pytest
from onnx import helper

from attnexport import export as E

STANDARD, MSFT = ("", "Attention"), ("com.microsoft", "MultiHeadAttention")


def _graph(options: dict, flavor: str, dtype: str = "fp32", variant: str = "sdpa") -> onnx.ModelProto:
    return E.build_model(variant, options, flavor, dtype=dtype)[0]


def _ops(model) -> Counter:
    return Counter((n.domain, n.op_type) for n in model.graph.node)


def _fused(model, key) -> onnx.NodeProto:
    nodes = [n for n in model.graph.node if (n.domain, n.op_type) == key]
    assert len(nodes) == 1, f"{len(nodes)} {key[1]} nodes"
    return nodes[0]


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# --- attention: the standard operator carries every option as an attribute or an input ----------

@pytest.mark.parametrize("options, attrs", [
    ({}, {"is_causal": 0}),
    ({"causal": True}, {"is_causal": 1}),
    ({"scale": 0.3}, {"is_causal": 0, "scale": pytest.approx(0.3)}),
    ({"softcap": 2.0, "causal": True}, {"is_causal": 1, "softcap": pytest.approx(2.0)}),
])
def test_attention_options_are_the_operators_attributes(options, attrs):
    model = _graph(options, "attention")
    node = _fused(model, STANDARD)
    got = _attrs(node)
    assert got.pop("qk_matmul_output_mode", 0) == 0  # the fused node's own output stays the attention
    if got.get("softcap") == 0.0:  # the operator's default, written out or not
        del got["softcap"]
    assert got == attrs
    ops = _ops(model)
    # Nothing computed beside the fused node: no second softmax, no mask built from primitives.
    assert ops[("", "Softmax")] == 0 and ops[("", "Trilu")] == 0 and ops[("", "MatMul")] == 0


def test_attention_softmax_precision_is_the_attribute_in_fp16():
    node = _fused(_graph({"softmax_precision": "float"}, "attention", "fp16"), STANDARD)
    assert _attrs(node)["softmax_precision"] == onnx.TensorProto.FLOAT


def test_attention_takes_the_mask_the_cache_and_grouped_heads_as_inputs():
    node = _fused(_graph({"mask": "bool", "kv_heads": 2, "heads": 4}, "attention"), STANDARD)
    assert len(node.input) >= 4 and node.input[3]  # attn_mask wired
    model = _graph({"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 2, "kv_seq": 2, "past_seq": 5},
                   "attention")
    node = _fused(model, STANDARD)
    graph_inputs = {i.name for i in model.graph.input}
    assert node.input[4] in graph_inputs and node.input[5] in graph_inputs  # past_key, past_value
    assert {node.output[1], node.output[2]} <= {o.name for o in model.graph.output}  # present_*
    assert not any(n.op_type == "Concat" and node.input[4] in n.input for n in model.graph.node)  # no join outside
    assert _attrs(node)["is_causal"] == 1


def test_attention_with_valid_key_counts_is_opset_24():
    model = _graph({"nonpad": True, "causal": True, "seq": 3, "kv_seq": 8}, "attention")
    node = _fused(model, STANDARD)
    assert len(node.input) == 7 and node.input[6] == "nonpad_kv_seqlen"
    assert next(o.version for o in model.opset_import if o.domain == "") == 24


def test_attention_weights_come_from_primitives_beside_the_fused_node():
    model = _graph({"weights": "softmax"}, "attention")
    _fused(model, STANDARD)
    ops = _ops(model)
    assert ops[("", "Softmax")] == 1 and ops[("", "MatMul")] >= 1


# --- primitives: standard ops only --------------------------------------------------------------

def test_primitives_has_no_fused_op_and_one_softmax_over_scaled_scores():
    model = _graph({"scale": 0.3}, "primitives")
    ops = _ops(model)
    assert ops[STANDARD] == 0 and ops[MSFT] == 0
    assert ops[("", "Softmax")] == 1 and ops[("", "MatMul")] == 2
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    assert _attrs(softmax)["axis"] == -1
    consts = [helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "Constant" for a in n.attribute]
    values = [float(onnx.numpy_helper.to_array(c).ravel()[0]) for c in consts if isinstance(c, onnx.TensorProto)
              and onnx.numpy_helper.to_array(c).size == 1]
    inits = [float(onnx.numpy_helper.to_array(i).ravel()[0]) for i in model.graph.initializer
             if onnx.numpy_helper.to_array(i).size == 1]
    assert any(v == pytest.approx(0.3) for v in values + inits), "the scale is not in the graph"


def test_primitives_softcap_is_a_tanh_and_precision_a_cast_around_the_softmax():
    ops = _ops(_graph({"softcap": 2.0}, "primitives"))
    assert ops[("", "Tanh")] == 1
    for dtype, cast in (("fp16", True), ("fp32", False)):  # in fp32 the precision is the input's: no Cast
        model = _graph({"softmax_precision": "float"}, "primitives", dtype)
        softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
        producer = {o: n for n in model.graph.node for o in n.output}
        assert (producer[softmax.input[0]].op_type == "Cast") == cast, dtype
        if cast:
            assert _attrs(producer[softmax.input[0]])["to"] == onnx.TensorProto.FLOAT


def test_primitives_guards_fully_masked_rows_with_a_where():
    plain, masked = _ops(_graph({}, "primitives")), _ops(_graph({"mask": "bool"}, "primitives"))
    assert plain[("", "Where")] == 0
    assert masked[("", "Where")] >= 1  # zeros selected where a row's mask hides every key


def test_primitives_cache_joins_past_and_new_keys():
    model = _graph({"kv_cache": True, "causal": True, "seq": 2, "kv_seq": 2, "past_seq": 5, "kv_heads": 4,
                    "heads": 4}, "primitives")
    concats = [n for n in model.graph.node if n.op_type == "Concat" and "past_key" in n.input]
    assert len(concats) == 1 and _attrs(concats[0])["axis"] == 2


# --- ort: com.microsoft.MultiHeadAttention -----------------------------------------------------

def test_ort_uses_its_own_causal_mask_where_it_is_the_operators():
    """Self-attention (queries and keys of one symbolic length): the kernel's unidirectional mask
    is the operator's causal one, so no bias tensor is built."""
    node = _fused(_graph({"causal": True}, "ort", variant="mha"), MSFT)
    attrs = _attrs(node)
    assert attrs["unidirectional"] == 1 and attrs["num_heads"] == 4 and attrs["scale"] == pytest.approx(0.25)
    assert len(node.input) < 6 or not node.input[5]


def test_ort_with_lengths_of_their_own_carries_the_causal_mask_as_a_bias():
    """sdpa's queries and keys have lengths of their own: the kernel's mask (offset by the keys
    before the block's last Tq) is not the operator's, so the bias carries it."""
    node = _fused(_graph({"causal": True, "seq": 6, "kv_seq": 4}, "ort"), MSFT)
    assert "unidirectional" not in _attrs(node)
    assert node.input[5]  # attention_bias


def test_ort_declines_softcap_and_softmax_precision():
    from attnexport.errors import ExportError, UnsupportedByFlavor
    for options in ({"softcap": 2.0}, {"softmax_precision": "float"}):
        with pytest.raises((UnsupportedByFlavor, ExportError)):
            _graph(options, "ort", "fp16")


def test_ort_cache_is_the_kernels_own_where_heads_are_fixed():
    model = _graph({"kv_cache": True, "causal": True, "layout": "bsd", "heads": 4, "kv_heads": 4, "seq": 2,
                    "kv_seq": 2, "past_seq": 5}, "ort")
    node = _fused(model, MSFT)
    assert len(node.input) >= 8 and node.input[6] and node.input[7]  # past_key, past_value
    assert len(node.output) == 3


# --- the static step: attnexport::static_attention ---------------------------------------------

STATIC = {"kv_cache": True, "max_seq": 12, "causal": True, "kv_heads": 2, "seq": 1, "past_seq": 5}


def test_ort_static_step_is_one_group_query_attention_over_the_buffers():
    from attnexport.export import GQA_BLOCKS, GQA_BUFFERS
    from attnexport.record import ExportRecord
    model = _graph(STATIC, "ort", variant="mha")
    node = _fused(model, ("com.microsoft", "GroupQueryAttention"))
    assert node.input[3] == "key_cache" and node.input[4] == "value_cache"
    assert list(node.output[1:]) == ["key_cache_out", "value_cache_out"]  # the graph's outputs, as they are
    assert _attrs(node)["num_heads"] == 4 and _attrs(node)["kv_num_heads"] == 2
    ops = _ops(model)
    assert ops[("", "ScatterElements")] == 0 and ops[MSFT] == 0 and ops[("", "Softmax")] == 0
    record = ExportRecord.of(model)
    assert record.static_blocks == GQA_BLOCKS and record.static_buffers == GQA_BUFFERS


def test_ort_static_step_without_causality_keeps_the_scattered_graph():
    model = _graph({**STATIC, "causal": False}, "ort", variant="mha")
    ops = _ops(model)
    assert ops[("com.microsoft", "GroupQueryAttention")] == 0 and ops[MSFT] == 1 and ops[("", "ScatterElements")] == 2


def test_the_other_flavours_static_steps_are_as_before():
    attention = _ops(_graph(STATIC, "attention", variant="mha"))
    assert attention[("", "TensorScatter")] == 2 and attention[STANDARD] == 1
    primitives = _ops(_graph(STATIC, "primitives", variant="mha"))
    assert primitives[("", "ScatterElements")] == 2 and primitives[STANDARD] == 0


def test_ort_static_step_writes_the_bound_buffers_in_place():
    """Bound as both the past input and the present output (IO binding), the buffers are written
    at write_pos and kept everywhere else, and the output is the float64 reference's."""
    import numpy as np
    import onnxruntime as ort

    from attnexport import seeding
    from attnexport import variants as V
    v = V.get("mha")
    o = v.resolve({**STATIC, "batch": 3})
    params = seeding.init_params(v, o, 0)
    model = E.build_model("mha", o, "ort", params=params)[0]
    feed = seeding.make_inputs(v, o, 1)
    want = v.reference(params, feed, o)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    buffers = {n: ort.OrtValue.ortvalue_from_numpy(feed[n].copy()) for n in ("key_cache", "value_cache")}
    binding = session.io_binding()
    binding.bind_output("output", "cpu")  # first: copy_outputs_to_cpu gives the outputs in binding order
    for n in ("x", "write_pos"):
        binding.bind_cpu_input(n, feed[n])
    for n, value in buffers.items():
        binding.bind_ortvalue_input(n, value)
        binding.bind_ortvalue_output(n + "_out", value)
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], want["output"], rtol=1e-4, atol=1e-5)
    for n, value in buffers.items():  # the reference writes the block and keeps the rest
        np.testing.assert_allclose(value.numpy(), want[n + "_out"], rtol=1e-4, atol=1e-5)


def _producers_of(model, name):
    """The nodes `name` is computed from, and the graph inputs whose values it reads (through
    Shape, only the input's shape is read: such an input does not count)."""
    made = {o: n for n in model.graph.node for o in n.output}
    inputs = {i.name for i in model.graph.input}
    nodes, values, todo = [], set(), [name]
    while todo:
        x = todo.pop()
        if x in inputs:
            values.add(x)
        node = made.get(x)
        if node is None or node in nodes:
            continue
        nodes.append(node)
        if node.op_type != "Shape":
            todo += [i for i in node.input if i]
    return nodes, values


def test_ort_static_total_length_is_shape_arithmetic():
    """GroupQueryAttention's total_sequence_length is read on the host by ONNX Runtime's CUDA
    provider: computed from the step's positions (device memory), its copy to the host kept every
    static step out of a CUDA graph on an H200 (2026-11-26). It comes from shapes alone."""
    model = _graph(STATIC, "ort", variant="mha")
    node = _fused(model, ("com.microsoft", "GroupQueryAttention"))
    nodes, values = _producers_of(model, node.input[6])
    assert not values, values  # no graph input's values, write_pos included
    assert {n.op_type for n in nodes} >= {"Shape", "Where"}


@pytest.mark.parametrize("batch,block,written,fails", [
    (3, 1, [5, 2, 0], False),   # one token at each sequence's own position
    (3, 4, [0, 0, 0], False),   # a block at batch > 1 into empty buffers: the operator's first prompt
    (1, 4, [5], False),          # a block at batch 1 over written positions
    (3, 4, [5, 0, 2], True),    # a block at batch > 1 over written positions: beyond the operator
])
def test_ort_static_step_is_right_or_nan_never_quietly_wrong(batch, block, written, fails):
    """Each step the operator computes agrees with the float64 reference; a block of several at
    batch > 1 over written positions (which GroupQueryAttention would read as a first prompt) gives
    NaN in each sequence that has written positions, and only there."""
    import numpy as np
    import onnxruntime as ort

    from attnexport import seeding
    from attnexport import variants as V
    v = V.get("mha")
    o = v.resolve({**STATIC, "batch": batch, "seq": block})
    params = seeding.init_params(v, o, 0)
    model = E.build_model("mha", o, "ort", params=params)[0]
    feed = {**seeding.make_inputs(v, o, 1), "write_pos": np.array(written, np.int64)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["output"], feed)[0]
    if not fails:
        np.testing.assert_allclose(got, v.reference(params, feed, o)["output"], rtol=1e-4, atol=1e-5)
        return
    for b, w in enumerate(written):
        assert np.isnan(got[b]).all() if w else np.isfinite(got[b]).all(), (b, w)
