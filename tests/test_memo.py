"""cache: exports kept by content; a damaged or unreadable entry is a miss, never an error."""

import json
import os

import onnx
import pytest
from conftest import cli
from onnx import helper

from attnexport import memo
from attnexport.errors import UsageError


def _model():
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    return helper.make_model(graph)


def test_put_then_get_and_damage_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNEXPORT_CACHE", str(tmp_path / "c"))
    k = memo.key({"variant": "x", "options": {"a": 1}})
    assert memo.get(k) is None
    memo.put(k, _model(), {"attention_op": "none", "note": ""})
    model, info = memo.get(k)
    assert model.graph.node[0].op_type == "Identity" and info["attention_op"] == "none"
    (tmp_path / "c" / f"{k}.onnx").write_bytes(b"damaged")
    assert memo.get(k) is None


def test_keys_follow_the_request_and_off_turns_it_off(monkeypatch):
    assert memo.key({"a": 1, "b": 2}) == memo.key({"b": 2, "a": 1}) != memo.key({"a": 1, "b": 3})
    for off in ("off", "0", ""):
        monkeypatch.setenv("ATTNEXPORT_CACHE", off)
        assert memo.directory() is None
        memo.put("k", _model(), {})  # nothing to write to, and no error


def test_the_limit_is_a_size_or_a_one_line_error(monkeypatch):
    monkeypatch.delenv("ATTNEXPORT_CACHE_SIZE", raising=False)
    assert memo.limit() == memo.DEFAULT_LIMIT == 2 * 2**30
    for text, n in (("500M", 500 * 2**20), ("4G", 4 * 2**30), ("1.5GiB", int(1.5 * 2**30)), ("1234", 1234)):
        monkeypatch.setenv("ATTNEXPORT_CACHE_SIZE", text)
        assert memo.limit() == n
    monkeypatch.setenv("ATTNEXPORT_CACHE_SIZE", "lots")
    with pytest.raises(UsageError, match="ATTNEXPORT_CACHE_SIZE='lots' is not a size"):
        memo.limit()


def _entry(d, k, size, used, current):
    (d / f"{k}.onnx").write_bytes(b"m" * size)
    record = d / f"{k}.json"
    record.write_text(json.dumps({"sha256": "-", "code": memo._code_hash() if current else "older", "result": {}}))
    os.utime(record, (used, used))


def test_pruning_removes_other_versions_first_then_the_least_recently_used(tmp_path):
    d = tmp_path
    keys = {name: name * 64 for name in "abcd"}
    _entry(d, keys["a"], 1000, used=400, current=True)   # the newest use
    _entry(d, keys["b"], 1000, used=100, current=True)   # the least recently used of this version
    _entry(d, keys["c"], 1000, used=300, current=True)
    _entry(d, keys["d"], 1000, used=500, current=False)  # another version's, however recent
    (d / "notes.txt").write_text("the user's")          # not an entry: never touched
    sizes = {e.key: e.size for e in memo.entries(d)}    # a model and its record
    assert memo.prune(d, sizes[keys["a"]] + sizes[keys["c"]]) == [keys["d"], keys["b"]]
    assert {e.key for e in memo.entries(d)} == {keys["a"], keys["c"]}
    assert (d / "notes.txt").read_text() == "the user's"


def test_a_put_keeps_the_cache_within_its_limit_and_a_hit_is_a_use(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNEXPORT_CACHE", str(tmp_path))
    k1, k2, k3 = (memo.key({"n": i}) for i in range(3))
    memo.put(k1, _model(), {})
    one = memo.entries()[0].size  # a model and its record: every entry here has this size
    monkeypatch.setenv("ATTNEXPORT_CACHE_SIZE", str(2 * one))
    memo.put(k2, _model(), {})
    os.utime(tmp_path / f"{k1}.json", (1, 1))
    os.utime(tmp_path / f"{k2}.json", (2, 2))
    assert memo.get(k1) is not None  # a use: k1 is now the most recent
    memo.put(k3, _model(), {})
    assert {e.key for e in memo.entries()} == {k1, k3}


def test_the_cache_command_shows_and_clears_only_its_entries(tmp_path, monkeypatch):

    monkeypatch.setenv("ATTNEXPORT_CACHE", str(tmp_path))
    monkeypatch.setenv("ATTNEXPORT_CACHE_SIZE", "1G")
    memo.put(memo.key({"n": 1}), _model(), {})
    _entry(tmp_path, "e" * 64, 10, used=5, current=False)
    (tmp_path / "notes.txt").write_text("the user's")
    r = cli("cache")
    assert r.exit_code == 0 and r.output.startswith(f"{tmp_path}: 2 entries,") and "of 1.00 GiB" in r.output
    assert "1 of this version, 1 of other versions" in r.output
    doc = json.loads(cli("cache", "--json").stdout)
    assert doc["entries"] == 2 and doc["limit_bytes"] == 2**30 and doc["directory"] == str(tmp_path)
    r = cli("cache", "--clear")
    assert r.exit_code == 0 and r.output.strip() == f"removed 2 entries from {tmp_path}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    monkeypatch.setenv("ATTNEXPORT_CACHE_SIZE", "much")
    r = cli("cache")
    assert r.exit_code == 2 and r.output.strip().startswith("error: ATTNEXPORT_CACHE_SIZE='much' is not a size")
