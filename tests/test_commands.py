"""commands: the command line's export, verify and bench as library calls, with the same refusals
and the same results as the command line (which only parses, calls them and prints)."""

import json

import pytest
from click.testing import CliRunner
from conftest import cli

from attnexport import commands
from attnexport.cli import main
from attnexport.errors import UsageError

# (command line, the same request as a library call): each is refused, with one line.
REFUSED = [
    (["export", "--variant", "mha", "--rtol", "1e-3"], lambda: commands.export("mha", rtol=1e-3)),
    (["export", "--variant", "mha", "--hf", "x"], lambda: commands.export("mha", hf_path="x")),
    (["export", "--variant", "mha", "--precision", "int4"], lambda: commands.export("mha", precision="int4")),
    (["export", "--variant", "mha", "--cache", "a:b"], lambda: commands.export("mha", cache_specs=["a:b"])),
    (["export", "--module", "m.py:f", "--cache", "a"], lambda: commands.export(module_spec="m.py:f",
                                                                               cache_specs=["a"])),
    (["export", "--variant", "mha", "--kv-cache", "static"], lambda: commands.export("mha", kv_cache="static")),
    (["export", "--variant", "mha", "--deploy", "d"], lambda: commands.export("mha", deploy="d")),
    (["verify", "--budget", "kl=0.1"], lambda: commands.verify(budget="kl=0.1")),
    (["verify", "a.onnx", "--module", "m.py:f", "--flavor", "ort"],
     lambda: commands.verify(["a.onnx"], module_spec="m.py:f", flavors=["ort"])),
    (["verify", "--input", "x:1,2"], lambda: commands.verify(input_specs=["x:1,2"])),
    (["bench", "--variant", "mha", "--seq", "8,x"], lambda: commands.bench("mha", seq="8,x")),
    (["bench", "--variant", "mha", "--context", "8"], lambda: commands.bench("mha", context="8")),
    (["bench", "--variant", "mha", "--precision", "int4"], lambda: commands.bench("mha", precisions_text="int4")),
    (["bench", "--hf", "x", "--decode", "--precision", "int3"],
     lambda: commands.bench(hf_path="x", decode=True, precisions_text="int3")),
]


@pytest.mark.parametrize("argv,call", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_the_library_refuses_what_the_command_line_refuses_in_the_same_words(argv, call):
    with pytest.raises(UsageError) as e:
        call()
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: {e.value}"]


def test_an_export_and_its_verify_from_python_are_the_command_lines(tmp_path):
    cli_path, api_path = tmp_path / "cli.onnx", tmp_path / "api.onnx"
    r = cli("export", "--variant", "mha", "--kv-cache", "--heads", "2", "--dim", "16",
            "--flavor", "attention", "-o", str(cli_path), "--json")
    assert r.exit_code == 0, r.output
    result = commands.export("mha", kv_cache="concat", heads=2, dim=16, flavor="attention", output=str(api_path))
    from_cli, from_api = json.loads(r.output), result.to_dict()
    assert from_api["options"] == from_cli["options"] and from_api["options"]["kv_cache"] is True
    assert {k: v for k, v in from_api.items() if k not in ("path", "options")} == \
        {k: v for k, v in from_cli.items() if k not in ("path", "options")}
    assert api_path.read_bytes() == cli_path.read_bytes()
    report = commands.verify([str(api_path)], runtimes=["ort-cpu"])
    assert report.ok and report.rows and all(r.comparisons for r in report.rows if not r.skipped)
    r = cli("verify", str(cli_path), "--runtimes", "ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    assert [(x["case"], x["passed"]) for x in json.loads(r.output)["results"]] == \
        [(x.case, x.passed) for x in report.rows]


def test_bench_from_python_returns_the_rows_the_command_prints_as_json():
    result = commands.bench("mha", heads=2, dim=16, batch="1", seq="4,8", runtimes=["torch", "ort-cpu"],
                            flavors=["attention"], warmup=0, iters=2, repeat=1)
    assert result.family is None and result.title == "mha" and result.plot is None
    shapes = {(r.runtime, r.shape_label) for r in result.rows}
    assert len(shapes) == 4 and {rt for rt, _ in shapes} == {"torch", "ort-cpu"}
    rows = result.to_json()
    assert len(rows) == len(result.rows) and all(r["median_ms"] > 0 for r in rows)
