"""A tied vocabulary matrix stored once as the head reads it (`attnexport.pretrained.fusions.tied_head`),
against a float64 NumPy reference, and a matrix only the embedding reads left alone."""

import numpy as np
import onnx
from conftest import ort_as_written as _run
from onnx import TensorProto, helper, numpy_helper

from attnexport.compare import compare, tolerance
from attnexport.pretrained.fusions.tied_head import folded_head, tied_head

D = 8
RNG = np.random.default_rng(43)


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


def test_a_head_reading_a_folded_copy_of_the_table_keeps_the_copy_alone():
    """The exporter folded the head's Transpose into a (D, V) constant of its own (T5's scaled head):
    the graph keeps that one and the embedding gathers its columns."""
    model, w = _tied()
    turn = next(n for n in model.graph.node if n.op_type == "Transpose")
    model.graph.node.remove(turn)
    model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), "W.T"))
    folded_head(model)
    onnx.checker.check_model(model)
    assert [(i.name, tuple(i.dims)) for i in model.graph.initializer] == [("W.T", (D, 11))]
    ids = RNG.integers(0, 11, (2, 3)).astype(np.int64)
    got = _run(model, {"ids": ids})
    hidden = w.astype(np.float64)[ids]
    for name, want in {"hidden": hidden, "logits": hidden @ w.astype(np.float64).T}.items():
        assert compare(name, got[name], want, tolerance("fp32")), name


def test_a_head_whose_matrix_is_not_the_tables_transpose_is_left_as_it_is():
    model, w = _tied()
    turn = next(n for n in model.graph.node if n.op_type == "Transpose")
    model.graph.node.remove(turn)
    other = w.T.copy()
    other[0, 0] += 1.0
    model.graph.initializer.append(numpy_helper.from_array(other, "W.T"))
    before = model.SerializeToString()
    folded_head(model)
    assert model.SerializeToString() == before
