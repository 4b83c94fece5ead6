"""A sentence encoder's verify (`attnexport.pretrained.encoders.check`): its embeddings judged on every runtime,
a changed weight named, the command line's rows. The [hf] extra, on small random configs."""

import shutil

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402


def test_verify_judges_an_encoder_on_every_runtime_and_catches_a_changed_weight(tiny_encoder, tmp_path):
    folder = tiny_encoder("bert")
    out = tmp_path / "bert.onnx"
    hf_export.export_hf(hf_export.HFExport(folder, output=out))
    report = verify_hf(HFCheck(out, folder, runtimes=["torch", "onnx-ref", "ort-cpu"]))
    assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
    cases = {r.case for r in report.rows}
    assert any(c.startswith("embeddings:") for c in cases) and any("right-padded" in c for c in cases)
    embedded = [r for r in report.rows if r.case.startswith("embeddings:")]
    assert {r.runtime for r in embedded} == {"torch", "onnx-ref", "ort-cpu"}
    assert all(r.detail["embeddings"]["top5_agreement"] == 1.0 for r in embedded)
    # The same file against a folder one of whose weights changed: named, not passed.

    from safetensors.numpy import load_file, save_file
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    weights = load_file(changed / "model.safetensors")
    name = next(k for k in weights if k.endswith("layer.1.intermediate.dense.weight"))
    save_file({**weights, name: weights[name] * 1.01}, changed / "model.safetensors", metadata={"format": "pt"})
    other = verify_hf(HFCheck(out, changed, runtimes=["ort-cpu"]))
    assert not other.ok and "parameters differ" in other.failures[0].error
    assert "intermediate.dense.weight" in other.failures[0].error


def test_the_command_line_exports_and_verifies_an_encoder(tiny_encoder, tmp_path):
    folder = tiny_encoder("bert")
    r = run("export", "--hf", folder, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0, r.output
    assert "bert (embed)" in r.output and "last_hidden_state max abs" in r.output
    r = run("verify", tmp_path / "m.onnx", "--hf", folder, "--runtimes", "ort-cpu")
    assert r.exit_code == 0, r.output
    assert "embeddings on ort-cpu: 1 - cosine max" in r.output and "top-5 agreement 1.000" in r.output
