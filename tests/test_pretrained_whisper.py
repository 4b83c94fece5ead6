"""Whisper, the encoder-decoder family, on small random models written as CTranslate2 folders
(examples/tiny_whisper.py: nothing downloaded): the folder read into transformers (float32, float16
and int8 variables), the client's log-mel against transformers' extractor, the export's three graphs
checked against float64 and merged into the decoder the clients load, verify's rows on the runtimes
here, and the one-line refusals (a CTranslate2 model of another kind, audio of the wrong rate or
shape, too many tokens, what a speech export does not make yet), nothing written by any of them.

The [hf] extra (transformers); the real tiny.en on real speech is tests/test_real_whisper.py's."""

import importlib.util
import json
import wave
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

import onnx  # noqa: E402
import torch  # noqa: E402
from conftest import ROOT, cli  # noqa: E402

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import audio as AU  # noqa: E402
from attnexport.pretrained import ctranslate2 as CT  # noqa: E402
from attnexport.pretrained import speech as S  # noqa: E402
from attnexport.pretrained import whisper as W  # noqa: E402


@pytest.fixture(scope="session")
def tiny_whisper():
    spec = importlib.util.spec_from_file_location("tiny_whisper", ROOT / "examples" / "tiny_whisper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def whisper_folder(tiny_whisper, tmp_path_factory):
    """`whisper_folder(**how)`: the CTranslate2 folder of tiny_whisper's model, made once per worker."""
    made: dict = {}

    def folder(**how) -> Path:
        key = tuple(sorted(how.items()))
        if key not in made:
            made[key] = tmp_path_factory.mktemp("whisper")
            tiny_whisper.save(made[key], **how)
        return made[key]
    return folder


@pytest.fixture(scope="session")
def deployed(whisper_folder, tmp_path_factory):
    """The English-only tiny model exported to a deployment folder (once per worker), and the export's JSON."""
    out = tmp_path_factory.mktemp("deployed") / "whisper"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--json")
    assert r.exit_code == 0, r.output
    return out, json.loads(r.output[r.output.index("{"):])


def _one_line(r, text: str) -> None:
    assert r.exit_code == 2, r.output
    assert text in r.output and len(r.output.strip().splitlines()) == 1, r.output


def _wav(path: Path, samples: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        kind = {1: np.uint8, 2: np.int16}[width]
        scaled = (samples * 100 + 128) if width == 1 else samples * 32767
        w.writeframes(np.repeat(scaled.astype(kind), channels).tobytes())
    return path


# --- reading CTranslate2 folders -------------------------------------------------------------------

@pytest.mark.parametrize("dtype,atol", [("float32", 0.0), ("float16", 1e-3), ("int8", 0.02)])
def test_a_ctranslate2_folder_reads_into_the_model_it_was_written_from(tiny_whisper, whisper_folder, dtype, atol):
    source = tiny_whisper.model()
    model, where = CT.load(whisper_folder(dtype=dtype))
    assert where.startswith("given: ")
    want, got = source.state_dict(), model.state_dict()
    assert set(got) == set(want)
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= atol, worst
    if dtype == "float32":  # the same parameters: the same logits
        features = torch.from_numpy(AU.log_mel(S.check_audio())[None])
        ids = torch.tensor([CT.start_tokens(CT.special_tokens(whisper_folder()), model.config.vocab_size)])
        with torch.no_grad():
            a = source(input_features=features, decoder_input_ids=ids).logits
            b = model(input_features=features, decoder_input_ids=ids).logits
        assert torch.allclose(a, b, atol=1e-5)
    assert model.get_output_embeddings().weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()


def test_the_start_tokens_are_whisper_s_for_english_and_multilingual_models(whisper_folder):
    en = CT.special_tokens(whisper_folder())
    assert CT.start_tokens(en, 51864) == [50257, 50362]
    multi = CT.special_tokens(whisper_folder(multilingual=True))
    assert CT.start_tokens(multi, 51865) == [50258, 50259, 50359, 50363]
    fields = CT.generation_fields(multi, 51865)
    assert fields["is_multilingual"] and fields["lang_to_id"]["<|en|>"] == 50259
    assert "lang_to_id" not in CT.generation_fields(en, 51864)  # an English-only start has no language


def test_a_ctranslate2_model_of_another_kind_is_refused_in_one_line(tiny_whisper, tmp_path):
    folder = tmp_path / "opus"
    folder.mkdir()
    tiny_whisper.write_bin(folder / "model.bin", {"encoder/num_heads": np.array(8, np.int16)}, spec="TransformerSpec",
                           aliases=())
    (folder / "config.json").write_text("{}")
    out = tmp_path / "out"
    _one_line(cli("export", "--hf", folder, "--deploy", out), "a CTranslate2 TransformerSpec folder")
    assert not out.exists()
    (folder / "model.bin").write_bytes(b"\x07\x00\x00\x00")
    _one_line(cli("export", "--hf", folder, "--deploy", out), "binary version 7")
    (folder / "model.bin").write_bytes(b"\x06\x00\x00\x00\x0c\x00WhisperSp")
    with pytest.raises(UsageError, match="inside a record"):
        CT.read(folder / "model.bin")


# --- the client's features -------------------------------------------------------------------------

@pytest.mark.parametrize("mels", [80, 128])
def test_the_log_mel_features_are_transformers_whisper_features(mels):
    clip = S.check_audio(4.0, seed=3)
    extractor = transformers.WhisperFeatureExtractor(feature_size=mels)
    want = extractor(clip, sampling_rate=16000, return_tensors="np").input_features[0]
    got = AU.log_mel(clip, mels)
    assert got.shape == want.shape == (mels, 3000)
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(AU.mel_filters(mels) - extractor.mel_filters).max() < 1e-6


def test_audio_of_the_wrong_rate_shape_or_length_is_refused_in_one_line(deployed, whisper_folder, tmp_path):
    folder, _ = deployed
    second = np.sin(np.linspace(0, 100, 16000)).astype(np.float32) * 0.3
    cases = {
        "sampled at 8000 Hz": _wav(tmp_path / "rate.wav", second, rate=8000),
        "2 channels": _wav(tmp_path / "stereo.wav", second, channels=2),
        "8-bit samples": _wav(tmp_path / "bytes.wav", second, width=1),
        "31.00 s of audio": _wav(tmp_path / "long.wav", np.tile(second, 31)),
        "not a WAV file": tmp_path / "text.wav",
    }
    cases["not a WAV file"].write_text("not audio")
    for text, path in cases.items():
        _one_line(cli("verify", folder, "--hf", whisper_folder(), "--audio", path), text)
    with pytest.raises(UsageError, match="one channel"):
        AU.samples(np.zeros((2, 100), np.float32))


# --- export ---------------------------------------------------------------------------------------

def test_the_export_writes_the_folder_whisper_s_clients_load(deployed):
    folder, doc = deployed
    assert sorted(p.name for p in (folder / "onnx").iterdir()) == ["decoder_model_merged.onnx", "encoder_model.onnx"]
    for f in ("config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json",
              "tokenizer_config.json"):
        assert (folder / f).is_file(), f
    assert json.loads((folder / "preprocessor_config.json").read_text())["feature_size"] == 80
    decoder = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    layers = 2
    assert [i.name for i in decoder.graph.input] == W.merged_inputs(layers)
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


def test_the_merged_decoder_keeps_each_weight_once(deployed, whisper_folder):
    folder, _ = deployed
    decoder = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    sizes = [onnx.numpy_helper.to_array(i).nbytes for i in decoder.graph.initializer]
    model, _ = CT.load(whisper_folder())
    decoder_params = sum(p.numel() * 4 for n, p in model.model.decoder.named_parameters())
    assert sum(sizes) < 1.1 * decoder_params  # one copy (the first step and the later one share it)


@pytest.mark.parametrize("args,text", [
    ((), "write them with --deploy FOLDER"),
    (("--deploy", "{out}", "--precision", "int8"), "exports in fp32"),
    (("--deploy", "{out}", "--kv-cache", "static", "--max-seq", "64"), "--kv-cache static"),
])
def test_what_a_speech_export_does_not_make_is_refused_before_anything_is_written(whisper_folder, tmp_path, args,
                                                                                  text):
    out = tmp_path / "out"
    _one_line(cli("export", "--hf", whisper_folder(), *[a.format(out=out) for a in args]), text)
    assert not out.exists() and list(tmp_path.iterdir()) == []


# --- verify ---------------------------------------------------------------------------------------

def test_verify_checks_every_graph_the_decode_property_and_transcripts_on_each_runtime(deployed, whisper_folder,
                                                                                       tmp_path):
    folder, _ = deployed
    clip = _wav(tmp_path / "clip.wav", S.check_audio(2.0, seed=5))
    r = cli("verify", folder, "--hf", whisper_folder(), "--audio", clip, "--runtimes", "torch,ort-cpu,onnx-ref",
            "--new-tokens", "12", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    cases = {row["case"].split(":")[0] for row in rows}
    assert cases == {"encoder_model", "decoder_model_merged", "decode", "transcripts"}
    assert len(rows) == 3 * 5 and all(row["passed"] for row in rows)
    transcripts = [row for row in rows if row["case"].startswith("transcripts")]
    assert all(row["detail"]["tokens"] == row["detail"]["transformers_tokens"] for row in transcripts)
    assert all(len(row["detail"]["tokens"][0]) > 0 for row in transcripts)


def test_verify_names_parameters_that_differ_from_the_source(deployed, tiny_whisper, tmp_path):
    folder, _ = deployed
    other = tmp_path / "other"
    tiny_whisper.save(other, seed=1)
    r = cli("verify", folder, "--hf", other, "--runtimes", "ort-cpu")
    assert r.exit_code == 1 and "parameters differ" in r.output


def test_too_many_new_tokens_for_the_decoder_s_positions_is_refused(deployed, whisper_folder):
    folder, _ = deployed
    _one_line(cli("verify", folder, "--hf", whisper_folder(), "--new-tokens", "63"), "holds 64 positions")


def test_the_decode_property_fails_a_decoder_that_forgets_its_past(deployed, whisper_folder, tmp_path, monkeypatch):
    """A step with past that drops the self cache (its first position read again each step): the
    transcripts may agree by chance, the decode property cannot."""
    folder, _ = deployed
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.rglob("*"):
        if f.is_file():
            (broken / f.relative_to(folder)).parent.mkdir(exist_ok=True)
            (broken / f.relative_to(folder)).write_bytes(f.read_bytes())
    real = W.merged_steps

    def forgetful(run_merged, config):
        first, later = real(run_merged, config)

        def step(feed):
            cut = {n: (v[:, :, :1] if ".decoder." in n else v) for n, v in feed.items()}
            return later(cut)
        return first, step
    monkeypatch.setattr(W, "merged_steps", forgetful)
    r = cli("verify", broken, "--hf", whisper_folder(), "--runtimes", "ort-cpu", "--json")
    rows = {row["case"].split(":")[0]: row for row in json.loads(r.output)["results"]}
    assert r.exit_code == 1 and not rows["decode"]["passed"]


def test_the_multilingual_start_and_int8_variables_verify(whisper_folder, tmp_path):
    source = whisper_folder(multilingual=True, dtype="int8")
    out = tmp_path / "ml"
    assert cli("export", "--hf", source, "--deploy", out).exit_code == 0
    r = cli("verify", out, "--hf", source, "--runtimes", "ort-cpu", "--new-tokens", "8", "--json")
    assert r.exit_code == 0, r.output
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["is_multilingual"] and generation["decoder_start_token_id"] == 50258
