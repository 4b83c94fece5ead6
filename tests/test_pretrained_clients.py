"""The clients of a deployment folder (`attnexport.pretrained.clients`, `verify FOLDER --hf PATH --clients`):
Optimum's ORTModelForCausalLM and transformers.js load the folder `export --hf --deploy` writes of a
language model and generate transformers' tokens from it; sentence-transformers (backend onnx),
Optimum's ORTModelForFeatureExtraction and transformers.js' feature-extraction pipeline load a
sentence encoder's and embed as transformers does. Each client's test skips, saying why, where it is
not installed (CI installs them for the real-model tests: optimum-onnx, sentence-transformers, and
transformers.js among attnexport's pinned npm packages)."""

import json

import pytest
from conftest import cli

from attnexport.errors import UsageError
from attnexport.pretrained import clients
from attnexport.pretrained.causal import CausalLM
from attnexport.pretrained.encoders import SentenceEncoder


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








def test_clients_need_a_deployment_folder(deployed, tmp_path):
    source, out = deployed
    alone = tmp_path / "model.onnx"
    alone.write_bytes((out / "onnx" / "model.onnx").read_bytes())
    r = cli("verify", str(alone), "--hf", str(source), "--clients", "optimum")
    assert r.exit_code == 2 and "deployment folder" in r.output
    r = cli("verify", str(tmp_path), "--hf", str(source))
    assert r.exit_code == 2 and "holds 0" in r.output
















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
