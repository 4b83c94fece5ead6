"""Whisper's export (`export --hf WHISPER --deploy FOLDER`) of a small random model written as a
CTranslate2 folder: the folder Optimum and transformers.js load, every graph checked against float64
before writing (the merged decoder's two branches too), and what a speech export does not make yet
refused in one line before anything is written.

The [hf] extra (transformers)."""

import json

import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

import onnx  # noqa: E402
from conftest import cli  # noqa: E402

from attnexport.pretrained.encdec import graphs as G  # noqa: E402
from attnexport.pretrained.whisper import ctranslate2 as CT  # noqa: E402
from attnexport.pretrained.whisper import graphs as W  # noqa: E402


def test_the_export_writes_the_folder_whisper_s_clients_load(whisper_deployed):
    folder, doc = whisper_deployed
    assert sorted(p.name for p in (folder / "onnx").iterdir()) == ["decoder_model_merged.onnx", "encoder_model.onnx",
                                                                    "generation_config.json"]  # Optimum reads it there
    assert (folder / "onnx" / "generation_config.json").read_text() == (folder / "generation_config.json").read_text()
    for f in ("config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json",
              "tokenizer_config.json"):
        assert (folder / f).is_file(), f
    assert json.loads((folder / "preprocessor_config.json").read_text())["feature_size"] == 80
    decoder = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    layers = 2
    assert [i.name for i in decoder.graph.input] == G.merged_inputs(G.Spec(layers, 1, 1, 1))
    assert [o.name for o in decoder.graph.output] == W.outputs(W.DECODER, layers)
    assert [n.op_type for n in decoder.graph.node] == ["If"]
    encoder = onnx.load(folder / "onnx" / "encoder_model.onnx")
    assert [i.name for i in encoder.graph.input] == ["input_features"]
    # every graph checked against float64 before writing, the merged decoder's two branches too
    assert [c["graph"] for c in doc["checked"]] == [
        "encoder_model", "decoder_model", "decoder_with_past_model",
        "decoder_model_merged (use_cache_branch=false)", "decoder_model_merged (use_cache_branch=true)"]
    assert all(c["worst"]["max_abs"] <= c["worst"]["atol"] for c in doc["checked"])
    assert doc["graphs"]["decoder_model_merged"]["routed"] == 4  # each layer's self and cross attention


def test_the_merged_decoder_keeps_each_weight_once(whisper_deployed, whisper_folder):
    folder, _ = whisper_deployed
    decoder = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    held = sum(onnx.numpy_helper.to_array(i).nbytes for i in decoder.graph.initializer)
    model, _ = CT.load(whisper_folder())
    decoder_params = sum(p.numel() * 4 for p in model.model.decoder.parameters())
    assert held < 1.1 * decoder_params  # one copy: the first step and the later one share it


@pytest.mark.parametrize("args,text", [
    ((), "write them with --deploy FOLDER"),
    (("--deploy", "{out}", "--precision", "q4f16"), "exports in fp32, fp16, int8 or int4"),
    (("--deploy", "{out}", "--max-seq", "64"), "give it with --kv-cache static"),
])
def test_what_a_speech_export_does_not_make_is_refused_before_anything_is_written(whisper_folder, tmp_path, args,
                                                                                  text):
    out = tmp_path / "out"
    r = cli("export", "--hf", whisper_folder(), *[a.format(out=out) for a in args])
    assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []
