"""flavors: the one registry of flavour names, their ops, opsets and help."""

import pytest

from attnexport import dtypes as D
from attnexport import flavors as FL
from attnexport.errors import UsageError
from attnexport.onnx_attention import TRANSLATIONS


def test_names_are_checked_in_one_place_with_a_close_match():
    assert FL.check("ort") == "ort" and FL.check_all(None) == ["primitives", "attention", "ort"]
    with pytest.raises(UsageError, match=r"unknown flavor 'atention' \(did you mean attention\?\); valid: primitives"):
        FL.check_all(["primitives", "atention"])
    with pytest.raises(UsageError, match="unknown dtype 'bf16'; valid: fp32, fp16"):
        D.check("bf16")
    assert FL.help_text() == "primitives | attention | ort" and D.help_text() == "fp32 | fp16"


def test_each_flavour_has_one_translation_and_its_ops_name_it():
    assert set(TRANSLATIONS) == set(FL.FLAVORS)
    assert FL.FUSED_OPS[("", "Attention")] == "Attention"
    assert FL.FUSED_OPS[("com.microsoft", "GroupQueryAttention")] == "com.microsoft.GroupQueryAttention"
    assert [FL.of_op(op) for op in ("Attention", "com.microsoft.MultiHeadAttention", "MatMul+Softmax", "none")] == \
        ["attention", "ort", "primitives", "primitives"]


@pytest.mark.parametrize("flavor, given, lowest, want", [("primitives", None, None, 18), ("primitives", 17, None, 17),
                                                         ("attention", None, None, 23), ("attention", None, 24, 24),
                                                         ("ort", 18, None, 18)])
def test_opset_for(flavor, given, lowest, want):
    assert FL.opset_for(flavor, given, lowest) == want


@pytest.mark.parametrize("flavor, opset", [("primitives", 16), ("attention", 18), ("ort", 23)])
def test_an_opset_the_flavour_cannot_declare_is_refused(flavor, opset):
    with pytest.raises(UsageError, match=f"--opset {opset} is not available for the {flavor} flavor"):
        FL.opset_for(flavor, opset)

