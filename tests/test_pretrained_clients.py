"""The clients of a deployment folder (`attnexport.pretrained.clients`, `verify FOLDER --hf PATH --clients`):
Optimum's ORTModelForCausalLM and transformers.js load the folder `export --hf --deploy` writes of a
language model and generate transformers' tokens from it; sentence-transformers (backend onnx),
Optimum's ORTModelForFeatureExtraction and transformers.js' feature-extraction pipeline load a
sentence encoder's and embed as transformers does. Each client's test skips, saying why, where it is
not installed (CI installs them for the real-model tests: optimum-onnx, sentence-transformers, and
transformers.js among attnexport's pinned npm packages)."""

import json
from pathlib import Path

import pytest
from conftest import cli

from attnexport.errors import UsageError
from attnexport.pretrained import clients
from attnexport.pretrained.causal import CausalLM
from attnexport.pretrained.causal import clients as causal_clients
from attnexport.pretrained.causal import generation as G
from attnexport.pretrained.encoders import SentenceEncoder
from attnexport.pretrained.encoders import clients as encoder_clients


def test_clients_are_named_or_refused():
    assert clients.parse("all") == ["all"]
    assert clients.parse("transformers.js, optimum") == ["transformers.js", "optimum"]
    assert clients.parse(None) == []
    with pytest.raises(UsageError, match="unknown onnxruntime-genai"):
        clients.parse("optimum,onnxruntime-genai")
    assert clients.of_family(["all"], CausalLM()) == list(CausalLM.clients)
    assert clients.of_family(["all"], SentenceEncoder()) == list(SentenceEncoder.clients)
    with pytest.raises(UsageError, match="sentence-transformers: a causal language model's clients are"):
        clients.of_family(["sentence-transformers"], CausalLM())


def _available(client):
    ok, why = clients.status(client)
    if not ok:
        pytest.skip(f"{client}: {why}")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, tiny_lm):
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    source, out = tiny_lm("llama"), tmp_path_factory.mktemp("deploy") / "llama-onnx"
    r = cli("export", "--hf", str(source), "--kv-cache", "--deploy", str(out))
    assert r.exit_code == 0, r.output
    return source, out


@pytest.mark.parametrize("client", CausalLM.clients)
def test_each_client_generates_transformers_tokens_from_the_folder(client, deployed):
    _available(client)
    source, out = deployed
    r = cli("verify", str(out), "--hf", str(source), "--runtimes", "ort-cpu", "--clients",
            client, "--new-tokens", "12", "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output)["results"] if row["runtime"] == client]
    assert len(rows) == 1 and rows[0]["passed"] and rows[0]["outputs"][0]["compared"] == 3 * 12
    assert rows[0]["detail"]["tokens"] == rows[0]["detail"]["transformers_tokens"]


@pytest.mark.parametrize("client", CausalLM.clients)
def test_a_folder_a_client_cannot_run_fails_its_row(client, deployed, tmp_path):
    """The folder's config names a model type no client knows: each fails to load it, and its row
    says so."""
    _available(client)
    import shutil

    source, out = deployed
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "no-such-model"
    (broken / "config.json").write_text(json.dumps(config))
    r = cli("verify", str(broken), "--hf", str(source), "--runtimes", "ort-cpu", "--clients",
            client, "--new-tokens", "4", "--json")
    assert r.exit_code == 1, r.output
    row = next(row for row in json.loads(r.output)["results"] if row["runtime"] == client)
    assert not row["passed"] and "no-such-model" in row["error"]


def test_optimum_runs_the_form_without_a_cache_and_transformers_js_is_said_not_to(tmp_path, tiny_lm):
    """Optimum loads a folder without past inputs with use_cache=False (the folder's config says
    so); transformers.js feeds only the new token after the first step, which such a model cannot
    run: its row fails saying why, without running."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    source, out = tiny_lm("llama"), tmp_path / "llama-onnx"
    assert cli("export", "--hf", str(source), "--deploy", str(out)).exit_code == 0
    r = cli("verify", str(out), "--hf", str(source), "--runtimes", "ort-cpu", "--clients",
            "all", "--new-tokens", "6", "--skip-unavailable", "--json")  # Optimum where it is installed
    rows = {row["runtime"]: row for row in json.loads(r.output)["results"] if row["runtime"] in CausalLM.clients}
    if clients.status("transformers.js")[0]:
        assert "feeds only the new token" in rows["transformers.js"]["error"]
        assert not rows["transformers.js"]["passed"]
    if clients.status("optimum")[0]:
        assert rows["optimum"]["passed"], rows["optimum"]
    else:
        assert rows["optimum"]["skipped"].startswith("optimum is not available")


def test_clients_need_a_deployment_folder(deployed, tmp_path):
    source, out = deployed
    alone = tmp_path / "model.onnx"
    alone.write_bytes((out / "onnx" / "model.onnx").read_bytes())
    r = cli("verify", str(alone), "--hf", str(source), "--clients", "optimum")
    assert r.exit_code == 2 and "deployment folder" in r.output
    r = cli("verify", str(tmp_path), "--hf", str(source))
    assert r.exit_code == 2 and "holds 0" in r.output


def test_the_optimum_clients_loop_gives_the_models_own_new_tokens(tiny_lm):
    """The Optimum client's loop is attnexport's (encode, generate alone, keep the new tokens): run
    by transformers' own model, which generates as Optimum's does, it gives exactly the tokens of
    transformers' generate after each prompt, none of the prompt's, however long the prompt."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    from attnexport.pretrained import model as hf
    model, _ = hf.load(tiny_lm("llama"))
    layout = hf.layout_of(model, "concat")
    prompts = [p.tolist() for p in G.prompts_for(layout, (1, 6, 3), seed=5)]
    encoded, tokens = causal_clients.greedy_each(model, None, prompts, 5)
    assert encoded == prompts
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == G.reference_generation(model, layout, [prompt], 5).tokens[0].tolist()


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


# Each turn: its role's word (t3 the user's, t4 the assistant's), its words, t8; then t6, the reply's turn.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t3{% else %}t4{% endif %} {{ m['content'] }} t8 "
                 "{% endfor %}{% if add_generation_prompt %}t6{% endif %}")


def test_a_folder_written_under_transformers_5_with_a_chat_template_is_read_by_every_client(tmp_path, tiny_lm):
    """A source whose tokenizer transformers 5 saved (its class TokenizersBackend, which transformers 4
    cannot import; its chat template in chat_template.jinja, which transformers.js 4 does not read):
    the deployment folder names a class both load and carries the template in tokenizer_config.json,
    and each client encodes a conversation with it as transformers does, then generates its tokens."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    import shutil

    import numpy as np
    import transformers

    from attnexport.pretrained import model as hf
    from attnexport.pretrained.causal import bench as hf_bench
    source = tmp_path / "llama"
    shutil.copytree(tiny_lm("llama"), source)
    hf_bench.word_tokenizer(source, 1000)
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TokenizersBackend", "bos_token": "t1", "eos_token": "t2", "pad_token": "t0"}))
    (source / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    out = tmp_path / "deploy"
    r = cli("export", "--hf", str(source), "--kv-cache", "--deploy", str(out))
    assert r.exit_code == 0, r.output
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"] == CHAT_TEMPLATE
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))  # this transformers, whichever it is
    chat = [{"role": "user", "content": "t5 t37 t48"}, {"role": "assistant", "content": "t7"},
            {"role": "user", "content": "t9 t3"}]
    want_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    want_ids = list(want_ids if isinstance(want_ids, list) else want_ids["input_ids"])  # 5: an encoding
    assert want_ids == [3, 5, 37, 48, 8, 4, 7, 8, 3, 9, 3, 8, 6]  # the template's, word for word (t1, t2 are special)
    model, _ = hf.load(source)
    layout = hf.layout_of(model, "concat")
    want = G.reference_generation(model, layout, [np.array(want_ids)], 6).tokens[0].tolist()
    for client in CausalLM.clients:
        if not clients.status(client)[0]:
            continue
        done = causal_clients.generate(client, out, [chat], 6)
        assert done.prompt_ids == [list(want_ids)], client
        assert done.tokens == [want], client


def test_a_client_that_cannot_run_here_is_a_broken_setup_not_a_mismatch(deployed, tmp_path):
    """transformers.js without its npm packages (and installing them turned off): exit 2 in one line,
    as a runtime that cannot run is, nothing compared; skipped with the reason under --skip-unavailable."""
    source, out = deployed
    env = {"ATTNEXPORT_JS_HOME": str(tmp_path / "no-packages"), "ATTNEXPORT_JS_INSTALL": "0"}
    r = cli("verify", str(out), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", "transformers.js",
            "--new-tokens", "4", env=env)
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: client transformers.js is not available: the npm packages are not installed in "
        f"{tmp_path}/no-packages: run `attnexport runtimes --install` (use --skip-unavailable to skip it)"]
    r = cli("verify", str(out), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", "transformers.js",
            "--new-tokens", "4", "--skip-unavailable", "--json", env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    row = next(row for row in doc["results"] if row["runtime"] == "transformers.js")
    assert row["skipped"].startswith("transformers.js is not available: the npm packages are not installed")
    assert {"name": "transformers.js", "available": False, "used": False} == {
        k: v for k, v in next(t for t in doc["runtimes"] if t["name"] == "transformers.js").items() if k != "reason"}
