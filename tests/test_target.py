"""A target (`attnexport.target`): the module an export traces and torch runs, fed by its inputs'
names, with the signature its export records."""

import numpy as np
import pytest
import torch

from attnexport import export as E
from attnexport import seeding
from attnexport import signature as S
from attnexport import target as T
from attnexport import variants as V
from attnexport.compare import compare_outputs, tolerance

STATIC = {"batch": 2, "seq": 1, "dim": 32, "heads": 4, "kv_cache": True, "max_seq": 8}


def _target(name, options):
    variant = V.get(name)
    o = variant.resolve(options)
    return variant, o, T.of_variant(variant, o, seeding.init_params(variant, o, 0))


@pytest.mark.parametrize("name, options", [("mha", {"batch": 2, "seq": 5, "dim": 32, "heads": 4}),
                                           ("decoder", {"batch": 2, "seq": 4, "dim": 32, "heads": 4,
                                                        "kv_cache": True, "past_seq": 3}),
                                           ("mha", STATIC)])
def test_a_variants_target_computes_its_reference_whatever_order_it_is_fed_in(name, options):
    variant, o, target = _target(name, options)
    assert target.inputs == tuple(s.name for s in variant.inputs(o))
    assert target.outputs == tuple(s.name for s in variant.outputs(o))
    feed = seeding.make_inputs(variant, o, 1)
    reversed_feed = dict(reversed(list(feed.items())))  # a feed is matched by name, not by position
    with torch.no_grad():
        out = target.module()(*target.args(reversed_feed))
    out = out if isinstance(out, tuple) else (out,)
    got = {n: t.numpy() for n, t in zip(target.outputs, out, strict=False)}
    params = seeding.init_params(variant, o, 0)
    expected = {n: np.asarray(v, np.float64) for n, v in variant.reference(params, feed, o).items()}
    if V.static_cache(o):  # the buffers past each sequence's written positions are not compared
        for n in ("key_cache_out", "value_cache_out"):
            got.pop(n, None)
            expected.pop(n, None)
    comparisons = compare_outputs([n for n in target.outputs if n in expected], got, expected, tolerance("fp32"))
    assert comparisons and all(c.passed for c in comparisons), [c for c in comparisons if not c.passed]


def test_each_use_builds_its_own_module_in_its_own_dtype():
    _, _, target = _target("mha", {"batch": 1, "seq": 3, "dim": 32, "heads": 4})
    half, full = target.module("fp16"), target.module("fp32")
    assert next(half.parameters()).dtype == torch.float16 and next(full.parameters()).dtype == torch.float32
    assert not half.training and not full.training


def test_a_feed_without_one_of_its_inputs_is_refused_by_name():
    variant, o, target = _target("mha", {"batch": 1, "seq": 3, "dim": 32, "heads": 4})
    feed = seeding.make_inputs(variant, o, 1)
    dropped = target.inputs[-1]
    del feed[dropped]
    with pytest.raises(ValueError, match=f"mha takes {dropped}, which the feed lacks"):
        target.args(feed)


def test_the_signature_is_the_one_its_export_records():
    variant, o, target = _target("mha", STATIC)
    model, _ = E.build_model("mha", STATIC, "attention")
    recorded = S.of(model)
    assert recorded is not None and target.signature.static
    assert recorded.caches == target.signature.caches and recorded.write_pos == target.signature.write_pos
    assert recorded.inputs == target.inputs and recorded.outputs == target.outputs


def test_a_modules_target_is_what_its_export_records_and_what_bench_declares(tmp_path):
    """A user's module: its inputs, outputs and cache pairs worked out once (target.of_module), for
    its export and its bench alike: the export records the same names and pairs, and bench's
    variant of the module declares every output it returns (it declared one `output` before)."""
    from attnexport import bench as B
    from attnexport import modules as M
    from attnexport.errors import UsageError
    module, inputs = M.load("examples/kv_cache_module.py:example")
    cache = {"past_key": "present_key", "past_value": "present_value"}
    target = T.of_module(module, inputs, "step", cache=cache)
    assert target.inputs == ("x", "past_key", "past_value")
    assert target.outputs == ("output", "present_key", "present_value")
    assert target.signature.pairs == {"past_key": "present_key", "past_value": "present_value"}
    assert {c.kind for c in target.signature.caches} == {"concat"}
    result = E.export_module(module, inputs, flavor="attention", output=tmp_path / "m.onnx", name="step", cache=cache)
    recorded = S.of(result.model)
    assert recorded.pairs == target.signature.pairs and tuple(recorded.outputs) == target.outputs
    assert tuple(recorded.inputs) == target.inputs
    variant = B.module_variant("step", module, inputs)
    assert tuple(s.name for s in variant.outputs(variant.resolve({}))) == target.outputs
    with pytest.raises(UsageError, match="present_query is not an output of step"):
        T.of_module(module, inputs, "step", cache={"past_key": "present_query"})
    with pytest.raises(UsageError, match="--output-names gives 1 name"):
        T.of_module(module, inputs, "step", output_names=["y"])
