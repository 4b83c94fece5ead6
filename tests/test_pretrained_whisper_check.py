"""verify of a Whisper deployment folder against its source, on a small random model written as a
CTranslate2 folder: each graph, the decode property and the transcripts on every runtime here, a
decoder that forgets its past caught, parameters of another model named, and the one-line refusals
(audio of the wrong kind, more tokens than the decoder holds).

The [hf] extra (transformers)."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402
from test_pretrained_whisper_audio import wav  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained.encdec import graphs as G  # noqa: E402
from attnexport.pretrained.whisper import ctranslate2 as CT  # noqa: E402
from attnexport.pretrained.whisper import export as S  # noqa: E402
from attnexport.pretrained.whisper import graphs as W  # noqa: E402


def _one_line(r, text: str) -> None:
    assert r.exit_code == 2, r.output
    assert text in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_verify_checks_every_graph_the_decode_property_and_transcripts_on_each_runtime(whisper_deployed,
                                                                                       whisper_folder, tmp_path):
    folder, _ = whisper_deployed
    clip = wav(tmp_path / "clip.wav", S.check_audio(2.0, seed=5))
    # the deployment runtimes too where they are here (CI installs them): tiny.en runs on them outside CI's budget
    runtimes = ["torch", "ort-cpu", "onnx-ref"] + [rt for rt in ("ort-node", "ort-wasm") if R.status(rt).available]
    r = cli("verify", folder, "--hf", whisper_folder(), "--audio", clip, "--runtimes", ",".join(runtimes),
            "--new-tokens", "12", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert {row["case"].split(":")[0] for row in rows} == {"encoder_model", "decoder_model_merged", "decode",
                                                           "transcripts"}
    assert len(rows) == len(runtimes) * 5 and all(row["passed"] for row in rows)
    for row in rows:  # every declared output compared
        if row["case"].startswith("encoder"):
            assert [o["name"] for o in row["outputs"]] == ["last_hidden_state"]
        if "first step" in row["case"]:
            assert [o["name"] for o in row["outputs"]] == W.outputs(W.DECODER, 2)
    transcripts = [row for row in rows if row["case"].startswith("transcripts")]
    assert all(row["detail"]["tokens"] == row["detail"]["transformers_tokens"] for row in transcripts)
    assert all(len(row["detail"]["tokens"][0]) > 0 for row in transcripts)


def test_audio_of_the_wrong_kind_is_refused_in_one_line(whisper_deployed, whisper_folder, tmp_path):
    folder, _ = whisper_deployed
    second = np.sin(np.linspace(0, 100, 16000)).astype(np.float32) * 0.3
    _one_line(cli("verify", folder, "--hf", whisper_folder(), "--audio", wav(tmp_path / "r.wav", second, rate=8000)),
              "sampled at 8000 Hz")
    _one_line(cli("verify", folder, "--hf", whisper_folder(), "--audio", tmp_path / "absent.wav"), "no such file")
    _one_line(cli("verify", "model.onnx", "--audio", wav(tmp_path / "ok.wav", second)), "goes with --hf")
    _one_line(cli("verify", folder, "--hf", whisper_folder(), "--audio", wav(tmp_path / "e.wav", second[:0])),
              "e.wav: holds no samples")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(wav(tmp_path / "whole.wav", second).read_bytes()[:20000])  # a copy that stopped half way
    _one_line(cli("verify", folder, "--hf", whisper_folder(), "--audio", cut), "cut.wav: truncated: its data chunk")
    import shutil
    half = tmp_path / "half"
    shutil.copytree(folder, half)
    (half / "onnx" / "encoder_model.onnx").unlink()
    _one_line(cli("verify", half, "--hf", whisper_folder(), "--audio", wav(tmp_path / "ok.wav", second)),
              "a Whisper folder holds onnx/encoder_model.onnx and onnx/decoder_model_merged.onnx (export --hf "
              "--deploy); it lacks encoder_model.onnx")


def test_verify_names_parameters_that_differ_from_the_source(whisper_deployed, tiny_whisper, tmp_path):
    folder, _ = whisper_deployed
    other = tmp_path / "other"
    tiny_whisper.save(other, seed=1)
    r = cli("verify", folder, "--hf", other, "--runtimes", "ort-cpu")
    assert r.exit_code == 1 and "parameters differ" in r.output


def test_too_many_new_tokens_for_the_decoder_s_positions_is_refused(whisper_deployed, whisper_folder):
    folder, _ = whisper_deployed
    _one_line(cli("verify", folder, "--hf", whisper_folder(), "--new-tokens", "63"), "holds 64 positions")


def test_the_decode_property_fails_a_decoder_that_forgets_its_past(whisper_deployed, whisper_folder, monkeypatch):
    """A step with past that drops its self cache but the first position: the transcripts may agree by
    chance, the decode property cannot."""
    folder, _ = whisper_deployed
    real = G.merged_steps

    def forgetful(run_merged, spec):
        first, later = real(run_merged, spec)
        return first, lambda feed: later({n: (v[:, :, :1] if ".decoder." in n else v) for n, v in feed.items()})
    monkeypatch.setattr(G, "merged_steps", forgetful)
    r = cli("verify", folder, "--hf", whisper_folder(), "--runtimes", "ort-cpu", "--json")
    rows = {row["case"].split(":")[0]: row for row in json.loads(r.output)["results"]}
    assert r.exit_code == 1 and not rows["decode"]["passed"] and rows["encoder_model"]["passed"]


def test_the_multilingual_start_and_int8_variables_verify(whisper_folder, tmp_path):
    source = whisper_folder(multilingual=True, dtype="int8")
    out = tmp_path / "ml"
    assert cli("export", "--hf", source, "--deploy", out).exit_code == 0
    r = cli("verify", out, "--hf", source, "--runtimes", "ort-cpu", "--new-tokens", "8", "--json")
    assert r.exit_code == 0, r.output
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["is_multilingual"] and generation["decoder_start_token_id"] == 50258


def test_a_config_only_whisper_is_refused_unless_a_seed_is_given_and_verifies_with_the_recorded_one(whisper_folder,
                                                                                                     tmp_path):
    """transformers' Whisper folder with a config (and its generation config, tokenizer) and no weights:
    refused without --seed; exported with --seed 3, whose export records the seed, so its verify
    draws the same weights (it once drew seed 0 whatever the export's) and passes; --seed 4 differs."""
    import shutil
    source = tmp_path / "whisper-config"
    model = CT.load(whisper_folder())[0]
    model.config.save_pretrained(source)
    model.generation_config.save_pretrained(source)
    shutil.copyfile(whisper_folder() / "tokenizer.json", source / "tokenizer.json")
    r = cli("export", "--hf", source, "--deploy", tmp_path / "d")
    assert r.exit_code == 2 and "a config and no weights" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()
    r = cli("export", "--hf", source, "--deploy", tmp_path / "d", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    assert any(n.startswith("the weights are random") for n in json.loads(r.output[r.output.index("{"):])["notes"])
    r = cli("verify", tmp_path / "d", "--hf", source, "--runtimes", "ort-cpu", "--new-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    r = cli("verify", tmp_path / "d", "--hf", source, "--runtimes", "ort-cpu", "--new-tokens", "4", "--seed", "4",
            "--json")
    assert r.exit_code == 1 and "parameters differ" in json.loads(r.output)["results"][0]["error"]
