"""Whole language models (`export --hf`, `verify --hf`, `bench --hf`): small random configs of five
architectures (examples/tiny_lms.py), each cache form exported, verified with generation parity
against transformers' `generate`, and docs/language-models.md's static loop run. The `[hf]` extra; by default
each form in one flavour (every flavour is covered), every flavour with --all-modules."""

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport.pretrained import fusions as hf_fusions
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.causal import generation as G  # noqa: E402
from attnexport.pretrained.check import NEW_TOKENS  # noqa: E402

ARCHITECTURES = ("llama", "mistral", "qwen2", "phi3", "gpt2")
FORMS = {"none": [], "concat": ["--kv-cache"], "static": ["--kv-cache", "static", "--max-seq", "64"]}
# The flavour each form runs in by default (each flavour once); --all-modules: every one.
DEFAULT_FLAVOR = {"none": "primitives", "concat": "attention", "static": "ort"}
OPS = {"primitives": "MatMul+Softmax", "attention": "Attention", "ort": "com.microsoft.MultiHeadAttention"}
STATIC_OPS = {**OPS, "ort": "com.microsoft.GroupQueryAttention"}


@pytest.fixture(scope="module")
def folders(tiny_lm):
    return {arch: tiny_lm(arch) for arch in ARCHITECTURES}


def _json(result):
    return json.loads(result.output[result.output.index("{"):])


@pytest.mark.parametrize("flavor", list(OPS))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_exports_and_generates_what_transformers_generates(arch, form, flavor, folders, tmp_path, request):
    # The static form in the attention flavour as well, on one architecture: SmolLM2's own runs with --all-real.
    if flavor != DEFAULT_FLAVOR[form] and (arch, form, flavor) != ("llama", "static", "attention") \
            and not request.config.getoption("--all-modules"):
        pytest.skip("the other flavours run with --all-modules")
    path = tmp_path / "lm.onnx"
    r = run("export", "--hf", folders[arch], *FORMS[form], "--flavor", flavor, "-o", path, "--json")
    assert r.exit_code == 0, r.output
    doc = _json(r)
    assert doc["attention_op"] == (STATIC_OPS if form == "static" else OPS)[flavor]
    assert doc["routed"] == 2  # one attention call a layer
    layout = hf.Layout.of(onnx.load(path))
    assert [i.name for i in onnx.load(path).graph.input] == layout.inputs
    assert doc["outputs"] == layout.outputs
    if form == "concat":  # Optimum's names
        assert layout.inputs[:5] == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                                     "past_key_values.0.value"]
        assert layout.outputs[:2] == ["logits", "present.0.key"]
    r = run("verify", path, "--hf", folders[arch], "--runtimes", "torch,onnx-ref,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    rows = _json(r)["results"]
    generation = [row for row in rows if row["case"].startswith("generate")]
    assert [row["runtime"] for row in generation] == ["torch", "onnx-ref", "ort-cpu"]
    for row in generation:
        assert row["passed"] and row["outputs"], row
        assert row["detail"]["tokens"] == row["detail"]["transformers_tokens"]
        assert len(row["detail"]["logits_max_abs_per_step"]) == NEW_TOKENS
    decode = [row for row in rows if row["case"].startswith("decode")]
    assert len(decode) == (0 if form == "none" else 6) and all(row["passed"] for row in decode)
    shapes = [row for row in rows if row["runtime"] == "ort-cpu" and not row["case"].startswith(("generate", "decode"))]
    assert len(shapes) >= 3 and all(row["passed"] and row["outputs"] for row in shapes)


def test_a_file_whose_weights_changed_after_the_export_is_refused_before_anything_runs(folders, tmp_path):
    path = tmp_path / "lm.onnx"
    assert run("export", "--hf", folders["llama"], "--kv-cache", "static", "--max-seq", "64", "--flavor", "ort",
               "-o", path).exit_code == 0
    model = onnx.load(path)
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    held = record["model.model.layers.1.mlp.down_proj.weight"]["initializer"]  # where the export keeps it
    target = next(i for i in model.graph.initializer if i.name == held)
    weights = onnx.numpy_helper.to_array(target)
    target.CopyFrom(onnx.numpy_helper.from_array(weights * np.float32(1.5), target.name))
    onnx.save(model, path)
    r = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 1, r.output
    rows = _json(r)["results"]
    assert len(rows) == 1 and not rows[0]["passed"], rows
    error = rows[0]["error"]
    assert "differ from the sha256 recorded at its export: model.model.layers.1.mlp.down_proj.weight" in error


def test_a_divergence_names_the_sequence_the_step_and_both_tokens_and_is_localized(folders, tmp_path, monkeypatch):
    """A model file whose graph was changed after the export, not its weights (the frozen rotary
    sine table, noised) generates other tokens: the report says where, and localization names the
    first diverging node."""
    path = tmp_path / "lm.onnx"
    assert run("export", "--hf", folders["llama"], "--kv-cache", "static", "--max-seq", "64", "--flavor", "ort",
               "-o", path).exit_code == 0
    model = onnx.load(path)
    target = next(i for i in model.graph.initializer if i.name == hf_fusions.rotary.SIN)
    table = onnx.numpy_helper.to_array(target)
    noisy = table + np.random.default_rng(0).standard_normal(table.shape).astype(np.float32) * 0.5
    target.CopyFrom(onnx.numpy_helper.from_array(noisy, target.name))
    onnx.save(model, path)
    r = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 1, r.output
    rows = _json(r)["results"]
    generation = next(row for row in rows if row["case"].startswith("generate"))
    assert not generation["passed"]
    assert "transformers generated token" in generation["error"] and "sequence" in generation["error"]
    assert generation["localization"] and generation["localization"]["node"], generation
    # Where the machine has not the memory a fresh export and both graphs' values take (a real model's
    # verify was killed for memory there, reporting nothing), the graph is compared with itself on the
    # reference evaluator, a part at a time: it computes what its nodes say, so no node is named, and the
    # note says so and what was not done; where even that does not fit, the row says so and fails all
    # the same; --no-memory-check localizes against the fresh export anyway.
    monkeypatch.setitem(hf.MEMORY_FACTORS, "localize", 1e9)
    for factor, flags, localized, said in ((1.0, (), False, "no value of the residual stream or output departs "
                                                             "from onnx-ref on the same graph"),
                                           (1e9, (), False, "localization skipped"),
                                           (1e9, ("--no-memory-check",), True, "")):
        monkeypatch.setitem(hf.MEMORY_FACTORS, "localize, bounded", factor)
        r = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", *flags, "--json")
        assert r.exit_code == 1, r.output
        generation = next(row for row in _json(r)["results"] if row["case"].startswith("generate"))
        assert not generation["passed"] and "transformers generated token" in generation["error"]
        note = generation["localization"]["note"] or ""
        assert bool(generation["localization"].get("node")) == localized, generation["localization"]
        assert said in note and ("against a fresh export of the model" in note) != localized, note
        assert ("available" in note) != localized, note


def test_verify_hf_takes_localize_and_a_baseline(folders, tmp_path):
    """--localize and --baseline reach a language model's rows (they run through verify's one
    executor): each step row is localized, and a later run is held to the baseline."""
    path = tmp_path / "lm.onnx"
    assert run("export", "--hf", folders["llama"], "--kv-cache", "--flavor", "attention", "-o", path).exit_code == 0
    r = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--localize", "--save-baseline",
            tmp_path / "b", "--json")
    assert r.exit_code == 0, r.output
    rows = _json(r)["results"]
    steps = [row for row in rows if not row["case"].startswith(("generate", "decode"))]
    assert len(steps) == 4 and all(row["localization"]["compared"] > 0 for row in steps)
    assert len(json.loads((tmp_path / "b" / "MANIFEST.json").read_text())["files"]) == len(rows)
    r = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--baseline", tmp_path / "b", "--json")
    assert r.exit_code == 0, r.output
    assert all(row["baseline"]["passed"] for row in _json(r)["results"])
    r = run("verify", path, "--hf", folders["llama"], "--runtimes", "onnx-ref", "--baseline", tmp_path / "b", "--json")
    assert r.exit_code == 1


def test_the_documented_static_loop_generates_what_transformers_generates(folders, tmp_path, monkeypatch):
    """docs/language-models.md's plain ONNX Runtime + NumPy loop (buffers bound in place) on an export
    (with rings: tests/test_pretrained_export.py)."""
    from test_docs import doc_block
    folder = folders["llama"]
    path = tmp_path / "llama-static.onnx"
    assert run("export", "--hf", folder, "--kv-cache", "static", "--max-seq", "64", "--flavor", "ort",
               "-o", path).exit_code == 0
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(doc_block("docs/language-models.md", "## Generating with the static cache", "python"), scope)  # noqa: S102
    model, _ = hf.load(folder)
    layout = hf.Layout.of(onnx.load(path))
    prompts = [np.array(p) for p in scope["prompts"]]
    want = G.reference_generation(model, layout, prompts, len(scope["generated"]))
    assert np.array_equal(np.stack(scope["generated"], axis=1), want.tokens)






def test_refusals_are_one_line_and_exit_2(folders, tmp_path):
    cases = [(["export", "--hf", tmp_path / "nothing-here"], "no such folder"),
             (["export", "--hf", folders["llama"], "--kv-cache", "static"], "--max-seq"),
             (["export", "--hf", folders["llama"], "--max-seq", "64"], "--kv-cache static"),
             (["export", "--hf", folders["llama"], "--heads", "3"], "no variant options"),
             (["export", "--hf", folders["llama"], "--module", "x.py:y"], "one of them"),
             (["bench", "--hf", folders["llama"]], "--decode")]
    for args, said in cases:
        r = run(*args)
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, (args, r.output)
    (tmp_path / "enc").mkdir()
    import transformers
    transformers.BartConfig(architectures=["BartForConditionalGeneration"]).save_pretrained(tmp_path / "enc")
    r = run("export", "--hf", tmp_path / "enc")
    assert r.exit_code == 2 and "not a causal language model" in r.output


def test_a_cache_pattern_names_every_layer():
    """`--cache 'past.{i}.key:present.{i}.key'` pairs every layer's tensors, not one flag each."""
    from attnexport.modules import expand_cache_patterns
    names = ["x", "past.0.key", "past.1.key", "past.10.key"]
    assert expand_cache_patterns({"past.{i}.key": "present.{i}.key"}, names) == {
        "past.0.key": "present.0.key", "past.1.key": "present.1.key", "past.10.key": "present.10.key"}
    assert expand_cache_patterns({"cache.{i}": "out.{i}"}, names) == {"cache.{i}": "out.{i}"}  # refused later


def test_verify_judges_every_output_of_a_step(folders, tmp_path):
    """A file whose every output is off (the logits and each layer's key and value, each by its own
    amount) fails each of verify's step rows on every one of them, by the amount it is off."""
    from conftest import nudged_output
    path = tmp_path / "lm.onnx"
    assert run("export", "--hf", folders["llama"], "--kv-cache", "--flavor", "attention", "-o", path).exit_code == 0
    model = onnx.load(path)
    outputs = hf.Layout.of(model).outputs
    assert len(outputs) == 5
    for i, name in enumerate(outputs):
        model = nudged_output(model, name, 0.01 * (i + 1))
    onnx.save(model, tmp_path / "off.onnx")
    r = run("verify", tmp_path / "off.onnx", "--hf", folders["llama"], "--runtimes", "ort-cpu", "--new-tokens", 2,
            "--json")
    assert r.exit_code == 1, r.output
    steps = [row for row in _json(r)["results"] if not row["case"].startswith(("generate", "decode"))]
    assert len(steps) == 4
    for row in steps:
        failed = {o["name"]: o["max_abs"] for o in row["outputs"] if not o["passed"]}
        assert list(failed) == outputs, row["case"]
        assert [failed[n] for n in outputs] == pytest.approx([0.01 * (i + 1) for i in range(5)], abs=1e-4), failed
