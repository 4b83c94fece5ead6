"""The step signature: every export records its inputs, outputs, symbolic axes, cache pairs (with
their kind) and write position; verify reads it back, and a graph that no longer matches it is
refused."""

import json

import numpy as np
import onnx
import pytest
from conftest import cli

from attnexport import export as E
from attnexport import signature as SG
from attnexport.decode import decode_all
from attnexport.errors import UsageError

STATIC = ["--cache", "key_cache:key_cache_out", "--cache", "value_cache:value_cache_out"]


def test_a_signature_survives_its_json():
    signature = SG.StepSignature(
        ("x", "key_cache", "value_cache", "pos"), ("output", "key_cache_out", "value_cache_out"),
        {"x": {0: "batch", 1: "x_len"}}, (SG.CachePair("key_cache", "key_cache_out", 2, "static"),
                                          SG.CachePair("value_cache", "value_cache_out", 2, "static")),
        SG.WritePos("pos", "shared", (1,), "int32"), {"output": 1})
    assert SG.StepSignature.from_json(signature.to_json()) == signature
    assert signature.static and signature.growing == set()
    with pytest.raises(ValueError, match="kind is one of"):
        SG.CachePair("a", "b", 2, "rolling")


@pytest.mark.parametrize("variant, options, kinds, write", [
    ("mha", {}, {}, None),
    ("mha", {"kv_cache": True}, {"past_key": "concat", "past_value": "concat"}, None),
    ("mha", {"kv_cache": True, "max_seq": 32}, {"key_cache": "static", "value_cache": "static"}, "write_pos"),
    ("decoder", {"kv_cache": True}, {"past_key": "concat", "past_value": "concat", "past_cross_key": "cross",
                                     "past_cross_value": "cross"}, None),
])
def test_a_variants_export_records_its_signature(tmp_path, variant, options, kinds, write):
    path = E.export(variant, options, "primitives", output=tmp_path / "m.onnx").path
    model = onnx.load(path)
    signature = SG.of(model)
    inits = {i.name for i in model.graph.initializer}
    assert signature.inputs == tuple(i.name for i in model.graph.input if i.name not in inits)
    assert signature.outputs == tuple(o.name for o in model.graph.output)
    assert {c.past: c.kind for c in signature.caches} == kinds
    assert all(c.present in signature.outputs and c.axis == 2 for c in signature.caches)
    assert (signature.write_pos.name if signature.write_pos else None) == write
    assert signature.dynamic_axes["x"][0] == "batch"  # the graph's own axis names


def _renamed_output(tmp_path, path):
    """The file with its first output renamed, as a hand edit after export would leave it."""
    model = onnx.load(path)
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = ["renamed" if o == old else o for o in node.output]
    model.graph.output[0].name = "renamed"
    changed = tmp_path / "changed.onnx"
    onnx.save(model, changed)
    return changed


def test_a_graph_changed_after_export_is_refused_in_one_line(tmp_path):
    spec, path = "examples/kv_cache_module.py:example", tmp_path / "m.onnx"
    cache = ["--cache", "past_key:present_key", "--cache", "past_value:present_value"]
    r = cli("export", "--module", spec, *cache, "-o", str(path))
    assert r.exit_code == 0, r.output
    changed = _renamed_output(tmp_path, path)
    r = cli("verify", str(changed), "--module", spec, "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "changed after export" in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    model = onnx.load(path)  # a record that is not JSON
    for p in model.metadata_props:
        if p.key == SG.META:
            p.value = "{not json"
    with pytest.raises(UsageError, match="damaged"):
        SG.of(model)


def test_a_file_from_before_signatures_is_read_from_its_old_record(tmp_path):
    """Exports made before `attnexport.signature` recorded a module's caches as
    `attnexport.cache` and `attnexport.write_pos`: verify still decodes them."""
    spec, path = "examples/static_cache_module.py:example", tmp_path / "m.onnx"
    r = cli("export", "--module", spec, *STATIC, "--write-pos", "write_pos", "-o", str(path))
    assert r.exit_code == 0, r.output
    model = onnx.load(path)
    recorded = SG.of(model)
    old = {"attnexport.cache": json.dumps(recorded.cache()), "attnexport.write_pos": json.dumps(
        {"input": "write_pos", "form": "start"})}
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != SG.META]
    del model.metadata_props[:]
    for k, v in [*kept, *old.items()]:
        model.metadata_props.add(key=k, value=v)
    before = tmp_path / "before.onnx"
    onnx.save(model, before)
    r = cli("verify", str(before), "--module", spec, "--runtimes", "ort-cpu", "--json")
    decode_rows = [row for row in json.loads(r.output)["results"] if row["case"].startswith("decode")]
    assert r.exit_code == 0 and len(decode_rows) == 2 and all(row["passed"] for row in decode_rows), r.output


def test_decoding_follows_the_signatures_kinds():
    """A concat cache must grow by the block; a cross cache is carried as the step gives it."""
    def step(feed):
        x = feed["x"]
        return {"output": x * 2, "present_key": np.concatenate([feed["past_key"], x[:, None]], axis=2),
                "present_cross": feed["past_cross"] + 0}
    stream = {"x": np.ones((1, 4, 3), np.float32)}
    empty = {"past_key": np.zeros((1, 1, 0, 3), np.float32), "past_cross": np.ones((1, 1, 5, 3), np.float32)}
    signature = SG.StepSignature(caches=(SG.CachePair("past_key", "present_key", 2, "concat"),
                                         SG.CachePair("past_cross", "present_cross", 2, "cross")))
    out, last = decode_all(step, stream, 2, empty, 1, layout=signature)
    assert out["output"].shape == (1, 4, 3) and last["past_cross"].shape == (1, 1, 5, 3)
    stuck = SG.StepSignature(caches=(SG.CachePair("past_cross", "present_cross", 2, "concat"),
                                     SG.CachePair("past_key", "present_key", 2, "concat")))
    with pytest.raises(ValueError, match="positions after"):
        decode_all(step, stream, 2, empty, 1, layout=stuck)
    # A cache input the signature pairs with nothing is refused, not guessed from its name.
    with pytest.raises(ValueError, match="pairs no output with the cache input.s. past_key, past_cross"):
        decode_all(step, stream, 2, empty, 1)


def test_a_variants_signature_is_what_its_inputs_declare_not_what_they_are_called():
    """The cache pairs come from each input's declared part (`TensorSpec.cache`): an input named
    like a cache but declaring none is not one, and a cache named otherwise is one, with its kind."""
    import dataclasses

    from attnexport import variants as V
    from attnexport.schema import TensorSpec

    decoder = V.get("decoder")
    o = decoder.resolve({"kv_cache": True})
    renamed = {"past_key": "history_k", "past_cross_key": "memory_k"}

    def inputs(opts):
        return tuple(dataclasses.replace(s, name=renamed.get(s.name, s.name)) for s in decoder.inputs(opts)) + \
            (TensorSpec("past_notes", ("batch", "seq"), "float"),)
    signature = V.step_signature(dataclasses.replace(decoder, inputs=inputs), o)
    assert {(c.past, c.present, c.kind, c.axis) for c in signature.caches} == {
        ("history_k", "present_key", "concat", 2), ("past_value", "present_value", "concat", 2),
        ("memory_k", "present_cross_key", "cross", 2), ("past_cross_value", "present_cross_value", "cross", 2)}
    assert signature.write_pos is None
    static = V.step_signature(V.get("mha"), V.get("mha").resolve({"kv_cache": True, "max_seq": 32}))
    assert {(c.past, c.present, c.kind) for c in static.caches} == {("key_cache", "key_cache_out", "static"),
                                                                    ("value_cache", "value_cache_out", "static")}
    assert static.write_pos is not None and static.write_pos.name == "write_pos"


def test_a_decode_check_splits_a_steps_inputs_by_their_declared_axes_not_their_names():
    """What runs along the sequence, what is given once and what starts empty come from the
    caches' declared pairs and the axes the variant declares: sdpa's cache renamed (no
    `past_key` beside `key`) still streams its new keys and values, and the decoder's memory
    (the length its cross cache grows by) is given once, whatever its name."""
    import dataclasses

    from attnexport import seeding
    from attnexport import variants as V
    from attnexport.decode import empty_cache, split_inputs

    def renamed(variant, names):
        def rename(specs):
            return tuple(dataclasses.replace(s, name=names.get(s.name, s.name),
                                             cache=s.cache and (names.get(s.cache[0], s.cache[0]), s.cache[1]))
                         for s in specs)
        return dataclasses.replace(variant, inputs=lambda o: rename(variant.inputs(o)),
                                   outputs=lambda o: rename(variant.outputs(o)))

    sdpa = renamed(V.get("sdpa"), {"past_key": "history_k", "past_value": "history_v", "present_key": "new_k",
                                   "present_value": "new_v"})
    o = sdpa.resolve({"kv_cache": True, "causal": True, "seq": 3, "kv_seq": 3, "past_seq": 2})
    signature = V.step_signature(sdpa, o)
    feed = seeding.make_inputs(sdpa, o, 0)
    stream, once, masks = split_inputs(sdpa, o, feed, signature)
    assert list(stream) == ["query", "key", "value"] and once == {} and masks == {}
    empty = empty_cache(sdpa, o, np.float32, signature)
    assert set(empty) == {"history_k", "history_v"} and all(v.shape[2] == 0 for v in empty.values())

    decoder = renamed(V.get("decoder"), {"memory": "encoded", "past_cross_key": "enc_k"})
    for options in ({"kv_cache": True}, {"kv_cache": True, "max_seq": 16}):
        o = decoder.resolve(options)
        signature = V.step_signature(decoder, o)
        stream, once, masks = split_inputs(decoder, o, seeding.make_inputs(decoder, o, 0), signature)
        assert list(stream) == ["x"] and list(once) == ["encoded"] and masks == {}
    o = decoder.resolve({"kv_cache": True, "past_seq": 4, "past_kv_seq": 5})
    empty = empty_cache(decoder, o, np.float32, V.step_signature(decoder, o))
    assert {n: v.shape[2] for n, v in empty.items()} == {"past_key": 0, "past_value": 0, "enc_k": 0,
                                                        "past_cross_value": 0}
