"""What every family's verify shares (`attnexport.pretrained.check`): the export's family verifies it
(recognized from its record), the request's options a family takes not refused in one line, a
folder's step graph found, the parameters row. The [hf] extra, on a small random config."""

import json

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import check as C  # noqa: E402


@pytest.fixture(scope="module")
def exported(tiny_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "llama.onnx"
    assert cli("export", "--hf", tiny_lm("llama"), "--kv-cache", "-o", out).exit_code == 0
    return out


def test_the_family_of_the_export_verifies_it_and_the_rows_name_it(exported, tiny_lm):
    report = C.verify_hf(C.HFCheck(exported, tiny_lm("llama"), runtimes=["ort-cpu"], new_tokens=4))
    assert report.ok and all(r.variant == "concat (causal-lm)" for r in report.rows)
    assert C.family_of_file(exported).task == "causal-lm"


def test_what_the_family_takes_not_is_refused_in_one_line(exported, tiny_lm, tmp_path):
    for args, said in ((["--audio", "clip.wav"], "--audio: a causal language model's verify takes no audio"),
                       (["--clients", "optimum"], "--clients load a deployment folder"),
                       (["--budget", "cosine=0.5"], "--budget cosine=0.5: the limits are kl-mean")):
        r = cli("verify", exported, "--hf", tiny_lm("llama"), *args)
        assert r.exit_code == 2 and said in r.output and len(r.output.strip().splitlines()) == 1, (args, r.output)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UsageError, match="holding one of onnx/model.onnx"):
        C.model_file(tmp_path / "empty")
    r = cli("verify", tmp_path / "absent.onnx", "--hf", tiny_lm("llama"))
    assert r.exit_code == 2 and "no such file" in r.output


def test_a_file_of_other_parameters_fails_its_parameters_row_and_runs_nothing_else(exported, tiny_lms, tmp_path):
    other = tmp_path / "other"
    tiny_lms.save("llama", other, seed=1)
    report = C.verify_hf(C.HFCheck(exported, other, runtimes=["ort-cpu"], new_tokens=4))
    assert [r.case for r in report.rows] == ["parameters"] and not report.ok
    assert "the model's parameters differ from" in report.rows[0].error


def test_a_language_model_is_verified_in_two_passes_and_its_source_let_go_before_the_sessions(
        exported, tiny_lm, monkeypatch):
    # torch's side of every row first, then the source model let go (nothing refers to it: the
    # kernel can unmap its weights) before ONNX Runtime maps the file; the rows as one pass gives them.
    import gc
    import weakref

    from attnexport.pretrained import model as hf
    loaded, alive_at_sessions = [], []
    load, prepared = hf.load, C._prepared

    def watched_load(*args, **kwargs):
        model, info = load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model, info

    def watched_prepared(*args, **kwargs):
        gc.collect()
        alive_at_sessions.append(loaded[0]() is not None)
        return prepared(*args, **kwargs)
    monkeypatch.setattr(hf, "load", watched_load)
    monkeypatch.setattr(C, "_prepared", watched_prepared)
    report = C.verify_hf(C.HFCheck(exported, tiny_lm("llama"), runtimes=["torch", "ort-cpu"], new_tokens=4))
    assert report.ok and alive_at_sessions == [False]
    phases = [p["name"] for p in report.resources["phases"]]
    assert phases.index("expectations") < phases.index("sessions") < phases.index("rows")
    cases = list(dict.fromkeys(r.case for r in report.rows))
    assert cases[0].startswith("batch ") and cases[-1].startswith("generate 4 tokens")
    for case in cases:  # each case's rows together, torch's first where it has one
        runtimes = [r.runtime for r in report.rows if r.case == case]
        assert runtimes in (["ort-cpu"], ["torch", "ort-cpu"]), (case, runtimes)
    assert [r for r in report.rows if r.runtime == "torch"]


def test_a_two_pass_verify_reads_back_only_what_its_first_pass_computed():
    ctx = C.Context(*[None] * 10, expectations={}, expecting=True)
    assert ctx.expect("a", lambda: 1) == 1
    with pytest.raises(ValueError, match="two rows expect under one key"):
        ctx.expect("a", lambda: 2)
    ctx.expecting = False
    assert ctx.expect("a", lambda: 3) == 1
    with pytest.raises(ValueError, match="was not computed before the source model was let go"):
        ctx.expect("b", lambda: 4)
