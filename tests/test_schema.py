"""attnexport.schema: options resolved and checked, tensors' shapes, the memory guard."""

import pytest

from attnexport import schema
from attnexport import variants as V
from attnexport.errors import UsageError


def test_resolve_fills_defaults_and_refuses_what_the_variant_does_not_take():
    v = V.get("mha")
    o = v.resolve({"heads": 2, "dim": 8})
    assert o["heads"] == 2 and o["kv_heads"] == 2 and set(o) == {opt.name for opt in v.options}
    with pytest.raises(UsageError, match="--softcap is not an option of variant 'mha'"):
        v.resolve({"softcap": 1.0})
    with pytest.raises(UsageError, match="--heads must be int"):
        v.resolve({"heads": "two"})
    with pytest.raises(UsageError, match="--batch must be an integer >= 1"):
        v.resolve({"batch": 0})


def test_float_options_are_finite_and_bounded():
    v = V.get("sdpa")
    assert v.resolve({"scale": 2})["scale"] == 2.0  # an int is taken as a float
    for bad in (float("inf"), float("nan"), 1e39):
        with pytest.raises(UsageError, match="--scale must be a finite number in"):
            v.resolve({"scale": bad})


def test_tensor_shapes_read_sizes_and_their_sums():
    spec = schema.TensorSpec("mask", ("batch", "seq", "past_seq+seq"), "bool")
    assert spec.shape({"batch": 2, "seq": 3, "past_seq": 4}) == (2, 3, 7)


def test_sizes_and_graph_options_split_the_options():
    v = V.get("mha")
    o = v.resolve({"batch": 3, "seq": 9, "heads": 2, "dim": 8})
    assert v.sizes(o) == {"batch": 3, "seq": 9}
    graph = v.graph_options(o)
    assert "batch" not in graph and "seq" not in graph and graph["heads"] == 2


def test_the_memory_guard_refuses_what_cannot_fit(monkeypatch):
    v = V.get("mha")
    o = v.resolve({"batch": 64, "seq": 4096})
    need = schema.memory_estimate(v, o)
    assert need > 64 * 4096 * 4096 * 4  # the score matrix of every head is counted
    monkeypatch.setattr(schema, "machine_memory", lambda: need // 2)
    with pytest.raises(UsageError, match="needs at least"):
        schema.check_memory(v, o)
    monkeypatch.setattr(schema, "machine_memory", lambda: need * 4)
    schema.check_memory(v, o)
