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


@pytest.mark.parametrize("flavor, given, needs, want", [
    ("primitives", None, (), 18), ("primitives", 17, (), 17), ("attention", None, (), 23),
    ("attention", None, ("--kv-cache static",), 24), ("attention", 24, ("--nonpad",), 24),
    ("ort", 18, ("--kv-cache static",), 18), ("primitives", None, ("--nonpad",), 18)])
def test_opset_for(flavor, given, needs, want):
    assert FL.opset_for(flavor, given, needs) == want


@pytest.mark.parametrize("option", ["--nonpad", "--kv-cache static"])
def test_what_needs_a_newer_opset_is_said_once_and_named(option):
    """The attention flavour's opset-24 needs live in its table entry: asked for below it, the
    option is named; other flavours do not need it."""
    assert dict(FL.FLAVORS["attention"].needs)[option] == 24
    with pytest.raises(UsageError, match=f"--opset 23: {option} needs opset 24 for the attention flavor"):
        FL.opset_for("attention", 23, [option])
    assert all(not f.needs for name, f in FL.FLAVORS.items() if name != "attention")


@pytest.mark.parametrize("flavor, opset", [("primitives", 16), ("attention", 18), ("ort", 23)])
def test_an_opset_the_flavour_cannot_declare_is_refused(flavor, opset):
    with pytest.raises(UsageError, match=f"--opset {opset} is not available for the {flavor} flavor"):
        FL.opset_for(flavor, opset)



def test_a_flavours_rules_are_read_from_its_line(monkeypatch):
    """Whether a flavour's attention is fused (which decides the fallback for a variant without a
    dot-product core, and which graphs may keep torch's NaN rows) and whether a language model is
    rewritten into fused ops are fields of its line, not its name: a line added under another
    name with the unfused flavour's rules and translations exports as that flavour does."""
    import dataclasses

    from attnexport import export as E
    from attnexport import onnx_attention as OA
    from attnexport import variants as V
    assert [f.name for f in FL.FLAVORS.values() if not f.fused] == [FL.UNFUSED_FLAVOR] == ["primitives"]
    assert [f.name for f in FL.FLAVORS.values() if f.fuses_language_models] == ["ort"]
    no_core = next(v for v in V.VARIANTS.values() if not v.dot_product_core)
    assert E.graph_flavor(no_core, "ort") == FL.UNFUSED_FLAVOR and E.graph_flavor(V.get("mha"), "ort") == "ort"
    monkeypatch.setitem(FL.FLAVORS, "plain", dataclasses.replace(FL.FLAVORS["primitives"], name="plain"))
    monkeypatch.setitem(OA.TRANSLATIONS, "plain", OA.TRANSLATIONS["primitives"])
    model, result = E.build_model("mha", {}, "plain", use_cache=False)
    assert result.attention_op == "MatMul+Softmax" and not any(n.domain for n in model.graph.node)
