"""The key/value cache: step exports, the decode-equals-forward property, and what cannot be cached."""

import json

import numpy as np
import pytest
from conftest import cli as run

from attnexport import export as E
from attnexport import runtimes as R
from attnexport import seeding
from attnexport import signature as SG
from attnexport import variants as V
from attnexport import verify as VF
from attnexport.compare import compare, tolerance
from attnexport.decode import decode, empty_cache, stream_axis


@pytest.fixture(scope="module")
def step_model():
    variant = V.get("mha")
    o = variant.resolve({"kv_cache": True, "causal": True, "kv_heads": 2})
    params = seeding.init_params(variant, o, 0)
    return variant, o, params, E.build_model("mha", o, "attention", params=params)[0]


def _empty(variant, o, batch):
    """The step's empty caches and its signature (which pairs each cache input with its output)."""
    signature = V.step_signature(variant, o)
    return empty_cache(variant, {**o, "batch": batch}, np.float32, signature)


def _full_forward(variant, o, params, x):
    full = variant.resolve({**o, "kv_cache": False, "seq": x.shape[1], "batch": x.shape[0]})
    return variant.reference(params, {"x": x}, full)["output"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_decoding_in_chunks_equals_the_full_forward(step_model, chunk):
    variant, o, params, model = step_model
    x = np.random.default_rng(3).standard_normal((2, 7, o["dim"])).astype(np.float32)
    session = R.prepare_onnx("ort-cpu", model)
    got = decode(session.run, {"x": x}, chunk, _empty(variant, o, 2), axis=1,
                 layout=V.step_signature(variant, o))
    c = compare("output", got, _full_forward(variant, o, params, x), tolerance("fp32"))
    assert c, str(c)


def test_a_step_that_forgets_its_cache_is_caught(step_model):
    variant, o, params, model = step_model
    x = np.random.default_rng(3).standard_normal((1, 5, o["dim"])).astype(np.float32)
    session = R.prepare_onnx("ort-cpu", model)

    def forgetful(feed):
        return session.run({**feed, "past_key": feed["past_key"][:, :, :0], "past_value": feed["past_value"][:, :, :0]})
    with pytest.raises(ValueError, match="present_key has 1 positions"):
        decode(forgetful, {"x": x}, 1, _empty(variant, o, 1), axis=1, layout=V.step_signature(variant, o))


def test_a_non_causal_step_fails_the_property(step_model):
    variant, o, params, _ = step_model
    loose = variant.resolve({**o, "causal": False})
    model = E.build_model("mha", loose, "primitives", params=params)[0]
    x = np.random.default_rng(4).standard_normal((1, 6, o["dim"])).astype(np.float32)
    got = decode(R.prepare_onnx("ort-cpu", model).run, {"x": x}, 3, _empty(variant, o, 1),
                 axis=stream_axis(variant, o), layout=V.step_signature(variant, o))
    assert not compare("output", got, _full_forward(variant, o, params, x), tolerance("fp32"))


def test_step_exports_have_the_cache_interface(step_model):
    *_, model = step_model
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.output}
    assert dims["past_key"] == ["batch", 2, "past_seq", 16]  # GQA: 2 key/value heads for 4 query heads
    assert outs["present_value"][:2] == ["batch", 2] and "past_seq" in outs["present_value"][2]
    listing = json.loads(run("list", "--json").output)
    mha = next(v for v in listing if v["name"] == "mha")
    names = {i["name"] for i in mha["inputs"]} | {o["name"] for o in mha["outputs"]}
    assert {"past_key", "past_value", "present_key", "present_value"} <= names


def test_ort_flavor_decodes_a_grouped_query_cache(step_model):
    """com.microsoft.MultiHeadAttention wants as many key/value heads as query heads: the cache is
    widened for the step and the present narrowed back, so the model's cache stays grouped."""
    variant, o, params, _ = step_model
    model = E.build_model("mha", o, "ort", params=params)[0]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.output}
    assert dims["present_key"][1] == 2
    x = np.random.default_rng(5).standard_normal((2, 7, o["dim"])).astype(np.float32)
    session = R.prepare_onnx("ort-cpu", model)
    for chunk in (1, 3):
        got = decode(session.run, {"x": x}, chunk, _empty(variant, o, 2), axis=1, layout=V.step_signature(variant, o))
        c = compare("output", got, _full_forward(variant, o, params, x), tolerance("fp32"))
        assert c, str(c)


def test_verify_a_step_model_file_checks_the_property(tmp_path):
    path = tmp_path / "step.onnx"
    assert run("export", "--variant", "mha", "--kv-cache", "--causal", "--flavor", "ort", "-o", path).exit_code == 0
    report = VF.verify(models=[path], runtimes=["torch", "onnx-ref", "ort-cpu"])
    assert report.ok, "\n".join(r.describe() for r in report.failures)
    assert {"mha-kv-cache/decode-1", "mha-kv-cache/decode-3"} <= {r.case for r in report.rows}


@pytest.mark.parametrize("args, code, text", [
    (["--mask", "padding"], 2, "--kv-cache takes no --mask"),
    (["--weights"], 2, "--kv-cache takes no --weights"),
    (["--scaling", "norm"], 2, "depends on all keys at once"),
    (["--past-seq", "-1"], 2, "'--past-seq': -1 is not in the range x>=0"),
])
def test_what_a_cache_cannot_do_is_said(tmp_path, args, code, text):
    r = run("export", "--variant", "mha", "--kv-cache", "--causal", *args, "-o", tmp_path / "x.onnx")
    assert r.exit_code == code and text in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x.onnx").exists()


def test_a_modules_own_cache_exports_symbolic_and_verify_checks_decoding(tmp_path):
    """examples/kv_cache_module.py takes its cache as tensors and returns it updated: with --cache
    the positions axis is symbolic (empty caches checked at export), and verify --module runs it a
    token at a time and in chunks against the module's full forward. The same step with torch's
    top-left is_causal (the classic cache bug) fails that check, on torch itself as on the export."""
    import json

    import onnx

    cache = ["--cache", "past_key:present_key", "--cache", "past_value:present_value"]
    for name, ok in (("example", True), ("topleft_example", False)):
        spec, path = f"examples/kv_cache_module.py:{name}", tmp_path / f"{name}.onnx"
        r = run("export", "--module", spec, *cache, "-o", str(path), "--json")
        assert r.exit_code == 0, r.output
        empty = {"past_key": [2, 4, 0, 16], "past_value": [2, 4, 0, 16], "x": [2, 5, 64]}
        assert empty in json.loads(r.output)["checked"]
        model = onnx.load(path)
        dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert dims["past_key"] == ["batch", 4, "past_len", 16]
        signature = SG.of(model)
        assert signature.cache() == {"past_key": {"output": "present_key", "axis": 2},
                                     "past_value": {"output": "present_value", "axis": 2}}
        assert {c.kind for c in signature.caches} == {"concat"} and signature.write_pos is None
        r = run("verify", str(path), "--module", spec, "--runtimes", "torch,ort-cpu", "--json")
        rows = json.loads(r.output)["results"]
        decode_rows = [row for row in rows if row["case"].startswith("decode")]
        assert len(decode_rows) == 4 and all(len(row["outputs"]) == 3 for row in decode_rows)
        assert all(row["passed"] == ok for row in decode_rows), r.output
        assert (r.exit_code == 0) == ok
        assert all(row["passed"] for row in rows if not row["case"].startswith("decode"))


def test_a_bad_cache_is_one_line_and_exit_2(tmp_path):
    spec = "examples/kv_cache_module.py:example"
    for cache, text in (("past_key", "--cache takes INPUT:OUTPUT"), ("past:present_key", "not an input"),
                        ("past_key:cache", "is not an output")):
        out = tmp_path / "m.onnx"
        r = run("export", "--module", spec, "--cache", cache, "-o", str(out))
        assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not out.exists()


STATIC = ["--cache", "key_cache:key_cache_out", "--cache", "value_cache:value_cache_out"]


@pytest.mark.parametrize("name, write_pos, flavor, ok", [
    ("example", "write_pos", "primitives", True),
    ("example", "write_pos", "attention", True),
    ("example", "write_pos", "ort", True),
    ("positions_example", "cache_position", "attention", True),
    ("unmasked_example", "write_pos", "attention", False),
])
def test_a_modules_static_cache_keeps_its_buffers_and_verify_decodes_sequences_apart(tmp_path, name, write_pos,
                                                                                     flavor, ok):
    """examples/static_cache_module.py writes its block into buffers of 16 positions: with --cache
    and --write-pos the buffers keep their size (only the batch is symbolic), the write position
    follows the batch (each sequence's) or the block (its positions), the export is checked at
    other sizes with positions where the block fits, and verify --module decodes two sequences
    from different positions (the per-sequence form) out of buffers full of noise against the
    module's full forward. The step that attends the whole buffer fails that check on torch
    itself as on the export; the shape checks cannot see it."""
    import json

    import onnx
    spec, path = f"examples/static_cache_module.py:{name}", tmp_path / f"{name}.onnx"
    r = run("export", "--module", spec, *STATIC, "--write-pos", write_pos, "--flavor", flavor, "-o", path, "--json")
    assert r.exit_code == 0, r.output
    checked = json.loads(r.output)["checked"]
    assert {tuple(c["key_cache"]) for c in checked} == {(1, 4, 16, 16), (5, 4, 16, 16)}
    model = onnx.load(path)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["key_cache"] == ["batch", 4, 16, 16]
    form = "positions" if write_pos == "cache_position" else "start"
    assert dims[write_pos] == ["x_len" if form == "positions" else "batch"]
    signature = SG.of(model)
    assert (signature.write_pos.name, signature.write_pos.form) == (write_pos, form)
    assert signature.cache()["key_cache"] == {"output": "key_cache_out", "axis": 2}
    assert {c.kind for c in signature.caches} == {"static"}
    r = run("verify", str(path), "--module", spec, "--runtimes", "torch,ort-cpu", "--json")
    report = json.loads(r.output)
    rows = report["results"]
    decode_rows = [row for row in rows if row["case"].startswith("decode")]
    assert len(decode_rows) == 4 and all(len(row["outputs"]) == 3 for row in decode_rows)
    assert all(row["passed"] == ok for row in decode_rows), r.output
    assert (r.exit_code == 0) == ok
    assert all(row["passed"] for row in rows if not row["case"].startswith("decode"))
    if form == "start":  # two sequences, each as far as it ran from its own prompt
        assert "(8, 7 positions)" in decode_rows[0]["expected"]


def test_verify_takes_a_static_cache_the_model_does_not_record(tmp_path):
    """A step exported without attnexport's cache metadata (another exporter's) is decoded when
    verify is told its buffers and write position; the form is read from the graph's axes."""
    import json

    import onnx
    spec, path = "examples/static_cache_module.py:example", tmp_path / "m.onnx"
    r = run("export", "--module", spec, *STATIC, "--write-pos", "write_pos", "-o", str(path))
    assert r.exit_code == 0, r.output
    model = onnx.load(path)
    kept = [p for p in model.metadata_props if p.key != SG.META]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    plain = tmp_path / "plain.onnx"
    onnx.save(model, plain)
    args = ["verify", str(plain), "--module", spec, "--runtimes", "ort-cpu", "--json"]
    r = run(*args)
    assert not [row for row in json.loads(r.output)["results"] if row["case"].startswith("decode")]
    r = run(*args, *STATIC, "--write-pos", "write_pos")
    decode_rows = [row for row in json.loads(r.output)["results"] if row["case"].startswith("decode")]
    assert r.exit_code == 0 and len(decode_rows) == 2 and all(row["passed"] for row in decode_rows), r.output
    r = run(*args, "--write-pos", "write_pos")
    assert r.exit_code == 2 and "give its buffers with --cache" in r.output, r.output


@pytest.mark.parametrize("args, text", [
    (["--write-pos", "write_pos"], "name its buffers with --cache"),
    ([*STATIC, "--write-pos", "slot"], "--write-pos slot: not an input"),
    ([*STATIC, "--write-pos", "x"], "an integer input of rank 0 or 1"),
    ([*STATIC, "--write-pos", "key_cache"], "a buffer of the cache cannot be its write position"),
    ([*STATIC, "--write-pos", "write_pos", "--dynamic", "x:0=batch", "--dynamic", "x:1=seq", "--dynamic",
      "key_cache:2=slots", "--dynamic", "value_cache:2=slots", "--dynamic", "write_pos:0=batch"],
     "a static cache's buffers keep their size"),
])
def test_a_bad_static_cache_is_one_line_and_exit_2(tmp_path, args, text):
    out = tmp_path / "m.onnx"
    r = run("export", "--module", "examples/static_cache_module.py:example", *args, "-o", out)
    assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_a_write_position_told_apart_by_its_size_or_refused():
    """The write position's axis follows the batch or the block, told apart by the example's sizes;
    where they are equal the export asks for different sizes (or --dynamic)."""
    import sys

    import torch

    from attnexport.errors import UsageError
    from attnexport.export import ModuleExport, export_module
    sys.path.insert(0, "examples")
    try:
        import static_cache_module as S
    finally:
        sys.path.remove("examples")
    request = ModuleExport(cache={"key_cache": "key_cache_out", "value_cache": "value_cache_out"},
                           write_pos="cache_position")
    module, (x, k, v, _) = S.positions_example()
    with pytest.raises(UsageError, match="neither one per sequence"):  # batch 2, block 2, 2 positions
        export_module(module, (x[:, :2], k, v, torch.arange(2)), request)
    # One token: torch.export fixes a length of 1, and the position (1,) is one for all sequences.
    shared = export_module(module, (x[:, :1], k, v, torch.tensor([4])), request)
    assert SG.of(shared.model).write_pos == SG.WritePos("cache_position", "shared", (1,), "int64")
    assert shared.dynamic == {n: {0: "batch"} for n in ("x", "key_cache", "value_cache")}


@pytest.mark.parametrize("args, text", [
    (["--kv-cache", "static"], "--kv-cache static needs --max-seq S"),
    (["--kv-cache", "--max-seq", "8"], "give --kv-cache static"),
    (["--max-seq", "8"], "it goes with --kv-cache static"),
    (["--kv-cache", "static", "--max-seq", "8", "--past-seq", "6", "--seq", "3"], "do not fit a static cache"),
    (["--kv-cache", "static", "--max-seq", "32", "--opset", "23"], "--kv-cache static needs opset 24"),
])
def test_bad_static_cache_options_are_one_line_and_exit_2(tmp_path, args, text):
    out = tmp_path / "m.onnx"
    r = run("export", "--variant", "mha", "--causal", *args, "-o", str(out))
    assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_the_static_cache_check_fails_a_step_that_ignores_the_write_position():
    """The static decode's check is not vacuous: a step that always writes at position 0 (and attends
    as if nothing were cached past the block) differs from the full forward."""
    from attnexport import reference as ref_mod
    from attnexport.decode import decode_static_all, static_prompts, static_reach
    variant = V.get("mha")
    o = variant.resolve({"kv_cache": True, "max_seq": 12, "causal": True, "batch": 2, "dim": 32, "heads": 4, "seq": 3})
    params = seeding.init_params(variant, o, 0)
    x = np.random.default_rng(1).standard_normal((2, 7, 32)).astype(np.float32)
    buffers = {n: np.random.default_rng(2).standard_normal((2, 4, 12, 8)).astype(np.float32)
               for n in ("key_cache", "value_cache")}
    signature = V.step_signature(variant, o)
    full = variant.reference(params, {"x": x}, variant.resolve({"causal": True, "batch": 2, "seq": 7, "dim": 32,
                                                                "heads": 4}))["output"]
    prompts = static_prompts(2)
    reached = static_reach(prompts, 7)
    full[np.arange(7)[None, :] >= reached[:, None]] = 0.0

    def step(feed, forget=False):
        feed = {**feed, "write_pos": np.zeros_like(feed["write_pos"])} if forget else feed
        return ref_mod.ref_mha(params, feed, o)

    for forget, ok in ((False, True), (True, False)):
        got = decode_static_all(lambda f, forget=forget: step(f, forget), {"x": x}, 1, prompts, 1, buffers,
                                layout=signature)[0]["output"]
        assert np.allclose(got, full, atol=1e-5) == ok


@pytest.mark.parametrize("args, text", [
    (["--layout", "bsd"], "--kv-cache static takes no --layout bsd"),
    (["--mask", "bool"], "--kv-cache static takes no --mask"),
    (["--past-seq", "10", "--kv-seq", "4", "--seq", "4"], "do not fit a static cache of --max-seq 12"),
])
def test_what_sdpas_static_cache_cannot_take_is_said(tmp_path, args, text):
    out = tmp_path / "m.onnx"
    r = run("export", "--variant", "sdpa", "--kv-cache", "static", "--max-seq", "12", *args, "-o", out)
    assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()
