"""A quantized or half Whisper export (`export --hf WHISPER --deploy FOLDER --precision int8|fp16`) of a
small random model written as a CTranslate2 folder: int8's encoder matrices on DynamicQuantizeMatMul,
the decoder's as MatMulNBits (the tied head too, the embedding still gathering the float table; the
blockwise form's encoder too), each graph checked before writing
against the model with the file's weights (fp16: every float in half, checked within fp16's
budget), and verify judging what the folder costs in transcripts against the speech budget
(teacher-forced KL and top-1, the greedy transcripts' tokens and word error rate). int4 is int8's
path with another plan (its 8-bit head the language models' rule), measured on tiny.en in
docs/whisper.md.

The [hf] extra (transformers)."""

import json

import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

import onnx  # noqa: E402
from conftest import cli  # noqa: E402

from attnexport.pretrained import precision as P  # noqa: E402
from attnexport.runtimes.base import all_nodes  # noqa: E402


@pytest.fixture(scope="module")
def int8_folder(whisper_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "whisper"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--precision", "int8", "--json")
    assert r.exit_code == 0, r.output
    return out, json.loads(r.output[r.output.index("{"):])


def test_int8_runs_the_encoder_on_integer_gemm_the_decoder_on_matmulnbits_each_graph_checked_with_its_weights(
        int8_folder):
    folder, doc = int8_folder
    encoder = onnx.load(folder / "onnx" / "encoder_model.onnx")
    ops = [n.op_type for n in encoder.graph.node]
    # 2 layers of q, k, v, out, fc1, fc2: int8 per column, uint8 activations per tensor
    assert ops.count("DynamicQuantizeMatMul") == 2 * 6 and "MatMul" not in ops and "MatMulNBits" not in ops
    record = P.record_of(encoder)
    assert record["plan"]["kernel"] == "integer" and {e["how"] for e in record["matrices"]} == {"integer"}
    assert "not calibrated" in " ".join(doc["notes"])
    decoder = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    ops = [n.op_type for n in all_nodes(decoder.graph)]
    # 2 layers of self q, k, v, out, cross q, out, fc1, fc2 a branch, the cross k, v in the first: and the head
    assert ops.count("MatMulNBits") == 2 * (2 * 8 + 1) + 2 * 2 and "MatMul" not in ops
    assert "DynamicQuantizeMatMul" not in ops
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    heads = [n for n in all_nodes(decoder.graph) if n.op_type == "MatMulNBits" and
             [a.i for a in n.attribute if a.name == "N"] == [vocab]]
    assert len(heads) == 2 and len({n.input[1] for n in heads}) == 1  # one matrix for both branches
    assert any(n.op_type == "Gather" for n in all_nodes(decoder.graph))  # the embedding gathers the float table
    assert P.record_of(decoder)["plan"]["bits"] == 8 and "int8:" in " ".join(doc["notes"])
    # every graph checked with the file's weights before writing, the merged decoder's two branches too
    assert all(c["worst"]["max_abs"] <= c["worst"]["atol"] for c in doc["checked"]) and len(doc["checked"]) == 5


def test_int8_s_blockwise_form_holds_the_encoder_as_matmulnbits_too(whisper_folder, tmp_path):
    out = tmp_path / "whisper"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--precision", "int8", "--int8-kernel", "blockwise")
    assert r.exit_code == 0, r.output
    ops = [n.op_type for n in onnx.load(out / "onnx" / "encoder_model.onnx").graph.node]
    assert ops.count("MatMulNBits") == 2 * 6 and "DynamicQuantizeMatMul" not in ops
    assert "block 32, accuracy level 4" in r.output and "not calibrated" not in r.output


def test_verify_judges_an_int8_folder_by_the_speech_budget(int8_folder, whisper_folder):
    folder, _ = int8_folder
    r = cli("verify", folder, "--hf", whisper_folder(), "--new-tokens", "10", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    by = {row["runtime"]: row for row in doc["results"]}
    assert doc["dtype"] == "int8" and set(by) == {"ort-cpu"}  # torch and onnx-ref: not runtimes of it
    skipped = {t["name"]: t["reason"] for t in doc["runtimes"] if not t["used"]}
    assert "source model" in skipped["torch"] and "MatMulNBits" in skipped["onnx-ref"]
    cost = by["ort-cpu"]["detail"]["accuracy"]
    assert [o["name"] for o in by["ort-cpu"]["outputs"]] == ["mean KL vs fp32 (nats)", "top-1 disagreement vs fp32",
                                                           "transcript tokens unlike fp32's", "word error rate vs fp32"]
    said = by["ort-cpu"]["detail"]["transformers_tokens"][0]
    assert 0 < cost["kl_mean"] < 0.05 and cost["positions"] == len(said) + 1
    # a limit the folder cannot meet fails, naming the measure
    r = cli("verify", folder, "--hf", whisper_folder(), "--runtimes", "ort-cpu", "--new-tokens", "10",
            "--budget", "kl-mean=0")
    assert r.exit_code == 1 and "mean KL" in r.output and "> 0" in r.output
    r = cli("verify", folder, "--hf", whisper_folder(), "--runtimes", "onnx-ref")
    assert r.exit_code == 2 and "MatMulNBits" in r.output and len(r.output.strip().splitlines()) == 1


def test_fp16_is_every_float_in_half_checked_in_fp16_s_budget_and_judged_by_the_speech_budget(whisper_folder,
                                                                                             tmp_path):
    out = tmp_path / "fp16"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--precision", "fp16", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert all("fp16" in c["worst"]["basis"] or "policy" in c["worst"]["basis"] for c in doc["checked"])
    for graph in ("encoder_model", "decoder_model_merged"):
        model = onnx.load(out / "onnx" / f"{graph}.onnx")
        floats = [i.type.tensor_type.elem_type for i in model.graph.input if i.name not in ("input_ids",
                                                                                            "use_cache_branch")]
        assert set(floats) == {onnx.TensorProto.FLOAT16}
        assert {i.data_type for i in model.graph.initializer} <= {onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64}
    r = cli("verify", out, "--hf", whisper_folder(), "--runtimes", "torch,ort-cpu", "--skip-unavailable",
            "--new-tokens", "10", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["dtype"] == "fp16" and {row["runtime"] for row in report["results"]} == {"ort-cpu"}
    assert "fp16 folder's cost" in next(t["reason"] for t in report["runtimes"] if t["name"] == "torch")
    assert all(row["case"].startswith("accuracy") for row in report["results"])


def test_an_fp16_export_that_overflows_is_refused_naming_the_node_where_it_starts(tiny_whisper, tmp_path,
                                                                                   monkeypatch):
    """The encoder's first MLP made to overflow fp16 and not fp32 (every fc1 weight 1, every fc2 weight
    60000): the export's check before writing refuses it as an overflow at the node that makes the
    first infinity from finite inputs, where the layer norm after it would only have shown NaN."""
    import torch
    made = tiny_whisper.model

    def saturated(*args, **how):
        model = made(*args, **how)
        mlp = model.model.encoder.layers[0]
        with torch.no_grad():
            mlp.fc1.weight.fill_(1.0)
            mlp.fc2.weight.fill_(60000.0)
        return model
    monkeypatch.setattr(tiny_whisper, "model", saturated)
    tiny_whisper.save(tmp_path / "hot")
    r = cli("export", "--hf", tmp_path / "hot", "--deploy", tmp_path / "out", "--precision", "fp16")
    assert r.exit_code == 1 and "encoder_model: the export overflows" in r.output, r.output
    assert "first non-finite value at" in r.output and "float16's range of 65504" in r.output
    assert not (tmp_path / "out").exists()
