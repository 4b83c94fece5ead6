"""The registry of families (`attnexport.pretrained.registry`): which configs each family takes and
what the others are told, a source and an export recognized by what they say of themselves (never
their files' names), a second decoder-only family as one class and one registration, exported and
verified as the first is, and a throwaway family in a package of its own, registered by one line,
exported and verified through the core. The `[hf]` extra, on small random configs."""

import json
import sys
import textwrap

import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import forms as FM  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import registry  # noqa: E402
from attnexport.pretrained.causal import CausalLM  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402


class _Config:
    def __init__(self, *architectures, model_type="x"):
        self.architectures, self.model_type = list(architectures), model_type


def test_a_config_goes_to_the_family_of_its_architecture_and_any_other_is_told_what_each_takes():
    assert registry.of_config(_Config("LlamaForCausalLM"), "src").task == "causal-lm"
    assert registry.of_config(_Config("GPT2LMHeadModel"), "src").task == "causal-lm"
    assert registry.of_config(_Config("BertModel"), "src").task == "feature-extraction"
    assert registry.of_config(_Config("WhisperForConditionalGeneration"), "src").task == "automatic-speech-recognition"
    with pytest.raises(UsageError, match=r"--hf src: not a causal language model \(task causal-lm: architectures "
                                         r"ending in ForCausalLM or LMHeadModel, .*\) or not a sentence encoder "
                                         r"\(task feature-extraction: .*; its config lists T5Model\)"):
        registry.of_config(_Config("T5Model"), "src")
    with pytest.raises(UsageError, match=r"its config lists none \(t5\)"):
        registry.of_config(_Config(model_type="t5"), "src")


def test_a_family_gives_its_own_forms_and_refuses_another_familys():
    """A form belongs to its family: a language model is never exported in an encoder's embed form
    nor an encoder in a language model's static form, whatever the forms' table holds."""
    families = dict(registry.families())
    lm, encoder = families["causal-lm"], families["feature-extraction"]
    assert {lm.form(n).name for n in lm.forms} == set(lm.forms)
    for family in families.values():
        others = {n for f in families.values() if f is not family for n in f.forms} - set(family.forms)
        for name in others:
            with pytest.raises(UsageError):
                family.form(name)
    assert "embed" in encoder.forms and "embed" not in lm.forms


@pytest.mark.parametrize("task, own, other", [
    ("causal-lm", "kl-mean=0.1", "cosine=0.5"),
    ("feature-extraction", "cosine=0.5", "kl-mean=1e-8"),
    ("image-feature-extraction", "retrieval=0.8", "kl-mean=1e-8"),
    ("automatic-speech-recognition", "wer=0.2", "cosine=0.5"),
    ("text2text-generation", "agreement=0.5", "cosine=0.5"),
])
def test_budget_is_parsed_by_the_family_s_own_budget(task, own, other):
    """`verify --budget` goes to the family's budget: its own limits taken, another family's refused in
    one line (an encoder's once took the language models' and judged by a fixed table)."""
    family = registry.of_task(task)
    assert family.budget(own) is not None
    with pytest.raises(UsageError):
        family.budget(other)


def test_a_task_no_family_records_is_refused():
    with pytest.raises(UsageError, match="task 'translation' is not one attnexport exports"):
        registry.of_task("translation")


def test_a_source_and_an_export_are_recognized_by_what_they_say_not_by_their_file_names(tiny_lm, tiny_encoder,
                                                                                        whisper_folder, tmp_path):
    """A source by its config (or a folder a family reads itself); an export by its config and its
    records: a folder named as Whisper's graphs are, with a T5 config, is no Whisper export."""
    assert registry.of_source(tiny_lm("llama")).task == "causal-lm"
    assert registry.of_source(tiny_encoder("bert")).task == "feature-extraction"
    assert registry.of_source(whisper_folder()).task == "automatic-speech-recognition"  # a CTranslate2 folder
    path = tmp_path / "lm.onnx"
    hf_export.export_hf(hf_export.HFExport(tiny_lm("llama"), output=path))
    assert registry.of_export(path).task == "causal-lm"
    t5 = tmp_path / "t5-folder"
    (t5 / "onnx").mkdir(parents=True)
    (t5 / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
        (t5 / "onnx" / name).write_bytes(b"")
    assert not registry.of_task("automatic-speech-recognition").exported(t5)
    assert registry.of_export(t5).task == "text2text-generation"  # the text encoder-decoders' own


class HeadOnly(CausalLM):
    """GPT-2's kin (a language-model head on a decoder), exported without the static form."""

    task = "lm-head"
    what = "language model with an LM head"
    architectures = ("LMHeadModel",)
    forms = ("none", "concat")
    tested = ("gpt2",)


@pytest.fixture
def second_family(monkeypatch):
    """A second decoder-only family: its class above and one registration (first, so that it takes
    GPT-2 before the causal-lm family does)."""
    registry.families()
    monkeypatch.setattr(registry, "FAMILIES", {HeadOnly.task: HeadOnly(), **registry.FAMILIES})


def test_a_second_decoder_only_family_is_a_class_and_a_line_and_exports_and_verifies(second_family, tiny_lm,
                                                                                     tmp_path):
    path = tmp_path / "gpt2.onnx"
    _, layout = hf_export.export_hf(hf_export.HFExport(tiny_lm("gpt2"), form="concat", output=path))
    model = onnx.load(path)
    recorded = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.signature"])["model"]
    assert recorded["task"] == "lm-head" and layout.family.task == "lm-head"
    assert hf.Layout.of(model).family is registry.FAMILIES["lm-head"]
    report = verify_hf(HFCheck(path, tiny_lm("gpt2"), runtimes=["torch", "ort-cpu"]))
    assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
    assert all(r.variant == "concat (lm-head)" for r in report.rows)
    with pytest.raises(UsageError, match="--kv-cache for --hf is one of none, concat, got 'static'"):
        hf_export.export_hf(hf_export.HFExport(tiny_lm("gpt2"), form="static", max_seq=16, output=tmp_path / "s.onnx"))
    # The first family still takes what is its own.
    _, llama = hf_export.export_hf(hf_export.HFExport(tiny_lm("llama"), output=tmp_path / "llama.onnx"))
    assert llama.family.task == "causal-lm"
    assert not (tmp_path / "s.onnx").exists()


# A family that nothing in attnexport knows: GPT-2's kin judged by its logits alone, its own package
# (a form of its own too), found by one line in PACKAGES. What it writes is its own: its class and its form.
THROWAWAY = {
    "__init__.py": '''
        """A throwaway family: a language model's head judged by its logits at every shape."""
        import importlib

        from attnexport.pretrained import forms as FM
        from attnexport.pretrained import registry


        class Throwaway(registry.Family):
            task = "throwaway-logits"
            what = "throwaway logits model"
            architectures = ("GPT2LMHeadModel",)
            auto_class = "AutoModelForCausalLM"
            forms = ("throwaway",)
            tested = ("gpt2",)


        registry.register(Throwaway())
        FM.register(importlib.import_module(f"{__name__}.form").Whole())
        ''',
    "form.py": '''
        """Its one form: the logits of a whole sequence, no cache."""
        import numpy as np
        import torch

        from attnexport.pretrained import forms as FM


        class Step(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


        class Whole(FM.CacheForm):
            name = "throwaway"
            kv_cache = False
            export_checks = (("batch 2, 6 tokens", 2, 6, 0, 0), ("batch 1, 1 token", 1, 1, 0, 0))
            verify_checks = (("batch 3, 4 tokens", 3, 4, 0, 0),)
            trace_shape = (5, 0)

            def inputs(self, layout):
                return ["input_ids", "attention_mask"]

            def outputs(self, layout):
                return ["logits"]

            def dynamic_axes(self, layout):
                return {n: {0: "batch", 1: "sequence"} for n in self.inputs(layout)}

            def wrapper(self, model, layout):
                return Step(model)

            def example_feed(self, layout, batch, block, past, seed, padded):
                ids = np.random.default_rng(seed).integers(3, layout.vocab, (batch, block), dtype=np.int64)
                return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

            def prefilled_feed(self, run, layout, ids, past, padded, dtype):
                return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

            def valid_positions(self, layout, feed):
                return {"logits": np.ones((*feed["input_ids"].shape, 1), bool)}
        ''',
}


@pytest.fixture
def throwaway_family(tmp_path, monkeypatch):
    """The throwaway family's package written in a temporary folder made importable as a package of
    attnexport.pretrained, and its one line in PACKAGES (first: it takes GPT-2)."""
    import attnexport.pretrained as package
    root = tmp_path / "families"
    (root / "throwaway").mkdir(parents=True)
    for name, text in THROWAWAY.items():
        (root / "throwaway" / name).write_text(textwrap.dedent(text))
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(root)])
    monkeypatch.setattr(registry, "PACKAGES", ("throwaway", *registry.PACKAGES))
    monkeypatch.setattr(registry, "FAMILIES", {})
    monkeypatch.setattr(FM, "FORMS", dict(FM.FORMS))  # its forms gone with it
    yield
    for name in [m for m in sys.modules if m.startswith("attnexport.pretrained.throwaway")]:
        del sys.modules[name]
    registry.FAMILIES.clear()


def test_a_throwaway_family_in_a_package_of_its_own_exports_and_verifies_through_the_core(throwaway_family, tiny_lm,
                                                                                          tmp_path):
    r = cli("export", "--hf", tiny_lm("gpt2"), "-o", tmp_path / "t.onnx", "--json")
    assert r.exit_code == 0, r.output
    model = onnx.load(tmp_path / "t.onnx")
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert hf.Layout.of(model).task == "throwaway-logits" and registry.of_export(tmp_path / "t.onnx").task == \
        "throwaway-logits"
    r = cli("verify", tmp_path / "t.onnx", "--hf", tiny_lm("gpt2"), "--runtimes", "ort-cpu,onnx-ref", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["results"]
    assert {row["runtime"] for row in rows} == {"ort-cpu", "onnx-ref"} and all(row["passed"] for row in rows)
    assert all(row["variant"] == "throwaway (throwaway-logits)" for row in rows)
    assert all(o["compared"] > 0 for row in rows for o in row["outputs"])
    r = cli("verify", tmp_path / "t.onnx", "--hf", tiny_lm("gpt2"), "--budget", "kl-mean=1")
    assert r.exit_code == 2 and "judged by no accuracy budget" in r.output


def test_no_family_is_named_outside_its_package_and_the_registry():
    """No module outside a family's package (and the registry's list of them) imports a family's
    package or holds a family's task or architecture in its code (docstrings and comments may say
    them: what they hold is not looked up)."""
    import ast
    from pathlib import Path

    import attnexport
    package = Path(attnexport.__file__).parent
    registry.families()
    names = {f.task for f in registry.FAMILIES.values()} | {a for f in registry.FAMILIES.values() for a in
                                                              f.architectures}
    homes = {package / "pretrained" / p for p in registry.PACKAGES}
    found = []
    for path in package.rglob("*.py"):
        if any(home in path.parents for home in homes) or path == package / "pretrained" / "registry.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                hit = [n for n in names if n in node.value]
                if hit:
                    found.append(f"{path.relative_to(package)}:{node.lineno} says {hit[0]!r}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                for m in modules:
                    if any(m == f"attnexport.pretrained.{p}" or m.startswith(f"attnexport.pretrained.{p}.")
                           for p in registry.PACKAGES):
                        found.append(f"{path.relative_to(package)}:{node.lineno} imports {m}")
    assert found == []
