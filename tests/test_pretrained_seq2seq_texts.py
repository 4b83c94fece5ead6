"""What a text encoder-decoder reads and answers (`attnexport.pretrained.seq2seq.texts`): the project's
texts as a right-padded batch, the model as the core sees it (T5's and Marian's start, end and banned
tokens from their configs), the tokenizer's files a deployment folder keeps. The [hf] extra."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.seq2seq import texts as T  # noqa: E402


def test_the_texts_are_a_right_padded_batch_with_its_mask(tiny_seq2seq):
    tok = T.tokenizer(tiny_seq2seq("t5"))
    feed = T.encoded(tok, ["The cat sleeps.", T.TEXTS[5]])
    assert feed["input_ids"].dtype == np.int64 and feed["attention_mask"].dtype == np.int64
    short = int(feed["attention_mask"][0].sum())
    assert short < feed["input_ids"].shape[1] and feed["attention_mask"][0, short:].sum() == 0
    assert (feed["input_ids"][0, short:] == tok.pad_token_id).all()
    assert feed["input_ids"][0, short - 1] == tok.eos_token_id  # the end token closes each text


@pytest.mark.parametrize("arch", ["t5", "marian"])
def test_the_model_says_its_start_end_and_banned_tokens(arch, tiny_seq2seq):
    model, _ = hf.load(tiny_seq2seq(arch), None)
    m = T.TextModel.of(model, tiny_seq2seq(arch))
    assert m.start == [0] and m.end == 1
    assert m.tokens.suppress == ((0,) if arch == "marian" else ())  # Marian never generates its padding
    assert m.tokens.forced_end == (arch == "marian")
    assert m.positions() == (64 if arch == "marian" else None)  # T5's positions are relative
    assert m.check_tokens() and m.end not in m.check_tokens()
    assert m.decode(m.tok(T.TEXTS[0], add_special_tokens=False)["input_ids"]) == T.TEXTS[0]


def test_a_deployment_folder_keeps_the_tokenizer_s_files(tiny_seq2seq, tmp_path):
    model, _ = hf.load(tiny_seq2seq("t5"), None)
    m = T.TextModel.of(model, tiny_seq2seq("t5"))
    m.write_files(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json",
                                                    "special_tokens_map.json"}
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
