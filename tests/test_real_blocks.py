"""Real attention modules (transformers, timm, torch) exported through attnexport and verified
against themselves: the `[hf]` extra. Built from small configs with random weights; nothing is
downloaded. By default each module in the attention flavour (the default); every flavour with
--all-modules."""

import json

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")


def _timm_problem() -> str:
    """Why timm cannot be imported here ("" when it can): it is the [blocks] extra, and it needs a
    torchvision built for the installed torch (PyPI's, a CUDA build, does not load beside the
    CPU-only torch wheel: "operator torchvision::nms does not exist")."""
    try:
        import timm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or torchvision's RuntimeError
        return f"timm cannot be imported here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return ""

from conftest import cli as run  # noqa: E402

# Module, and the number of attention calls torch itself makes in its forward.
MODULES = {"llama": 1, "mistral": 1, "qwen2": 1, "gpt2_block": 1, "gpt2_eager_block": 1, "gpt2_model": 2,
           "bert_layer": 1, "bert_model": 2, "bert_model_eager": 2, "t5_attention": 1,
           "whisper_attention": 1, "vit_block": 1, "torch_decoder_layer": 2}
FUSED = {"primitives": "MatMul+Softmax", "attention": "Attention", "ort": "com.microsoft.MultiHeadAttention"}


@pytest.mark.parametrize("flavor", list(FUSED))
@pytest.mark.parametrize("name", list(MODULES))
def test_module_exports_fused_and_verifies_on_every_cpu_runtime(name, flavor, tmp_path, request):
    if flavor != "attention" and not request.config.getoption("--all-modules"):
        pytest.skip("the other flavours run with --all-modules")
    if name == "vit_block" and _timm_problem():
        pytest.skip(_timm_problem())
    spec = f"examples/transformers_modules.py:{name}"
    path = tmp_path / "m.onnx"
    r = run("export", "--module", spec, "--flavor", flavor, "-o", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["attention_op"] == FUSED[flavor] and doc["routed"] == MODULES[name], doc
    r = run("verify", path, "--module", spec, "--runtimes", "torch,onnx-ref,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output[r.output.index("{"):])["results"]
    assert len(rows) == 12 and all(row["passed"] and row["outputs"] for row in rows)


def test_a_deep_block_in_fp16_is_compared_with_its_float32_truth(tmp_path):
    """A 2-layer BERT in fp16: torch's own fp16 run is 1 ulp (0.004 near 4) from the module in
    float32, past the policy's atol, and ONNX Runtime's export rounds elsewhere. The export is
    compared with the module in float32 on its fp16 parameters and inputs, within 4x torch's own
    fp16 error (it failed its export check before)."""
    spec = "examples/transformers_modules.py:bert_model"
    path = tmp_path / "m.onnx"
    r = run("export", "--module", spec, "--dtype", "fp16", "-o", path)
    assert r.exit_code == 0, r.output
    r = run("verify", path, "--module", spec, "--runtimes", "torch,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output[r.output.index("{"):])["results"]
    assert rows and all(row["passed"] and row["outputs"] for row in rows)
    assert all(row["tolerance"]["basis"].startswith("torch's fp16 error against the module in fp32") for row in rows)
    assert all(row["expected"].endswith("in float32 on its fp16 parameters and inputs") for row in rows)
