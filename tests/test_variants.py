import pytest

from attnexport import seeding
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
    a, b = seeding.make_inputs(v, o, 3), seeding.make_inputs(v, o, 3)
    assert all((a[k] == b[k]).all() for k in a)
    p, q = seeding.init_params(v, o, 3), seeding.init_params(v, o, 3)
    assert all((p[k] == q[k]).all() for k in p)
    assert not (seeding.make_inputs(v, o, 4)["x"] == a["x"]).all()


def _plain_attention(q, k, v, mask, past_key, past_value, nonpad, scale, causal, softcap, mode, precision):
    """The core's shapes with plain torch matmuls, so that torch's FlopCounterMode sees them (the
    core op itself is opaque to it). Only the shapes matter for counting."""
    import torch
    if past_key is not None:
        k, v = torch.cat([past_key, k], 2), torch.cat([past_value, v], 2)
    group = q.shape[1] // k.shape[1]
    w = torch.softmax(q @ k.repeat_interleave(group, 1).transpose(-1, -2), -1)
    return w @ v.repeat_interleave(group, 1), k, v, w


# FLOPs torch's counter does not see (it counts matrix products only), from each definition:
# the broadcast add W_q q + W_k k (additive); per query-key pair the difference, its square,
# the halving, the negation and the exponent (kernel); the softmax's max, subtraction, exponent,
# sum and division per score (masked-softmax); the sin or cos, the division of the angle, the
# power and the add per element (posenc).
ELEMENTWISE = {
    "additive": lambda o: o["batch"] * o["seq"] * o["kv_seq"] * o["hidden"],
    "kernel": lambda o: 5 * o["batch"] * o["seq"] * o["kv_seq"],
    "masked-softmax": lambda o: 5 * o["batch"] * o["seq"] * o["kv_seq"],
    "posenc": lambda o: 4 * o["batch"] * o["seq"] * o["dim"],
}
FLOP_OPTIONS = [({}, name) for name in V.VARIANTS] + [
    ({"kv_cache": True, "causal": True}, "mha"), ({"kv_heads": 2}, "mha"), ({"kv_cache": True, "causal": True}, "sdpa"),
    ({"kv_heads": 2, "v_head_dim": 16}, "sdpa"), ({"kv_cache": True}, "decoder"), ({"kv_cache": True, "kv_seq": 0,
                                                                                    "past_kv_seq": 5}, "decoder"),
    ({"kv_dim": 48}, "cross"), ({"learnable_bandwidth": True}, "kernel")]


@pytest.mark.parametrize("given, name", FLOP_OPTIONS)
def test_flop_count_is_torchs_own(given, name):
    """The registry's FLOP count (every TFLOP/s and peak fraction of bench rests on it) against
    torch's FlopCounterMode on the module itself, the attention core's matmuls included."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from attnexport.models import core
    v = V.get(name)
    o = v.resolve(given)
    module = seeding.load_params(v.build(o), seeding.init_params(v, o, 0)).eval()
    args = [torch.from_numpy(a) for a in seeding.make_inputs(v, o, 0).values()]
    counter = FlopCounterMode(display=False)
    original = core.attention
    core.attention = _plain_attention
    try:
        with counter, torch.no_grad():
            module(*args)
    finally:
        core.attention = original
    assert counter.get_total_flops() > 0 or name in ELEMENTWISE
    assert v.flops(o) == counter.get_total_flops() + ELEMENTWISE.get(name, lambda o: 0)(o), given
