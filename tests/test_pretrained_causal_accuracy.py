"""What a lossy language model costs in answers (`attnexport.pretrained.accuracy`): the measures on known
distributions, the budget and its overrides, and on small random models exported with
`--precision` in every cache form: a correct quantization passes the default budget, a broken one
(wrong scales, a layer zeroed) fails it, and verify says which layers cost most. SmolLM2's are in
test_real_models.py."""

import json
import math

import numpy as np
import onnx
import pytest
from conftest import cli as run

from attnexport import runtimes as R
from attnexport import signature as SG
from attnexport.errors import UsageError
from attnexport.pretrained import cost as COST
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained.causal import accuracy as A
from attnexport.pretrained.causal import generation as G


def test_perplexity_of_a_uniform_and_of_a_certain_model():
    ids = np.array([0, 3, 1, 2])
    assert A.perplexity(np.zeros((4, 7)), ids) == pytest.approx(7)
    certain = np.full((4, 7), -50.0)
    certain[np.arange(3), ids[1:]] = 50.0
    assert A.perplexity(certain, ids) == pytest.approx(1, abs=1e-9)


def test_the_budget_takes_overrides_and_refuses_what_is_not_a_number():
    b = A.Budget().with_overrides("kl-mean=0.1, top1=0.5,first-tokens=2,perplexity=none,margin=0.5")
    assert (b.kl_mean, b.top1, b.first_tokens, b.perplexity, b.margin) == (0.1, 0.5, 2, None, 0.5)
    for text, message in (("kl-mean=abc", "is not a number"), ("speed=3", "the limits are"),
                          ("top1=1.5", "at most 1"), ("first-tokens=1.5", "a whole number"),
                          ("kl-mean=nan", "finite number"), ("margin=none", "not a limit to drop")):
        with pytest.raises(UsageError, match=message):
            A.Budget().with_overrides(text)


def _cost(**kw):
    fields = {"kl_mean": 0.01, "kl_p99": 0.05, "kl_max": 0.1, "top1": 0.95, "positions": 100, "perplexity": 10.1,
              "perplexity_fp32": 10.0, "perplexity_fp64": 10.0, "first_difference": [None, 0, 5],
              "margins": [3.0, 0.2, 2.0], "equal_tokens": 53, "new_tokens": 144}
    return A.Cost(**{**fields, **kw})


def test_a_first_token_turned_where_fp32_is_undecided_does_not_count():
    assert _cost().judge(A.Budget()).failures == []
    bad = _cost(first_difference=[0, 0, 5]).judge(A.Budget())
    assert bad.failures == ["first greedy token differs on 1 prompt(s) where fp32 leads by >= 1 logits > 0"]
    assert "(near tie)" in bad.text()


def test_each_limit_is_checked_and_nan_fails_them_all():
    cost = _cost(kl_mean=0.2, top1=0.5, perplexity=12.0).judge(A.Budget())
    assert len(cost.failures) == 3
    assert [c.passed for c in cost.comparisons(A.Budget())] == [False, False, False, True]
    nan = _cost(kl_mean=math.nan, top1=math.nan, perplexity=math.nan).judge(A.Budget())
    assert len(nan.failures) == 3
    assert _cost(kl_mean=0.2).judge(A.Budget(kl_mean=None)).failures == []


# --- the measures on a model worked out by hand -----------------------------------------------------

# A bigram model over three tokens: the next token's probabilities depend on the last token only, so
# every measure can be written down. The fp32 reference and the model under test agree on rows 0 and
# 2 and differ on row 1 (its most likely token too).
P_REF = np.array([[0.1, 0.7, 0.2], [0.8, 0.1, 0.1], [0.2, 0.2, 0.6]])
P_GOT = np.array([[0.1, 0.7, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6]])
# KL(fp32 || model) at a position that reads row 1, in nats: 0.8 ln(0.8/0.2) + 0.1 ln(0.1/0.6) +
# 0.1 ln(0.1/0.2) = 1.5 ln 2 - 0.1 ln 6 = 0.860545 (the other direction, KL(model || fp32), is
# 0.6 ln 6 - 0.2 ln 2 = 0.936426; in bits it would be 1.241503).
KL_ROW1 = 1.5 * math.log(2) - 0.1 * math.log(6)


def _bigram(probs):
    """The step graph of a bigram model in the form without a cache: logits (B, T, V) of ids (B, T)."""
    table = np.log(probs)

    def run(feed):
        return {"logits": table[np.asarray(feed["input_ids"])]}
    return run


def _bigram_baseline():
    """What the fp32 model gives, by hand: its logits over the texts, its greedy tokens after the
    prompts [0] (0 -> 1 -> 0 -> 1 -> 0) and [2] (2 -> 2 -> ...), and the lead of each first token."""
    eval_ids, held_ids = np.array([[0, 1, 2, 0]]), np.array([[0, 1, 2]])
    ref = np.log(P_REF)
    return A.Baseline(eval_ids, held_ids, ref[eval_ids[0]], ref[eval_ids[0]], ref[held_ids[0]], ref[held_ids[0]],
                      [np.array([0]), np.array([2])], np.array([[1, 0, 1, 0], [2, 2, 2, 2]]),
                      A.leads(ref[[0, 2]]))


def test_kl_is_in_nats_and_from_the_reference_to_the_model():
    kl = COST.kl_per_position(np.log(P_REF), np.log(P_GOT))
    assert kl[1] == pytest.approx(KL_ROW1, rel=1e-12) and kl[1] == pytest.approx(0.860545, abs=1e-6)
    assert kl[0] == pytest.approx(0, abs=1e-15) and kl[2] == pytest.approx(0, abs=1e-15)


def test_each_measure_of_a_model_worked_out_by_hand():
    """Positions 0..3 of the text read rows 0, 1, 2, 0: KL only at position 1, so its mean is
    KL_ROW1 / 4 and top-1 agreement exactly 3/4. The held-out text 0, 1, 2 has perplexity
    (0.7 * 0.2)^-1/2 under the model and (0.7 * 0.1)^-1/2 under fp32: -29.3%. Greedy after [0]: the
    model goes 0 -> 1 -> 1 (row 1's most likely token is 1), fp32 0 -> 1 -> 0: first departure at
    step 1, one of four tokens equal; after [2] all four equal."""
    layout = hf.Layout("none", 1, 1, 1, 3)
    base = _bigram_baseline()
    assert base.margins == pytest.approx([math.log(3.5), math.log(3)], rel=1e-12)
    for alone in (False, True):
        cost = A.measure(_bigram(P_GOT), layout, base, A.Budget(), np.float64, one_at_a_time=alone)
        assert cost.kl_mean == pytest.approx(KL_ROW1 / 4, rel=1e-12) and cost.kl_max == pytest.approx(KL_ROW1)
        assert cost.top1 == 0.75 and cost.positions == 4
        assert cost.perplexity == pytest.approx(0.14 ** -0.5, rel=1e-12)
        assert cost.perplexity_fp32 == pytest.approx(0.07 ** -0.5, rel=1e-12)
        assert cost.perplexity_delta == pytest.approx(math.sqrt(0.5) - 1, rel=1e-12)
        assert cost.first_difference == [1, None] and (cost.equal_tokens, cost.new_tokens) == (5, 8)
        assert cost.failures == [f"mean KL {KL_ROW1 / 4:.3g} > 0.05", "top-1 75.0% < 85%"]
    same = A.measure(_bigram(P_REF), layout, base, A.Budget(), np.float64)
    assert same.kl_mean == pytest.approx(0, abs=1e-15) and (same.top1, same.first_difference, same.failures) == \
        (1.0, [None, None], [])


def test_a_first_token_counts_where_fp32_leads_by_the_margin_or_more():
    """The margin is a lead in logits, at least `margin`: a lead of exactly the margin is decided."""
    assert A.leads(np.array([[1.0, 5.0, 3.0], [2.0, 2.0, 0.0]])) == [2.0, 0.0]
    at = _cost(first_difference=[0], margins=[1.0]).judge(A.Budget(margin=1.0))
    assert at.first_tokens_differing == 1 and len(at.failures) == 1
    below = _cost(first_difference=[0], margins=[0.999]).judge(A.Budget(margin=1.0))
    assert below.first_tokens_differing == 0 and below.failures == []
    wider = _cost(first_difference=[0], margins=[1.5]).judge(A.Budget(margin=2.0))
    assert wider.first_tokens_differing == 0 and wider.margin == 2.0


# --- small random models (the [hf] extra: they skip without it) ------------------------------------


def _q4_1(w: np.ndarray, block: int = 32) -> np.ndarray:
    """(out, in) weights snapped to GGUF's Q4_1 grid along `in`, as a model read from such a file holds them."""
    rows, cols = w.shape
    b = w.reshape(rows, cols // block, block)
    low, step = b.min(-1, keepdims=True), (b.max(-1, keepdims=True) - b.min(-1, keepdims=True)) / 15
    q = np.clip(np.floor((b - low) / step + 0.5), 0, 15)
    return (step.astype(np.float16).astype(np.float32) * q + low.astype(np.float16).astype(np.float32)).reshape(
        rows, cols).astype(np.float32)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_lms):
    """A small Llama whose random weights are large enough for its next-token distributions to be
    peaked (at transformers' default scale every one is near uniform, and any rounding turns its top
    token): what quantizing a trained model risks."""
    transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e "
                                       "'.[dev,hf]'")
    import torch
    folder = tmp_path_factory.mktemp("plain")
    config = tiny_lms.config("llama", layers=3)
    config.initializer_range, config.intermediate_size = 0.1, 192
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gridded(tmp_path_factory, plain):
    """The same model with its layers' weights on Q4_1's grid, as a GGUF file's are: int4 carries them."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(plain)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(torch.from_numpy(_q4_1(module.weight.numpy())))
    folder = tmp_path_factory.mktemp("gridded")
    model.save_pretrained(folder)
    return folder


def _report(result):
    return json.loads(result.output[result.output.index("{"):])


def _accuracy(report):
    return [r for r in report["results"] if "accuracy" in r.get("detail", {})]


@pytest.mark.parametrize("form, precision, flavor, source", [
    ("static", "int4", "ort", "gridded"), ("concat", "int4", "attention", "gridded"),
    ("none", "int8", "primitives", "plain"), ("static", "int8", "ort", "plain"),
    ("static", "fp16", "attention", "plain"), ("static", "q4f16", "ort", "gridded"),
    ("static", "q4f16:float", "ort", "gridded")])
def test_a_lossy_export_is_judged_by_its_cost_in_answers(request, tmp_path, form, precision, flavor, source):
    """Each lossy form passes its budget on its cost in answers; `q4f16:float` is q4f16 with the
    grid's minimums as float zero points (`--minimums float`, the form for CUDA)."""
    precision, _, minimums = precision.partition(":")
    folder = request.getfixturevalue(source)
    out = tmp_path / "model.onnx"
    cache = [] if form == "none" else ["--kv-cache"] + (["static", "--max-seq", "200"] if form == "static" else [])
    held = ["--minimums", minimums] if minimums else []
    r = run("export", "--hf", folder, *cache, "--flavor", flavor, "--precision", precision, *held, "-o", out)
    assert r.exit_code == 0, r.output
    if source == "gridded":  # grids carried; head 8 bits
        assert f"{minimums or 'folded'} 4-bit, 1 ort 8-bit" in r.output and "ort 4-bit" not in r.output
    runtimes = "torch,ort-cpu" if precision == "fp16" else "ort-cpu"  # torch runs an fp16 model in its fp16
    report = _report(run("verify", out, "--hf", folder, "--runtimes", runtimes, "--json"))
    assert report["dtype"] == ("fp16" if precision in ("fp16", "q4f16") else "fp32")
    assert report["summary"]["ok"], [row["error"] for row in report["results"] if not row["passed"]]
    rows = _accuracy(report)
    assert [row["runtime"] for row in rows] == runtimes.split(",")
    for row in rows:
        cost = row["detail"]["accuracy"]
        assert 0 < cost["kl_mean"] < 0.05 and cost["top1"] >= 0.85 and cost["positions"] >= 150
    if precision != "fp16":
        weights = next(r for r in report["results"] if r["case"].startswith("weights"))
        per_layer = 5 if flavor == "ort" else 7  # the ort flavour packs q, k and v into one matrix
        assert weights["passed"] and sum(weights["detail"]["matrices"].values()) == 3 * per_layer + 1
        if source == "gridded":  # how far holding the minimums moved the weights, in steps
            moved = weights["detail"][minimums or "folded"]
            assert 0 < moved["max_steps"] < (0.01 if minimums else 0.5)
        layers = next(r for r in report["results"] if "layer_costs" in r.get("detail", {}))
        assert {c["group"] for c in layers["detail"]["layer_costs"]} == {"layer:0", "layer:1", "layer:2", "head"}


def _session_run(model):
    prepared = R.prepare_onnx("ort-cpu", model)
    return prepared.run


@pytest.fixture(scope="module")
def int4_export(gridded, tmp_path_factory):
    """(the int4 file, what its export said in JSON)."""
    out = tmp_path_factory.mktemp("int4") / "model.onnx"
    r = run("export", "--hf", gridded, "--kv-cache", "static", "--max-seq", "200", "--flavor", "ort", "--precision",
            "int4", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    return out, _report(r)


@pytest.fixture(scope="module")
def int4(int4_export):
    return int4_export[0]


def test_the_quantized_graph_is_checked_with_the_quantized_factor(int4_export):
    """The graph with float activations is held to QUANTIZED_FACTOR (16) times torch's own error
    against the model with the file's weights, never below fp32's policy: each checked step says so."""
    import re

    from attnexport.compare import QUANTIZED_FACTOR, TOLERANCES
    _, doc = int4_export
    assert QUANTIZED_FACTOR == 16 and len(doc["checked"]) == 4
    for entry in doc["checked"]:
        for worst in (entry["logits"], entry["cache"]):
            error = float(re.search(r"float64 (\S+) x 16(;|$)", worst["basis"]).group(1))
            assert worst["atol"] == pytest.approx(max(TOLERANCES["fp32"].atol, 16 * error), rel=6e-3)  # 3 digits


def _broken(path, how):
    model = onnx.load(path)
    record = P.record_of(model)
    layer = [e for e in record["matrices"] if e["group"] == "layer:1" and e["bits"]]
    inits = {i.name: i for i in model.graph.initializer}
    for e in layer if how == "zeroed" else layer[:1]:
        scales = inits[e["tensors"][1]]
        value = onnx.numpy_helper.to_array(scales)
        scales.CopyFrom(onnx.numpy_helper.from_array(value * 0 if how == "zeroed" else value * 3, scales.name))
    P.fingerprint(model)  # as a quantizer that made them so would have recorded them
    return model


@pytest.mark.parametrize("how", ["wrong scales", "zeroed"])
def test_the_budget_catches_a_broken_quantization(gridded, int4, tmp_path, how):
    model = _broken(int4, how)
    layout = hf.Layout.of(model)
    source, _ = hf.load(gridded)
    reference = HR.Reference(source, layout)
    prompts = G.prompts(None, layout, (5, 9, 2), seed=4)
    base = A.baseline(reference, None, prompts, 8)
    good = A.measure(_session_run(onnx.load(int4)), layout, base, A.Budget())
    bad = A.measure(_session_run(model), layout, base, A.Budget())
    assert good.failures == [] and bad.failures, (good.text(), bad.text())
    assert bad.kl_mean > 10 * good.kl_mean
    # Through verify: the weights row names the matrices, the accuracy row the budget's limits.
    path = tmp_path / "broken.onnx"
    onnx.save_model(model, path)
    report = _report(run("verify", path, "--hf", gridded, "--runtimes", "ort-cpu", "--json"))
    assert not report["summary"]["ok"]
    failed = {r["case"].split(":")[0]: r["error"] for r in report["results"] if not r["passed"]}
    assert "not a quantization of the source's" in failed["weights"]
    assert "over the accuracy budget" in failed["accuracy"]


def test_an_edited_quantized_file_is_refused_before_any_run(int4, gridded, tmp_path):
    model = onnx.load(int4)
    init = next(i for i in model.graph.initializer if i.name.endswith("_scales"))
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * 2, init.name))
    onnx.save_model(model, tmp_path / "edited.onnx")
    report = _report(run("verify", tmp_path / "edited.onnx", "--hf", gridded, "--runtimes", "ort-cpu", "--json"))
    (row,) = report["results"]
    assert not report["summary"]["ok"] and "recorded at its export" in row["error"]


def test_bad_input_is_one_line(int4, gridded):
    r = run("verify", int4, "--hf", gridded, "--runtimes", "onnx-ref")
    assert r.exit_code == 2 and "onnx-ref cannot run this int4 model: it has no com.microsoft.MatMulNBits" in r.output
    r = run("verify", int4, "--hf", gridded, "--runtimes", "ort-cpu", "--budget", "kl-mean=lots")
    assert r.exit_code == 2 and "'lots' is not a number" in r.output
    r = run("export", "--hf", gridded, "--precision", "int4", "--block-size", "48")
    assert r.exit_code == 2 and "--block-size is one of" in r.output
    r = run("export", "--variant", "mha", "--precision", "int4")
    assert r.exit_code == 2 and "go with --hf" in r.output
    r = run("export", "--hf", gridded, "--precision", "int4", "--dtype", "fp16")
    assert r.exit_code == 2 and "not both" in r.output
    assert "Traceback" not in r.output


def test_a_carried_grid_on_the_deployment_runtimes(gridded, tmp_path):
    """Node computes as ONNX Runtime's Python package does (int8 activations at accuracy level 4);
    WASM and WebGPU take MatMulNBits with float activations, so they compute with the weights the
    file holds: the folded grid's (its block sums appended to each input, K + K/32 rows, the last
    block part-filled) within a small fraction of a step of the model's, and both agree. WebGPU's
    kernel takes 2 and 4 bits: the default 8-bit head is refused in one line, a float head (--keep
    head) runs."""
    for name in ("ort-node", "ort-wasm", "ort-webgpu"):
        s = R.status(name)
        if not s.available:
            pytest.skip(f"{name} is not available: {s.reason}")
    default = tmp_path / "default.onnx"
    assert run("export", "--hf", gridded, "--kv-cache", "--flavor", "attention", "--precision", "int4", "-o",
               default).exit_code == 0
    r = run("verify", default, "--hf", gridded, "--runtimes", "ort-webgpu")
    assert r.exit_code == 2 and "it has no com.microsoft.MatMulNBits of 8 bits (it takes 2 and 4)" in r.output
    out = tmp_path / "float-head.onnx"
    assert run("export", "--hf", gridded, "--kv-cache", "--flavor", "attention", "--precision", "int4", "--keep",
               "head", "-o", out).exit_code == 0
    report = _report(run("verify", out, "--hf", gridded, "--runtimes", "ort-cpu,ort-node,ort-wasm,ort-webgpu",
                         "--json"))
    assert report["summary"]["ok"], [row["error"] for row in report["results"] if not row["passed"]]
    cost = {row["runtime"]: row["detail"]["accuracy"] for row in _accuracy(report)}
    assert set(cost) == {"ort-cpu", "ort-node", "ort-wasm", "ort-webgpu"}
    assert cost["ort-node"]["kl_mean"] == pytest.approx(cost["ort-cpu"]["kl_mean"], rel=0.05)
    for name in ("ort-wasm", "ort-webgpu"):  # float activations: the folded weights' own error only
        assert 0 < cost[name]["kl_mean"] < 0.5 * cost["ort-cpu"]["kl_mean"]  # measured 0.17 times
    assert cost["ort-webgpu"]["kl_mean"] == pytest.approx(cost["ort-wasm"]["kl_mean"], rel=0.05)


def test_bench_puts_each_precision_beside_its_accuracy(gridded):
    from attnexport.pretrained.causal import bench as hf_bench
    request = hf_bench.HFBenchRequest(gridded, contexts=(16,), forms=("static",), flavors=("ort",), iters=2,
                                      warmup=1, prefill=False, precisions=("fp32", "int4", "q4f16"),
                                      genai_precisions=())
    rows, _ = hf_bench.bench_hf(request)
    ours = {r.precision: r for r in rows if r.engine == "attnexport"}
    assert set(ours) == {"fp32", "int4", "q4f16"}  # q4f16's caches and empty pasts fed in fp16
    for precision, row in ours.items():
        a = row.agreement
        assert a["prompts"] == 5 and a["compared_tokens"] == 5 * hf_bench.AGREEMENT_TOKENS
        assert (a["kl_mean"] < 1e-9) == (precision == "fp32") and a["teacher_forced_tokens"] > 100
        assert "KL" in hf_bench.agreement_text(a)
    # The int4 file's step reads its 4-bit blocks: fewer bytes than the fp32 model's parameters.
    assert ours["int4"].step_bytes < 0.5 * ours["fp32"].step_bytes


def test_greedy_tokens_one_prompt_at_a_time_are_compared_as_in_a_batch(gridded, int4):
    """`measure(one_at_a_time=True)` (how a shared-buffer graph is driven) generates each prompt alone and
    compares it with the same row of transformers' tokens: on the carried grid both ways agree with the
    batch on how many tokens stay equal, and the teacher-forced numbers do not depend on it."""
    model = onnx.load(int4)
    layout = hf.Layout.of(model)
    assert SG.of(model).caches == layout.signature.caches  # the quantizer keeps the step's signature
    source, _ = hf.load(gridded)
    base = A.baseline(HR.Reference(source, layout), None, G.prompts(None, layout, (5, 9, 2), seed=4), 8)
    run_ = _session_run(model)
    batched = A.measure(run_, layout, base, A.Budget())
    alone = A.measure(run_, layout, base, A.Budget(), one_at_a_time=True)
    assert alone.new_tokens == batched.new_tokens == 3 * 8 and len(alone.first_difference) == 3
    assert alone.kl_mean == pytest.approx(batched.kl_mean, rel=1e-6) and alone.top1 == pytest.approx(batched.top1)
    assert alone.equal_tokens == sum(8 if f is None else f for f in alone.first_difference)
    assert abs(alone.equal_tokens - batched.equal_tokens) <= 8  # padding in the batch may turn one near tie


def test_q4f16_on_the_deployment_runtimes(gridded, tmp_path):
    """int4's weights in a half graph (`--precision q4f16`): the grid carried from the model's
    float32 matrices, fp16 activations. ORT's CPU provider, Node and WASM keep its answers;
    WebGPU's fp16 MatMulNBits answers zeros on Chromium's software adapter (pinned in
    test_js_runtimes.py), which verify fails on the budget. A float head (--keep head) for WebGPU's
    2- and 4-bit MatMulNBits."""
    for name in ("ort-node", "ort-wasm", "ort-webgpu"):
        s = R.status(name)
        if not s.available:
            pytest.skip(f"{name} is not available: {s.reason}")
    out = tmp_path / "q4f16.onnx"
    r = run("export", "--hf", gridded, "--kv-cache", "--flavor", "attention", "--precision", "q4f16", "--keep",
            "head", "-o", out)
    assert r.exit_code == 0 and "folded 4-bit" in r.output and "ort 4-bit" not in r.output, r.output
    report = _report(run("verify", out, "--hf", gridded, "--runtimes", "ort-cpu,ort-node,ort-wasm", "--json"))
    assert report["summary"]["ok"] and report["dtype"] == "fp16", \
        [row["error"] for row in report["results"] if not row["passed"]]
    cost = {row["runtime"]: row["detail"]["accuracy"] for row in _accuracy(report)}
    assert set(cost) == {"ort-cpu", "ort-node", "ort-wasm"} and all(c["kl_mean"] < 0.01 for c in cost.values())
    from attnexport.runtimes import js
    if js.bridge().adapter and js.bridge().adapter.get("fallback"):
        r = run("verify", out, "--hf", gridded, "--runtimes", "ort-webgpu")
        assert r.exit_code == 1 and "over the accuracy budget" in r.output
