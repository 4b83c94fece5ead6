"""An encoder's layers as the ort flavour leaves them (`attnexport.pretrained.fusions.encoder`): in
fp32 one com.microsoft.Attention a layer (q, k, v packed, the (B, S) padding mask as it comes), the
skip layer norms and the bias GELU fused, no transposes; in half and when quantized the three
projections kept as MatMuls into a MultiHeadAttention with its bias and key padding mask; each
computing the model's embeddings at right-padded batches, each weight still fingerprinted. On small
random encoders (the [hf] extra)."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import precision as P  # noqa: E402
from attnexport.pretrained.encoders import SentenceEncoder  # noqa: E402
from attnexport.pretrained.encoders import measures as E  # noqa: E402
from attnexport.pretrained.fusions import encoder  # noqa: E402


def _export(folder, path, flavor="ort", **how):
    hf_export.export_hf(hf_export.HFExport(folder, flavor=flavor, output=path, **how))
    return onnx.load(path)


def _padded_feed(folder, texts):
    from transformers import AutoTokenizer
    batch = AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="np")
    assert (batch["attention_mask"] == 0).any()  # right padding in the batch
    return {k: np.asarray(v, np.int64) for k, v in batch.items()}


def _embed(path, feed):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(["last_hidden_state", "sentence_embedding"], {k: v for k, v in feed.items() if k in names})


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_fp32_is_one_packed_attention_a_layer_with_the_mask_as_it_comes(tiny_encoder, tmp_path, arch):
    folder = tiny_encoder(arch)
    model = _export(folder, tmp_path / "ort.onnx")
    ops = [n.op_type for n in model.graph.node]
    layers = ops.count("Attention")
    assert layers == 2 and "MultiHeadAttention" not in ops and "Transpose" not in ops and "Where" not in ops
    # every norm after a residual add (RoBERTa's embeddings' sum and norm too)
    assert ops.count("SkipLayerNormalization") >= 2 * layers and ops.count("BiasGelu") == layers
    assert ops.count("MatMul") == 3 * layers  # the output projection and the feed-forward's two
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    assert {n.input[3] for n in attention} == {encoder.MASK_INT32}  # one cast of the mask for every layer
    cast = next(n for n in model.graph.node if encoder.MASK_INT32 in n.output)
    assert cast.op_type == "Cast" and list(cast.input) == ["attention_mask"]
    # The same numbers as the attention flavour's export (standard ops) at a right-padded batch:
    # padding never compared, each sentence's embedding.
    _export(folder, tmp_path / "attention.onnx", flavor="attention")
    feed = _padded_feed(folder, list(E.CORPUS[:6]))
    (states, pooled), (want_states, want_pooled) = _embed(tmp_path / "ort.onnx", feed), \
        _embed(tmp_path / "attention.onnx", feed)
    kept = feed["attention_mask"].astype(bool)
    assert np.abs(states[kept] - want_states[kept]).max() < 1e-5 and np.abs(pooled - want_pooled).max() < 1e-5
    # onnx's reference evaluator runs the fused ops from their contracts (attnexport.runtimes.reference)
    ref = R.prepare_onnx("onnx-ref", model).run(feed)
    assert np.abs(ref["last_hidden_state"][kept] - states[kept]).max() < 1e-5
    # Each projection's weight is fingerprinted as its columns of the packed matrix.
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    prefix = "model.encoder.layer.0.attention.self"
    q, v = record[f"{prefix}.query.weight"], record[f"{prefix}.value.weight"]
    hidden = q["columns"][1]
    assert q["columns"] == [0, hidden] and v["columns"] == [2 * hidden, 3 * hidden]
    assert q["initializer"] == v["initializer"] == attention[0].input[1]
    # WebGPU's kernels take no padding mask: said before anything runs, not as a kernel's failure.
    assert R.missing_ops("ort-webgpu", model) == [
        "com.microsoft.Attention with a padding mask (its kernel takes none: export the attention flavour)"]
    assert R.missing_ops("ort-cpu", model) == R.missing_ops("ort-wasm", model) == []


def test_a_weight_changed_inside_the_packed_matrix_is_named(tiny_encoder, tmp_path):
    folder = tiny_encoder("bert")
    path = tmp_path / "ort.onnx"
    model = _export(folder, path)
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    key = record["model.encoder.layer.0.attention.self.key.weight"]
    packed = next(i for i in model.graph.initializer if i.name == key["initializer"])
    values = onnx.numpy_helper.to_array(packed).copy()
    values[0, key["columns"][0] + 3] += 0.5
    packed.CopyFrom(onnx.numpy_helper.from_array(values, packed.name))
    onnx.save(model, path)
    r = run("verify", path, "--hf", folder, "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 1 and "layer.0.attention.self.key.weight" in r.output


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_in_half_and_quantized_the_projections_stay_matmuls_into_a_masked_multi_head_attention(
        tiny_encoder, tmp_path, precision):
    """fp16, and int8's blockwise form (MatMulNBits)."""
    folder = tiny_encoder("bert")
    path = tmp_path / f"{precision}.onnx"
    how = {"plan": P.plan_for("int8", kernel="blockwise")} if precision == "int8" else {}
    model = _export(folder, path, precision=precision, **how)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MultiHeadAttention") == 2 and "Attention" not in ops and "Transpose" not in ops
    made = {o: n for n in model.graph.node for o in n.output}
    matrix = "MatMulNBits" if precision == "int8" else "MatMul"
    for node in (n for n in model.graph.node if n.op_type == "MultiHeadAttention"):
        assert [made[i].op_type for i in node.input[:3]] == [matrix] * 3  # the bias is the kernel's
        assert node.input[4] == encoder.MASK_INT32 and node.input[3].endswith("qkv_bias")
    assert "com.microsoft.MultiHeadAttention with a padding mask" in R.missing_ops("ort-webgpu", model)[-1]
    feed = _padded_feed(folder, list(E.CORPUS[:6]))
    _export(folder, tmp_path / "attention.onnx", flavor="attention", precision=precision, **how)
    got, want = _embed(path, feed)[1], _embed(tmp_path / "attention.onnx", feed)[1]
    if precision == "fp16":  # the reference evaluator's MultiHeadAttention with the bias and the mask
        ref = R.prepare_onnx("onnx-ref", model).run(feed)["sentence_embedding"]
        assert np.abs(ref.astype(np.float32) - got.astype(np.float32)).max() < 2e-3
    cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert np.isfinite(got).all() and cosine.min() > 0.999


def test_the_integer_int8_form_packs_the_projections_into_a_qattention(tiny_encoder, tmp_path):
    """int8's integer form: each layer's packed Attention a QAttention over its input quantized once
    (DynamicQuantizeLinear), the padding mask as it comes; the same embeddings as the attention
    flavour's int8 (its q, k and v DynamicQuantizeMatMuls read the same quantized input) and as the
    reference evaluator's QAttention."""
    folder = tiny_encoder("bert")
    model = _export(folder, tmp_path / "int8.onnx", precision="int8")
    made = {o: n for n in model.graph.node for o in n.output}
    attention = [n for n in model.graph.node if n.op_type == "QAttention"]
    assert len(attention) == 2 and not any(n.op_type in ("Attention", "MultiHeadAttention") for n in model.graph.node)
    for node in attention:
        assert made[node.input[0]].op_type == "DynamicQuantizeLinear" and node.input[5] == encoder.MASK_INT32
    feed = _padded_feed(folder, list(E.CORPUS[:6]))
    _export(folder, tmp_path / "attention.onnx", flavor="attention", precision="int8")
    got, want = _embed(tmp_path / "int8.onnx", feed)[1], _embed(tmp_path / "attention.onnx", feed)[1]
    ref = R.prepare_onnx("onnx-ref", model).run(feed)["sentence_embedding"]
    assert np.isfinite(got).all() and np.abs(ref - got).max() < 1e-3
    cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosine.min() > 0.999
    assert "QAttention" in R.missing_ops("ort-webgpu", model)[-1] and R.missing_ops("ort-cpu", model) == []


def test_a_layer_that_differs_from_the_form_is_left_alone(tiny_encoder, tmp_path, monkeypatch):
    """On the graph the fusion reads (the ort flavour's general attention, the family's own fusions
    off): every layer rewritten; a layer whose queries go through transposes that do not cancel, or
    a bias read off another input than attention_mask, left as it was (nothing guessed)."""
    monkeypatch.setattr(SentenceEncoder, "fuses_encoder_layers", False)
    plain = _export(tiny_encoder("bert"), tmp_path / "general.onnx")
    assert [n.op_type for n in plain.graph.node].count("MultiHeadAttention") == 2
    copy = onnx.ModelProto()
    copy.CopyFrom(plain)
    assert encoder.attention_with_padding_mask(copy, packed=True) == 2

    made = {o: n for n in plain.graph.node for o in n.output}
    first = next(n for n in plain.graph.node if n.op_type == "MultiHeadAttention")
    node = made[first.input[0]]
    while node.op_type != "Transpose":
        node = made[node.input[0]]
    turned = onnx.ModelProto()
    turned.CopyFrom(plain)
    for n in turned.graph.node:
        if n.name == node.name:
            del n.attribute[:]
            n.attribute.append(onnx.helper.make_attribute("perm", [0, 1, 3, 2]))
    assert encoder.attention_with_padding_mask(turned, packed=True) == 1

    renamed = onnx.ModelProto()
    renamed.CopyFrom(plain)
    for i in renamed.graph.input:
        if i.name == "attention_mask":
            i.name = "mask"
    for n in renamed.graph.node:
        n.input[:] = ["mask" if x == "attention_mask" else x for x in n.input]
    before = [n.op_type for n in renamed.graph.node]
    assert encoder.attention_with_padding_mask(renamed, packed=True) == 0
    assert [n.op_type for n in renamed.graph.node] == before
