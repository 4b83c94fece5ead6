import pytest

from attnexport import variants as V
from attnexport.errors import UnknownVariantError, UsageError

ALL = ("sdpa", "self", "mha", "mha-tied", "cross", "additive", "masked-softmax", "kernel",
       "posenc", "encoder", "decoder")


def test_registry_has_every_variant():
    assert tuple(V.VARIANTS) == ALL


@pytest.mark.parametrize("name", ALL)
def test_defaults_resolve_and_describe(name):
    v = V.get(name)
    o = v.resolve()
    assert all(opt.name in o for opt in v.options)
    assert v.flops(o) > 0
    specs = v.inputs(o)
    assert specs and all(len(s.shape(o)) == len(s.dims) for s in specs)
    assert set(v.dynamic) <= set(o), "dynamic axes must name size options"


def test_unknown_variant_suggests_closest():
    with pytest.raises(UnknownVariantError, match="did you mean 'mha'"):
        V.get("mhaa")


def test_option_not_taken_lists_valid_ones():
    with pytest.raises(UsageError, match="--softcap is not an option of variant 'mha'"):
        V.get("mha").resolve({"softcap": 1.0})


@pytest.mark.parametrize("given, message", [
    ({"heads": 5}, "--heads \\(5\\) must divide --dim \\(64\\)"),
    ({"kv_heads": 3}, "--kv-heads \\(3\\) must divide --heads \\(4\\)"),
    ({"scaling": "cube"}, "--scaling must be one of"),
    ({"batch": 0}, "--batch must be an integer >= 1"),
    ({"past_seq": -1}, "--past-seq must be an integer >= 0"),
    ({"temperature": 0.0}, r"--temperature must be a finite number in \[0.001, 1000\]"),
])
def test_bad_options(given, message):
    with pytest.raises(UsageError, match=message):
        V.get("mha").resolve(given)


@pytest.mark.parametrize("given,message", [
    ({"mask": "bool", "mask_rank": 5}, "--mask-rank must be 2, 3 or 4"),
    ({"mask": "bool", "mask_heads": 3}, "--mask-heads must be 1 or --heads \\(8\\), got 3"),
    ({"mask": "bool", "mask_batch": 3}, "--mask-batch must be 1 or --batch \\(2\\), got 3"),
    ({"mask": "bool", "mask_rank": 3, "mask_batch": 2}, "a rank-3 mask has no batch axis"),
    ({"mask": "bool", "mask_rank": 2, "mask_heads": 8}, "a rank-2 mask has no head axis"),
])
def test_bad_sdpa_mask_shapes(given, message):
    with pytest.raises(UsageError, match=message):
        V.get("sdpa").resolve(given)


def test_sdpa_mask_shapes():
    v = V.get("sdpa")
    shape = {r: next(s for s in v.inputs(v.resolve({"mask": "bool", "mask_rank": r})) if s.name == "attn_mask")
             .shape(v.resolve({"mask": "bool", "mask_rank": r})) for r in (2, 3, 4)}
    assert shape == {4: (2, 1, 16, 16), 3: (1, 16, 16), 2: (16, 16)}  # the batch axis only at rank 4


def test_kv_heads_defaults_to_heads():
    assert V.get("mha").resolve({"heads": 8})["kv_heads"] == 8


def test_seeded_inputs_and_params_are_reproducible():
    v = V.get("mha")
    o = v.resolve({"mask": "padding"})
    a, b = V.make_inputs(v, o, 3), V.make_inputs(v, o, 3)
    assert all((a[k] == b[k]).all() for k in a)
    p, q = V.init_params(v, o, 3), V.init_params(v, o, 3)
    assert all((p[k] == q[k]).all() for k in p)
    assert not (V.make_inputs(v, o, 4)["x"] == a["x"]).all()
