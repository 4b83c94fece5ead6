"""The ort flavour's rewrites together (`attnexport.pretrained.fusions.fuse_for_ort`) on a small
graph built here, run on ONNX Runtime against a float64 NumPy reference: the skip RMS norm fused
into one op, the plain one given back as ONNX ops. Each rewrite has its own file of tests
(test_pretrained_fusions_<file>.py)."""

import numpy as np
import onnx
from conftest import ort_as_written as _run
from onnx import TensorProto, helper, numpy_helper

from attnexport.compare import compare, tolerance
from attnexport.pretrained.fusions import fuse_for_ort

D, EPS = 8, 1e-5
RNG = np.random.default_rng(41)


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
