"""attnexport.seeding: example inputs and parameters from a seed, with NumPy only."""

import numpy as np

from attnexport import seeding
from attnexport import variants as V


def test_the_same_seed_gives_the_same_arrays_and_another_seed_others():
    v = V.get("mha")
    o = v.resolve({"mask": "padding"})
    a, b, c = (seeding.make_inputs(v, o, s) for s in (3, 3, 4))
    assert a.keys() == b.keys() == {"x", "mask"}
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["x"], c["x"])
    p, q = seeding.init_params(v, o, 0), seeding.init_params(v, o, 0)
    assert p.keys() == q.keys() and all(np.array_equal(p[k], q[k]) and p[k].dtype == np.float32 for k in p)


def test_inputs_have_their_specs_shapes_and_kinds():
    v = V.get("sdpa")
    o = v.resolve({"mask": "bool", "nonpad": True, "batch": 3, "seq": 4, "kv_seq": 6})
    inputs = seeding.make_inputs(v, o, 0)
    for spec in v.inputs(o):
        assert inputs[spec.name].shape == spec.shape(o), spec.name
    assert inputs["attn_mask"].dtype == np.bool_
    lens = inputs["nonpad_kv_seqlen"]
    assert lens.dtype == np.int64 and lens.min() >= 1 and lens.max() <= 6


def test_a_padding_mask_keeps_every_sequence_at_least_one_position():
    v = V.get("mha")
    o = v.resolve({"mask": "padding", "batch": 16, "seq": 5})
    mask = seeding.make_inputs(v, o, 1)["mask"]
    assert mask.dtype == np.bool_ and mask[:, 0].all()
    assert (np.diff(mask.astype(int), axis=1) <= 0).all()  # valid positions first, then padding


def test_static_cache_write_positions_differ_per_sequence():
    assert seeding.write_positions({"past_seq": 5, "batch": 3}).tolist() == [5, 4, 3]
    assert seeding.write_positions({"past_seq": 1, "batch": 3}).tolist() == [1, 0, 0]


def test_parameters_load_into_the_module_by_name():
    import torch
    v = V.get("self")
    o = v.resolve({})
    params = seeding.init_params(v, o, 0)
    module = seeding.load_params(v.build(o), params)
    for name, t in module.state_dict().items():
        assert torch.equal(t, torch.from_numpy(params[name]))
