"""A vision transformer's verify (`attnexport.pretrained.vision.check`): the project's images embedded on
every runtime against the model in float64 (cosine per image, top-5 retrieval), fp16 and int8 within
their budgets with each layer's cost, a changed weight named, `--budget` parsed as an embedder's. The
[hf] extra, on small random configs."""

import json
import re
import shutil

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402


@pytest.mark.parametrize("arch", ["vit", "dinov2"])
def test_verify_embeds_the_images_on_every_runtime_and_catches_a_changed_weight(arch, tiny_vision, tmp_path):
    folder = tiny_vision(arch)
    out = tmp_path / "m.onnx"
    hf_export.export_hf(hf_export.HFExport(folder, output=out))
    report = verify_hf(HFCheck(out, folder, runtimes=["torch", "onnx-ref", "ort-cpu"]))
    assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
    embedded = [r for r in report.rows if r.case.startswith("embeddings:")]
    assert {r.runtime for r in embedded} == {"torch", "onnx-ref", "ort-cpu"}
    for row in embedded:
        cost = row.detail["embeddings"]
        assert cost["images"] == 26 and cost["top5_agreement"] == 1.0 and cost["cosine_min"] > 0.99999
    assert {r.case for r in report.rows} >= {"batch 4 images", "batch 1 image"}
    from safetensors.numpy import load_file, save_file
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    weights = load_file(changed / "model.safetensors")
    name = next(k for k in weights if k.endswith("layer.1.attention.attention.query.weight"))
    save_file({**weights, name: weights[name] * 1.01}, changed / "model.safetensors", metadata={"format": "pt"})
    other = verify_hf(HFCheck(out, changed, runtimes=["ort-cpu"]))
    # The changed matrix named as the loaded model calls it (transformers 5 loads ViT's query as q_proj).
    error = other.failures[0].error if not other.ok else ""
    assert "parameters differ" in error
    assert re.search(r"layers?\.1\.attention\.(attention\.query|q_proj)\.weight", error)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_half_and_int8_are_judged_by_their_budget_with_each_layer_s_cost(precision, tiny_vision, tmp_path):
    folder = tiny_vision("vit")
    out = tmp_path / f"{precision}.onnx"
    r = cli("export", "--hf", folder, "--precision", precision, "-o", out)
    assert r.exit_code == 0, r.output
    r = cli("verify", out, "--hf", folder, "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    embedded = next(row for row in rows if row["case"].startswith("embeddings:") and row["runtime"] == "ort-cpu")
    budget = embedded["detail"]["budget"]
    assert budget["cosine"] == {"fp16": 0.999, "int8": 0.99}[precision]
    assert embedded["detail"]["embeddings"]["cosine_min"] >= budget["cosine"]
    if precision == "int8":
        costs = next(row for row in rows if "each layer quantized alone" in row["case"])
        assert {c["group"] for c in costs["detail"]["layer_costs"]} == {"layer:0", "layer:1"}
        assert costs["passed"]
        assert any(row["case"].startswith("weights:") and row["passed"] for row in rows)
    else:
        assert any(row["case"] == "batch 4 images" and row["passed"] for row in rows)


def test_budget_takes_an_embedder_s_limits_and_refuses_a_language_model_s(tiny_vision, tmp_path):
    folder = tiny_vision("vit")
    out = tmp_path / "int8.onnx"
    assert cli("export", "--hf", folder, "--precision", "int8", "-o", out).exit_code == 0
    r = cli("verify", out, "--hf", folder, "--runtimes", "ort-cpu", "--budget", "kl-mean=0.1")
    assert r.exit_code == 2 and "cosine" in r.output and len(r.output.strip().splitlines()) == 1
    r = cli("verify", out, "--hf", folder, "--runtimes", "ort-cpu", "--budget", "cosine=0.9999999")
    assert r.exit_code == 1 and "over the embedding budget" in r.output


def test_the_deployment_runtimes_embed_as_the_model_does(tiny_vision, tmp_path):
    """Node and WASM (where installed: CI's [hf] step has them) on DINOv2, in fp32 and in half."""
    folder = tiny_vision("dinov2")
    for precision in ("fp32", "fp16"):
        out = tmp_path / f"{precision}.onnx"
        hf_export.export_hf(hf_export.HFExport(folder, precision=precision, output=out))
        report = verify_hf(HFCheck(out, folder, runtimes=["ort-node", "ort-wasm"], skip_unavailable=True))
        assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
        embedded = [r for r in report.rows if r.case.startswith("embeddings:")]
        if not embedded:
            pytest.skip("neither ort-node nor ort-wasm is installed: attnexport runtimes --install")
        assert all(r.detail["embeddings"]["top5_agreement"] == 1.0 for r in embedded)
