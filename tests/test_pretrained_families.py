"""The model families (`attnexport.pretrained.families`): which configs each takes, what the
others are told, and a second decoder-only family as one class and one line in the table,
exported and verified as the first is. The `[hf]` extra, on small random configs."""

import json

import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import families  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402


class _Config:
    def __init__(self, *architectures, model_type="x"):
        self.architectures, self.model_type = list(architectures), model_type


def test_a_config_goes_to_the_family_of_its_architecture_and_any_other_is_told_what_each_takes():
    assert families.of_config(_Config("LlamaForCausalLM"), "src").task == "causal-lm"
    assert families.of_config(_Config("GPT2LMHeadModel"), "src").task == "causal-lm"
    assert families.of_config(_Config("BertModel"), "src").task == "feature-extraction"
    with pytest.raises(UsageError, match=r"--hf src: not a causal language model \(task causal-lm: architectures "
                                         r"ending in ForCausalLM or LMHeadModel, .*\) or not a sentence encoder "
                                         r"\(task feature-extraction: .*; its config lists T5Model\)"):
        families.of_config(_Config("T5Model"), "src")
    with pytest.raises(UsageError, match=r"its config lists none \(t5\)"):
        families.of_config(_Config(model_type="t5"), "src")


def test_a_task_no_family_records_is_refused():
    with pytest.raises(UsageError, match="task 'translation' is not one attnexport exports"):
        families.of_task("translation")


class HeadOnly(families.DecoderOnly):
    """GPT-2's kin (a language-model head on a decoder), exported without the static form."""

    task = "lm-head"
    what = "language model with an LM head"
    architectures = ("LMHeadModel",)
    forms = ("none", "concat")
    tested = ("gpt2",)


@pytest.fixture
def second_family(monkeypatch):
    """A second decoder-only family: its class above and one line in the table (first, so that it
    takes GPT-2 before the causal-lm family does)."""
    monkeypatch.setattr(families, "FAMILIES", {HeadOnly.task: HeadOnly(), **families.FAMILIES})


def test_a_second_decoder_only_family_is_a_class_and_a_line_and_exports_and_verifies(second_family, tiny_lm,
                                                                                     tmp_path):
    path = tmp_path / "gpt2.onnx"
    _, layout = hf_export.export_hf(hf_export.HFExport(tiny_lm("gpt2"), form="concat", output=path))
    model = onnx.load(path)
    recorded = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.signature"])["model"]
    assert recorded["task"] == "lm-head" and layout.family.task == "lm-head"
    assert hf.Layout.of(model).family is families.FAMILIES["lm-head"]
    report = verify_hf(HFCheck(path, tiny_lm("gpt2"), runtimes=["torch", "ort-cpu"]))
    assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
    assert all(r.variant == "concat (lm-head)" for r in report.rows)
    with pytest.raises(UsageError, match="--kv-cache for --hf is one of none, concat, got 'static'"):
        hf_export.export_hf(hf_export.HFExport(tiny_lm("gpt2"), form="static", max_seq=16, output=tmp_path / "s.onnx"))
    # The first family still takes what is its own.
    _, llama = hf_export.export_hf(hf_export.HFExport(tiny_lm("llama"), output=tmp_path / "llama.onnx"))
    assert llama.family.task == "causal-lm"
    assert not (tmp_path / "s.onnx").exists()
