"""A sentence encoder's clients embedding with its deployment folder (`attnexport.pretrained.encoders.clients`):
sentence-transformers, Optimum and transformers.js each within the budget of transformers' embeddings, the
folder's pooling as they read it, one longest input in every file they read. Where installed (CI's real step)."""

import json
from pathlib import Path

import pytest
from conftest import cli

from attnexport.pretrained import clients
from attnexport.pretrained.encoders import SentenceEncoder
from attnexport.pretrained.encoders import clients as encoder_clients


def _available(client):
    ok, why = clients.status(client)
    if not ok:
        pytest.skip(f"{client}: {why}")


@pytest.fixture(scope="module")
def encoder_deployed(tmp_path_factory, tiny_encoder):
    """A small random BERT encoder (examples/tiny_encoders.py) and its deployment folder."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    source = tiny_encoder("bert")
    out = tmp_path_factory.mktemp("deploy") / "bert-onnx"
    r = cli("export", "--hf", str(source), "--deploy", str(out))
    assert r.exit_code == 0, r.output
    return source, out


@pytest.mark.parametrize("client", SentenceEncoder.clients)
def test_each_embedding_client_embeds_as_transformers_from_the_folder(client, encoder_deployed):
    _available(client)
    source, out = encoder_deployed
    assert (out / "modules.json").is_file() and (out / "1_Pooling" / "config.json").is_file()
    r = cli("verify", str(out), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", client, "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output)["results"] if row["runtime"] == client]
    assert len(rows) == 1 and rows[0]["passed"], rows
    cost = rows[0]["detail"]["embeddings"]
    assert cost["sentences"] == 40 and cost["cosine_min"] > 0.99999 and cost["top5_agreement"] == 1.0


def test_an_embedding_client_whose_pooling_differs_fails_its_row(encoder_deployed, tmp_path):
    """The folder says cls pooling, the model was exported with mean: the clients pool as the folder
    says, and their embeddings are not the model's."""
    _available("optimum")
    import shutil

    source, out = encoder_deployed
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    (changed / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    r = cli("verify", str(changed), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", "optimum", "--json")
    assert r.exit_code == 1, r.output
    row = next(row for row in json.loads(r.output)["results"] if row["runtime"] == "optimum")
    assert not row["passed"] and "over the embedding budget" in row["error"]


def test_an_encoder_folder_states_one_longest_input_and_every_client_cuts_a_long_text_there(tiny_encoder, tmp_path):
    """A source whose files disagree (tokenizer.json: truncation at 16 and fixed padding to 32;
    tokenizer_config.json: 512; sentence-transformers: 24, the model's own): the deployment folder says
    24 in each file a client reads, with no fixed padding, and a text longer than that embeds in the
    plain tokenizers + ONNX Runtime loop and in each client as sentence-transformers embeds it from
    the source (its first 24 tokens). transformers.js cuts after adding [CLS] and [SEP], so its last
    token is a word's, not [SEP] (docs/encoders.md): it is held to a looser cosine."""
    import shutil
    import sys

    import numpy as np
    pytest.importorskip("sentence_transformers", reason="sentence-transformers: pip install 'sentence-transformers<6'")
    from sentence_transformers import SentenceTransformer

    from attnexport.pretrained.encoders import measures as embeddings
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "probes"))
    from encoder_long_text import plain_loop
    source = tmp_path / "source"
    shutil.copytree(tiny_encoder("bert"), source)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    tokenizer["padding"] = {"strategy": {"Fixed": 32}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                            "pad_type_id": 0, "pad_token": "[PAD]"}
    (source / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 512}))
    (source / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    out = tmp_path / "bert-onnx"
    assert cli("export", "--hf", source, "--deploy", out).exit_code == 0
    written = json.loads((out / "tokenizer.json").read_text())
    assert written["truncation"]["max_length"] == 24 and written["padding"] is None
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 24
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 24
    texts = [" ".join(embeddings.sentences()[:6]), embeddings.sentences()[0]]
    want = SentenceTransformer(str(source), device="cpu").encode(texts, convert_to_numpy=True).astype(np.float64)
    got, kept = plain_loop(out, texts)
    assert kept[0] == 24 and kept[1] < 24
    got = {"plain loop": got} | {c: encoder_clients.embed(c, out, texts).embeddings for c in SentenceEncoder.clients
                                 if clients.status(c)[0]}
    for who, e in got.items():
        e = np.asarray(e, np.float64)
        cosine = (e * want).sum(-1) / np.linalg.norm(e, axis=-1) / np.linalg.norm(want, axis=-1)
        assert cosine[1] > 1 - 1e-6, (who, cosine)
        assert cosine[0] > (0.95 if who == "transformers.js" else 1 - 1e-6), (who, cosine)
