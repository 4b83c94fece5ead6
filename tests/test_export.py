"""Every variant x flavour exports, passes onnx checks, and runs on ONNX Runtime's CPU provider at
shapes other than the export's, matching torch and the reference."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import cli, run_module

from attnexport import dtypes as D
from attnexport import export as E
from attnexport import seeding
from attnexport import variants as V
from attnexport.compare import compare, tolerance
from attnexport.errors import ExportError, UsageError

ort.set_default_logger_severity(3)

# Options that switch on the masks and other paths worth exporting, per variant.
RICH = {
    "sdpa": {"mask": "bool", "kv_heads": 2, "causal": True},
    "self": {"mask": "additive", "scaling": "length"},
    "mha": {"mask": "padding", "kv_heads": 2, "causal": True, "scaling": "norm"},
    "mha-tied": {"mask": "bool"},
    "cross": {"mask": "padding"},
    "encoder": {"mask": "padding"},
    "decoder": {"mask": "padding"},
    "kernel": {"learnable_bandwidth": True},
}
# Shapes other than the export's example shapes, length 1 included.
SHAPES = [{"batch": 3, "seq": 17, "kv_seq": 6, "heads": 4, "kv_heads": 2, "head_dim": 5, "v_head_dim": 3},
          {"batch": 1, "seq": 1, "kv_seq": 1, "heads": 2, "kv_heads": 1, "head_dim": 1, "v_head_dim": 2}]
COMBOS = [(v, f) for v in V.VARIANTS for f in E.FLAVORS]


def _at(variant, base, shape):
    """Options at another shape: symbolic sizes change, weight shapes do not."""
    sizes = {k: x for k, x in shape.items() if k in variant.dynamic}
    return variant.resolve({**base, **sizes})


@pytest.fixture(scope="module")
def exported():
    cache = {}

    def get(name, flavor, dtype="fp32", options=None):
        key = (name, flavor, dtype, None if options is None else tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = E.build_model(name, RICH.get(name, {}) if options is None else options, flavor,
                                       dtype=dtype)
        return cache[key]
    return get


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name, flavor", COMBOS)
def test_fp32_matches_torch_and_reference_at_other_shapes(exported, name, flavor):
    model, result = exported(name, flavor)
    variant = V.get(name)
    sess = _session(model)
    params = seeding.init_params(variant, result.options, 0)  # build_model's default seed
    for shape in SHAPES:
        o = _at(variant, RICH.get(name, {}), shape)
        inputs = seeding.make_inputs(variant, o, 11)
        if "attn_mask" in inputs:
            inputs["attn_mask"][0, 0, 0, :] = False  # a fully masked row in every run
        got = dict(zip([s.name for s in variant.outputs(o)], sess.run(None, inputs), strict=True))
        want_ref = variant.reference(params, inputs, o)
        want_torch = run_module(variant, o, params, inputs, torch.float32)
        for out in want_ref:
            c_ref = compare(out, got[out], want_ref[out], tolerance("fp32"))
            c_torch = compare(out, got[out], want_torch[out], tolerance("fp32"))
            assert c_ref and c_torch, f"{name}/{flavor} at {shape}: vs reference {c_ref}; vs torch {c_torch}"


STATIC_SCALES = [("sdpa", {"scale": 0.3}), ("mha", {"scaling": "cosine", "temperature": 0.05})]


@pytest.mark.parametrize("flavor", E.FLAVORS)
@pytest.mark.parametrize("name, options", STATIC_SCALES)
def test_a_static_scale_reaches_the_graph(exported, name, options, flavor):
    """A scale known at export (sdpa's --scale, 1/sqrt(head size) of a fixed head count, cosine's
    1/temperature) is in every flavour's graph: dropping it changes the outputs."""
    model, result = exported(name, flavor, options=options)
    variant = V.get(name)
    o = result.options
    params, inputs = seeding.init_params(variant, o, 0), seeding.make_inputs(variant, o, 3)
    got = dict(zip([s.name for s in variant.outputs(o)], _session(model).run(None, inputs), strict=True))
    want = variant.reference(params, inputs, o)
    for out in want:
        assert compare(out, got[out], want[out], tolerance("fp32")), (name, options, flavor, out)


@pytest.mark.parametrize("name, flavor", COMBOS)
def test_fp16_runs_on_cpu_provider(exported, name, flavor):
    model, result = exported(name, flavor, "fp16")
    variant = V.get(name)
    o = result.options
    feed = D.cast_floats(seeding.make_inputs(variant, o, 5), "fp16")
    expected = variant.reference(seeding.init_params(variant, o, 0), seeding.make_inputs(variant, o, 5), o)
    got = _session(model).run(None, feed)
    for spec, g in zip(variant.outputs(o), got, strict=True):
        assert g.dtype == np.float16
        c = compare(spec.name, g, expected[spec.name], tolerance("fp16"))
        assert c, f"{name}/{flavor} fp16: {c}"


VARIANT_METADATA = ("variant", "options", "flavor", "graph_flavor", "opset", "dtype", "seed", "params_source",
                    "params", "params_sha256", "golden_manifest_sha256", "version", "torch_version", "signature")


@pytest.mark.parametrize("name, flavor", COMBOS)
def test_model_hygiene(exported, name, flavor):
    model, result = exported(name, flavor)
    variant = V.get(name)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    assert model.ir_version == onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["attnexport.variant"] == name and meta["attnexport.flavor"] == flavor
    assert json.loads(meta["attnexport.options"]) == result.options
    # The metadata a deployment app or `verify` reads: exactly these keys, none dropped or added.
    assert set(meta) == {f"attnexport.{k}" for k in VARIANT_METADATA}
    for key in ("opset", "version", "torch_version", "golden_manifest_sha256", "dtype"):
        assert meta[f"attnexport.{key}"]
    assert meta["attnexport.params_source"] == "seed" and meta["attnexport.seed"] == "0"
    ex = E.example_sizes(variant, result.options)
    assert [i.name for i in model.graph.input] == [s.name for s in variant.inputs(ex)]
    assert [o.name for o in model.graph.output] == [s.name for s in variant.outputs(ex)]
    for vi, spec in zip(model.graph.input, variant.inputs(ex), strict=True):
        dims = vi.type.tensor_type.shape.dim
        for d, sym in zip(dims, spec.dims, strict=True):
            if sym in variant.dynamic:
                assert d.dim_param, f"{vi.name}: {sym} should be symbolic"
            else:
                assert d.dim_value == spec.shape(ex)[list(spec.dims).index(sym)]
    op = result.attention_op
    if variant.dot_product_core:
        assert op == {"primitives": "MatMul+Softmax", "attention": "Attention",
                      "ort": "com.microsoft.MultiHeadAttention"}[flavor]
    else:
        assert op in ("MatMul+Softmax", "none") and result.graph_flavor == "primitives"
        assert (flavor == "primitives") or "no dot-product core" in result.note


def test_primitives_opset_17():
    model, result = E.build_model("mha", {"mask": "padding"}, "primitives", opset=17)
    assert {o.domain: o.version for o in model.opset_import}[""] == 17
    assert model.ir_version == 8


def test_reexport_gives_the_same_bytes():
    a = E.build_model("mha", {"causal": True}, "ort", use_cache=False)[0]
    b = E.build_model("mha", {"causal": True}, "ort", use_cache=False)[0]
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def test_export_cache_returns_what_a_fresh_export_writes(tmp_path, monkeypatch):
    from attnexport import memo
    monkeypatch.setenv("ATTNEXPORT_CACHE", str(tmp_path / "cache"))
    fresh = E.build_model("posenc", {}, "primitives", use_cache=False)[0].SerializeToString(deterministic=True)
    first = E.build_model("posenc", {}, "primitives")[0]  # a miss: exports and stores
    entries = sorted((tmp_path / "cache").glob("*.onnx"))
    assert len(entries) == 1 and entries[0].read_bytes() == fresh
    hit, result = E.build_model("posenc", {}, "primitives")
    assert hit.SerializeToString(deterministic=True) == fresh == first.SerializeToString(deterministic=True)
    assert result.attention_op == "none"
    # Other parameters, dtype or options are another key; a damaged entry is a miss, then replaced.
    E.build_model("posenc", {"dim": 16}, "primitives")
    assert len(list((tmp_path / "cache").glob("*.onnx"))) == 2
    entries[0].write_bytes(b"damaged")
    assert memo.get(entries[0].stem) is None
    assert E.build_model("posenc", {}, "primitives")[0].SerializeToString(deterministic=True) == fresh
    monkeypatch.setenv("ATTNEXPORT_CACHE", "off")
    assert memo.directory() is None


def test_failed_export_leaves_nothing(tmp_path):
    target = tmp_path / "sdpa.onnx"
    with pytest.raises(ExportError, match="cannot express --softcap"):
        E.export("sdpa", {"softcap": 2.0}, "ort", output=target)
    assert not target.exists()
    assert not any(tmp_path.rglob("*.tmp"))


def test_flavor_whose_op_is_missing_fails(monkeypatch):
    from attnexport import onnx_attention as OA
    monkeypatch.setitem(OA.TRANSLATIONS, "ort", OA.TRANSLATIONS["primitives"])  # ort's table makes no fused op
    with pytest.raises(ExportError, match="should use com.microsoft"):
        E.build_model("mha", {}, "ort", use_cache=False)  # the patched code must really run


@pytest.mark.parametrize("kwargs, message", [
    ({"variant": "nope"}, "unknown variant 'nope'"),
    ({"variant": "mha", "options": {"heads": 7}}, "must divide --dim"),
    ({"variant": "posenc", "options": {"heads": 2}}, "--heads is not an option"),
    ({"variant": "mha", "flavor": "fast"}, "unknown flavor"),
    ({"variant": "mha", "flavor": "attention", "opset": 18}, "--opset 18 is not available"),
    ({"variant": "mha", "dtype": "int8"}, "unknown dtype"),
])
def test_bad_arguments(kwargs, message, tmp_path):
    with pytest.raises(UsageError, match=message):
        E.export(E.ExportRequest(output=tmp_path / "x.onnx", **kwargs))


def _readme_python(heading: str, page: str = "README.md") -> str:
    """The first Python block of `page` (the README, or a page under docs/) after `heading`."""
    text = (Path(__file__).parent.parent / page).read_text()
    section = text.split(heading, 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def _run_without_attnexport(code: str, cwd) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter that cannot import attnexport, as a deployment app would."""
    guard = "import sys\nsys.modules['attnexport'] = None  # the app must not need attnexport\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", guard + code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_readme_deployment_snippet_runs_with_onnxruntime_alone(tmp_path):
    """Exports models/mha.onnx as the README says, then runs the README's snippet in a fresh
    interpreter that cannot import attnexport."""

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = cli("export", "--variant", "mha")
    finally:
        os.chdir(cwd)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "models" / "mha.onnx").exists()
    proc = _run_without_attnexport(_readme_python("## Deploying an exported model"), tmp_path)
    assert "(3, 17, 64)" in proc.stdout


def test_readme_decode_loop_runs_alone_and_equals_the_full_forward(tmp_path, monkeypatch):
    """The README's generation loop (prefill 5, decode 20) in a fresh interpreter without
    attnexport; its outputs are those of the full causal forward over the same inputs."""

    monkeypatch.chdir(tmp_path)  # the README's commands, from a folder without models/
    r = cli("export", "--variant", "mha", "--kv-cache", "--causal", "-o",
            "models/mha-step.onnx")
    assert r.exit_code == 0, r.output
    proc = _run_without_attnexport(_readme_python("## Generating with a key/value cache", "docs/caches.md"), tmp_path)
    assert "the cache holds 25 positions" in proc.stdout
    x = np.load(tmp_path / "decoded_inputs.npy")
    got = np.load(tmp_path / "decoded_outputs.npy")
    variant = V.get("mha")
    full = variant.resolve({"causal": True, "batch": 1, "seq": 25})
    want = variant.reference(seeding.init_params(variant, variant.resolve({"kv_cache": True, "causal": True}), 0),
                             {"x": x}, full)["output"]
    c = compare("output", got, want, tolerance("fp32"))
    assert c, str(c)


@pytest.mark.parametrize("flavor", ["ort", "attention"])
def test_readme_static_cache_loop_runs_in_place_and_equals_the_full_forward(tmp_path, monkeypatch, flavor):
    """The README's static-cache loop (two sequences, prompts of 5 and 3, 20 steps) in a fresh
    interpreter without attnexport, on the flavour it recommends (ort: GroupQueryAttention) and on
    the standard one: its buffers never move, ONNX Runtime logs no copy of them, and each
    sequence's outputs are the full causal forward's over its own positions."""

    monkeypatch.chdir(tmp_path)
    assert "--flavor ort -o models/mha-static.onnx" in (Path(__file__).parent.parent / "docs/caches.md").read_text()
    r = cli("export", "--variant", "mha", "--kv-cache", "static", "--max-seq", "64",
            "--causal", "--flavor", flavor, "-o", "models/mha-static.onnx")
    assert r.exit_code == 0, r.output
    proc = _run_without_attnexport(_readme_python("## A static cache, written in place", "docs/caches.md"), tmp_path)
    assert "written in place: the buffers never moved; sequences hold [25 23] positions" in proc.stdout
    assert "in-place optimization not activated" not in proc.stderr, proc.stderr
    tokens, got = np.load(tmp_path / "static_tokens.npy"), np.load(tmp_path / "static_outputs.npy")
    variant = V.get("mha")
    params = seeding.init_params(variant, variant.resolve({"kv_cache": True, "max_seq": 64, "causal": True}), 0)
    for b, length in enumerate((25, 23)):
        full = variant.resolve({"causal": True, "batch": 1, "seq": length})
        want = variant.reference(params, {"x": tokens[b:b + 1, :length]}, full)["output"]
        c = compare("output", got[b:b + 1, :length], want, tolerance("fp32"))
        assert c, str(c)


def test_readme_decoder_loop_runs_alone_and_equals_the_full_forward(tmp_path, monkeypatch):
    """The README's decoder loop (memory once, prefill 5, decode 20) without attnexport; its outputs
    are the decoder's full forward over the same inputs and memory."""

    monkeypatch.chdir(tmp_path)  # the README's commands, from a folder without models/
    r = cli("export", "--variant", "decoder", "--kv-cache", "-o",
            "models/decoder-step.onnx")
    assert r.exit_code == 0, r.output
    proc = _run_without_attnexport(_readme_python("## A decoder step", "docs/caches.md"), tmp_path)
    assert "the caches hold 25 and 12 positions" in proc.stdout
    x, got = np.load(tmp_path / "decoder_inputs.npy"), np.load(tmp_path / "decoder_outputs.npy")
    memory = np.random.default_rng(0).standard_normal((1, 12, 64)).astype(np.float32)
    variant = V.get("decoder")
    full = variant.resolve({"batch": 1, "seq": 25, "kv_seq": 12})
    want = variant.reference(seeding.init_params(variant, variant.resolve({"kv_cache": True}), 0),
                             {"x": x, "memory": memory}, full)["output"]
    c = compare("output", got, want, tolerance("fp32"))
    assert c, str(c)


@pytest.mark.parametrize("case", ["sdpa-mask-per-head", "sdpa-mask-rank3-float"])
@pytest.mark.parametrize("flavor", E.FLAVORS)
def test_one_sdpa_model_takes_every_broadcastable_mask(case, flavor):
    """The mask's batch and head axes are 1 or full in the same model: (1|B, 1|Hq, Tq, Tk)."""
    from attnexport import golden
    from attnexport import reference as ref
    from attnexport import runtimes as R
    v = V.get("sdpa")
    o = golden.load(case).options
    model = E.build_model("sdpa", o, flavor, params={})[0]
    mask = next(i for i in model.graph.input if i.name == "attn_mask")
    names = [d.dim_param for d in mask.type.tensor_type.shape.dim]
    assert names == ["mask_batch", "mask_heads", "seq", "kv_seq"][4 - o["mask_rank"]:]
    tol = tolerance("fp32")
    prepared = {rt: R.prepare_onnx(rt, model) for rt in ("ort-cpu", "onnx-ref")}
    batch = 3  # not the export's: the sizes stay symbolic
    for mb in (1, batch) if o["mask_rank"] == 4 else (1,):
        for mh in (1, o["heads"]):
            oo = dict(o, batch=batch, seq=4, mask_batch=mb, mask_heads=mh)
            feed = seeding.make_inputs(v, oo, 7)
            assert feed["attn_mask"].shape[:-2] == ((mb, mh) if o["mask_rank"] == 4 else (mh,))
            want = ref.ref_sdpa({}, feed, oo)["output"]
            for rt, p in prepared.items():
                c = compare("output", p.run(feed)["output"], want, tol)
                assert c.passed, (mb, mh, rt, c.to_dict())


def test_torchs_exporter_is_patched_only_while_attnexport_exports():
    """attnexport speeds torch's exporter up with caches of its own, in place only during its
    trace and export: afterwards a user's torch.export and torch.onnx run torch as it came."""
    patches = E.torch_patches()
    assert patches  # at least one found its target in this torch (all five in torch 2.13)

    def current():  # the patched attributes, and Python's collection thresholds
        return [vars(owner).get(attr) for owner, attr, _ in patches] + [gc.get_threshold()]
    before = current()
    E.build_model("mha", {}, "primitives", use_cache=False)
    assert current() == before
    with E.torch_sped_up():
        during = current()
        with E.torch_sped_up():  # nested, as a trace inside an export
            pass
        assert current() == during
    assert during[:-1] == [replacement for _, _, replacement in patches] and current() == before
    assert during[-1][2] >= E._FULL_COLLECTIONS_EVERY  # full collections rarer only meanwhile


def test_the_rewriters_shortcut_for_rules_of_several_outputs_rewrites_what_it_did():
    """export.torch_patches fails a rule of several output nodes at once at a node of another op than
    its first output node's (onnxscript lists the whole graph there first). Its one such rule, two
    Slices of an input's halves made one Split, fires where the second half's Slice comes first in
    the graph; with and without the shortcut the rewriter makes the same graph."""
    import contextlib

    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper
    from onnxscript import rewriter

    nodes = [helper.make_node("Slice", ["x", "four", "eight", "last"], ["b"]),
             helper.make_node("Slice", ["x", "zero", "four", "last"], ["a"]),
             helper.make_node("Sub", ["a", "b"], ["d"]), helper.make_node("Relu", ["d"], ["y"])]
    inits = [numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("zero", 0), ("four", 4), ("eight", 8), ("last", -1))]
    graph = helper.make_graph(nodes, "halves", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    def rewritten(context):
        model = ir.from_proto(proto)
        with context:
            rewriter.rewrite(model)
        return ir.to_proto(model)
    shortcut, listed = rewritten(E.torch_sped_up()), rewritten(contextlib.nullcontext())
    assert [n.op_type for n in shortcut.graph.node] == ["Split", "Sub", "Relu"]
    assert shortcut.SerializeToString() == listed.SerializeToString()
