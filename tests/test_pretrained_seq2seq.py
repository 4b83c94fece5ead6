"""The text encoder-decoders' family (`attnexport.pretrained.seq2seq`): T5 and Marian configs taken, a
folder recognized as the family's from its config (an Optimum-layout seq2seq folder is no Whisper),
exported only as a deployment folder, T5's static cache and a folder without its tokenizer refused in
one line, a config-only folder refused without --seed. The [hf] extra, on small random configs."""

import shutil

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import registry  # noqa: E402
from attnexport.pretrained.seq2seq import Text2Text  # noqa: E402


@pytest.mark.parametrize("arch", ["t5", "marian"])
def test_the_family_takes_its_architectures_and_knows_its_folders(arch, tiny_seq2seq, tmp_path):
    folder = tiny_seq2seq(arch)
    family = registry.of_source(folder)
    assert isinstance(family, Text2Text) and family.task == "text2text-generation"
    model, source = hf.load(folder, None)
    assert source == f"given: {folder.name}" and registry.of_model(model) is family
    if arch == "t5":
        return  # one export shows the folder (test_pretrained_seq2seq_check.py exports T5's)
    out = tmp_path / "deployed"
    r = cli("export", "--hf", folder, "--deploy", out)
    assert r.exit_code == 0, r.output
    assert registry.of_export(out) is family  # known by its config, not by its graphs' names
    assert sorted(p.name for p in (out / "onnx").glob("*.onnx")) == ["decoder_model_merged.onnx",
                                                                       "encoder_model.onnx"]
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_refusals_are_one_line_and_leave_nothing(tiny_seq2seq, tmp_path):
    t5 = tiny_seq2seq("t5")
    r = cli("export", "--hf", t5, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and "--deploy FOLDER" in r.output and not (tmp_path / "m.onnx").exists()
    r = cli("export", "--hf", t5, "--deploy", tmp_path / "s", "--kv-cache", "static", "--max-seq", "32")
    assert r.exit_code == 2 and "relative position bias" in r.output and not (tmp_path / "s").exists()
    r = cli("export", "--hf", t5, "--deploy", tmp_path / "i", "--precision", "int8", "--int8-kernel", "integer")
    assert r.exit_code == 2 and "int8 is the blockwise form" in r.output and not (tmp_path / "i").exists()
    assert len(r.output.strip().splitlines()) == 1
    marian = tiny_seq2seq("marian")
    r = cli("export", "--hf", marian, "--deploy", tmp_path / "s", "--kv-cache", "static", "--max-seq", "100")
    assert r.exit_code == 2 and "holds 64 positions" in r.output
    bare = tmp_path / "bare"
    shutil.copytree(t5, bare)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / f).unlink()
    r = cli("export", "--hf", bare, "--deploy", tmp_path / "b")
    assert r.exit_code == 2 and "needs its tokenizer beside it" in r.output and not (tmp_path / "b").exists()
    for out in (r.output,):
        assert len(out.strip().splitlines()) == 1


def test_a_config_only_folder_is_refused_unless_a_seed_is_given(tiny_seq2seq, tmp_path):
    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_seq2seq("marian"), config_only)
    (config_only / "model.safetensors").unlink()
    r = cli("export", "--hf", config_only, "--deploy", tmp_path / "m")
    assert r.exit_code == 2 and "--seed" in r.output and not (tmp_path / "m").exists()
    r = cli("export", "--hf", config_only, "--seed", "3", "--deploy", tmp_path / "m")
    assert r.exit_code == 0 and "the weights are random" in r.output, r.output
    r = cli("verify", tmp_path / "m", "--hf", config_only, "--runtimes", "ort-cpu", "--new-tokens", "8")
    assert r.exit_code == 0, r.output  # the recorded seed draws the same weights
