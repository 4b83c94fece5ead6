"""Whisper with its self cache static (`export --hf WHISPER --deploy FOLDER --kv-cache static --max-seq N`),
on a small random model written as a CTranslate2 folder: buffers of N positions written in place at
write_pos (ONNX's TensorScatter and Attention in the attention flavour), each graph checked against
float64 before writing, verify's rows (each graph, the decode property, transcripts token for token
transformers') on every runtime here, and the one-line refusals.

The [hf] extra (transformers)."""

import json

import onnx
import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.pretrained.whisper import graphs as W  # noqa: E402
from attnexport.runtimes.base import all_nodes  # noqa: E402

OPS = {"attention": {"TensorScatter", "Attention"}, "ort": {"GroupQueryAttention"}}


# The attention flavour's (the default): the ort flavour's GroupQueryAttention over the same buffers is
# the language models' static form's (tests/test_pretrained_forms.py), and tiny.en's static export in
# it verifies on ort-cpu and ort-node (docs/whisper.md).
@pytest.mark.parametrize("flavor", ["attention"])
def test_the_static_self_cache_is_written_in_place_and_verifies_on_every_runtime(whisper_folder, tmp_path, flavor):
    out = tmp_path / flavor
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--kv-cache", "static", "--max-seq", "40",
            "--flavor", flavor, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert len(doc["checked"]) == 5 and all(c["worst"]["max_abs"] <= c["worst"]["atol"] for c in doc["checked"])
    decoder = onnx.load(out / "onnx" / "decoder_model_merged_static.onnx")
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in decoder.graph.input}
    assert list(inputs)[:3] == ["input_ids", "encoder_hidden_states", W.WRITE_POS]
    assert inputs["past_key_values.1.decoder.key"][2] == 40 and inputs[W.WRITE_POS] == ["batch_size"]
    assert OPS[flavor] <= {n.op_type for n in all_nodes(decoder.graph)}
    r = cli("verify", out, "--hf", whisper_folder(), "--runtimes", "torch,ort-cpu,onnx-ref", "--new-tokens", "12",
            "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert len(rows) == 15 and all(row["passed"] for row in rows)
    transcripts = [row for row in rows if row["case"].startswith("transcripts")]
    assert all(row["detail"]["tokens"] == row["detail"]["transformers_tokens"] for row in transcripts)
    r = cli("verify", out, "--hf", whisper_folder(), "--new-tokens", "39")
    assert r.exit_code == 2 and "holds 40 positions" in r.output
    r = cli("verify", out, "--hf", whisper_folder(), "--clients", "optimum")
    assert r.exit_code == 2 and "attnexport's own" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args,text", [
    (("--kv-cache", "static"), "needs --max-seq N"),
    (("--kv-cache", "static", "--max-seq", "1000"), "holds 64 positions"),
    (("--kv-cache", "static", "--max-seq", "8"), "the export's checks write"),
])
def test_a_static_cache_s_size_is_refused_in_one_line_before_anything_is_written(whisper_folder, tmp_path, args,
                                                                                 text):
    out = tmp_path / "out"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, *args)
    assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()
