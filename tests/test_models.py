"""Every module against the float64 reference: golden cases, random seeded shapes, edge cases."""

import numpy as np
import pytest
import torch
from conftest import draw_options, run_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnexport import golden, seeding
from attnexport import variants as V
from attnexport.compare import compare, tolerance

CASE_NAMES = list(golden.CASES)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, "fp64"), (torch.float32, "fp32")])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_module_matches_golden(name, dtype, tol):
    case = golden.load(name)
    v = V.get(case.variant)
    got = run_module(v, case.options, case.params, case.inputs, dtype)
    assert set(got) == set(case.expected)
    for out, expected in case.expected.items():
        c = compare(out, got[out], expected, tolerance(tol))
        assert c, f"{name}: {c}"


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_module_matches_reference_on_random_shapes(name):
    v = V.get(name)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**16), data=st.data())
    def check(seed, data):
        o = draw_options(v, data)
        params, inputs = seeding.init_params(v, o, seed), seeding.make_inputs(v, o, seed)
        expected = v.reference(params, inputs, o)
        for dtype, tol in ((torch.float64, "fp64"), (torch.float32, "fp32")):
            got = run_module(v, o, params, inputs, dtype)
            for out in expected:
                c = compare(out, got[out], expected[out], tolerance(tol))
                assert c, f"{name} {o}: {c}"

    check()


def test_sdpa_fully_masked_rows_are_zero():
    case = golden.load("sdpa-fully-masked-rows")
    got = run_module(V.get("sdpa"), case.options, case.params, case.inputs)
    assert (got["output"][0, :, 1] == 0).all() and (got["weights"][1, :, 3] == 0).all()
    assert not np.isnan(got["output"]).any()


def test_mha_all_padding_sequence_gives_bias_only():
    case = golden.load("mha-padding-all-masked")
    got = run_module(V.get("mha"), case.options, case.params, case.inputs)
    # Every row of sequence 1 attends to nothing: weights 0, output = out_proj's bias.
    assert (got["weights"][1] == 0).all()
    np.testing.assert_allclose(got["output"][1], np.broadcast_to(case.params["out_proj.bias"], (16, 64)), atol=1e-6)


@pytest.mark.parametrize("name", ["additive-zero-length", "masked-softmax-zero-length"])
def test_valid_length_zero(name):
    case = golden.load(name)
    got = run_module(V.get(case.variant), case.options, case.params, case.inputs)
    key = "weights" if "weights" in got else "probs"
    assert (got[key][0] == 0).all() and not np.isnan(got[key]).any()
    if "output" in got:
        assert (got["output"][0] == 0).all()


FP16_CASES = ["sdpa-gqa-causal-bool", "sdpa-softcap-float-mask", "sdpa-fully-masked-rows", "mha-causal-gqa",
              "mha-padding-all-masked", "self-scaling-sqrt", "additive-zero-length", "masked-softmax-zero-length",
              "encoder-padding", "decoder-padding", "cross-padding", "mha-tied-10d-2h", "posenc-table"]


@pytest.mark.parametrize("name", FP16_CASES)
def test_fp16_masks_do_not_overflow(name):
    """In fp16 the masks must stay masks: no NaN, no leak, results within the fp16 tolerance."""
    case = golden.load(name)
    v = V.get(case.variant)
    got = run_module(v, case.options, case.params, case.inputs, torch.float16)
    for out, expected in case.expected.items():
        assert not np.isnan(got[out]).any(), f"{name}.{out} has NaN in fp16"
        c = compare(out, got[out], expected, tolerance("fp16"))
        assert c, f"{name}: {c}"


def test_no_overflowing_mask_constants_in_the_package():
    """No numeric literal that overflows fp16 (|x| > 65504) in the code that builds masks."""
    import io
    import pathlib
    import tokenize

    import attnexport
    root = pathlib.Path(attnexport.__file__).parent
    for path in [*root.joinpath("models").rglob("*.py"), root / "onnx_attention.py", root / "reference.py"]:
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NUMBER and "j" not in tok.string.lower():
                assert abs(float(tok.string)) <= 65504, f"{path.name}:{tok.start[0]}: {tok.string}"
