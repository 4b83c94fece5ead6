"""The integer int8 form (`precision.Plan.kernel`: DynamicQuantizeMatMul, weights int8 per column,
activations uint8 per tensor) and its calibration (`calibrate.choose`): an encoder's default int8,
checked before writing, verified within the int8 budget on every runtime that runs it, its weights
faithful, its kernels emulated as they compute. The [hf] extra, on small random configs."""

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from conftest import cli as run  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from attnexport.pretrained import calibrate, emulate  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import precision as P  # noqa: E402
from attnexport.record import ExportRecord  # noqa: E402
from attnexport.runtimes.base import all_nodes  # noqa: E402
from attnexport.runtimes.reference import fused_reference_ops  # noqa: E402


def _ops(path) -> set:
    return {n.op_type for n in onnx.load(path).graph.node}


def test_an_encoders_int8_is_the_integer_form_verified_within_its_budget(tiny_encoder, tmp_path):
    folder = tiny_encoder("bert")
    out = tmp_path / "int8.onnx"
    r = run("export", "--hf", folder, "--precision", "int8", "-o", out)
    assert r.exit_code == 0, r.output
    assert "DynamicQuantizeMatMul: int8 weights per column" in r.output and "on calibration text" in r.output
    ops = _ops(out)
    assert "DynamicQuantizeMatMul" in ops and "MatMulNBits" not in ops and "MatMul" not in ops
    record = json.loads(ExportRecord.of(onnx.load(out)).precision)
    assert record["plan"]["kernel"] == "integer"
    matrices = [e for e in record["matrices"] if e["how"] == "integer"]
    # every input's matrices measured at every alpha on the calibration text, the whole graph at least once
    table = record["calibration"]["per_input"]
    assert sorted(n for t in table for n in t["nodes"]) == sorted(e["node"] for e in record["matrices"])
    assert all(len([k for k in t if k.startswith("alpha ")]) == len(calibrate.ALPHAS) for t in table)
    assert record["calibration"]["whole"] and matrices
    r = run("verify", out, "--hf", folder, "--runtimes", "onnx-ref,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    embedded = [x for x in rows if x["case"].startswith("embeddings: 40")]
    assert {x["runtime"] for x in embedded} == {"onnx-ref", "ort-cpu"}
    assert all(x["passed"] and x["detail"]["embeddings"]["top5_agreement"] >= 0.9 for x in embedded)
    weights = next(x for x in rows if x["case"].startswith("weights:"))
    assert weights["passed"] and weights["detail"]["matrices"] == {"integer 8-bit": len(matrices)}


def test_the_blockwise_form_is_still_there_and_the_forms_options_do_not_mix(tiny_encoder, tmp_path):
    folder = tiny_encoder("bert")
    r = run("export", "--hf", folder, "--precision", "int8", "--int8-kernel", "blockwise", "-o", tmp_path / "b.onnx")
    assert r.exit_code == 0, r.output
    assert "MatMulNBits" in _ops(tmp_path / "b.onnx") and "DynamicQuantizeMatMul" not in _ops(tmp_path / "b.onnx")
    r = run("export", "--hf", folder, "--precision", "int8", "--block-size", "64", "-o", tmp_path / "c.onnx")
    assert r.exit_code == 0 and "MatMulNBits" in _ops(tmp_path / "c.onnx")  # MatMulNBits's option: its form
    for args, said in ((("--precision", "int4", "--int8-kernel", "integer"), "goes with --precision int8"),
                       (("--precision", "int8", "--int8-kernel", "integer", "--block-size", "32"), "MatMulNBits")):
        r = run("export", "--hf", folder, *args, "-o", tmp_path / "x.onnx")
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.onnx").exists()


def _tiny_step(tiny_encoder, tmp_path):
    folder = tiny_encoder("bert")
    out = tmp_path / "fp32.onnx"
    hf_export.export_hf(hf_export.HFExport(folder, output=out))
    model, _ = hf.load(folder, 0)
    layout = hf.layout_of(model, None, None, folder)
    return onnx.load(out), hf.step_module(model, layout), layout, hf.tokenizer_of(folder)


def test_calibration_keeps_the_costliest_in_float_and_smooths_as_recorded(tiny_encoder, tmp_path):
    graph, wrapper, layout, tokenizer = _tiny_step(tiny_encoder, tmp_path)
    feeds, cost, _ = layout.family.calibration(layout, tokenizer)
    found = P.sites(graph, layout.vocab)
    before = {s.weight: np.array(numpy_helper.to_array(i), np.float64)
              for s in found for i in graph.graph.initializer if i.name == s.weight}
    chosen = calibrate.choose(wrapper, graph, found, feeds, layout.outputs, cost, target=0.0)  # nothing is enough
    table = chosen.table["per_input"]
    by_cost = [n for t in sorted(table, key=lambda t: -t["cost"]) for n in t["nodes"]]
    assert list(chosen.kept) == by_cost[:len(chosen.kept)] and chosen.kept
    assert len({t["input"] for t in table if t["nodes"][0] in chosen.kept}) <= max(1, int(calibrate.LIMIT * len(table)))
    # a smoothing vector the kernel's check cannot tell apart from the plain product: the same matrix
    s = found[0]
    w = before[s.weight]
    chosen.smoothing[s.node] = (0.5, np.linspace(0.5, 4.0, s.k))
    chosen.kept.pop(s.node, None)
    P.quantize(graph, P.plan_for("int8", kernel="integer"), layout.layers, layout.vocab, calibration=chosen)
    record = P.record_of(graph)
    entry = next(e for e in record["matrices"] if e["node"] == s.node)
    assert entry["how"] == "integer" and entry["alpha"] == 0.5
    assert [e["node"] for e in record["matrices"] if e["how"] == "kept"] == list(chosen.kept)
    assert all(e.get("why") for e in record["matrices"] if e["how"] == "kept")
    got = P.matrix(graph, entry)
    assert np.abs(got - w).max() <= np.abs(w).max() / 127 * 4  # within a few steps of the widest row's scale
    assert P.unfaithful(before, graph) == [] and P.damaged(graph) == []
    # one code moved by a step: no longer ONNX Runtime's rounding of the source, and not what was recorded
    q = next(i for i in graph.graph.initializer if i.name == f"{s.weight}_Q8")
    codes = numpy_helper.to_array(q).copy()
    codes[0, 0] = codes[0, 0] - 1 if codes[0, 0] > -127 else codes[0, 0] + 1
    q.CopyFrom(numpy_helper.from_array(codes, q.name))
    assert [b.split(":")[0] for b in P.unfaithful(before, graph)] == [s.node] and P.damaged(graph) == [s.node]


def test_the_kernels_are_computed_as_onnx_runtime_computes_them():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((2, 5, 16)) * np.linspace(0.1, 8, 16)).astype(np.float32)
    w = rng.standard_normal((16, 6)).astype(np.float32)
    q, scale = P.int8_columns(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert np.abs(q * scale - w).max() <= scale.max() / 2 * (1 + 1e-6)
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeMatMul", ["a", "q", "s"], ["y"], domain="com.microsoft"),
         helper.make_node("DynamicQuantizeLinear", ["a"], ["aq", "as", "az"])],
        "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, 5, 16])],
        [helper.make_tensor_value_info(n, t, None) for n, t in (("y", onnx.TensorProto.FLOAT),
                                                                ("aq", onnx.TensorProto.UINT8),
                                                                ("as", onnx.TensorProto.FLOAT),
                                                                ("az", onnx.TensorProto.UINT8))],
        [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    y, aq, a_scale, a_zero = ort.InferenceSession(model.SerializeToString(),
                                                  providers=["CPUExecutionProvider"]).run(None, {"a": a})
    # emulate's rounding of the activations: ONNX Runtime's grid, at most one step off where a value
    # sits on a rounding boundary (vectorised division differs by CPU)
    dq = emulate.per_tensor_uint8(torch.from_numpy(a)).numpy()
    assert np.abs(dq - (aq.astype(np.float32) - a_zero) * a_scale).max() <= a_scale * (1 + 1e-5)
    # the reference evaluator's op against ONNX Runtime's kernel, and both against the float product
    op = next(o for o in fused_reference_ops() if o.__name__ == "DynamicQuantizeMatMul")
    ref = op._run(None, a, q, scale)[0]
    exact = a.astype(np.float64) @ (q * scale).astype(np.float64)
    assert np.abs(ref - y).max() <= 1e-4 * np.abs(exact).max()
    assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()


def test_the_float_twin_computes_with_the_files_weights_in_an_ifs_branches_too():
    # The twin every quantized graph is checked through (`float_activations`): each DynamicQuantizeMatMul
    # a MatMul by its decoded weights, within an If's branches too (a merged decoder's two steps), and
    # nothing ONNX Runtime's optimizer turns back into integer kernels (a DequantizeLinear before a
    # MatMul is fused so): fed activations with wide channels, it is the float product, where the
    # quantized graph is a step of the input's grid away.
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((1, 64, 16)) * np.linspace(0.1, 30, 16)).astype(np.float32)
    weights = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(2)]
    grids = [P.int8_columns(w) for w in weights]
    inits = [t for i, (q, s) in enumerate(grids) for t in (numpy_helper.from_array(q, f"q{i}"),
                                                           numpy_helper.from_array(s, f"s{i}"))]

    def branch(i):
        node = helper.make_node("DynamicQuantizeMatMul", ["a", f"q{i}", f"s{i}"], [f"y{i}"], name=f"m{i}",
                                domain="com.microsoft")
        return helper.make_graph([node], f"b{i}", [], [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT,
                                                                                      None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch(0), else_branch=branch(1))], "g",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, 64, 16]),
         helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    twin = P.float_activations(model)
    assert not [n for n in all_nodes(twin.graph) if n.op_type == "DynamicQuantizeMatMul"]
    run = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"]).run
    quantized = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run
    for i, c in enumerate((True, False)):
        exact = a.astype(np.float64) @ (grids[i][0] * grids[i][1]).astype(np.float64)
        feed = {"a": a, "c": np.array([c])}
        assert np.abs(run(None, feed)[0] - exact).max() <= 1e-5 * np.abs(exact).max()
        assert np.abs(quantized(None, feed)[0] - exact).max() > 1e-3 * np.abs(exact).max()  # the file's own rounding
