import json
import shutil

from click.testing import CliRunner

from attnexport import golden
from attnexport.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_list_table_shows_every_variant():
    r = run("list")
    assert r.exit_code == 0
    for name in ("sdpa", "mha-tied", "masked-softmax", "decoder"):
        assert name in r.output


def test_list_json():
    r = run("list", "--json")
    assert r.exit_code == 0
    rows = json.loads(r.output)
    assert len(rows) == 11
    for row in rows:
        assert {"name", "inputs", "outputs", "options"} <= set(row)
    sdpa = next(r for r in rows if r["name"] == "sdpa")
    assert [i["name"] for i in sdpa["inputs"]] == ["query", "key", "value", "attn_mask"]
    assert sdpa["inputs"][3]["optional"] and not sdpa["inputs"][0]["optional"]
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
    m["files"]["kernel-seeded.npz"] = golden._sha256(data)
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
    r = run("golden", "--write", "--dir", str(tmp_path))
    assert r.exit_code == 0
    assert golden.read_manifest(tmp_path) == golden.read_manifest()
