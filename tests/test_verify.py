"""verify: golden cases on every runtime and flavour, integrity, model files, failure modes."""

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import cli as run

from attnexport import golden
from attnexport import runtimes as R
from attnexport import verify as VF
from attnexport.cli import main
from attnexport.errors import ProviderUnavailableError, UsageError

CPU_RUNTIMES = ["torch", "onnx-ref", "ort-cpu"]


@pytest.mark.parametrize("variant", list(__import__("attnexport.variants", fromlist=["VARIANTS"]).VARIANTS))
def test_every_golden_case_passes_everywhere(variant):
    """All golden cases of the variant pass on torch, onnx-ref and ort-cpu in every flavour."""
    report = VF.verify(variants=[variant], runtimes=CPU_RUNTIMES)
    assert report.ok, "\n".join(r.describe() for r in report.failures)
    cases = {c.name for c in golden.load_all(variants=[variant])}
    assert {r.case.split("/")[0] for r in report.rows} == cases
    for r in report.rows:
        if r.skipped:  # only what the fused ort op cannot express: softcap, a softmax precision, and
            # the blocks its static step (GroupQueryAttention) does not take, as its metadata says
            limit = "the model takes one position a step over written positions at batch > 1"
            assert r.flavor == "ort" and any(w in r.skipped for w in ("--softcap", "--softmax-precision", limit)), \
                r.describe()
            if limit in r.skipped:
                o = golden.load(r.case.split("/")[0]).options
                assert o["batch"] > 1 and (r.case.endswith("/decode-3") or o["seq"] > 1), r.describe()
        else:
            assert r.median_ms is not None and r.median_ms > 0
    # Every causal cache case also checks decoding against the full forward, in two chunk sizes.
    for c in cases:
        if golden.load(c).options.get("kv_cache"):
            assert {f"{c}/decode-1", f"{c}/decode-3"} <= {r.case for r in report.rows}
    assert {(r.runtime, r.flavor) for r in report.rows if r.runtime != "torch"} == \
        {(rt, f) for rt in ("onnx-ref", "ort-cpu") for f in ("primitives", "attention", "ort")}


@pytest.fixture
def golden_copy(tmp_path):
    d = tmp_path / "golden"
    shutil.copytree(golden.default_dir(), d)
    return d


def _tamper(directory, name, update_manifest):
    case = golden.load(name, directory)
    case.expected["output"] = case.expected["output"].copy()
    case.expected["output"].flat[3] += 0.5
    data = golden._to_bytes(case)
    (directory / f"{name}.npz").write_bytes(data)
    if update_manifest:
        m = json.loads((directory / golden.MANIFEST).read_text())
        m["files"][f"{name}.npz"] = golden.sha256(data)
        (directory / golden.MANIFEST).write_text(json.dumps(m))


def test_changed_expected_value_with_manifest_updated_exits_1(golden_copy):
    _tamper(golden_copy, "posenc-seeded", update_manifest=True)
    r = run("verify", "--variant", "posenc", "--runtimes", "torch,ort-cpu", "--golden", str(golden_copy))
    assert r.exit_code == 1, r.output
    assert "FAIL posenc-seeded / primitives / ort-cpu: output max abs 0.5" in r.output
    assert "posenc-table" not in r.output.split("FAIL", 1)[1]


def test_changed_expected_value_without_manifest_exits_2(golden_copy):
    _tamper(golden_copy, "posenc-seeded", update_manifest=False)
    r = run("verify", "--variant", "posenc", "--runtimes", "ort-cpu", "--golden", str(golden_copy))
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [f"error: golden file damaged: {golden_copy / 'posenc-seeded.npz'} "
                                             "(sha256 does not match MANIFEST.json)"]


def test_missing_golden_file_exits_2(golden_copy):
    (golden_copy / "kernel-seeded.npz").unlink()
    r = run("verify", "--variant", "kernel", "--runtimes", "ort-cpu", "--golden", str(golden_copy))
    assert r.exit_code == 2 and "golden file missing" in r.output and "kernel-seeded.npz" in r.output


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"", "is empty"),
    (b"plain text, not a model", "is not an ONNX model"),
    ("truncated", "is not"),
])
def test_bad_model_files_exit_2(tmp_path, content, message):
    path = tmp_path / "m.onnx"
    if content == "truncated":
        from attnexport import export as E
        E.export("mha", {}, "primitives", output=tmp_path / "good.onnx")
        data = (tmp_path / "good.onnx").read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif content is not None:
        path.write_bytes(content)
    r = run("verify", str(path), "--runtimes", "ort-cpu")
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.output


def test_ort_cuda_without_cuda_exits_2_with_the_reason():
    s = R.status("ort-cuda")
    if s.available:
        pytest.skip("this machine has a working CUDA provider")
    r = run("verify", "--variant", "masked-softmax", "--runtimes", "ort-cuda")
    assert r.exit_code == 2
    assert r.output.startswith("error: runtime ort-cuda is not available: ") and s.reason in r.output


def test_ort_cuda_skipped_under_skip_unavailable():
    s = R.status("ort-cuda")
    if s.available:
        pytest.skip("this machine has a working CUDA provider")
    r = run("verify", "--variant", "masked-softmax", "--runtimes", "ort-cpu,ort-cuda", "--skip-unavailable",
            "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    skipped = {t["name"]: t for t in doc["runtimes"]}["ort-cuda"]
    assert skipped["used"] is False and skipped["reason"] == s.reason
    assert {row["runtime"] for row in doc["results"]} == {"ort-cpu"}


def test_torch_cuda_without_cuda_is_an_error():
    if R.status("torch-cuda").available:
        pytest.skip("this machine has CUDA")
    with pytest.raises(ProviderUnavailableError, match="torch-cuda is not available"):
        VF.verify(variants=["posenc"], runtimes=["torch-cuda"])


def test_json_document(tmp_path):
    r = run("verify", "--variant", "kernel", "--runtimes", "torch,onnx-ref,ort-cpu", "--flavor", "primitives",
            "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)  # stdout holds the JSON document and nothing else
    assert {"results", "runtimes", "versions", "device", "summary", "dtype"} <= set(doc)
    assert doc["summary"]["ok"] and doc["summary"]["failed"] == 0
    assert set(doc["summary"]["by_runtime"]) == {"torch", "onnx-ref", "ort-cpu"}
    row = doc["results"][0]
    assert {"case", "flavor", "runtime", "passed", "median_ms", "outputs"} <= set(row)
    out = row["outputs"][0]
    assert {"max_abs", "max_rel", "nan_diff", "inf_diff", "rtol", "atol", "needed_atol", "needed_rtol",
            "passed"} <= set(out)
    assert {"torch", "onnx", "onnxruntime", "numpy"} <= set(doc["versions"])


def test_tolerance_override_can_fail_a_run():
    r = run("verify", "--variant", "encoder", "--runtimes", "ort-cpu", "--flavor", "attention",
            "--rtol", "0", "--atol", "1e-12")
    assert r.exit_code == 1
    assert "needs atol>=" in r.output


def test_fp16_verify_is_green_with_derived_tolerances():
    """Cases that were red in fp16 (cosine scaling, the decoder) and a grouped cache decoded in
    fp16, on torch and ONNX Runtime, pass with tolerances derived from the fp16-emulated
    reference, and say so. (Every case in fp16: benchmarks/results/2026-11-23-cpu/verify-fp16.json, 0 failed.)"""
    wanted = ("mha-scaling-cosine", "decoder-seeded", "mha-kv-cache-gqa")
    r = run("verify", "--dtype", "fp16", *[a for c in wanted for a in ("--case", c)],
            "--flavor", "attention", "--runtimes", "torch,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rows = {(row["case"], row["runtime"]): row for row in doc["results"]}
    for case in ("mha-scaling-cosine", "decoder-seeded"):
        for rt in ("torch", "ort-cpu"):
            row = rows[(case, rt)]
            assert row["passed"] and row["tolerance"]["basis"].startswith("fp16-emulated reference error")
            # The derived atol is 4x what rounding alone costs, and the run needs less than it.
            assert row["outputs"][0]["needed_atol"] <= row["tolerance"]["atol"]
    assert {c.split("/")[0] for c, _ in rows} == set(wanted)
    decoded = {(c, rt) for (c, rt), row in rows.items() if "/decode-" in c and row["passed"]}
    assert {("mha-kv-cache-gqa/decode-3", "ort-cpu"), ("mha-kv-cache-gqa/decode-1", "torch")} <= decoded
    bad = run("verify", "--case", "no-such-case", "--runtimes", "ort-cpu")
    assert bad.exit_code == 2 and "no golden case no-such-case" in bad.output
    text = run("verify", "--dtype", "fp16", "--variant", "masked-softmax", "--runtimes", "ort-cpu")
    assert text.exit_code == 0 and "fp16 tolerances: derived per case" in text.output


def test_model_file_with_metadata(tmp_path):
    path = tmp_path / "mha.onnx"
    assert run("export", "--variant", "mha", "--flavor", "ort", "-o", str(path)).exit_code == 0
    r = run("verify", str(path), "--runtimes", "torch,onnx-ref,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {(row["model"], row["case"]) for row in doc["results"]} == {("mha.onnx", "mha-seeded")}
    # Exported with seed 0, the model's weights differ from the golden case's: the reference
    # recomputes the expected outputs for them.
    assert all(row["expected"].startswith("reference") for row in doc["results"])


def test_model_file_with_wrong_weights_fails(tmp_path):
    import onnx
    from onnx import numpy_helper
    path = tmp_path / "mha.onnx"
    assert run("export", "--variant", "mha", "--flavor", "attention", "-o", str(path)).exit_code == 0
    model = onnx.load(path)
    init = next(i for i in model.graph.initializer if np.prod(i.dims) > 100)
    arr = numpy_helper.to_array(init).copy()
    arr.flat[0] += 1.0
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, path)
    r = run("verify", str(path), "--runtimes", "ort-cpu")
    assert r.exit_code == 1 and "FAIL mha.onnx:mha-seeded" in r.output


def test_model_without_metadata_needs_a_variant(tmp_path):
    import onnx
    path = tmp_path / "bare.onnx"
    assert run("export", "--variant", "posenc", "-o", str(path)).exit_code == 0
    model = onnx.load(path)
    del model.metadata_props[:]
    onnx.save(model, path)
    r = run("verify", str(path), "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "has no attnexport metadata" in r.output
    r = run("verify", str(path), "--variant", "posenc", "--runtimes", "torch,ort-cpu")
    assert r.exit_code == 0, r.output


def test_unknown_runtime_and_flavor():
    with pytest.raises(UsageError, match="unknown runtime 'gpu'"):
        R.parse("ort-cpu,gpu")
    with pytest.raises(UsageError, match="names no runtime"):
        R.parse(" , ")
    r = run("verify", "--flavor", "fast", "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "unknown flavor" in r.output


def test_strict_placement_counts_cpu_nodes_only_on_ort_cuda():
    p = R.Prepared("ort-cuda", lambda feed: [], ["CUDAExecutionProvider", "CPUExecutionProvider"],
                   {"CPUExecutionProvider": ["Shape:n1", "MatMul:n2"], "CUDAExecutionProvider": ["Softmax:n3"]},
                   frozenset({"Shape:n1"}))  # what runtimes.shape_computations found in the graph
    assert p.cpu_nodes == ["MatMul:n2"]
    assert R.Prepared("ort-cpu", None, [], {"CPUExecutionProvider": ["MatMul:n"]}).cpu_nodes == []


def test_model_file_with_options_no_golden_case_has(tmp_path):
    path = tmp_path / "mha8.onnx"
    assert run("export", "--variant", "mha", "--heads", "8", "--causal", "-o", str(path)).exit_code == 0
    r = run("verify", str(path), "--runtimes", "torch,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {(row["model"], row["case"]) for row in doc["results"]} == {("mha8.onnx", "seeded-2x7"),
                                                                        ("mha8.onnx", "seeded-1x1")}
    assert all(row["expected"].endswith("seeded inputs") for row in doc["results"])


def test_verify_tables_are_readable_at_80_columns(golden_copy):
    from conftest import assert_fits_80
    runner = CliRunner(env={"COLUMNS": "80"})
    r = runner.invoke(main, ["verify", "--variant", "kernel", "--variant", "mha-tied", "--runtimes",
                             "torch,onnx-ref,ort-cpu", "--details"])
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    for head in ("run", "output", "max abs", "@ index", "mean", "median", "p99", "atol", "needs", "primitives",
                 "onnx-ref", "kernel-seeded", "mha-tied-10d-2h", "1.00e-05"):
        assert head in r.output, head
    _tamper(golden_copy, "posenc-seeded", update_manifest=True)
    r = runner.invoke(main, ["verify", "--variant", "posenc", "--runtimes", "torch,ort-cpu", "--golden",
                             str(golden_copy)])
    assert r.exit_code == 1
    assert_fits_80(r.output)
    assert "failures" in r.output and "needs atol" in r.output and "5.00e-01" in r.output


def _fixed_dims(v, o, spec):
    """{axis: size} of the axes a model with options `o` fixes in input `spec`."""
    symbolic = set(v.sizes(o))
    fixed = {}
    for axis, d in enumerate(spec.dims):
        if isinstance(d, int):
            fixed[axis] = d
        elif not all(p in symbolic for p in d.split("+")):
            fixed[axis] = o[d]
    return fixed


@pytest.mark.parametrize("name", ["sdpa", "mha", "cross", "decoder", "encoder", "self"])
def test_golden_cases_chosen_for_a_model_fit_its_fixed_axes(name):
    """A golden case is run through a model only where it fits: every axis the model fixes
    (sdpa's heads in the bsd layout, a model dimension) has the case's size. Random options,
    the golden cases' own options among them."""
    from conftest import draw_options
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from attnexport import variants as V
    v = V.get(name)
    cases = golden.load_all(variants=[name])

    checked = []

    def fits(o):
        for case in VF.matching_cases(v, o, cases):
            for spec in v.inputs(o):
                shape = case.inputs[spec.name].shape
                for axis, size in _fixed_dims(v, o, spec).items():
                    assert shape[axis] == size, f"{case.name} for {o}: {spec.name} axis {axis}"
                    checked.append((case.name, spec.name, axis))

    for case in cases:
        fits(case.options)
    # Some case is chosen for a model of some case's own options, with an axis it fixes: the
    # check above compared something.
    assert checked, f"no golden case of {name} was chosen for a model of its own options"

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        fits(draw_options(v, data))
    check()


def test_bsd_model_is_not_given_a_case_with_other_head_counts(tmp_path):
    """sdpa's heads are fixed in the bsd layout: the bsd golden case (other head counts) must not
    be chosen; seeded inputs at the model's head counts take its place."""
    path = tmp_path / "m.onnx"
    assert run("export", "--variant", "sdpa", "--layout", "bsd", "--heads", "4", "--kv-heads", "2", "--causal",
               "-o", str(path)).exit_code == 0
    r = run("verify", str(path), "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    assert {row["case"] for row in json.loads(r.output)["results"]} == {"seeded-2x7", "seeded-1x1"}


def test_verify_passes_every_correct_export(tmp_path):
    """The property: export with random valid options in a random flavour, then `verify MODEL`
    passes (a flavour that cannot express the options refuses at export, exit 1)."""
    from conftest import draw_options
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from attnexport import variants as V

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(["sdpa", "sdpa", "mha", "decoder", "cross"]),
           flavor=st.sampled_from(["primitives", "attention", "ort"]), data=st.data())
    def check(name, flavor, data):
        o = draw_options(V.get(name), data)
        args = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
                for k, v in o.items() if v not in (False, None)]
        path = tmp_path / "m.onnx"
        path.unlink(missing_ok=True)
        r = run("export", "--variant", name, "--flavor", flavor, *args, "-o", str(path))
        if r.exit_code == 1:  # the flavour cannot express these options: said, nothing written
            assert not path.exists()
            return
        assert r.exit_code == 0, (args, r.output)
        r = run("verify", str(path), "--runtimes", "ort-cpu")
        assert r.exit_code == 0, (args, r.output)
    check()


def test_a_model_with_an_infinite_weight_fails_with_the_reason_and_no_numpy_warning(tmp_path):
    import onnx
    from onnx import numpy_helper
    path = tmp_path / "mha.onnx"
    assert run("export", "--variant", "mha", "-o", str(path)).exit_code == 0
    model = onnx.load(path)
    init = next(i for i in model.graph.initializer if np.prod(i.dims) > 100)
    arr = numpy_helper.to_array(init).copy()
    arr.flat[0] = np.inf
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, path)
    r = run("verify", str(path), "--runtimes", "torch,onnx-ref,ort-cpu")
    assert r.exit_code == 1 and "weights changed since export" in r.output
    assert "RuntimeWarning" not in r.output and "Traceback" not in r.output


def test_a_module_export_verified_without_its_module_says_which_to_give(tmp_path):
    path = tmp_path / "block.onnx"
    spec = "examples/causal_self_attention.py:example"
    assert run("export", "--module", spec, "-o", str(path)).exit_code == 0
    r = run("verify", str(path), "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and f"`attnexport verify {path} --module {spec}`" in r.output


# Every kind of declared output, each spoiled alone: (case, its outputs, the ones spoiled here).
_OUTPUT_CASES = {"mha-kv-cache": ["output", "present_key", "present_value"], "sdpa-weights-bias": ["output", "weights"],
                 "decoder-kv-cache-first": ["output", "present_key", "present_value", "present_cross_key",
                                            "present_cross_value"]}
_SPOILED = [("mha-kv-cache", o, "ort-cpu") for o in _OUTPUT_CASES["mha-kv-cache"]] + \
    [("sdpa-weights-bias", o, rt) for o in ("output", "weights") for rt in ("ort-cpu", "torch")] + \
    [("decoder-kv-cache-first", o, "ort-cpu") for o in ("present_cross_key", "present_cross_value")]


@pytest.mark.parametrize("case, output, runtime", _SPOILED)
def test_a_wrong_value_in_any_one_declared_output_fails_the_run(monkeypatch, case, output, runtime):
    """Every declared output is compared: one element of one output off by 0.01 (a thousand
    times fp32's atol) fails the run, names that output, and only it."""
    def spoiled(prepare):
        def wrapper(*args, **kwargs):
            prepared = prepare(*args, **kwargs)
            run = prepared.run

            def spoiled_run(feed):
                outs = dict(run(feed))
                if output in outs:
                    bad = np.array(outs[output], copy=True)
                    bad.flat[bad.size // 2] += 0.01
                    outs[output] = bad
                return outs
            prepared.run = spoiled_run
            return prepared
        return wrapper
    monkeypatch.setattr(R, "prepare_onnx", spoiled(R.prepare_onnx))
    monkeypatch.setattr(R, "prepare_torch", spoiled(R.prepare_torch))
    report = VF.verify(cases=[case], flavors=["attention"], runtimes=[runtime])
    main_rows = [r for r in report.rows if r.case == case]
    assert main_rows and not any(r.passed for r in main_rows)
    for r in main_rows:
        failed = [c for c in r.comparisons if not c.passed]
        assert [c.name for c in failed] == [output], (r.case, failed)
        # Compared as a value (not flagged as unexpected or missing), and found 0.01 off.
        assert not failed[0].problem and failed[0].max_abs == pytest.approx(0.01, abs=1e-3)
        assert {c.name for c in r.comparisons} == set(_OUTPUT_CASES[case])


def test_verify_takes_a_request_or_its_fields():
    request = VF.VerifyRequest(cases=["posenc-seeded"], flavors=["primitives"], runtimes=["ort-cpu"])
    by_request, by_fields = VF.verify(request), VF.verify(cases=["posenc-seeded"], flavors=["primitives"],
                                                          runtimes=["ort-cpu"])
    assert by_request.ok and [r.case for r in by_request.rows] == [r.case for r in by_fields.rows] == ["posenc-seeded"]
    with pytest.raises(TypeError, match="not both"):
        VF.verify(request, cases=["mha-seeded"])


def test_verify_hf_leaves_torch_on_a_gpu_out_and_refuses_it_when_named():
    """verify --hf's reference is the model in torch on the CPU beside its float64 copy: torch-cuda
    is no runtime of that check. Taken by default it is left out with the reason; named, it is a
    one-line error. The registry decides (a module runtime on a device), not the name."""
    from onnx import TensorProto, helper

    from attnexport.errors import UsageError
    from attnexport.pretrained import precision

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    table = [{"name": n, "available": True, "reason": "", "used": True} for n in ("torch", "torch-cuda", "ort-cpu")]
    used = ["torch", "torch-cuda", "ort-cpu"]
    kept, out = precision.able_runtimes(model, used, table, None, None)
    assert kept == ["torch", "ort-cpu"]
    left = next(r for r in out if r["name"] == "torch-cuda")
    assert not left["used"] and "reference" in left["reason"] and "ort-cuda" in left["reason"]
    with pytest.raises(UsageError, match="torch-cuda"):
        precision.able_runtimes(model, used, table, ["torch-cuda", "ort-cpu"], None)
