"""A causal language model's clients generating from its deployment folder (`attnexport.pretrained.causal.clients`,
`verify FOLDER --hf PATH --clients`): token for token transformers' `generate`, each client's refusals, a
chat template read by every client. Optimum and transformers.js where installed (CI's real step)."""

import json

import pytest
from conftest import cli

from attnexport.pretrained import clients
from attnexport.pretrained.causal import CausalLM
from attnexport.pretrained.causal import clients as causal_clients
from attnexport.pretrained.causal import generation as G


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


def test_each_client_reads_a_folder_whose_weights_are_beside_the_graph(tiny_lm, tmp_path):
    """`export --deploy --external-data` (a model of a billion parameters gets it by default):
    onnx/model.onnx and onnx/model.onnx_data, which Optimum (through ONNX Runtime) and transformers.js
    (`use_external_data_format`) load, generating transformers' tokens."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    for client in CausalLM.clients:
        _available(client)
    source, out = tiny_lm("llama"), tmp_path / "llama-onnx"
    r = cli("export", "--hf", str(source), "--kv-cache", "--external-data", "--deploy", str(out))
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model.onnx", "model.onnx_data"]
    r = cli("verify", str(out), "--hf", str(source), "--runtimes", "ort-cpu", "--clients",
            ",".join(CausalLM.clients), "--new-tokens", "6", "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output)["results"] if row["runtime"] in CausalLM.clients]
    assert len(rows) == len(CausalLM.clients) and all(row["passed"] for row in rows)
    assert all(row["detail"]["tokens"] == row["detail"]["transformers_tokens"] for row in rows)
