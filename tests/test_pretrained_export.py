"""A whole model's export (`attnexport.pretrained.export`, `attnexport.pretrained.fusions`): the deployment folder,
the user's budget, the graph a client that feeds empty pasts of batch 0 can run, the ort flavour's
fused ops with every weight still fingerprinted, Gemma2, and the refusals. The `[hf]` extra, on
small random configs."""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402
from conftest import graph_difference, in_time  # noqa: E402

from attnexport import signature as SG  # noqa: E402
from attnexport import weights as W  # noqa: E402
from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import forms  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.record import ExportRecord  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_lms, tiny_lm):
    # Gemma2: a window of 4 positions, which the checks' sequences pass; the wide one's static buffers fit in
    made = {"llama": tiny_lm("llama"), "gemma2": tiny_lm("gemma2"), "gemma2-wide": tiny_lm("gemma2", window=64)}
    tied = tmp_path_factory.mktemp("tied")
    config = tiny_lms.config("llama")
    config.tie_word_embeddings = True
    tiny_lms.save_config(config, tied)
    made["tied"] = tied
    return made


def _json(result):
    return json.loads(result.output[result.output.index("{"):])


def test_a_deployment_folder_holds_what_its_clients_read(folders, tmp_path):
    out = tmp_path / "deploy"
    old = os.umask(0o027)
    try:
        r = run("export", "--hf", folders["llama"], "--kv-cache", "--deploy", out)
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "onnx"]
    assert [p.name for p in (out / "onnx").iterdir()] == ["model.onnx"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["use_cache"] is True
    model = onnx.load(out / "onnx" / "model.onnx")
    layout, signature = hf.Layout.of(model), SG.of(model)
    assert layout.form == "concat" and signature.pairs == layout.cache_pairs  # what apps feed back, recorded
    assert {c.kind for c in signature.caches} == {"concat"} and signature.write_pos is None
    for path in [out, out / "onnx", *out.rglob("*")]:  # the user's umask, as a plain mkdir and open would
        assert path.stat().st_mode & 0o027 == 0, path
    assert not list(tmp_path.glob(".attnexport-*"))  # no staging folder left


def test_the_model_sizes_are_in_the_signature_and_files_from_before_are_read_alike(folders, tmp_path):
    out = tmp_path / "m.onnx"
    _, layout = hf_export.export_hf(hf_export.HFExport(folders["llama"], form="static", max_seq=16, output=out))
    model = onnx.load(out)
    props = {p.key: p.value for p in model.metadata_props}
    assert hf.OLD_META not in props  # one record: the signature
    assert json.loads(props[SG.META])["model"] == layout.sizes() and hf.Layout.of(model) == layout
    # A file from before: its sizes in attnexport.hf, its signature without them.
    signature = json.loads(props[SG.META])
    sizes = signature.pop("model")
    old = {**props, SG.META: json.dumps(signature), hf.OLD_META: json.dumps(sizes)}
    del model.metadata_props[:]
    for key, value in old.items():
        model.metadata_props.add(key=key, value=value)
    assert hf.Layout.of(model) == layout
    # One whose caches disagree with its recorded form, and one whose sizes are damaged: one line each.
    model.metadata_props[[p.key for p in model.metadata_props].index(hf.OLD_META)].value = \
        json.dumps({**sizes, "form": "concat"})
    with pytest.raises(UsageError, match="records its caches otherwise than its concat form"):
        hf.Layout.of(model)
    model.metadata_props[[p.key for p in model.metadata_props].index(hf.OLD_META)].value = \
        json.dumps({**sizes, "heads": 3})
    with pytest.raises(UsageError, match="recorded sizes are damaged"):
        hf.Layout.of(model)


def test_an_existing_deployment_folder_gets_its_files_replaced_and_keeps_the_rest(folders, tmp_path):
    out = tmp_path / "deploy"
    out.mkdir()
    (out / "README.md").write_text("mine")
    (tmp_path / "elsewhere.json").write_text("{}")
    (out / "config.json").symlink_to(tmp_path / "elsewhere.json")
    r = run("export", "--hf", folders["llama"], "--kv-cache", "static", "--max-seq", "16", "--flavor", "ort",
            "--deploy", out)
    assert r.exit_code == 0, r.output
    assert (out / "README.md").read_text() == "mine"
    assert (out / "config.json").is_symlink() and json.loads((tmp_path / "elsewhere.json").read_text())["use_cache"]
    assert (out / "onnx" / "model_static.onnx").is_file() and not (out / "onnx" / "model.onnx").exists()
    assert not list(out.glob(".attnexport-*"))


def test_a_past_of_batch_0_runs_as_an_empty_one(folders, tmp_path):
    """transformers.js feeds the first step's empty pasts as (0, kv heads, 0, d): each past is
    reshaped to the block's batch first, so the fused attention op takes it."""
    path = tmp_path / "lm.onnx"
    for flavor in ("attention", "ort", "primitives"):
        assert run("export", "--hf", folders["llama"], "--kv-cache", "--flavor", flavor, "-o", path).exit_code == 0
        model = onnx.load(path)
        layout = hf.Layout.of(model)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        feed = {"input_ids": np.array([[5, 17, 42]]), "attention_mask": np.ones((1, 3), np.int64),
                "position_ids": np.arange(3)[None]}
        outs = []
        for batch in (1, 0):
            empty = np.zeros((batch, layout.kv_heads, 0, layout.head_dim), np.float32)
            outs.append(session.run(["logits"], {**feed, **{n: empty for n in layout.cache_pairs}})[0])
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6, err_msg=flavor)


def test_a_tied_vocabulary_matrix_is_kept_once_as_the_head_reads_it(folders, tmp_path):
    path = tmp_path / "lm.onnx"
    assert run("export", "--hf", folders["tied"], "-o", path).exit_code == 0
    model = onnx.load(path)
    vocab = [i for i in model.graph.initializer if 1000 in i.dims]
    assert len(vocab) == 1 and list(vocab[0].dims) == [64, 1000]
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == vocab[0].name)
    assert onnx.helper.get_attribute_value(gather.attribute[-1]) == 1
    r = run("verify", path, "--hf", folders["tied"], "--runtimes", "torch,onnx-ref,ort-cpu", "--new-tokens", "8")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("form, flavor", [("none", "attention"), ("concat", "primitives"), ("static", "ort")])
def test_gemma2_softcap_and_sliding_window_export_and_generate_what_eager_transformers_generates(folders, tmp_path,
                                                                                                form, flavor):
    path = tmp_path / "gemma2.onnx"
    folder = folders["gemma2-wide" if form == "static" else "gemma2"]
    extra = {"none": [], "concat": ["--kv-cache"], "static": ["--kv-cache", "static", "--max-seq", "64"]}[form]
    r = run("export", "--hf", folder, *extra, "--flavor", flavor, "-o", path, "--json")
    assert r.exit_code == 0, r.output
    assert _json(r)["routed"] == 2
    nodes = onnx.load(path).graph.node
    if flavor == "primitives":  # a Tanh in each layer's score path, a few ops before its Softmax
        made = {o: n for n in nodes for o in n.output}

        def capped(name, depth=0):
            node = made.get(name)
            return node is not None and depth < 6 and (node.op_type == "Tanh" or any(capped(i, depth + 1)
                                                                                     for i in node.input))
        assert [capped(n.input[0]) for n in nodes if n.op_type == "Softmax"] == [True, True]
    else:  # the scores' softcap is the fused op's attribute
        fused = [n for n in nodes if n.op_type in ("Attention", "GroupQueryAttention")]
        assert len(fused) == 2
        assert all({a.name: a.f for a in n.attribute}["softcap"] == pytest.approx(50.0) for n in fused)
    r = run("verify", path, "--hf", folder, "--runtimes", "torch,onnx-ref,ort-cpu", "--new-tokens", "16", "--json")
    assert r.exit_code == 0, r.output
    generation = [row for row in _json(r)["results"] if row["case"].startswith("generate")]
    assert len(generation) == 3 and all(row["passed"] for row in generation)


def test_gemma3_in_fp16_keeps_its_norms_in_float32_and_generates_what_transformers_generates(tiny_lm, tmp_path):
    """Gemma 3's RMSNorm casts its input to float32; torch.onnx's fused RMSNormalization dropped that
    cast (an fp16 input beside a float32 scale, which onnx's checks refuse): the export puts it back.
    The model: five sliding-window layers (a window of 4, which the checks' sequences pass) to one
    global, q/k norms, four query heads over one key/value head."""
    folder = tiny_lm("gemma3")
    path = tmp_path / "gemma3.onnx"
    r = run("export", "--hf", folder, "--kv-cache", "--precision", "fp16", "-o", path, "--json")
    assert r.exit_code == 0, r.output
    assert _json(r)["routed"] == 6
    model = onnx.load(path)
    made = {o: n for n in model.graph.node for o in n.output}
    norms = [n for n in model.graph.node if n.op_type == "RMSNormalization"]
    assert norms and all(made[n.input[0]].op_type == "Cast" for n in norms)
    # fp16 keeps the Gelu op (its formula's x^3 would leave fp16's range: `pretrained.tanh_gelu`)
    assert [n.op_type for n in model.graph.node].count("Gelu") == 6
    r = run("verify", path, "--hf", folder, "--runtimes", "ort-cpu", "--new-tokens", "16", "--json")
    assert r.exit_code == 0, r.output
    rows = _json(r)["results"]
    assert all(row["passed"] for row in rows)
    assert sum(row["case"].startswith("decode") for row in rows) == 2  # past the window: 4 + 8 steps
    assert [row["case"] for row in rows if row["case"].startswith("accuracy")]  # transformers' greedy tokens


@pytest.mark.parametrize("arch, flavor, window", [("gemma3", "ort", 8), ("gemma2", "attention", 4)])
def test_sliding_window_layers_keep_a_ring_of_their_window_in_the_static_form(tiny_lm, tmp_path, monkeypatch, arch,
                                                                             flavor, window):
    """Buffers of 32 positions; the local layers a ring of their window's slots, returned rewritten,
    the global layers' buffers written in place (one GroupQueryAttention in the ort flavour). verify
    decodes in blocks longer than the window and generates 20 tokens after prompts of 5, 9 and 2
    (each alone: the longest passes the window), equal to transformers' generate. Gemma 3's export
    also runs docs/language-models.md's loop (each ring two buffers, swapped each step) and bench's
    decode step (the buffers bound in place, each ring to an output of its own)."""
    folder = tiny_lm(arch, window=window)
    path = tmp_path / "llama-static.onnx"  # the documented loop's file name
    r = run("export", "--hf", folder, "--kv-cache", "static", "--max-seq", "32", "--flavor", flavor, "-o", path)
    assert r.exit_code == 0, r.output
    model = onnx.load(path)
    layout, signature = hf.Layout.of(model), SG.of(model)
    windows = {"gemma3": [8, 8, 8, 8, 8, 0], "gemma2": [4, 0]}[arch]
    assert layout.extra["windows"] == windows
    kinds = [c.kind for c in signature.caches]
    assert kinds == [k for w in windows for k in (["ring"] * 2 if w else ["static"] * 2)]
    sizes = {i.name: i.type.tensor_type.shape.dim[2].dim_value for i in model.graph.input if i.name.startswith("past")}
    assert [sizes[f"past_key_values.{i}.key"] for i in range(len(windows))] == [w or 32 for w in windows]
    if flavor == "ort":
        assert [n.op_type for n in model.graph.node].count("GroupQueryAttention") == windows.count(0)
    r = run("verify", path, "--hf", folder, "--runtimes", "torch,ort-cpu", "--new-tokens", "20", "--json")
    assert r.exit_code == 0, r.output
    rows = _json(r)["results"]
    assert all(row["passed"] for row in rows) and len(rows) >= 10
    assert sum(row["case"].startswith("decode") for row in rows) == 2 * 2
    assert sum(row["case"].startswith("generate 20 tokens") for row in rows) == 2
    if arch != "gemma3":
        return
    from test_docs import doc_block

    from attnexport.pretrained.causal import bench as hf_bench
    from attnexport.pretrained.causal import generation as G
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(doc_block("docs/language-models.md", "## Generating with the static cache", "python"), scope)  # noqa: S102
    source, _ = hf.load(folder)
    want = G.reference_generation(source, layout, [np.array(p) for p in scope["prompts"]], len(scope["generated"]))
    assert np.array_equal(np.stack(scope["generated"], axis=1), want.tokens)  # past the window of 8
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    copied = dict(zip([o.name for o in session.get_outputs()], hf_bench._decode_call(session, layout, 20, False)(),
                      strict=True))
    step = hf_bench._decode_call(session, layout, 20, True)  # the same seeded feed, the buffers bound in place
    step()
    bound = [v.numpy() for v in step.__defaults__[0].get_outputs()]
    (logits,) = [a for a in bound if a.shape == copied["logits"].shape]
    np.testing.assert_allclose(logits, copied["logits"], rtol=1e-5, atol=1e-5)  # a ring aliased would differ


def _saturated(model, layer: int = 0):
    """Layer `layer`'s MLP made to overflow fp16 and not fp32: every gate and up weight 1, every down
    weight 60000 (below fp16's 65504), so each down projection sums about 176 x 64 x 60000."""
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.fill_(1.0)
        mlp.up_proj.weight.fill_(1.0)
        mlp.down_proj.weight.fill_(60000.0)
    return mlp


def test_an_fp16_export_that_overflows_is_refused_naming_the_node_where_it_starts(folders, tmp_path):
    model, _ = hf.load(folders["llama"], 0)
    _saturated(model)
    model.save_pretrained(tmp_path / "hot")
    r = run("export", "--hf", tmp_path / "hot", "--kv-cache", "--precision", "fp16", "-o", tmp_path / "m.onnx")
    assert r.exit_code != 0 and "overflows" in r.output and "first non-finite value at" in r.output, r.output
    assert "float16's range of 65504" in r.output and not (tmp_path / "m.onnx").exists()
    r = run("export", "--hf", tmp_path / "hot", "--kv-cache", "-o", tmp_path / "m.onnx")  # fp32 holds it
    assert r.exit_code == 0, r.output


def test_verify_names_an_overflow_and_the_node_where_it_starts(folders, tmp_path):
    """An fp16 file whose MLP weights overflow (those of a source whose export refuses it, put into
    the file of one that exports, and recorded): the rows that compare numbers fail as an overflow in
    fp16, named at the node that makes the first infinity from finite inputs (the down projection's
    MatMul), not only as NaN in the logits."""
    path = tmp_path / "m.onnx"
    assert run("export", "--hf", folders["llama"], "--kv-cache", "--precision", "fp16", "-o", path).exit_code == 0
    model = onnx.load(path)
    params = json.loads(ExportRecord.of(model).params)
    inits = {i.name: i for i in model.graph.initializer}
    for what, value in (("gate_proj", 1.0), ("up_proj", 1.0), ("down_proj", 60000.0)):
        entry = params[f"model.model.layers.0.mlp.{what}.weight"]
        init = inits[entry["initializer"]]
        changed = np.full(onnx.numpy_helper.to_array(init).shape, value, np.float16)
        init.CopyFrom(onnx.numpy_helper.from_array(changed, init.name))
        entry["sha256"] = W.sha256_of(changed)  # recorded as exported: the numbers, not the fingerprints, fail
    record = ExportRecord.of(model)
    replace(record, params=json.dumps(params), params_sha256=W.total_sha256(params)).write(model)
    onnx.save(model, path)
    down = params["model.model.layers.0.mlp.down_proj.weight"]["initializer"]
    source, _ = hf.load(folders["llama"], 0)
    _saturated(source)  # the same weights: the fingerprints match, the numbers fail
    source.save_pretrained(tmp_path / "hot")
    r = run("verify", path, "--hf", tmp_path / "hot", "--runtimes", "ort-cpu", "--new-tokens", "2", "--json")
    assert r.exit_code == 1
    rows = [row for row in _json(r)["results"] if row["error"].startswith("overflow in fp16")]
    assert rows, r.output
    where = rows[0]["localization"]
    assert where["kind"] == "overflow" and where["op_type"] == "MatMul", where
    assert down in [i["name"] for i in where["inputs"]], where


def test_refusals_are_one_line(folders, tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    cases = [(["export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / "x.onnx", "--deploy", tmp_path / "d"],
              2, "not both"),
             (["export", "--hf", folders["llama"], "--deploy", tmp_path / "a-file"], 2, "it is a file"),
             (["export", "--hf", folders["llama"], "--deploy", tmp_path / "no" / "such"], 2, "does not exist"),
             (["export", "--variant", "mha", "--deploy", tmp_path / "d"], 2, "goes with --hf"),
             (["export", "--variant", "mha", "--atol", "1e-3"], 2, "checked by verify"),
             (["export", "--hf", folders["llama"], "--rtol", "-1"], 2, "finite number >= 0"),
             (["export", "--hf", tmp_path / "bad.gguf"], 2, "GGUF"),
             (["export", "--hf", folders["gemma2"], "--kv-cache", "--flavor", "ort"], 1, "softcap"),
             (["verify", tmp_path / "x.onnx", "--clients", "optimum"], 2, "goes with --hf"),
             # an empty folder named "empty" (transformers once guessed the model type mpt from its name)
             (["export", "--hf", tmp_path / "empty", "-o", tmp_path / "x.onnx"], 2,
              "a folder without a config.json (a save_pretrained folder, a CTranslate2 Whisper folder"),
             # a name that is no path: read from the local cache only, no network wait
             (["export", "--hf", "no-such-model-id", "-o", tmp_path / "x.onnx"], 2,
              "no such file or folder, and no model of that id in the Hugging Face cache (nothing is downloaded "
              "unless asked: HF_HUB_OFFLINE=0)")]
    (tmp_path / "empty").mkdir()
    for args, code, said in cases:
        r = run(*args, env={"HF_HUB_OFFLINE": None})
        assert r.exit_code == code and said in r.output and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "x.onnx").exists()


def test_a_budget_of_nothing_stops_the_export_before_anything_is_written(folders, tmp_path):
    path = tmp_path / "lm.onnx"
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--rtol", "0", "--atol", "0", "-o", path)
    assert r.exit_code == 1 and "differs from the model in float64" in r.output and "override" in r.output
    assert not path.exists() and not list(tmp_path.iterdir())


def test_the_export_says_what_it_checked_and_the_budget(folders, tmp_path):
    r = run("export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / "lm.onnx", "--json")
    assert r.exit_code == 0, r.output
    doc = _json(r)
    assert [e["step"] for e in doc["checked"]] == [c[0] for c in forms.FORMS["concat"].export_checks]
    assert all("float64" in e["logits"]["basis"] and e["logits"]["max_abs"] >= 0 for e in doc["checked"])
    assert any("checked against the model in float64" in n for n in doc["notes"])


def test_strict_placement_fails_a_language_models_step_rows_that_left_nodes_on_the_cpu(folders, tmp_path,
                                                                                         monkeypatch):
    """verify --hf --strict-placement judges the step and decode rows as the golden rows are
    judged (the CPU provider's line is marked accelerated here: every compute node is left behind)."""
    import dataclasses

    from attnexport import runtimes as R
    path = tmp_path / "lm.onnx"
    assert run("export", "--hf", folders["llama"], "--kv-cache", "-o", path).exit_code == 0
    monkeypatch.setitem(R.REGISTRY, "ort-cpu", dataclasses.replace(R.REGISTRY["ort-cpu"], accelerated=True))
    args = ["verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--new-tokens", "2", "--json"]
    loose = [x for x in json.loads(run(*args).output)["results"] if x["cpu_nodes"]]
    r = run(*args, "--strict-placement")
    strict = [x for x in json.loads(r.output)["results"] if x["cpu_nodes"]]
    assert loose and all(x["passed"] for x in loose) and {x["case"] for x in loose} == {x["case"] for x in strict}
    assert any(x["case"].startswith("decode") for x in strict) and r.exit_code == 1
    assert all(not x["passed"] and "ran on the CPU" in x["error"] for x in strict)


def test_the_request_of_export_hf_is_the_libraries_own_from_the_command_lines_options(tmp_path, monkeypatch):
    """What `export --hf` asks for, built by the library (the command line only parses): the
    precision's plan with the options given applied, `keep="none"` keeping nothing, an output named
    after the source, and the refusals before anything runs."""
    from attnexport.errors import UsageError
    from attnexport.pretrained import precision as P
    monkeypatch.chdir(tmp_path)
    r = hf_export.request("/x/SmolLM2-135M.Q4_1.gguf", {"keep": "none", "accuracy_level": 0, "requantize": True,
                                                        "symmetric": None}, form="static", max_seq=64, precision="int4")
    assert r.output.endswith("SmolLM2-135M.Q4_1.onnx") and (r.form, r.max_seq, r.precision) == ("static", 64, "int4")
    base = P.TABLE["int4"].plan
    assert (r.plan.keep, r.plan.accuracy, r.plan.carry, r.plan.block) == ((), 0, False, base.block)
    assert hf_export.request("/x/tiny-llama/", precision="int8").plan == P.plan_for("int8")
    assert hf_export.request("/x/tiny-llama/").plan is None
    assert hf_export.request("/x/tiny-llama/", deploy=str(tmp_path / "out")).output is None
    for plan, fields in (({"block_size": 32}, {"precision": "fp16"}), ({}, {"output": "a.onnx", "deploy": "d"}),
                         ({"block_size": 7}, {"precision": "int4"})):
        with pytest.raises(UsageError):
            hf_export.request("/x/tiny-llama", plan, **fields)


def test_a_folder_with_a_config_and_no_weights_is_refused_unless_a_seed_is_given(tiny_lms, tiny_encoder, tmp_path):
    """A config alone would be a randomly initialised model: export, verify and bench refuse it in one
    line, nothing written; with --seed N its weights are drawn from N, the note says so, and verify
    finds N in the file's record (another seed: the parameters differ)."""
    lm, encoder = tmp_path / "lm-config", tmp_path / "encoder-config"
    tiny_lms.config("llama").save_pretrained(lm)
    shutil.copytree(tiny_encoder("bert"), encoder)
    (encoder / "model.safetensors").unlink()
    for source in (lm, encoder):
        bench = ["bench", "--hf", source, *(["--decode"] if source == lm else [])]
        for args in (["export", "--hf", source, "-o", tmp_path / "x.onnx"], bench):
            r = run(*args)
            assert r.exit_code == 2 and "Traceback" not in r.output, r.output
            assert r.output.strip().splitlines() == [
                f"error: --hf {source}: a config and no weights (model.safetensors or pytorch_model.bin): the model "
                "made from it would be randomly initialised; give --seed N to make one on purpose (its weights "
                "drawn from N)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder-config", "lm-config"]
    path = tmp_path / "lm.onnx"
    r = run("export", "--hf", lm, "--kv-cache", "--seed", "3", "-o", path, "--json")
    assert r.exit_code == 0, r.output
    assert any(n.startswith("the weights are random: lm-config has a config and no weights, so they were drawn "
                            "from --seed 3") for n in _json(r)["notes"])
    r = run("verify", path, "--hf", lm, "--runtimes", "ort-cpu", "--new-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    r = run("verify", path, "--hf", lm, "--runtimes", "ort-cpu", "--new-tokens", "4", "--seed", "4", "--json")
    assert r.exit_code == 1 and "the model's parameters differ" in _json(r)["results"][0]["error"]


def test_external_data_puts_the_weights_beside_the_graph_and_verify_reads_them(folders, tmp_path, monkeypatch):
    """`--external-data` (the default from EXTERNAL_FROM bytes): the graph names `m.onnx_data` for
    every tensor of its weights, each at an offset ONNX Runtime maps in place; the check before
    writing loaded the staged pair; verify reads the pair; nothing else is left in the folder. The
    export's JSON carries its wall time and peak memory, phase by phase, and its notes say both."""
    path = tmp_path / "m.onnx"
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--external-data", "-o", path, "--json")
    assert r.exit_code == 0, r.output
    doc = _json(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx_data"]
    data = tmp_path / "m.onnx_data"
    assert doc["size"] == path.stat().st_size + data.stat().st_size
    assert any("m.onnx_data beside the graph" in n for n in doc["notes"])
    model = onnx.load(path, load_external_data=False)
    external = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(len(i.raw_data) < 1024 for i in model.graph.initializer if i not in external)
    for init in external:
        info = {e.key: e.value for e in init.external_data}
        assert info["location"] == "m.onnx_data" and int(info["offset"]) % (1 << 16) == 0
    phases = [p["name"] for p in doc["resources"]["phases"]]
    assert {"load", "trace", "to onnx", "write", "check"} <= set(phases)
    assert doc["resources"]["peak_bytes"] >= max(p["peak_bytes"] for p in doc["resources"]["phases"]) > 0
    assert any(n.startswith("took ") and "peak resident memory" in n for n in doc["notes"])
    v = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--json")
    assert v.exit_code == 0, v.output
    assert _json(v)["resources"]["peak_bytes"] > 0
    from attnexport import runtimes as R
    from attnexport import usage as U
    from attnexport.runtimes import js
    if R.status("ort-node").available:  # a model above what the JavaScript runtimes are given: one line
        monkeypatch.setattr(js, "JS_LIMIT", 1000)
        v = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-node")
        assert v.exit_code == 2 and "ort-node cannot load a model of" in v.output and "ort-cpu" in v.output
        assert len(v.output.strip().splitlines()) == 1, v.output
    monkeypatch.setattr(U, "available", lambda: 1 << 20)  # a machine with 1 MiB to give: refused first
    v = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu")
    assert v.exit_code == 2 and "verify needs about" in v.output and len(v.output.strip().splitlines()) == 1


def test_a_tied_head_with_external_data_is_turned_on_disk_and_the_file_holds_only_live_weights(folders, tmp_path):
    """A tied vocabulary matrix kept as the head reads it is written transposed beside the traced
    weights (`weights.transposed_external`), never in memory whole; the data file the export
    commits holds each live tensor once (the table as traced is not copied over), and the pair
    passes its check before writing and verify."""
    path = tmp_path / "m.onnx"
    r = run("export", "--hf", folders["tied"], "--kv-cache", "--seed", "2", "--external-data", "-o", path, "--json")
    assert r.exit_code == 0, r.output
    model = onnx.load(path, load_external_data=False)
    external = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    (head,) = [i for i in external if i.name.endswith(".transposed")]
    assert [int(d) for d in head.dims][::-1] == [hf.load(folders["tied"], 2)[0].config.vocab_size,
                                               hf.load(folders["tied"], 2)[0].config.hidden_size]
    spans = sorted((int(info["offset"]), int(info["offset"]) + int(info["length"]))
                   for info in ({e.key: e.value for e in i.external_data} for i in external))
    assert spans[-1][1] == (tmp_path / "m.onnx_data").stat().st_size
    # between one tensor and the next, no more than the alignment's padding
    assert spans[0][0] == 0 and all(0 <= b[0] - a[1] < 1 << 16 for a, b in zip(spans, spans[1:], strict=False))
    v = run("verify", path, "--hf", folders["tied"], "--seed", "2", "--runtimes", "ort-cpu", "--new-tokens", "4",
            "--json")
    assert v.exit_code == 0, v.output


def test_the_weights_are_fingerprinted_as_they_are_written_and_not_read_back(folders, tmp_path, monkeypatch):
    """The record's sha256 of each weight the trace wrote is taken from the bytes as they were written
    (`weights.Written`), and a parameter is matched to its tensor by the memory it was written from:
    nothing is read back to be hashed, not even the tied head, which is turned from the table's memory
    and hashed as it is written. Every fingerprint is that of the file as committed (`weights.read`),
    tied and untied."""
    read_back = []
    hashed = W._sha256_of_initializer

    def spy(init, base):
        if init.data_location == onnx.TensorProto.EXTERNAL:
            read_back.append(init.name)
        return hashed(init, base)
    monkeypatch.setattr(W, "_sha256_of_initializer", spy)
    for name in ("llama", "tied"):
        read_back.clear()
        path = tmp_path / f"{name}.onnx"
        r = run("export", "--hf", folders[name], "--kv-cache", "--seed", "2", "--external-data", "-o", path)
        assert r.exit_code == 0, r.output
        model = onnx.load(path, load_external_data=False)
        entries = json.loads(ExportRecord.of(model).params)
        external = {i.name for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL}
        assert external and {e["initializer"] for e in entries.values()} >= external
        assert read_back == [], read_back
        assert (name == "tied") == any(n.endswith(".transposed") for n in external)
        assert W.read(model, entries, str(tmp_path), keep=False)[1] == []
        assert all(e["layout"] != "folded" for e in entries.values())


def test_int4_with_external_data_quantizes_a_matrix_at_a_time_from_the_traced_weights(folders, tmp_path,
                                                                                        monkeypatch):
    """`--precision int4 --external-data`: the quantizer reads each float matrix from the trace's
    staged weights (none of them in memory as protobuf), the data file holds what the graph reads
    (the MatMulNBits blocks, the float table its Gather reads), and verify's accuracy rows pass.
    The float matrices the check reads a block of columns at a time are those columns, from one
    parameter or several packed together."""
    from attnexport.pretrained import precision as P
    seen = []
    unfaithful = P.unfaithful

    def kept(before, model, record=None):
        for weight in before if hasattr(before, "rows") else ():  # the export's, not verify's dict
            whole = before[weight]
            n = whole.shape[1]
            for first, stop in ((0, n), (1, n - 1), (n // 3, 2 * n // 3)):
                assert np.array_equal(before.rows(weight, first, stop), whole[:, first:stop].T), weight
            seen.append(weight)
        return unfaithful(before, model, record)
    monkeypatch.setattr(hf_export.P, "unfaithful", kept)
    path = tmp_path / "m.onnx"
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--precision", "int4", "--external-data", "-o", path,
            "--json")
    assert r.exit_code == 0, r.output
    model = onnx.load(path, load_external_data=False)
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) >= 7
    assert len(seen) >= 7
    read = {i for n in model.graph.node for i in n.input}
    assert all(i.name in read for i in model.graph.initializer)  # no float matrix left behind
    size = sum(int({e.key: e.value for e in i.external_data}["length"]) for i in model.graph.initializer
               if i.data_location == onnx.TensorProto.EXTERNAL)
    assert size > 0 and (tmp_path / "m.onnx_data").stat().st_size < size + len(model.graph.initializer) * (1 << 16)
    v = run("verify", path, "--hf", folders["llama"], "--runtimes", "ort-cpu", "--new-tokens", "4", "--json")
    assert v.exit_code == 0, v.output
    seen.clear()  # a tied vocabulary: its matrix named twice, as the embedding and as the head
    tied = run("export", "--hf", folders["tied"], "--precision", "int4", "--external-data", "-o", tmp_path / "t.onnx")
    assert tied.exit_code == 0, tied.output
    assert len(seen) >= 7


def _mapped_from(address: int) -> str:
    """The file whose mapping holds `address` in this process (/proc/self/maps), or ''."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    return ""


def test_a_half_precision_folder_is_mapped_widened_to_float32_and_exports_as_its_float32_twin(
        folders, tmp_path):
    """An export with its weights beside the graph loads a bfloat16 folder as its files' own mapping
    and widens it a tensor at a time into a file it maps (`model.map_float32`; the file's name gone
    at once, nothing left beside the output), and leaves a float32 folder's tensors in the mapping
    of its own file that transformers made (nothing written, no second mapping): the parameters
    are float32, equal to the folder's values; the export equals the float32 folder's, weight for
    weight."""
    import transformers
    source = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    half = tmp_path / "half"
    source.to(torch.bfloat16).save_pretrained(half)
    wide = tmp_path / "wide"
    source.to(torch.bfloat16).to(torch.float32).save_pretrained(wide)
    maps = tmp_path / "maps"
    maps.mkdir()
    model, _ = hf.load(half, mapped_in=maps)
    assert list(maps.iterdir()) == []
    expected = dict(source.to(torch.bfloat16).named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, expected[name].float()), name
        assert _mapped_from(p.data_ptr()).startswith(str(maps / ".attnexport-weights-")), name  # the file's pages
    assert model.config.dtype == torch.float32
    model, _ = hf.load(wide, mapped_in=maps)  # a float32 folder's tensors as transformers mapped them
    assert list(maps.iterdir()) == []
    for name, p in model.named_parameters():
        assert _mapped_from(p.data_ptr()) == str(wide / "model.safetensors"), name
        assert torch.equal(p, expected[name].float()), name
    out = tmp_path / "out"
    out.mkdir()
    for name, folder in (("half", half), ("wide", wide)):
        r = run("export", "--hf", folder, "--kv-cache", "--external-data", "-o", out / f"{name}.onnx")
        assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["half.onnx", "half.onnx_data", "wide.onnx", "wide.onnx_data"]
    a, b = (onnx.load(out / f"{n}.onnx") for n in ("half", "wide"))
    wa, wb = ({i.name: numpy_helper.to_array(i) for i in m.graph.initializer} for m in (a, b))
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_a_full_disk_while_the_traced_weights_are_written_is_one_line_and_leaves_nothing(folders, tmp_path,
                                                                                          monkeypatch):
    """The trace's weights go to the staging folder first (`weights.unload`): a disk that fills there
    is one line and exit 2, and neither the graph, its data nor the staging folder is left; a full disk
    anywhere else a command writes is one line too (the CLI's own catch)."""
    import errno

    from attnexport import cli
    written = []
    write = W._write_tensor

    def filling(tensor, f, *rest):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(tensor.name)
        return write(tensor, f, *rest)
    monkeypatch.setattr(W, "_write_tensor", filling)
    out = tmp_path / "out"
    out.mkdir()
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--external-data", "-o", out / "m.onnx")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith(f"error: cannot write the weights to {out}") and "No space left on device" in r.output
    assert "more)" in r.output and written and list(out.iterdir()) == []

    @cli.reports_errors
    def full():
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "x"))
    with pytest.raises(SystemExit) as stop:
        full()
    assert stop.value.code == 2


def test_verify_of_a_model_with_external_data_maps_its_half_precision_source(folders, tmp_path, monkeypatch):
    """verify of an export with its weights beside the graph loads the source as the export did: a
    bfloat16 folder widened into a file in the model's folder and mapped from it (the name gone at
    once), in one pass (a quantized file) as in two; its memory check counts the mapped work."""
    import transformers

    from attnexport.pretrained import check as hf_check
    half = tmp_path / "half"
    transformers.AutoModelForCausalLM.from_pretrained(folders["llama"]).to(torch.bfloat16).save_pretrained(half)
    for name in os.listdir(folders["llama"]):
        if name.startswith("tokenizer"):
            shutil.copy(Path(folders["llama"]) / name, half / name)
    out = tmp_path / "out"
    out.mkdir()
    loads, works = [], []
    load, fits = hf_check.hf.load, hf_check.hf.check_fits

    def loading(source, seed=None, mapped_in=None):
        model, params = load(source, seed, mapped_in=mapped_in)
        loads.append((mapped_in, {_mapped_from(p.data_ptr()).rsplit("-", 1)[0] for p in model.parameters()}))
        return model, params

    monkeypatch.setattr(hf_check.hf, "load", loading)
    monkeypatch.setattr(hf_check.hf, "check_fits", lambda source, work: works.append(work) or fits(source, work))
    for precision in ("fp32", "int4"):
        path = out / f"{precision}.onnx"
        r = run("export", "--hf", half, "--kv-cache", "--precision", precision, "--external-data", "-o", path)
        assert r.exit_code == 0, r.output
        v = run("verify", path, "--hf", half, "--runtimes", "ort-cpu", "--new-tokens", "4")
        assert "Traceback" not in v.output and v.exit_code in (0, 1), v.output  # a random model's int4 answers may fail
    assert [m for m, _ in loads] == [out] * 4  # each export's load, then its verify's
    assert all(files == {str(out / ".attnexport-weights")} for _, files in loads), loads
    assert [w for w in works if w.startswith("verify")] == ["verify, mapped", "verify in one pass, mapped"]
    assert sorted(p.name for p in out.iterdir()) == ["fp32.onnx", "fp32.onnx_data", "int4.onnx", "int4.onnx_data"]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_check_before_writing_lets_the_models_weights_go_before_onnx_runtime_loads_the_graph(
        folders, tmp_path, monkeypatch, precision):
    """The float64 side of the check first, then the source model's weights let go (a quantized
    export's too), then ONNX Runtime's sessions: the model and the graph's weights are not held together."""
    loaded, sources, held_at_sessions = [], [], []
    load, prepare, matrices = hf.load, hf_export.R.prepare_onnx, hf_export.SourceMatrices

    def watched_load(*args, **kwargs):
        model, info = load(*args, **kwargs)
        loaded.append(model)
        return model, info

    def watched_matrices(*args, **kwargs):  # what the quantizer reads the float matrices through
        sources.append(matrices(*args, **kwargs))
        return sources[-1]

    def watched_prepare(*args, **kwargs):  # the model's parameters, and any tensor of them held elsewhere
        held = [p for p in loaded[0].parameters()] + [t for s in sources for t in s._state.values()]
        held_at_sessions.append(sum(t.numel() for t in held))
        return prepare(*args, **kwargs)
    monkeypatch.setattr(hf, "load", watched_load)
    monkeypatch.setattr(hf_export, "SourceMatrices", watched_matrices)
    monkeypatch.setattr(hf_export.R, "prepare_onnx", watched_prepare)
    hf_export.export(hf_export.HFExport(folders["llama"], form="concat", output=tmp_path / "m.onnx",
                                        precision=precision))
    assert held_at_sessions and set(held_at_sessions) == {0}
    assert len(sources) == (precision == "int4")


def test_external_data_in_a_deployment_folder_and_nothing_left_when_the_check_fails(folders, tmp_path):
    out = tmp_path / "deploy"
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--external-data", "--deploy", out)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model.onnx", "model.onnx_data"]
    session = ort.InferenceSession(str(out / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].name == "logits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy"]  # no staging left
    path = tmp_path / "lm.onnx"
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--external-data", "--rtol", "0", "--atol", "0",
            "-o", path)
    assert r.exit_code == 1 and "differs from the model in float64" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy"]


def test_one_file_above_protobufs_limit_is_refused_before_the_export(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_export, "PROTOBUF_LIMIT", 1000)
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--one-file", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and "--one-file" in r.output and "--external-data" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not list(tmp_path.iterdir())
    monkeypatch.setattr(hf_export, "EXTERNAL_FROM", 1000)  # the default from that size: beside the graph
    r = run("export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m.onnx_data").is_file()


def test_a_model_the_machine_cannot_hold_is_refused_before_it_loads(folders, tmp_path, monkeypatch):
    from attnexport import usage as U
    count = hf.parameter_count(folders["llama"])
    assert count == sum(p.numel() for p in hf.load(folders["llama"])[0].parameters())
    monkeypatch.setattr(U, "available", lambda: 1 << 20)  # a machine with 1 MiB to give
    monkeypatch.setattr(hf, "load", lambda *a, **k: pytest.fail("loaded"))
    r = run("export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "parameters" in r.output and "needs about" in r.output and "1.0 MiB available" in r.output
    assert not list(tmp_path.iterdir())


def test_the_memory_check_of_an_export_that_maps_the_weights_counts_only_what_the_process_holds(
        folders, tmp_path, monkeypatch):
    """With its weights beside the graph the export reads the model from files' mappings, whose
    pages the kernel can drop: the check before loading counts the process's own memory
    (`MEMORY_FACTORS["export, mapped"]`), so a machine that cannot hold the model twice exports it
    mapped and refuses the same export held in memory."""
    from attnexport import usage as U
    count = hf.parameter_count(folders["llama"])
    held, mapped = hf.MEMORY_FACTORS["export"], hf.MEMORY_FACTORS["export, mapped"]
    assert mapped < held
    monkeypatch.setattr(U, "available", lambda: int(hf.MEMORY_BASE + (held + mapped) / 2 * 4 * count))
    r = run("export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / "held.onnx")
    assert r.exit_code == 2 and "needs about" in r.output and not list(tmp_path.iterdir()), r.output
    r = run("export", "--hf", folders["llama"], "--kv-cache", "--external-data", "-o", tmp_path / "mapped.onnx")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mapped.onnx", "mapped.onnx_data"]


def test_a_forked_child_tokenizes_after_its_parent_used_the_tokenizers_pool():
    """The tokenizers library's thread pool, started by the parent's batch encoding, does not survive a
    fork: the child (a whole encoder's reference tokenizes its check sentences) encodes on its own
    thread, within seconds, and nothing is said of the fork."""
    pytest.importorskip("tokenizers")
    got = in_time("""
        from tokenizers import Tokenizer, models, pre_tokenizers
        from attnexport import aside as A
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.encode_batch(["a b a"] * 256)  # the parent's pool, started
        print(A.Aside(lambda: [e.ids for e in tok.encode_batch(["a b", "b c a"])], "tokens").result())
    """)
    assert got.strip() == "[[1, 2], [2, 0, 1]]", got


def test_a_stalled_forked_reference_is_computed_in_the_process_and_said(folders, tmp_path, monkeypatch):
    """Where the forked reference stops computing without ending (a lock its fork left held), the
    export ends it after STALL_SECONDS, computes the reference itself, checks as ever and says so."""
    import threading

    from attnexport import aside as A
    if not A.forks():
        pytest.skip("this platform does not fork")
    monkeypatch.setattr(A, "STALL_SECONDS", 1.0)
    parent, held, real = os.getpid(), threading.Lock(), hf_export.expectations
    held.acquire()

    def stuck_in_the_child(*args, **kwargs):
        if os.getpid() != parent:
            held.acquire()  # never released in the child
        return real(*args, **kwargs)
    monkeypatch.setattr(hf_export, "expectations", stuck_in_the_child)
    r = run("export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / "lm.onnx", "--json")
    assert r.exit_code == 0, r.output
    doc = _json(r)
    assert any("computed nothing for 1 s" in n and "computed in this process instead" in n for n in doc["notes"]), \
        doc["notes"]
    assert len(doc["checked"]) == 3 and all(0 < e["logits"]["max_abs"] <= e["logits"]["atol"] for e in doc["checked"])


def test_the_reference_computed_aside_or_beside_the_write_gives_the_same_check(folders, tmp_path, monkeypatch):
    """The check's float64 reference runs in a forked child from before the trace (`aside`), or, where
    the platform does not fork, on a thread while the weights are written: the same budgets and
    errors either way, each said as a phase of the export."""
    from attnexport import aside as A
    if not A.forks():
        pytest.skip("this platform does not fork")
    checked = {}
    for forks in (True, False):
        monkeypatch.setattr(A, "forks", lambda forks=forks: forks)
        r = run("export", "--hf", folders["llama"], "--kv-cache", "--external-data", "-o", tmp_path / f"{forks}.onnx",
                "--json")
        assert r.exit_code == 0, r.output
        doc = _json(r)
        phases = [p["name"] for p in doc["resources"]["phases"]]
        assert ("the float64 reference (forked)" in phases) == forks and ("reference" in phases) != forks, phases
        checked[forks] = [e["logits"] for e in doc["checked"]]
        assert all(0 < e["max_abs"] <= e["atol"] for e in checked[forks])
    for a, b in zip(checked[True], checked[False], strict=True):
        assert a["atol"] == pytest.approx(b["atol"], rel=1e-6) and a["max_abs"] == pytest.approx(b["max_abs"], rel=1e-3)


def test_a_language_models_program_is_not_traced_twice_and_its_graph_is_torchs(folders, tmp_path, monkeypatch):
    """A language model's traced program goes to torch.onnx as its decomposition would leave it
    (`attnexport.decomposed`: none of its ops needs one, so it is not traced again), and the graph
    is the one torch's decomposition gives, node for node."""
    from attnexport import decomposed
    taken: list = []
    fast = decomposed.as_decomposed
    monkeypatch.setattr(decomposed, "as_decomposed", lambda p, registry: taken.append(fast(p, registry)) or taken[-1])
    for name, retrace in (("fast", False), ("torchs", True)):
        if retrace:
            monkeypatch.setattr(decomposed, "as_decomposed", lambda p, registry: None)
        r = run("export", "--hf", folders["llama"], "--kv-cache", "-o", tmp_path / f"{name}.onnx")
        assert r.exit_code == 0, r.output
    assert taken and (decomposed.unsupported() is not None or all(p is not None for p in taken))
    graphs = [onnx.load(tmp_path / f"{name}.onnx") for name in ("fast", "torchs")]
    assert graph_difference(*graphs) is None, graph_difference(*graphs)
