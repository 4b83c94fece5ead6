"""The static form's GroupQueryAttention as the ort flavour leaves it (`attnexport.pretrained.fusions.gqa`):
one operator a layer with the rotary inside and the three projections packed into one matrix,
each weight still fingerprinted; the output projection reading the operator's output as it is;
in fp32 and in half. On a small random Llama (the [hf] extra)."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport import signature as SG  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402


def test_the_ort_flavours_static_step_is_one_fused_attention_a_layer_with_every_weight_fingerprinted(tiny_lm, tmp_path):
    path = tmp_path / "lm.onnx"
    r = run("export", "--hf", tiny_lm("llama"), "--kv-cache", "static", "--max-seq", "64", "--flavor", "ort", "-o",
            path)
    assert r.exit_code == 0, r.output
    assert "not for CUDA" in r.output  # its float32 GroupQueryAttention has no CUDA kernel
    model = onnx.load(path)
    signature = SG.of(model)
    assert signature.caches == hf.Layout.of(model).signature.caches and signature.write_pos.form == "start"
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "RotaryEmbedding" not in ops and "Transpose" not in ops
    assert ops.count("SkipSimplifiedLayerNormalization") == 4  # every norm after a residual add
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert attrs["do_rotary"] == 1 and list(gqa.input[1:3]) == ["", ""]  # rotary inside, q/k/v packed
    # The total length and the NaN guard once for the model, not once a layer, and the guard still
    # answers NaN for a block at batch > 1 over written positions (sequence 0), right elsewhere.
    gqas = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    outs = {n.output[0] for n in gqas}
    assert len({n.input[6] for n in gqas}) == 1
    assert sum(n.op_type == "Where" and n.input[2] in outs for n in model.graph.node) == 1
    # The output projection reads the attention's (B, S, hidden) output as it is, not through the
    # split into heads and the join back that the export writes.
    assert not any(n.op_type == "Reshape" and n.input[0] in outs for n in model.graph.node)
    assert any(n.op_type == "MatMul" and n.input[0] in outs for n in model.graph.node)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.array([[5, 6, 7], [8, 9, 10]], np.int64), "write_pos": np.array([2, 0], np.int64)}
    for i in session.get_inputs()[2:]:
        feed[i.name] = np.zeros([2, *i.shape[1:]], np.float32)
    logits = session.run(["logits"], feed)[0]
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    q = record["model.model.layers.0.self_attn.q_proj.weight"]
    assert q["columns"] == [0, 64] and q["initializer"] == record["model.model.layers.0.self_attn.v_proj.weight"][
        "initializer"]
    assert all(e["layout"] != "folded" for e in record.values())
    # A weight changed inside the packed matrix is named before any number is compared.
    packed = next(i for i in model.graph.initializer if i.name == q["initializer"])
    values = onnx.numpy_helper.to_array(packed).copy()
    values[0, 70] += 0.5  # a key projection's column
    packed.CopyFrom(onnx.numpy_helper.from_array(values, packed.name))
    onnx.save(model, path)
    r = run("verify", path, "--hf", tiny_lm("llama"), "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 1 and "layers.0.self_attn.k_proj.weight" in r.output


def test_the_static_step_in_half_is_fused_as_the_fp32_one(tiny_lm, tmp_path):
    """In half, transformers 5 casts the rotary cos and sin to fp16 in the graph; the step is still
    one GroupQueryAttention a layer with the rotary inside and q, k, v in one matrix (before the
    rule for the Cast, its rotary stayed a RotaryEmbedding and its projections three MatMuls)."""
    path = tmp_path / "lm16.onnx"
    r = run("export", "--hf", tiny_lm("llama"), "--kv-cache", "static", "--max-seq", "64", "--flavor", "ort",
            "--dtype", "fp16", "-o", path)
    assert r.exit_code == 0, r.output
    assert "not for CUDA" not in r.output  # the form for CUDA
    model = onnx.load(path)
    signature = SG.of(model)
    assert signature.caches == hf.Layout.of(model).signature.caches and signature.write_pos.form == "start"
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "RotaryEmbedding" not in ops and "Transpose" not in ops
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute}["do_rotary"] == 1 and list(gqa.input[1:3]) == ["", ""]
