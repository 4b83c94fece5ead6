"""verify of a text encoder-decoder's deployment folder (`attnexport.pretrained.seq2seq.check` through
the encoder-decoder core): T5 and Marian on every runtime, each graph against float64, the decode
property and greedy outputs token for token with transformers' `generate` (Marian's padding never
generated, its end token forced at the budget's last position); Marian's static self cache; a changed
weight caught; int8 judged by the generation budget, whose limits `--budget` takes and no other. The
[hf] extra, on small random configs."""

import json
import shutil

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained.check import HFCheck, verify_hf  # noqa: E402
from attnexport.pretrained.seq2seq import check as SC  # noqa: E402
from attnexport.pretrained.seq2seq import texts as T  # noqa: E402

RUNTIMES = ["torch", "onnx-ref", "ort-cpu", *(["ort-node"] if R.status("ort-node").available else [])]


@pytest.fixture(scope="module")
def deployed(tiny_seq2seq, tmp_path_factory):
    made = {}

    def folder(arch, *options):
        key = (arch, options)
        if key not in made:
            made[key] = tmp_path_factory.mktemp(f"{arch}-deployed") / "onnx-folder"
            r = cli("export", "--hf", tiny_seq2seq(arch), "--deploy", made[key], *options)
            assert r.exit_code == 0, r.output
        return made[key]
    return folder


@pytest.mark.parametrize("arch", ["t5", "marian"])
def test_verify_generates_what_transformers_generates_on_every_runtime(arch, deployed, tiny_seq2seq):
    report = verify_hf(HFCheck(deployed(arch), tiny_seq2seq(arch), runtimes=RUNTIMES, new_tokens=16))
    assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
    cases = {r.case.split(":")[0] for r in report.rows}
    assert {"encoder_model", "decoder_model_merged", "decode", "outputs"} <= cases
    answered = [r for r in report.rows if r.case.startswith("outputs")]
    assert {r.runtime for r in answered} == set(RUNTIMES)
    want = answered[0].detail["transformers_tokens"]
    assert len(want) == len(T.TEXTS) and any(len(t) >= 4 for t in want)  # real generations, compared
    assert all(r.comparisons for r in report.rows if not r.skipped)


def test_marian_s_end_token_is_forced_at_the_budget_s_last_position(tiny_seq2seq):
    """The tiny Marian's random weights rarely say the end token: each output runs to the budget, whose
    last token transformers forces to be the end token (its forced_eos_token_id): the outputs are one
    token short of the budget, as verify's loop makes them."""
    from attnexport.pretrained import model as hf
    model, _ = hf.load(tiny_seq2seq("marian"), None)
    m = T.TextModel.of(model, tiny_seq2seq("marian"))
    assert m.tokens.forced_end and m.tokens.suppress == (0,)
    want = SC.reference_outputs(m, T.encoded(m.tok, T.TEXTS), 10)
    assert max(len(t) for t in want) <= 9 and 0 not in {t for row in want for t in row}


def test_marian_s_static_self_cache_generates_the_same(deployed, tiny_seq2seq):
    folder = deployed("marian", "--kv-cache", "static", "--max-seq", "40")
    assert (folder / "onnx" / "decoder_model_merged_static.onnx").is_file()
    report = verify_hf(HFCheck(folder, tiny_seq2seq("marian"), runtimes=["torch", "ort-cpu"], new_tokens=30))
    assert report.ok, [(r.case, r.runtime, r.error) for r in report.failures]
    assert any(r.case.startswith("outputs") and r.runtime == "ort-cpu" for r in report.rows)
    r = cli("verify", folder, "--hf", tiny_seq2seq("marian"), "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "at most 39" in r.output  # 48 new tokens do not fit 40 positions


def test_a_changed_weight_is_caught(deployed, tiny_seq2seq, tmp_path):
    from safetensors.numpy import load_file, save_file
    changed = tmp_path / "changed"
    shutil.copytree(tiny_seq2seq("t5"), changed)
    weights = load_file(changed / "model.safetensors")
    name = next(k for k in weights if k.endswith("decoder.block.1.layer.0.SelfAttention.q.weight"))
    save_file({**weights, name: weights[name] * 1.01}, changed / "model.safetensors", metadata={"format": "pt"})
    report = verify_hf(HFCheck(deployed("t5"), changed, runtimes=["ort-cpu"]))
    assert not report.ok and "parameters differ" in report.failures[0].error
    assert "SelfAttention.q.weight" in report.failures[0].error


def test_int8_is_judged_by_the_generation_budget_and_takes_its_limits_alone(deployed, tiny_seq2seq):
    folder = deployed("t5", "--precision", "int8")
    source = tiny_seq2seq("t5")
    r = cli("verify", folder, "--hf", source, "--runtimes", "ort-cpu", "--new-tokens", "16", "--json")
    assert r.exit_code == 0, r.output
    (row,) = [x for x in json.loads(r.output)["results"] if x["case"].startswith("accuracy")]
    cost = row["detail"]["accuracy"]
    assert 0 < cost["kl_mean"] < 0.05 and cost["top1"] >= 0.9, cost
    assert row["detail"]["budget"]["text"] == ("mean KL <= 0.05, top-1 >= 90%, output tokens >= 80% as fp32's, "
                                               "WER <= 10%")
    r = cli("verify", folder, "--hf", source, "--runtimes", "ort-cpu", "--new-tokens", "16", "--budget", "kl-mean=0")
    assert r.exit_code == 1 and "mean KL" in r.output
    r = cli("verify", folder, "--hf", source, "--runtimes", "ort-cpu", "--budget", "cosine=0.5")
    assert r.exit_code == 2 and "kl-mean, top1, agreement, wer" in r.output


def test_marian_in_half_is_every_float_in_half_and_judged_by_the_budget(deployed, tiny_seq2seq):
    """Marian's head adds its final_logits_bias in the graph's type: the half graph's logits are half,
    as its caches are, and its merged decoder's branches declare each output's own type."""
    import onnx
    folder = deployed("marian", "--precision", "fp16")
    merged = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    assert {o.type.tensor_type.elem_type for o in merged.graph.output} == {onnx.TensorProto.FLOAT16}
    r = cli("verify", folder, "--hf", tiny_seq2seq("marian"), "--runtimes", "ort-cpu", "--new-tokens", "12", "--json")
    assert r.exit_code == 0, r.output
    (row,) = [x for x in json.loads(r.output)["results"] if x["case"].startswith("accuracy")]
    assert row["passed"] and row["detail"]["accuracy"]["kl_mean"] < 1e-3
