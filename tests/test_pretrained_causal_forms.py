"""A language model's cache forms (`attnexport.pretrained.causal.forms`): each form's feeds agree
with its own inputs, axes and signature, and a fourth form is one class and one line in the table,
exported and verified as the three are. The `[hf]` extra, on a small random config."""

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import forms  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.causal import CausalLM  # noqa: E402
from attnexport.pretrained.causal import forms as CF  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402


@pytest.mark.parametrize("name", CausalLM.forms)
def test_every_feed_a_form_makes_is_its_inputs_and_its_axes_name_only_them(name):
    layout = hf.Layout(name, layers=2, kv_heads=1, head_dim=4, vocab=11, max_seq=16)
    form = layout.cache_form
    assert list(hf.example_feed(layout)) == layout.inputs
    assert set(form.dynamic_axes(layout)) == set(layout.inputs)
    decoding = form.decoding(layout, [np.array([3, 4, 5]), np.array([6])], 2, np.float32)
    assert list(decoding.feed) == layout.inputs
    written = np.zeros((2, 1, form.cache_positions(layout, 3), 4), np.float32)
    outputs = {"logits": np.zeros((2, 3, 11), np.float32), **{q: written for q in layout.cache_pairs.values()}}
    decoding.advance(np.array([7, 8]), outputs)
    assert list(decoding.feed) == layout.inputs and decoding.feed["input_ids"].shape[0] == 2
    block = form.block_feed(layout, np.ones((2, 3), np.int64), 0, form.empty_caches(layout, 2, np.float32))
    assert sorted(block) == sorted(layout.inputs)
    signature = layout.signature
    assert signature.pairs == layout.cache_pairs and {c.kind for c in signature.caches} <= {form.kind}
    assert layout.outputs == ["logits", *layout.cache_pairs.values()]


def test_a_form_is_refused_by_name_with_the_family_s_forms():
    with pytest.raises(Exception, match="one of none, concat, static, got 'ring'"):
        CausalLM().form("ring")


class PastNamed(CF.ConcatCache):
    """The concat step with its caches named as older exports named them: past.{i}.key in,
    present.{i}.key out."""

    name = "past-named"

    def cache_names(self, layout, prefix):
        return super().cache_names(layout, "past" if prefix == "past_key_values" else prefix)


@pytest.fixture
def fourth_form(monkeypatch):
    """A fourth form: its class above and one line in the table (and the family's list of forms)."""
    monkeypatch.setitem(forms.FORMS, PastNamed.name, PastNamed())
    monkeypatch.setattr(CausalLM, "forms", (*CausalLM.forms, PastNamed.name))


def test_a_fourth_form_is_a_class_and_a_line_and_exports_and_verifies(fourth_form, tiny_lm, tmp_path):
    path = tmp_path / "named.onnx"
    result, layout = hf_export.export_hf(hf_export.HFExport(tiny_lm("llama"), form="past-named", output=path))
    model = onnx.load(path)
    assert [i.name for i in model.graph.input][3:5] == ["past.0.key", "past.0.value"]
    assert [o.name for o in model.graph.output][:2] == ["logits", "present.0.key"]
    assert hf.Layout.of(model).form == "past-named" and result.checked  # checked before writing
    report = verify_hf(HFCheck(path, tiny_lm("llama"), runtimes=["torch", "ort-cpu"]))
    rows = report.rows
    assert rows and all(row.passed for row in rows), [(r.case, r.runtime, r.error) for r in rows if not r.passed]
    assert {r.runtime for r in rows if r.case.startswith("generate")} == {"torch", "ort-cpu"}
    assert sum(r.case.startswith("decode") for r in rows) == 4  # the decode property, as a cache form has it
