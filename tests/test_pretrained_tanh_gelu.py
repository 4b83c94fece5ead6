"""GELU's tanh approximation written as its formula in fp32 graphs of the attention flavour
(`attnexport.pretrained.tanh_gelu`): the same function, and Gemma 3 on WebGPU within its budgets
(onnxruntime-web's kernel for the Gelu op errs: tests/test_js_runtimes.py pins it). The `[hf]`
extra, on a small random Gemma 3."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained.tanh_gelu import spell_out  # noqa: E402


def _gelus(*approximations):
    nodes = [helper.make_node("Gelu", ["x"], [f"y{k}"], approximate=a)  # unnamed, as a node may be
             for k, a in enumerate(approximations)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6001])],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, [6001]) for n in nodes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


def test_the_formula_computes_what_the_kernel_does_and_leaves_the_exact_gelu():
    model = _gelus("tanh", "none", "tanh")
    x = np.linspace(-30, 30, 6001, dtype=np.float32)
    before = R.prepare_onnx("ort-cpu", model).run({"x": x})
    assert spell_out(model) == 2 and spell_out(model) == 0  # done once; the erf GELU kept
    onnx.checker.check_model(model, full_check=True)  # each value made once
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Gelu") == 1 and ops.count("Tanh") == 2
    after = R.prepare_onnx("ort-cpu", model).run({"x": x})
    xd = x.astype(np.float64)
    want = 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd**3)))
    for name in ("y0", "y2"):  # each within fp32's rounding of values up to 30 of float64, as the kernel is
        assert np.abs(after[name] - want).max() <= 4 * 2.0**-24 * 30, name
        assert np.abs(before[name] - want).max() <= 4 * 2.0**-24 * 30, name
    kept = next(n for n in model.graph.node if n.op_type == "Gelu")
    assert (list(kept.input), list(kept.output), kept.attribute[0].s) == (["x"], ["y1"], b"none")
    np.testing.assert_allclose(after["y1"], before["y1"], rtol=0, atol=4 * 2.0**-24 * 30)


def test_gemma3_in_the_attention_flavour_writes_its_gelus_out_and_passes_on_webgpu(tiny_lm, tmp_path):
    """The export says how many it wrote; verify passes every row, on WebGPU too where it runs (before,
    the first departing node there was a Gelu, 1.4e-05 off against a budget of 1e-05)."""
    folder = tiny_lm("gemma3")
    path = tmp_path / "gemma3.onnx"
    r = run("export", "--hf", folder, "--kv-cache", "-o", path)
    assert r.exit_code == 0, r.output
    assert "6 Gelu(approximate='tanh') written as its formula with Tanh" in r.output
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert "Gelu" not in ops and ops.count("Tanh") == 6
    runtimes = "ort-cpu,ort-webgpu" if R.status("ort-webgpu").available else "ort-cpu"
    r = run("verify", path, "--hf", folder, "--runtimes", runtimes, "--new-tokens", "8", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert {row["runtime"] for row in rows} == set(runtimes.split(","))
    assert all(row["passed"] for row in rows) and len(rows) == 7 * len(runtimes.split(","))
