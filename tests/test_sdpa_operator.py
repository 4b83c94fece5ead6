"""sdpa as the whole ONNX Attention operator, the decoder's cache, and where ONNX Runtime's own
kernel departs from the operator (each departure pinned, with what attnexport does about it)."""

import numpy as np
import onnx
import pytest
from conftest import cli as run
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from attnexport import bench as B
from attnexport import export as E
from attnexport import runtimes as R
from attnexport import seeding
from attnexport import variants as V
from attnexport.compare import compare, tolerance
from attnexport.errors import UnsupportedByFlavor

# Option combinations of the operator, each exported in every flavour that can express it and run
# at other shapes than the export's (the golden cases and onnx's own cases run theirs at one: a
# bsd cache with a rank-2 mask is `sdpa-kv-cache-bsd-mask`, decoded from an empty cache; valid key
# counts with causal are `sdpa-nonpad-causal` and six of onnx's cases).
COMBOS = [
    {"layout": "bsd", "kv_heads": 2, "causal": True, "mask": "bool", "mask_heads": 8, "weights": "softmax"},
    {"kv_cache": True, "causal": True, "mask": "bool", "mask_rank": 3, "mask_heads": 8, "softcap": 1.5,
     "weights": "bias", "kv_heads": 2},
    {"nonpad": True, "layout": "bsd", "mask": "bool", "softcap": 2.0, "weights": "softcap"},
    {"softmax_precision": "float", "causal": True, "mask": "float", "seq": 9, "kv_seq": 5},
]
# Other shapes than the export's: length 1 with an empty cache, and larger ones.
SHAPES = ({}, {"batch": 1, "seq": 1, "kv_seq": 1, "past_seq": 0}, {"batch": 3, "seq": 5, "kv_seq": 7, "past_seq": 2})
# What only the ort flavour cannot express, and says so.
ORT_CANNOT = ("--softcap", "--softmax-precision")


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_every_option_combination_matches_the_reference_at_other_shapes(combo):
    variant = V.get("sdpa")
    o = variant.resolve(combo)
    params = seeding.init_params(variant, o, 0)
    exported = 0
    for flavor in E.FLAVORS:
        try:
            model, _ = E.build_model("sdpa", o, flavor, params=params)
        except UnsupportedByFlavor as e:
            assert flavor == "ort" and any(w in str(e) for w in ORT_CANNOT), str(e)
            continue
        exported += 1
        if combo.get("nonpad") and flavor == "attention":
            assert {(i.domain, i.version) for i in model.opset_import} >= {("", 24)}
        declared = [s.name for s in variant.outputs(o)]
        assert [i.name for i in model.graph.output] == declared
        for sizes in SHAPES:
            at = variant.resolve({**combo, **sizes})
            inputs = seeding.make_inputs(variant, at, 1)
            expected = variant.reference(params, inputs, at)
            for rt in ("ort-cpu", "onnx-ref"):
                got = R.prepare_onnx(rt, model).run(inputs)
                assert set(got) == set(expected) == set(declared)
                for name in declared:
                    c = compare(name, got[name], expected[name], tolerance("fp32"))
                    assert c, f"{flavor} {rt} {sizes}: {c}"
    assert exported >= 2


def _attention_node_model(attrs, opset=23):
    """One standard Attention node whose fourth output is the score output (for the pins)."""
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y", "", "", "w"], **attrs)
    f, b = TensorProto.FLOAT, TensorProto.BOOL
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, f, None) for n in "qkv"]
                              + [helper.make_tensor_value_info("m", b, None)],
                              [helper.make_tensor_value_info(n, f, None) for n in "yw"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _qkvm(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((1, 2, 3, 3), bool)
    mask[0, 0, 0, 1] = False
    return {"q": q, "k": k, "v": v, "m": mask}


def test_ort_kernel_writes_float_lowest_where_the_operator_has_minus_inf():
    """qk_matmul_output_mode 2 (scores with the mask added): the operator's masked scores are
    -inf; ONNX Runtime's CPU kernel (1.31.1) writes -3.4e38. attnexport computes the score
    output beside the fused node, so its `--weights bias` output has -inf, as the reference."""
    feed = _qkvm()
    ort_w = R.prepare_onnx("ort-cpu", _attention_node_model({"qk_matmul_output_mode": 2})).run(feed)["w"]
    ref_w = ReferenceEvaluator(_attention_node_model({"qk_matmul_output_mode": 2})).run(None, feed)[1]
    assert np.isneginf(ref_w[0, 0, 0, 1]) and ort_w[0, 0, 0, 1] == np.finfo(np.float32).min
    o = V.get("sdpa").resolve({"weights": "bias", "mask": "bool", "batch": 1, "heads": 2, "seq": 3, "kv_seq": 3,
                               "head_dim": 4, "v_head_dim": 4})
    model, _ = E.build_model("sdpa", o, "attention")
    ours = R.prepare_onnx("ort-cpu", model).run({"query": feed["q"], "key": feed["k"], "value": feed["v"],
                                                 "attn_mask": feed["m"]})["weights"]
    assert np.isneginf(ours[0, 0, 0, 1]) and np.array_equal(np.isneginf(ours), np.isneginf(ref_w))


def test_raw_scores_are_the_product_before_softcap_as_the_operator_says():
    """qk_matmul_output_mode 0 with softcap: the operator's text says the output of the QK
    matmul; onnx's reference evaluator (1.23) returns it after the softcap, ONNX Runtime before.
    attnexport follows the text, and so does its float64 reference."""
    feed = _qkvm(1)
    model = _attention_node_model({"qk_matmul_output_mode": 0, "softcap": 1.0})
    raw = (feed["q"] @ feed["k"].transpose(0, 1, 3, 2)) / 2.0  # scale 1/sqrt(4)
    assert np.allclose(R.prepare_onnx("ort-cpu", model).run(feed)["w"], raw, atol=1e-6)
    assert np.allclose(ReferenceEvaluator(model).run(None, feed)[1], np.tanh(raw), atol=1e-6)
    o = V.get("sdpa").resolve({"weights": "raw", "softcap": 1.0, "batch": 1, "heads": 2, "seq": 3, "kv_seq": 3,
                               "head_dim": 4, "v_head_dim": 4})
    for flavor in ("primitives", "attention"):
        got = R.prepare_onnx("onnx-ref", E.build_model("sdpa", o, flavor)[0]).run(
            {"query": feed["q"], "key": feed["k"], "value": feed["v"]})["weights"]
        assert np.allclose(got, raw, atol=1e-6)


def test_ort_attention_refuses_a_cache_step_without_new_keys():
    """Why the decoder joins its memory cache outside the attention op: ONNX Runtime's Attention
    kernel refuses past_key with an empty key block ("kv_sequence_length > 0"), which is every
    decoder step after the first. The decoder's step export runs such a step."""
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pko", "pvo"])
    f = TensorProto.FLOAT
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v", "pk", "pv")],
                              [helper.make_tensor_value_info(n, f, None) for n in ("y", "pko", "pvo")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    z = np.zeros((1, 2, 0, 4), np.float32)
    past = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(Exception, match="kv_sequence_length > 0"):
        R.prepare_onnx("ort-cpu", model).run({"q": np.ones((1, 2, 1, 4), np.float32), "k": z, "v": z,
                                              "pk": past, "pv": past})
    variant = V.get("decoder")
    o = variant.resolve({"kv_cache": True, "kv_seq": 0, "past_kv_seq": 5, "seq": 1})
    params = seeding.init_params(variant, o, 0)
    inputs = seeding.make_inputs(variant, o, 2)
    got = R.prepare_onnx("ort-cpu", E.build_model("decoder", o, "attention", params=params)[0]).run(inputs)
    for name, want in variant.reference(params, inputs, o).items():
        assert compare(name, got[name], want, tolerance("fp32"))


def test_fp16_softmax_in_float():
    """--softmax-precision float: the operator's attribute in the attention flavour, a Cast
    around the Softmax in primitives; the ort flavour cannot say it."""
    variant = V.get("sdpa")
    o = variant.resolve({"softmax_precision": "float", "mask": "bool", "causal": True})
    params = seeding.init_params(variant, o, 0)
    inputs = seeding.make_inputs(variant, o, 3)
    expected = variant.reference(params, inputs, o)
    for flavor in ("primitives", "attention"):
        model, _ = E.build_model("sdpa", o, flavor, dtype="fp16")
        nodes = {n.op_type: n for n in model.graph.node}
        if flavor == "attention":
            assert onnx.helper.get_node_attr_value(nodes["Attention"], "softmax_precision") == TensorProto.FLOAT
        else:
            softmax = nodes["Softmax"]
            cast = next(n for n in model.graph.node if softmax.input[0] in n.output)
            assert cast.op_type == "Cast" and onnx.helper.get_node_attr_value(cast, "to") == TensorProto.FLOAT
        got = R.prepare_onnx("ort-cpu", model).run({k: v.astype(np.float16) if v.dtype == np.float32 else v
                                                    for k, v in inputs.items()})
        assert compare("output", got["output"], expected["output"], tolerance("fp16"))
    with pytest.raises(UnsupportedByFlavor, match="--softmax-precision"):
        E.build_model("sdpa", o, "ort", dtype="fp16")


@pytest.mark.parametrize("args, code, text", [
    (["--nonpad", "--flavor", "attention", "--opset", "23"], 2, "--nonpad needs opset 24"),
    (["--nonpad", "--kv-cache"], 2, "not both"),
    (["--kv-cache", "--causal", "--softcap", "1", "--flavor", "ort", "--layout", "bsd"], 1, "softcap"),
    (["--weights", "logits"], 2, "--weights must be one of none, raw, softcap, bias, softmax"),
    (["--softmax-precision", "float16"], 2, "'--softmax-precision': 'float16' is not 'float'"),
    (["--mask-keys", "4"], 2, "--mask-keys is the length of a mask"),
    (["--mask", "bool", "--mask-keys", "17"], 2, "--mask-keys must be from 1 to the number of keys (16)"),
])
def test_what_sdpa_cannot_take_is_said(tmp_path, args, code, text):
    r = run("export", "--variant", "sdpa", *args, "-o", tmp_path / "x.onnx")
    assert r.exit_code == code and text in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x.onnx").exists()


def test_weights_flag_and_modes(tmp_path):
    for args, mode in ((["--weights"], "softmax"), (["--weights", "bias"], "bias")):
        path = tmp_path / f"{mode}.onnx"
        r = run("export", "--variant", "sdpa", *args, "--mask", "bool", "-o", path)
        assert r.exit_code == 0, r.output
        model = onnx.load(path)
        assert [o.name for o in model.graph.output] == ["output", "weights"]
        meta = {p.key: p.value for p in model.metadata_props}
        assert f'"weights": "{mode}"' in meta["attnexport.options"]
    r = run("export", "--variant", "mha", "--weights", "raw", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and "only sdpa has score modes" in r.output


def test_decoder_decode_bench_times_both_phases():
    rows = B.bench_decode("decoder", {"batch": [1], "dim": 32, "heads": 4, "kv_seq": 6}, [8],
                          runtimes=["torch", "ort-cpu"], flavors=["attention"], warmup=1, iters=2, threads=1,
                          repeat=2)
    got = {(r.runtime, r.phase, r.shape["seq"], r.shape["past_seq"], r.shape["kv_seq"], r.shape["past_kv_seq"])
           for r in rows if r.shape}
    for rt in ("torch", "ort-cpu"):
        # The prefill projects the memory; a step reads it from the cache.
        assert (rt, "prefill", 8, 0, 6, 0) in got and (rt, "decode", 1, 8, 0, 6) in got
    assert all(r.max_abs_err < 1e-4 for r in rows if r.runtime != "torch")


def test_a_short_mask_model_verifies_at_other_key_counts(tmp_path):
    """A --mask-keys model takes masks of any length up to the keys: verify runs it on seeded
    inputs at two other sizes (its mask kept shorter than the keys) against the reference."""
    path = tmp_path / "short.onnx"
    r = run("export", "--variant", "sdpa", "--mask", "float", "--mask-rank", "3", "--mask-keys", "5", "--kv-seq",
            "7", "--causal", "--flavor", "primitives", "-o", path)
    assert r.exit_code == 0, r.output
    dims = [d.dim_param for d in onnx.load(path).graph.input[3].type.tensor_type.shape.dim]
    assert dims == ["mask_heads", "seq", "mask_keys"]
    r = run("verify", str(path), "--runtimes", "ort-cpu,onnx-ref")
    assert r.exit_code == 0 and "4 passed, 0 failed" in r.output, r.output
