import json
import shutil

from click.testing import CliRunner
from conftest import cli as run

from attnexport import golden
from attnexport import variants as V
from attnexport.cli import main


def test_list_table_shows_every_variant():
    r = run("list")
    assert r.exit_code == 0
    for name in ("sdpa", "mha-tied", "masked-softmax", "decoder"):
        assert name in r.output


def test_list_json():
    r = run("list", "--json")
    assert r.exit_code == 0
    rows = json.loads(r.output)
    assert len(rows) == len(V.VARIANTS)
    for row in rows:
        assert {"name", "inputs", "outputs", "options"} <= set(row)
    sdpa = next(r for r in rows if r["name"] == "sdpa")
    assert [i["name"] for i in sdpa["inputs"]] == ["query", "key", "value", "attn_mask", "nonpad_kv_seqlen",
                                                       "past_key", "past_value"]
    assert sdpa["inputs"][3]["optional"] and not sdpa["inputs"][0]["optional"]
    # A cache input says which output carries it on, and how (what an app binds its cache by).
    assert {i["name"]: i.get("cache") for i in sdpa["inputs"] if "cache" in i} == {
        "past_key": {"output": "present_key", "kind": "concat"},
        "past_value": {"output": "present_value", "kind": "concat"}}
    decoder = next(r for r in rows if r["name"] == "decoder")
    assert {i["cache"]["kind"] for i in decoder["inputs"] if "cache" in i} == {"concat", "cross"}
    assert {o["flag"] for o in sdpa["options"]} >= {"--causal", "--scale", "--softcap", "--mask", "--weights"}


def test_golden_check_clean():
    r = run("golden", "--check")
    assert r.exit_code == 0, r.output
    assert f"{len(golden.CASES)} cases match" in r.output


def test_golden_check_drift_exits_1(tmp_path):
    d = tmp_path / "g"
    shutil.copytree(golden.default_dir(), d)
    case = golden.load("kernel-seeded", d)
    case.expected["output"] = case.expected["output"] * 2
    data = golden._to_bytes(case)
    (d / "kernel-seeded.npz").write_bytes(data)
    m = json.loads((d / golden.MANIFEST).read_text())
    m["files"]["kernel-seeded.npz"] = golden.sha256(data)
    (d / golden.MANIFEST).write_text(json.dumps(m))
    r = run("golden", "--check", "--dir", str(d))
    assert r.exit_code == 1
    assert "kernel-seeded" in r.output


def test_golden_damaged_exits_2(tmp_path):
    d = tmp_path / "g"
    shutil.copytree(golden.default_dir(), d)
    (d / "kernel-seeded.npz").write_bytes(b"not a zip")
    r = run("golden", "--check", "--dir", str(d))
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1].startswith("error: golden file damaged")
    assert "Traceback" not in r.output


def test_golden_write(tmp_path):
    """--write writes every case; of what was there it removes only a case file its earlier
    manifest listed, and names the user's own files, which stay."""
    (tmp_path / "my_experiment.npz").write_bytes(b"the user's")
    (tmp_path / "retired-case.npz").write_bytes(b"a case of an older attnexport")
    (tmp_path / golden.MANIFEST).write_text(json.dumps({"format": 1, "files": {"retired-case.npz": "0" * 64}}))
    r = run("golden", "--write", "--dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert f"wrote {len(golden.CASES)} golden cases" in r.output
    assert (tmp_path / "my_experiment.npz").read_bytes() == b"the user's"
    assert not (tmp_path / "retired-case.npz").exists()
    assert r.output.strip().splitlines()[-1] == "left 1 file(s) there that are not golden cases: my_experiment.npz"
    assert set(golden.read_manifest(tmp_path)) == set(golden.read_manifest())
    for name in golden.CASES:  # array by array: the last bits may differ on another CPU
        assert golden.differences(golden.load(name), golden.load(name, tmp_path)) == [], name


def test_export_and_inspect(tmp_path):
    out = tmp_path / "cross.onnx"
    r = run("export", "--variant", "cross", "--flavor", "ort", "--heads", "2", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert r.output.count("\n") == 1
    assert "flavor ort" in r.output and "com.microsoft.MultiHeadAttention" in r.output
    r = run("inspect", str(out), "--json")
    assert r.exit_code == 0
    d = json.loads(r.output)
    assert d["attention_op"] == "com.microsoft.MultiHeadAttention"
    assert d["attnexport"]["variant"] == "cross" and d["attnexport"]["options"]["heads"] == 2
    assert d["inputs"][0]["dims"] == ["batch", "seq", 32]
    r = run("inspect", str(out))
    assert r.exit_code == 0 and "com.microsoft.MultiHeadAttention" in r.output


def test_export_no_core_says_so(tmp_path):
    r = run("export", "--variant", "kernel", "--flavor", "attention", "-o", str(tmp_path / "k.onnx"))
    assert r.exit_code == 0 and "no dot-product core" in r.output


def _one_line_error(r, code):
    assert r.exit_code == code, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output


def test_export_errors(tmp_path):
    o = str(tmp_path / "x.onnx")
    _one_line_error(run("export", "--variant", "nope", "-o", o), 2)
    _one_line_error(run("export", "--variant", "mha", "--heads", "5", "-o", o), 2)
    _one_line_error(run("export", "--variant", "posenc", "--causal", "-o", o), 2)
    _one_line_error(run("export", "--variant", "mha", "--flavor", "attention", "--opset", "17", "-o", o), 2)
    blocker = tmp_path / "file"
    blocker.write_text("")
    _one_line_error(run("export", "--variant", "mha", "-o", str(blocker / "x.onnx")), 2)
    _one_line_error(run("export", "--variant", "sdpa", "--flavor", "ort", "--softcap", "1", "-o", o), 1)
    assert not (tmp_path / "x.onnx").exists()


def test_inspect_errors(tmp_path):
    _one_line_error(run("inspect", str(tmp_path / "missing.onnx")), 2)
    (tmp_path / "empty.onnx").write_bytes(b"")
    _one_line_error(run("inspect", str(tmp_path / "empty.onnx")), 2)
    (tmp_path / "text.onnx").write_text("hello, not a model")
    _one_line_error(run("inspect", str(tmp_path / "text.onnx")), 2)
    good = tmp_path / "good.onnx"
    assert run("export", "--variant", "posenc", "-o", str(good)).exit_code == 0
    (tmp_path / "cut.onnx").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _one_line_error(run("inspect", str(tmp_path / "cut.onnx")), 2)


def test_list_and_inspect_are_readable_at_80_columns(tmp_path):
    from conftest import assert_fits_80
    runner = CliRunner(env={"COLUMNS": "80"})
    r = runner.invoke(main, ["list"])
    assert r.exit_code == 0
    assert_fits_80(r.output)
    assert "{sqrt|none|norm|cosine|" in r.output and "--kv-heads=auto" in r.output
    path = tmp_path / "m.onnx"
    assert runner.invoke(main, ["export", "--variant", "mha", "-o", str(path)]).exit_code == 0
    r = runner.invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0 and "8 parameters fingerprinted" in r.output
    assert_fits_80(r.output)


def test_golden_list_names_every_case_with_its_provenance():
    r = run("golden", "--list")
    assert r.exit_code == 0
    lines = r.output.strip().splitlines()
    assert len(lines) == len(golden.CASES)
    assert any(line.split()[:2] == ["kernel-nadaraya-watson", "kernel"] and
               line.endswith("worked example, 001_efde4ef825fe046a.txt") for line in lines)
    assert any(line.split() == ["mha-seeded", "mha", "seeded"] for line in lines)


def test_verify_names_close_cases_and_the_kinds_of_expected_values(tmp_path):
    r = run("verify", "--case", "mha-sead", "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "close: mha-seeded" in r.output and "golden --list" in r.output
    path = tmp_path / "m.onnx"
    assert run("export", "--variant", "mha", "--heads", "8", "-o", str(path)).exit_code == 0
    r = run("verify", str(path), "--runtimes", "ort-cpu")
    assert r.exit_code == 0, r.output
    assert "cases, expected from reference (the model's own parameters), seeded inputs: seeded-2x7, seeded-1x1" \
        in r.output
    r = run("verify", "--case", "mha-seeded", "--runtimes", "ort-cpu", "--flavor", "attention")
    assert "cases, expected from golden: mha-seeded" in r.output


def test_details_wrap_between_names_at_80_columns(tmp_path):
    from conftest import assert_fits_80
    path = tmp_path / "mha-step.onnx"
    assert run("export", "--variant", "mha", "--kv-cache", "--causal", "-o", str(path)).exit_code == 0
    r = run("verify", str(path), "--runtimes", "ort-cpu", "--details", env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    cells = [line[:20].strip() for line in r.output.splitlines()]
    assert "mha-step.onnx:" in cells and "mha-kv-cache-empty/" in cells and "decode-1" in cells


def _strict(text):
    """json.loads that refuses NaN and Infinity, as Node's JSON.parse and strict parsers do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_the_json_of_a_failing_verify_and_of_an_untimed_bench_row_is_strict(tmp_path):
    """A model whose output is NaN and Inf, and a bench row that did not run (NaN times): every
    non-finite number is null (attnexport.jsonout), for Python's strict parsing and Node's."""
    import subprocess

    import numpy as np
    import onnx
    from onnx import numpy_helper
    path = tmp_path / "m.onnx"
    assert run("export", "--variant", "self", "-o", str(path)).exit_code == 0
    model = onnx.load(path)
    for i, init in enumerate(model.graph.initializer):
        if init.name == "W_v":  # an infinite weight: outputs Inf and NaN
            w = numpy_helper.to_array(init).copy()
            w[0, 0] = np.inf
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, "W_v"))
    onnx.save(model, path)
    r = run("verify", str(path), "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 1
    verify_doc = _strict(r.stdout)
    assert not verify_doc["summary"]["ok"]
    loc = verify_doc["results"][0]["localization"]
    assert loc["error"] is None and loc["scale"] is None  # were Infinity and NaN
    r = run("bench", "--variant", "sdpa", "--softcap", "5", "--runtimes", "torch,ort-cpu", "--flavor", "ort",
            "--iters", "2", "--warmup", "0", "--repeat", "1", "--json")
    assert r.exit_code == 0, r.output
    rows = _strict(r.stdout)
    untimed = [row for row in rows if row["flavor"] == "ort"]
    assert untimed and untimed[0]["median_ms"] is None and "softcap" in untimed[0]["note"]
    node = shutil.which("node")
    if node is None:
        return  # Python's strict parse above stands; Node is on the development and CI machines
    for text in (json.dumps(verify_doc), r.stdout):
        (tmp_path / "doc.json").write_text(text)
        p = subprocess.run([node, "-e", "JSON.parse(require('fs').readFileSync(process.argv[1], 'utf8'))",
                            str(tmp_path / "doc.json")], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr


def test_closed_choices_are_listed_and_completed():
    """--variant, --flavor, --dtype, --runtimes and the variants' choice options list their values in --help and
    complete in shells; a wrong one is attnexport's one line, exit 2."""
    from attnexport.options import RUNTIME_LIST
    text = run("bench", "--help").output
    for shown in ("[primitives|attention|ort]", "[fp32|fp16]", "[torch|torch-cuda|ort-cpu|ort-cuda|ort-node|",
                  "[bhsd|bsd]", "INTEGER RANGE", "[sdpa|self|mha|mha-tied|cross|"):
        assert shown in text, shown
    completed = [c.value for c in RUNTIME_LIST.shell_complete(None, None, "torch,ort-c")]
    assert completed == ["torch,ort-cpu", "torch,ort-cuda"]
    r = run("export", "--variant", "mha", "--flavor", "atention")
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: Invalid value for '--flavor': unknown flavor 'atention' (did you mean attention?); valid: primitives, "
        "attention, ort (see `attnexport export --help`)"]
    r = run("verify", "--variant", "mah")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "unknown variant 'mah' (did you mean 'mha'?); valid: sdpa, self, mha" in r.output
    r = run("bench", "--variant", "mha", "--runtimes", "onnx-ref")
    assert r.exit_code == 2 and "unknown runtime 'onnx-ref' for bench; valid: torch, torch-cuda, ort-cpu" in r.output
