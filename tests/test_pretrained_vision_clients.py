"""A vision transformer's clients embedding images with its deployment folder
(`attnexport.pretrained.vision.clients`): Optimum's ORTModelForFeatureExtraction and transformers.js'
image-feature-extraction pipeline, each with its own image processor, within the budget of transformers'
embeddings; a folder whose processor differs fails its rows. Where installed (CI's real step)."""

import json
import shutil

import pytest
from conftest import cli

from attnexport.pretrained import clients
from attnexport.pretrained.vision import VisionTransformer


def _available(client):
    ok, why = clients.status(client)
    if not ok:
        pytest.skip(f"{client}: {why}")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, tiny_vision):
    """ViT's and DINOv2's deployment folders (examples/tiny_vision.py), and DINOv2's in half (its
    graph takes and gives float32, as the clients' processors make and read them)."""
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    out = {}
    for arch, precision in (("vit", "fp32"), ("dinov2", "fp32"), ("dinov2", "fp16")):
        folder = tmp_path_factory.mktemp("deploy") / f"{arch}-{precision}-onnx"
        r = cli("export", "--hf", str(tiny_vision(arch)), "--precision", precision, "--deploy", str(folder))
        assert r.exit_code == 0, r.output
        out[arch if precision == "fp32" else f"{arch}-{precision}"] = (tiny_vision(arch), folder)
    return out


@pytest.mark.parametrize("arch", ["vit", "dinov2", "dinov2-fp16"])
@pytest.mark.parametrize("client", VisionTransformer.clients)
def test_each_client_embeds_as_transformers_from_the_folder(client, arch, deployed):
    _available(client)
    source, folder = deployed[arch]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "onnx", "preprocessor_config.json"]
    r = cli("verify", str(folder), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", client, "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output)["results"] if row["runtime"] == client]
    assert len(rows) == 1 and rows[0]["passed"], rows
    cost = rows[0]["detail"]["embeddings"]
    assert cost["images"] == 26 and cost["top5_agreement"] == 1.0
    assert cost["cosine_min"] > (0.999 if arch.endswith("fp16") else 0.99999)


def test_a_folder_whose_processor_differs_fails_its_clients_rows(deployed, tmp_path):
    """The folder's processor normalises by ImageNet's mean, the model was made for 0.5: each client
    normalises as the folder says, and its embeddings are not the model's."""
    _available("optimum")
    source, folder = deployed["vit"]
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    said = json.loads((changed / "preprocessor_config.json").read_text())
    said.update(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    (changed / "preprocessor_config.json").write_text(json.dumps(said))
    r = cli("verify", str(changed), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", "optimum", "--json")
    assert r.exit_code == 1, r.output
    row = next(row for row in json.loads(r.output)["results"] if row["runtime"] == "optimum")
    assert not row["passed"] and "over the embedding budget" in row["error"]
