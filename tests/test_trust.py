"""A suite of broken models: verify fails each one and localizes it to the right node.

Each edit a user or a tool could make to an exported file (an attribute, a constant, a weight,
an axis, a removed guard) is applied in every flavour whose graph has the node, and verify must
fail the model and name the node. Weight damage too small for the tolerance is caught by the
fingerprint, and with the metadata stripped, by a baseline and by --localize.
"""

import json

import numpy as np
import onnx
import pytest
from conftest import cli as run
from onnx import helper, numpy_helper

from attnexport import export as E
from attnexport import golden, seeding
from attnexport import variants as V
from attnexport import verify as VF
from attnexport.errors import UsageError

RUNTIMES = ["onnx-ref", "ort-cpu"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Exports shared by the tests: (variant, flavor, options as a tuple) -> path."""
    d = tmp_path_factory.mktemp("models")
    made = {}

    def get(variant, flavor, **options):
        key = (variant, flavor, tuple(sorted(options.items())))
        if key not in made:
            path = d / f"{variant}-{flavor}-{len(made)}.onnx"
            E.export(variant, options, flavor, output=path)
            made[key] = path
        return made[key]
    return get


def _edited(path, tmp_path, edit, name="edited.onnx", strip=False):
    model = onnx.load(path)
    edit(model)
    if strip:
        del model.metadata_props[:]
    out = tmp_path / name
    onnx.save(model, out)
    return out


def _node(model, op_type, domain=""):
    nodes = [n for n in model.graph.node if n.op_type == op_type and n.domain == domain]
    assert nodes, f"no {op_type} node"
    return nodes[0]


def _set_attr(node, name, value):
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(name, value))


def _verify_model(path, *extra, runtimes=RUNTIMES):
    return VF.verify(models=[path], runtimes=runtimes, **dict(extra))


def _assert_localized(report, op_type, what=None):
    bad = [r for r in report.failures if r.runtime in RUNTIMES]
    assert bad, "verify passed a broken model"
    for r in bad:
        loc = r.localization
        assert loc is not None and loc.diverged, r.describe()
        assert loc.op_type == op_type, r.describe()
        if what:
            assert what in loc.describe(), loc.describe()


# --- attribute and constant edits -------------------------------------------------------------

@pytest.mark.parametrize("variant, flavor, op, domain, attr", [
    ("sdpa", "attention", "Attention", "", "is_causal"),
    # The fused contrib op has its own causal flag for self-attention (same query and key length).
    ("mha", "ort", "MultiHeadAttention", "com.microsoft", "unidirectional")])
def test_causal_switched_off(models, tmp_path, variant, flavor, op, domain, attr):
    path = _edited(models(variant, flavor, causal=True), tmp_path,
                   lambda m: _set_attr(_node(m, op, domain), attr, 0))
    report = _verify_model(path)
    assert not report.ok
    assert all(r.comparisons for r in report.failures)  # failed on compared values, not on nothing
    _assert_localized(report, op, f"{attr}=0")


@pytest.mark.parametrize("flavor, op, domain", [("attention", "Attention", ""),
                                                ("ort", "MultiHeadAttention", "com.microsoft")])
def test_scale_attribute_changed(models, tmp_path, flavor, op, domain):
    path = _edited(models("sdpa", flavor, causal=True), tmp_path,
                   lambda m: _set_attr(_node(m, op, domain), "scale", 123.0))
    report = _verify_model(path)
    _assert_localized(report, op, "scale=123.0")


def test_scale_constant_changed_in_primitives(models, tmp_path):
    def edit(m):
        mul = _node(m, "Mul")  # query * scale: its constant operand is a scalar initializer
        init = next(i for i in m.graph.initializer if i.name in mul.input and not i.dims)
        init.CopyFrom(numpy_helper.from_array(np.array(123.0, np.float32), init.name))
    path = _edited(models("sdpa", "primitives", scale=0.5), tmp_path, edit)
    report = _verify_model(path)
    _assert_localized(report, "Mul", "initializers differ")


def test_infinite_scale_gives_nan_and_fails(models, tmp_path):
    path = _edited(models("sdpa", "attention", causal=True), tmp_path,
                   lambda m: _set_attr(_node(m, "Attention"), "scale", float("inf")))
    report = _verify_model(path, runtimes=["ort-cpu"])
    assert not report.ok and all("NaN never passes" in r.describe() for r in report.failures)
    _assert_localized(report, "Attention", "scale=inf")


def test_softmax_axis_changed(models, tmp_path):
    path = _edited(models("mha", "primitives"), tmp_path, lambda m: _set_attr(_node(m, "Softmax"), "axis", 2))
    report = _verify_model(path)
    _assert_localized(report, "Softmax", "axis=2")


def _dead_row_guard(model):
    """The Where that selects zeros for rows with nothing to attend to (fed by Equal(ReduceSum(...)))."""
    producer = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        cond = producer.get(n.input[0]) if n.op_type == "Where" else None
        if cond is not None and cond.op_type == "Equal" and producer.get(cond.input[0]) is not None \
                and producer[cond.input[0]].op_type == "ReduceSum":
            return n
    raise AssertionError("no fully-masked-row guard")


@pytest.mark.parametrize("flavor", ["primitives", "ort"])
def test_fully_masked_row_guard_removed(models, tmp_path, flavor):
    def edit(m):
        guard = _dead_row_guard(m)
        guard.op_type = "Identity"  # passes the unguarded value on under the same name
        guard.input[:] = [guard.input[2]]
    path = _edited(models("sdpa", flavor, mask="bool", weights=True), tmp_path, edit)
    report = _verify_model(path)
    # Both golden cases with these options (the mask's head axis is symbolic): the one with
    # fully masked rows fails, on every ONNX runtime.
    assert {r.case for r in report.rows} == {"sdpa-fully-masked-rows", "sdpa-mask-per-head"}
    assert {r.runtime for r in report.failures if r.case == "sdpa-fully-masked-rows"} >= set(RUNTIMES)
    _assert_localized(report, "Identity", "export has Where")


# --- weights ----------------------------------------------------------------------------------

def _damage_query_weight(model, index=None):
    """Multiplies one element of the query projection's weight by 1.001 (default: the largest)."""
    entries = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    name = entries["q_proj.weight"]["initializer"]
    assert entries["q_proj.weight"]["layout"] == "transposed"
    init = next(i for i in model.graph.initializer if i.name == name)
    w = numpy_helper.to_array(init).copy()
    w[index[::-1] if index else np.unravel_index(np.argmax(np.abs(w)), w.shape)] *= 1.001
    init.CopyFrom(numpy_helper.from_array(w, name))


def _subtle_element():
    """An element of mha's query weight whose 1.001x change moves the output by 7-9e-6 on its golden
    case: under the fp32 tolerance, but over 10x a correct model's error (about 6e-7)."""
    variant = V.get("mha")
    o = variant.resolve({})
    params = seeding.init_params(variant, o, 0)
    inputs = golden.load("mha-seeded").inputs
    exact = variant.reference(params, inputs, o)["output"]
    w = params["q_proj.weight"]
    for index in np.ndindex(w.shape):
        p = dict(params, **{"q_proj.weight": w.copy()})
        p["q_proj.weight"][index] *= 1.001
        if 7e-6 < np.abs(variant.reference(p, inputs, o)["output"] - exact).max() < 9e-6:
            return index
    raise AssertionError("no element with a subtle effect")


@pytest.mark.parametrize("flavor", E.FLAVORS)
def test_small_weight_change_is_caught_by_the_fingerprint(models, tmp_path, flavor):
    path = _edited(models("mha", flavor), tmp_path, _damage_query_weight)
    r = run("verify", path, "--runtimes", "torch,ort-cpu")
    assert r.exit_code == 1
    assert "weights changed since export: q_proj.weight" in r.output
    report = _verify_model(path, runtimes=["ort-cpu"])
    assert report.failures[0].localization.op_type == "MatMul"


def test_small_weight_change_without_metadata_baseline_and_localize(models, tmp_path):
    good = _edited(models("mha", "primitives"), tmp_path, lambda m: None, "good.onnx", strip=True)
    index = _subtle_element()
    bad = _edited(models("mha", "primitives"), tmp_path, lambda m: _damage_query_weight(m, index), "bad.onnx",
                  strip=True)
    # Under the fp32 tolerance: the plain gate alone cannot see it.
    plain = run("verify", bad, "--variant", "mha", "--runtimes", "ort-cpu")
    assert plain.exit_code == 0, plain.output
    base = tmp_path / "baseline"
    saved = run("verify", good, "--variant", "mha", "--runtimes", "torch,ort-cpu", "--save-baseline", base)
    assert saved.exit_code == 0 and (base / "MANIFEST.json").exists()
    assert run("verify", good, "--variant", "mha", "--runtimes", "torch,ort-cpu", "--baseline", base).exit_code == 0
    grew = run("verify", bad, "--variant", "mha", "--runtimes", "torch,ort-cpu", "--baseline", base)
    assert grew.exit_code == 1 and "error grew" in grew.output and "--max-growth 10" in grew.output
    assert "torch" not in [ln.split(" / ")[-1].split(":")[0] for ln in grew.output.splitlines()
                           if ln.startswith("FAIL")]
    loc = run("verify", bad, "--variant", "mha", "--runtimes", "ort-cpu", "--localize")
    assert loc.exit_code == 1 and "first divergence at MatMul" in loc.output, loc.output


def test_damaged_baseline_file_exits_2(models, tmp_path):
    base = tmp_path / "b"
    path = models("mha", "attention")
    assert run("verify", path, "--runtimes", "ort-cpu", "--save-baseline", base).exit_code == 0
    f = next(base.glob("*.npz"))
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")
    r = run("verify", path, "--runtimes", "ort-cpu", "--baseline", base)
    assert r.exit_code == 2 and "baseline file damaged" in r.output


def test_correct_model_with_custom_parameters_passes(tmp_path):
    variant = V.get("mha")
    o = variant.resolve({})
    mine = seeding.init_params(variant, o, 42)  # not the seed-0 weights the golden case and export default use
    path = tmp_path / "mine.onnx"
    E.export("mha", {}, "attention", output=path, params=mine)
    report = VF.verify(models=[path], runtimes=["torch", "ort-cpu"])
    assert report.ok, "\n".join(r.describe() for r in report.failures)
    assert all("own parameters" in r.expected_kind for r in report.rows)


@pytest.mark.parametrize("bad, message", [
    (lambda p: {**p, "q_proj.weight": np.full((64, 64), np.nan, np.float32)}, "non-finite"),
    (lambda p: {**p, "q_proj.weight": np.zeros((64, 32), np.float32)}, "shape"),
    (lambda p: {k: v for k, v in p.items() if k != "out_proj.bias"}, "missing out_proj.bias"),
])
def test_bad_parameters_are_refused(tmp_path, bad, message):
    p = seeding.init_params(V.get("mha"), V.get("mha").resolve({}), 0)
    with pytest.raises(UsageError, match=message):
        E.export("mha", {}, "attention", output=tmp_path / "x.onnx", params=bad(p))
    assert not (tmp_path / "x.onnx").exists()


# --- the model's interface and metadata --------------------------------------------------------

def test_renamed_output_is_missing_not_passed(models, tmp_path):
    def edit(m):
        old = m.graph.output[0].name
        m.graph.output[0].name = "renamed"
        for n in m.graph.node:
            n.output[:] = ["renamed" if o == old else o for o in n.output]
    report = _verify_model(_edited(models("posenc", "primitives"), tmp_path, edit), runtimes=["ort-cpu"])
    problems = {c.name: c.problem for r in report.rows for c in r.comparisons}
    assert problems["output"] == "output missing" and "unexpected output" in problems["renamed"]
    assert not report.ok


def test_model_without_metadata_takes_options_as_flags(models, tmp_path):
    path = _edited(models("mha", "attention", heads=8, causal=True), tmp_path, lambda m: None, strip=True)
    ok = run("verify", path, "--variant", "mha", "--heads", "8", "--causal", "--runtimes", "torch,ort-cpu")
    assert ok.exit_code == 0, ok.output
    # Without --causal the same model is the wrong function: a numeric failure, not a pass.
    assert run("verify", path, "--variant", "mha", "--heads", "8", "--runtimes", "ort-cpu").exit_code == 1
    # Inputs that do not fit the variant's: exit 2 with one line.
    r = run("verify", path, "--variant", "mha", "--mask", "padding", "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "do not fit" in r.output


@pytest.mark.parametrize("flags, message", [
    (("--variant", "self"), "--variant self disagrees"),
    (("--flavor", "ort"), "--flavor ort disagrees"),
    (("--heads", "2"), "--heads 2 disagrees"),
    (("--dtype", "fp16"), "--dtype fp16 disagrees"),
    (("--rtol", "nan"), "--rtol must be a finite number"),
    (("--atol", "-1"), "--atol must be a finite number"),
    (("--max-growth", "0.5"), "--max-growth must be"),
])
def test_flags_that_contradict_the_model_exit_2(models, flags, message):
    r = run("verify", models("mha", "attention"), "--runtimes", "ort-cpu", *flags)
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and message in r.output


def test_fp16_model_file_takes_its_dtype_from_the_model(tmp_path):
    path = tmp_path / "mha16.onnx"
    E.export("mha", {"mask": "padding"}, "attention", dtype="fp16", output=path)
    report = VF.verify(models=[path], runtimes=["torch", "ort-cpu"])
    assert report.ok and report.dtype == "fp16", "\n".join(r.describe() for r in report.failures)
    assert all(r.tolerance.basis.startswith("fp16-emulated") for r in report.rows)


def test_error_statistics_in_json(models):
    r = run("verify", models("mha", "attention"), "--runtimes", "ort-cpu", "--json")
    out = json.loads(r.output)["results"][0]["outputs"][0]
    assert {"mean_abs", "median_abs", "p99_abs", "argmax"} <= set(out)
    assert out["median_abs"] <= out["p99_abs"] <= out["max_abs"] and len(out["argmax"]) == 3


def test_localize_on_a_good_model_finds_nothing(models):
    report = VF.verify(models=[models("mha", "ort")], runtimes=RUNTIMES, localize=True)
    assert report.ok
    for r in report.rows:
        assert r.localization is not None and not r.localization.diverged and r.localization.compared > 10


def test_reweighted_export_holds_what_a_fresh_export_with_those_parameters_holds():
    from attnexport import weights as W
    from attnexport.record import ExportRecord
    variant = V.get("decoder")
    o = variant.resolve({"mask": "padding"})
    other = seeding.init_params(variant, o, 7)
    base = E.build_model("decoder", o, "ort")[0]
    moved = W.reweight(base, ExportRecord.of(base).parsed("params"), other)
    fresh = E.build_model("decoder", o, "ort", params=other)[0]
    assert moved.graph.SerializeToString(deterministic=True) == fresh.graph.SerializeToString(deterministic=True)
    assert ExportRecord.of(moved).params_sha256 == ExportRecord.of(fresh).params_sha256
    # Another parameter set (a missing name) cannot be put in: the caller exports afresh.
    assert W.reweight(base, ExportRecord.of(base).parsed("params"), dict(list(other.items())[1:])) is None
