"""runtimes: one adapter per runtime, named outputs, placement recorded, unavailable ones explained."""

import dataclasses

import numpy as np
import onnx
import pytest

from attnexport import export as E
from attnexport import flavors as FL
from attnexport import runtimes as R
from attnexport import seeding
from attnexport import target as T
from attnexport import variants as V
from attnexport.errors import ProviderUnavailableError
from attnexport.onnx_attention import TRANSLATIONS


@pytest.fixture(scope="module")
def mha():
    variant = V.get("mha")
    o = variant.resolve({"weights": True})
    params = seeding.init_params(variant, o, 0)
    model = E.build_model("mha", o, "attention", params=params)[0]
    return variant, o, params, model, seeding.make_inputs(variant, o, 1)


def test_every_runtime_has_a_status_with_a_reason():
    for name in R.RUNTIMES:
        s = R.status(name)
        assert s.name == name and s.reason
    with pytest.raises(ValueError):
        R.status("tpu")


def test_a_runtime_is_its_registry_line_and_its_adapter(mha, monkeypatch):
    """What docs/layout.md shows: a runtime added as one REGISTRY line and an adapter module (here
    ONNX Runtime's CPU provider under another name) is found, described and run through the one
    dispatch, and what it is (module or ONNX, its device) is read from its line, not its name."""
    import sys
    import types

    from attnexport.runtimes import ort
    adapter = types.ModuleType("attnexport.runtimes.other")
    adapter.status = lambda name: R.Status(name, True, "another adapter")
    adapter.prepare = lambda name, model, optimize=True, threads=None, prepack=True: ort.prepare(
        "ort-cpu", model, optimize, threads, prepack)
    monkeypatch.setitem(sys.modules, "attnexport.runtimes.other", adapter)
    monkeypatch.setitem(R.REGISTRY, "cuda-lookalike", R.Runtime("cuda-lookalike", "onnx", "cpu", "other",
                                                                default=False, timed=True))
    assert R.status("cuda-lookalike").reason == "another adapter"
    assert not R.on_cuda("cuda-lookalike") and not R.runs_module("cuda-lookalike")
    _, _, _, model, feed = mha
    got = R.prepare_onnx("cuda-lookalike", model).run(feed)
    want = R.prepare_onnx("ort-cpu", model).run(feed)
    np.testing.assert_allclose(got["output"], want["output"], rtol=1e-6, atol=1e-6)
    assert [n for n in R.RUNTIMES if R.runs_module(n)] == ["torch", "torch-cuda"]
    assert [n for n in R.RUNTIMES if R.on_cuda(n)] == ["torch-cuda", "ort-cuda"]
    with pytest.raises(ValueError):
        R.prepare_onnx("torch", model)


def test_torch_and_onnx_runtimes_agree_by_output_name(mha):
    variant, o, params, model, feed = mha
    results = {"torch": R.prepare_torch("torch", T.of_variant(variant, o, params), "fp32").run(feed)}
    for name in ("onnx-ref", "ort-cpu"):
        results[name] = R.prepare_onnx(name, model).run(feed)
    for name, got in results.items():
        assert set(got) == {"output", "weights"}, name
        np.testing.assert_allclose(got["output"], results["torch"]["output"], rtol=1e-4, atol=1e-5)


def test_timed_returns_outputs_and_a_median(mha):
    *_, model, feed = mha
    got, ms = R.prepare_onnx("ort-cpu", model).timed(feed, warmup=1, iters=3)
    assert ms > 0 and got["output"].shape == feed["x"].shape


def test_sessions_record_where_every_node_ran(mha):
    *_, model, feed = mha
    session, placement, _ = R.ort_session("ort-cpu", model, threads=1)
    assert set(placement) == {"CPUExecutionProvider"}
    ops = {n.split(":")[0] for n in placement["CPUExecutionProvider"]}
    assert "Attention" in ops
    unoptimized = R.ort_session("ort-cpu", model, optimize=False)[1]["CPUExecutionProvider"]
    assert len(unoptimized) >= len(model.graph.node) - 2  # no fusion: nearly every node as exported


def test_unavailable_cuda_is_an_error_that_says_why():
    for name in ("ort-cuda", "torch-cuda"):
        s = R.status(name)
        if s.available:
            continue
        with pytest.raises(ProviderUnavailableError, match=f"{name} is not available"):
            R.require(name)


def test_flavor_registry_matches_the_translations():
    assert set(FL.FLAVORS) == set(TRANSLATIONS) == set(E.FLAVORS)
    assert FL.DEFAULT in FL.FLAVORS
    for f in FL.FLAVORS.values():
        lo, hi = f.opsets
        assert lo <= f.default_opset <= hi and f.expected_ops


def test_shape_arithmetic_is_told_from_a_fallback():
    """Placement exempts only values computed from shapes and constants, of rank 0 or 1."""
    from attnexport import export as E
    from attnexport import variants as V
    v = V.get("sdpa")
    o = v.resolve({"causal": True})
    model = E.build_model("sdpa", o, "primitives", params=seeding.init_params(v, o, 0))[0]
    found = R.shape_computations(model)
    ops = {n.split(":")[0] for n in found}
    assert {"Range", "Concat", "Squeeze", "Add"} <= ops  # the causal mask's positions and their bounds
    # The causal mask itself (rank 2, from shapes) and everything reading inputs is compute.
    assert not ops & {"Greater", "LessOrEqual", "Where", "MatMul", "Softmax", "Expand", "Reshape"}
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim)
             for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    nodes = {f"{n.op_type}:{n.name}": n for n in model.graph.node}
    assert all(ranks.get(o, 0) <= 1 for n in found for o in nodes[n].output)
    # A vector read from an input's values is compute, whatever its rank.
    from onnx import TensorProto, helper
    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"], name="shape"),
         helper.make_node("Gather", ["s", "zero"], ["n"], name="from_shape"),
         helper.make_node("ReduceMax", ["x"], ["m"], name="from_values", keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("n", TensorProto.INT64, []),
         helper.make_tensor_value_info("m", TensorProto.INT64, [])],
        [helper.make_tensor("zero", TensorProto.INT64, [], [0])])
    found = R.shape_computations(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert found == {"Shape:shape", "Gather:from_shape"}
    placement = {"CPUExecutionProvider": ["Shape:shape", "Gather:from_shape", "ReduceMax:from_values"]}
    assert R.cpu_nodes("ort-cuda", placement, found) == ["ReduceMax:from_values"]
    assert R.cpu_nodes("ort-cpu", placement, found) == []


def test_reference_evaluator_gathers_elements_along_a_long_axis():
    """onnx 1.23's GatherElements breaks where the gathered axis has more than numpy.choose's
    64 choices (a BertModel's position ids: (1, 512) gathered to (1, T)); attnexport's
    replacement is the operator's definition, checked against ONNX Runtime."""
    from onnx import TensorProto, helper
    node = helper.make_node("GatherElements", ["data", "idx"], ["out"], axis=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 128]),
                                            helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 5])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    rng = np.random.default_rng(0)
    feed = {"data": rng.standard_normal((2, 128)).astype(np.float32),
            "idx": np.array([[0, 127, 64, -1, 3], [5, 6, 7, 100, -128]], np.int64)}
    want = np.take_along_axis(feed["data"], np.where(feed["idx"] < 0, feed["idx"] + 128, feed["idx"]), axis=1)
    for rt in ("onnx-ref", "ort-cpu"):
        np.testing.assert_array_equal(R.prepare_onnx(rt, model).run(feed)["out"], want)


def test_a_float16_transpose_into_matmul_gets_a_cpu_session():
    """ONNX Runtime's CPU provider (1.24 to 1.31.1 at least, on x86-64 with AVX2) crashes the
    process creating a session for an fp16 Transpose -> MatMul (microsoft/onnxruntime#28392:
    its NCHWc pass meets the Cast it puts before MatMul); attnexport's CPU sessions of fp16 graphs
    leave that pass out. Both sessions are made in child processes: the default one may crash
    (where the bug is), attnexport's must run and give the product."""
    import subprocess
    import sys
    script = """
import sys, numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from attnexport import runtimes as R
w = numpy_helper.from_array(np.eye(8, dtype=np.float16), "w")
g = helper.make_graph([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
                       helper.make_node("MatMul", ["t", "w"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["s", "b", 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], [w])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
x = np.arange(48, dtype=np.float16).reshape(3, 2, 8)
if sys.argv[1] == "default":
    import onnxruntime as ort
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
else:
    assert R.has_fp16(m)
    y = R.prepare_onnx("ort-cpu", m).run({"x": x})["y"]
    assert np.array_equal(y, x.transpose(1, 0, 2)), y
print("ok")
"""
    ours = subprocess.run([sys.executable, "-c", script, "attnexport"], capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and ours.stdout.strip() == "ok", ours.stderr[-2000:]
    default = subprocess.run([sys.executable, "-c", script, "default"], capture_output=True, text=True, timeout=120)
    assert default.returncode == 0 or default.returncode < 0, default.stderr[-2000:]  # ran, or crashed


def test_a_session_from_a_file_path_is_made_in_the_one_place(mha, tmp_path):
    """bench --hf's engines open their files by path through `ort_session` too: a float16 file (the
    CPU pass that crashes on it skipped), with the pool spinning, runs as the ModelProto's session."""
    variant, o, params, _, feed = mha
    model = E.build_model("mha", o, "attention", dtype="fp16", params=params)[0]
    path = tmp_path / "mha-fp16.onnx"
    onnx.save(model, str(path))
    half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feed.items()}
    by_path, placement, _ = R.ort_session("ort-cpu", path, threads=1, spinning=True)
    by_proto = R.ort_session("ort-cpu", model, threads=1)[0]
    got, want = by_path.run(None, half), by_proto.run(None, half)
    assert placement == {"CPUExecutionProvider": placement["CPUExecutionProvider"]}
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=1e-3, atol=1e-3)


def test_what_a_runtime_lacks_is_read_from_its_line_and_its_adapter(monkeypatch):
    """MatMulNBits' widths come from the runtime's registry line (WebGPU's kernel takes 2 and 4
    bits), the reference evaluator's missing contrib ops from its adapter; no name is read."""
    from onnx import TensorProto, helper
    node = helper.make_node("MatMulNBits", ["a", "w", "s"], ["y"], domain="com.microsoft", K=32, N=4, bits=8,
                            block_size=32)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor("w", TensorProto.UINT8, [4, 1, 32], bytes(128), raw=True),
                               helper.make_tensor("s", TensorProto.FLOAT, [4], [1.0] * 4)])
    model = helper.make_model(graph)
    assert R.missing_ops("ort-cpu", model) == []
    assert R.missing_ops("ort-webgpu", model) == ["com.microsoft.MatMulNBits of 8 bits (it takes 2 and 4)"]
    assert R.missing_ops("onnx-ref", model) == ["com.microsoft.MatMulNBits"]
    monkeypatch.setitem(R.REGISTRY, "ort-cpu", dataclasses.replace(R.REGISTRY["ort-cpu"], nbits=(4,)))
    assert R.missing_ops("ort-cpu", model) == ["com.microsoft.MatMulNBits of 8 bits (it takes 4)"]
    # the integer int8 form's kernel: the blockwise form named as the way out only where 8-bit MatMulNBits runs
    integer = helper.make_model(helper.make_graph(
        [helper.make_node("DynamicQuantizeMatMul", ["a", "q", "s"], ["y"], domain="com.microsoft")], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("q", TensorProto.INT8, [32, 4], bytes(128), raw=True),
         helper.make_tensor("s", TensorProto.FLOAT, [4], [1.0] * 4)]))
    assert R.missing_ops("ort-cpu", integer) == [] and R.missing_ops("ort-wasm", integer) == []
    assert R.missing_ops("ort-cuda", integer) == ["com.microsoft.DynamicQuantizeMatMul on its device (it would run "
                                                  "them on the CPU: export --int8-kernel blockwise)"]
    assert R.missing_ops("ort-webgpu", integer) == ["com.microsoft.DynamicQuantizeMatMul on its device (it would "
                                                    "run them on the CPU; its MatMulNBits takes no 8 bits either: "
                                                    "export int4 or fp16)"]


def test_an_onnx_runtime_provider_is_one_registry_line(mha, monkeypatch):
    """What docs/layout.md shows: another ONNX Runtime provider is its line in the registry alone.
    One this build has (the CPU provider under another name) runs a model; one it lacks says why
    and is refused when named, never run on the CPU instead."""
    monkeypatch.setitem(R.REGISTRY, "ort-other", R.Runtime("ort-other", "onnx", "cpu", "ort", default=False,
                                                           timed=True, provider="CPUExecutionProvider"))
    monkeypatch.setitem(R.REGISTRY, "ort-rocm", R.Runtime("ort-rocm", "onnx", "gpu", "ort", default=False,
                                                          timed=True, accelerated=True,
                                                          provider="ROCMExecutionProvider"))
    *_, model, feed = mha
    got = R.prepare_onnx("ort-other", model).run(feed)
    np.testing.assert_allclose(got["output"], R.prepare_onnx("ort-cpu", model).run(feed)["output"], rtol=1e-6,
                               atol=1e-6)
    status = R.status("ort-rocm")
    assert not status.available and "built without ROCMExecutionProvider" in status.reason
    with pytest.raises(ProviderUnavailableError, match="ort-rocm is not available"):
        R.select(["ort-rocm"])


def test_torch_on_cuda_runs_without_tf32_and_puts_the_process_setting_back():
    import torch

    from attnexport.runtimes import pytorch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # the user's choice
        with pytorch.without_tf32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
