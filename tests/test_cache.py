"""cache: exports kept by content; a damaged or unreadable entry is a miss, never an error."""

import onnx
from onnx import helper

from attnexport import cache


def _model():
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    return helper.make_model(graph)


def test_put_then_get_and_damage_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNEXPORT_CACHE", str(tmp_path / "c"))
    k = cache.key({"variant": "x", "options": {"a": 1}})
    assert cache.get(k) is None
    cache.put(k, _model(), {"attention_op": "none", "note": ""})
    model, info = cache.get(k)
    assert model.graph.node[0].op_type == "Identity" and info["attention_op"] == "none"
    (tmp_path / "c" / f"{k}.onnx").write_bytes(b"damaged")
    assert cache.get(k) is None


def test_keys_follow_the_request_and_off_turns_it_off(monkeypatch):
    assert cache.key({"a": 1, "b": 2}) == cache.key({"b": 2, "a": 1}) != cache.key({"a": 1, "b": 3})
    for off in ("off", "0", ""):
        monkeypatch.setenv("ATTNEXPORT_CACHE", off)
        assert cache.directory() is None
        cache.put("k", _model(), {})  # nothing to write to, and no error
