"""CTranslate2 Whisper folders read without CTranslate2 (examples/tiny_whisper.py writes small random
ones from a transformers Whisper): float32, float16 and int8 variables back into the model they came
from, Whisper's start tokens and generation fields, and a folder of another kind refused in one line.

The [hf] extra (transformers)."""

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

import torch  # noqa: E402
from conftest import cli  # noqa: E402

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained.whisper import audio as AU  # noqa: E402
from attnexport.pretrained.whisper import ctranslate2 as CT  # noqa: E402
from attnexport.pretrained.whisper import export as S  # noqa: E402


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
    r = cli("export", "--hf", folder, "--deploy", out)
    assert r.exit_code == 2 and "a CTranslate2 TransformerSpec folder" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
    assert CT.read_spec(folder / "model.bin") == "TransformerSpec"
    (folder / "model.bin").write_bytes(b"\x07\x00\x00\x00")
    r = cli("export", "--hf", folder, "--deploy", out)
    assert r.exit_code == 2 and "binary version 7" in r.output
    (folder / "model.bin").write_bytes(b"\x06\x00\x00\x00\x0c\x00WhisperSp")
    with pytest.raises(UsageError, match="inside a record"):
        CT.read(folder / "model.bin")
