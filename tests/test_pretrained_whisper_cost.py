"""A quantized or half Whisper export (`export --hf WHISPER --deploy FOLDER --precision int8|fp16`) of a
small random model written as a CTranslate2 folder: its matrices as MatMulNBits in every graph (the
tied head too, the embedding still gathering the float table), each graph checked before writing
against the model with the file's weights (fp16: every float in half, checked within fp16's
budget), and verify judging what the folder costs in transcripts against the speech budget
(teacher-forced KL and top-1, the greedy transcripts' tokens and word error rate). int4 is int8's
path with another plan (its 8-bit head the language models' rule), measured on tiny.en in
docs/whisper.md.

The [hf] extra (transformers)."""

import json

import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

import onnx  # noqa: E402
from conftest import cli  # noqa: E402

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import precision as P  # noqa: E402
from attnexport.pretrained.whisper import cost as SCOST  # noqa: E402
from attnexport.runtimes.base import all_nodes  # noqa: E402


@pytest.fixture(scope="module")
def int8_folder(whisper_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "whisper"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--precision", "int8", "--json")
    assert r.exit_code == 0, r.output
    return out, json.loads(r.output[r.output.index("{"):])


def test_int8_holds_every_matrix_as_matmulnbits_and_checks_each_graph_with_its_weights(int8_folder):
    folder, doc = int8_folder
    decoder = onnx.load(folder / "onnx" / "decoder_model_merged.onnx")
    ops = [n.op_type for n in all_nodes(decoder.graph)]
    # 2 layers of self q, k, v, out, cross q, out, fc1, fc2 a branch, the cross k, v in the first: and the head
    assert ops.count("MatMulNBits") == 2 * (2 * 8 + 1) + 2 * 2 and "MatMul" not in ops
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    heads = [n for n in all_nodes(decoder.graph) if n.op_type == "MatMulNBits" and
             [a.i for a in n.attribute if a.name == "N"] == [vocab]]
    assert len(heads) == 2 and len({n.input[1] for n in heads}) == 1  # one matrix for both branches
    assert any(n.op_type == "Gather" for n in all_nodes(decoder.graph))  # the embedding gathers the float table
    assert P.record_of(decoder)["plan"]["bits"] == 8
    assert ops.count("MatMulNBits") and "int8:" in " ".join(doc["notes"])
    assert all(c["worst"]["max_abs"] <= c["worst"]["atol"] for c in doc["checked"]) and len(doc["checked"]) == 5


def test_verify_judges_an_int8_folder_by_the_speech_budget(int8_folder, whisper_folder):
    folder, _ = int8_folder
    r = cli("verify", folder, "--hf", whisper_folder(), "--new-tokens", "10", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    by = {row["runtime"]: row for row in doc["results"]}
    assert doc["dtype"] == "int8" and set(by) == {"ort-cpu"}  # torch and onnx-ref: not runtimes of it
    skipped = {t["name"]: t["reason"] for t in doc["runtimes"] if not t["used"]}
    assert "source model" in skipped["torch"] and "MatMulNBits" in skipped["onnx-ref"]
    cost = by["ort-cpu"]["detail"]["accuracy"]
    assert [o["name"] for o in by["ort-cpu"]["outputs"]] == ["mean KL vs fp32 (nats)", "top-1 disagreement vs fp32",
                                                           "transcript tokens unlike fp32's", "word error rate vs fp32"]
    said = by["ort-cpu"]["detail"]["transformers_tokens"][0]
    assert 0 < cost["kl_mean"] < 0.05 and cost["positions"] == len(said) + 1
    # a limit the folder cannot meet fails, naming the measure
    r = cli("verify", folder, "--hf", whisper_folder(), "--runtimes", "ort-cpu", "--new-tokens", "10",
            "--budget", "kl-mean=0")
    assert r.exit_code == 1 and "mean KL" in r.output and "> 0" in r.output
    r = cli("verify", folder, "--hf", whisper_folder(), "--runtimes", "onnx-ref")
    assert r.exit_code == 2 and "MatMulNBits" in r.output and len(r.output.strip().splitlines()) == 1


def test_a_speech_budget_takes_its_own_limits():
    b = SCOST.SpeechBudget().with_overrides("wer=0.2, top1=none")
    assert b.wer == 0.2 and b.top1 is None and b.kl_mean == SCOST.SpeechBudget().kl_mean
    with pytest.raises(UsageError, match="kl-mean, top1, agreement, wer"):
        SCOST.SpeechBudget().with_overrides("perplexity=0.1")
    with pytest.raises(UsageError, match="at most 1"):
        SCOST.SpeechBudget().with_overrides("agreement=2")


def test_agreement_word_errors_and_the_first_departure():
    words = {1: " Ever", 2: " tried,", 3: " ever", 4: " failed."}

    def text(tokens):
        return "".join(words[t] for t in tokens)
    assert SCOST.agreement([1, 2, 3, 4], [1, 2, 3, 4], text) == (1.0, 0.0)
    assert SCOST.agreement([1, 2, 4, 4], [1, 2, 3, 4], text) == (0.75, 0.25)
    assert SCOST.agreement([1, 2, 3, 4, 4], [1, 2, 3, 4], text) == (1.0, 0.25)  # a word said twice: 1 edit in fp32's 4
    assert SCOST.agreement([1, 2], [1, 2, 3, 4], text) == (0.5, 0.5)  # two words left out
    assert SCOST.word_errors(["a", "b"], ["a", "c", "b"]) == 1  # one word left out
    assert SCOST.first_departure([1, 2], [1, 2]) is None
    assert SCOST.first_departure([1, 3], [1, 2]) == 1 and SCOST.first_departure([1], [1, 2]) == 1


def test_a_cost_over_its_budget_names_each_limit_and_nan_passes_none():
    cost = SCOST.SpeechCost(0.2, 0.5, 0.9, 0.8, 20, 0.5, 0.3, [3], [[1, 2]])
    cost.judge(SCOST.SpeechBudget())
    assert len(cost.failures) == 4 and "mean KL 0.2 > 0.05" in cost.failures[0]
    nan = SCOST.SpeechCost(float("nan"), 0, 0, float("nan"), 20, float("nan"), float("nan"), [None], [[1]])
    assert len(nan.judge(SCOST.SpeechBudget()).failures) == 4
    assert not any(c.passed for c in nan.comparisons(SCOST.SpeechBudget()))


def test_fp16_is_every_float_in_half_checked_in_fp16_s_budget_and_judged_by_the_speech_budget(whisper_folder,
                                                                                             tmp_path):
    out = tmp_path / "fp16"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--precision", "fp16", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert all("fp16" in c["worst"]["basis"] or "policy" in c["worst"]["basis"] for c in doc["checked"])
    for graph in ("encoder_model", "decoder_model_merged"):
        model = onnx.load(out / "onnx" / f"{graph}.onnx")
        floats = [i.type.tensor_type.elem_type for i in model.graph.input if i.name not in ("input_ids",
                                                                                            "use_cache_branch")]
        assert set(floats) == {onnx.TensorProto.FLOAT16}
        assert {i.data_type for i in model.graph.initializer} <= {onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64}
    r = cli("verify", out, "--hf", whisper_folder(), "--runtimes", "torch,ort-cpu", "--skip-unavailable",
            "--new-tokens", "10", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["dtype"] == "fp16" and {row["runtime"] for row in report["results"]} == {"ort-cpu"}
    assert "fp16 folder's cost" in next(t["reason"] for t in report["runtimes"] if t["name"] == "torch")
    assert all(row["case"].startswith("accuracy") for row in report["results"])


def _fake_whisper(next_token):
    """(steps, speech) of a Whisper stand-in: vocabulary 8, start tokens 5 6, end token 7, one layer;
    its decoder's logits after k text tokens, the last `last`, are `next_token(k, last)` (a list of 8).
    The self cache carries the count of tokens seen in its third axis; `later.ids` the tokens so far."""
    import types

    import numpy as np

    from attnexport.pretrained.whisper import graphs as W
    start = (5, 6)

    def logits_after(ids):
        k = len(ids) - len(start)
        return np.array(next_token(k, ids[-1] if k else None), np.float64)

    def first(feed):
        ids = feed["input_ids"][0].tolist()
        rows = [logits_after(ids[:t + 1]) if t + 1 >= len(start) else np.zeros(8) for t in range(len(ids))]
        seen = np.zeros((1, 1, len(ids), 1), np.float32)
        return {"logits": np.array(rows)[None], "present.0.decoder.key": seen, "present.0.decoder.value": seen,
                "present.0.encoder.key": np.zeros((1, 1, 1, 1), np.float32),
                "present.0.encoder.value": np.zeros((1, 1, 1, 1), np.float32), "_ids": ids}

    def later(feed):
        seen = feed["past_key_values.0.decoder.key"].shape[2]
        token = int(feed["input_ids"][0, 0])
        said = later.ids[:seen] + [token]
        later.ids = said
        grown = np.zeros((1, 1, seen + 1, 1), np.float32)
        return {"logits": logits_after(said)[None, None], "present.0.decoder.key": grown,
                "present.0.decoder.value": grown}

    def run_first(feed):
        out = first(feed)
        later.ids = out.pop("_ids")
        return out
    later.ids = []
    steps = (lambda feed: {"last_hidden_state": np.zeros((1, 1, 1), np.float32)}, run_first, later)
    speech = types.SimpleNamespace(tokens=W.Tokens(start, 7, (), ()), layers=1, end=7, start=list(start))
    return steps, speech


def test_a_departure_at_a_near_tie_of_fp32_is_taken_its_way_and_any_other_counts():
    """Hand-worked: fp32 says 1 2 3; the file says 1 4 3 (at its second token it prefers 4, logit 1.0
    to 2's 0.9; after fp32's 1 2 it says 3 then the end). Where fp32's 2 leads the next by 0.3 logits
    (below the margin of 1) the departure is a near tie: the clip is transcribed again from 1 2 and
    judged 1 2 3, the tie at token 1 reported; where fp32 leads by 2, the file's 1 4 3 is judged."""
    import numpy as np

    def file(k, last):
        table = {0: {1: 1.0}, 1: {4: 1.0, 2: 0.9}, 2: {3: 1.0}, 3: {7: 1.0}}
        row = [-5.0] * 8
        for token, value in table[min(k, 3)].items():
            row[token] = value
        return row
    steps, speech = _fake_whisper(file)
    own = [1, 4, 3]
    reference = np.full((4, 8), -5.0)  # fp32's logits along 1 2 3 and its end
    for t, token in enumerate([1, 2, 3, 7]):
        reference[t, token] = 1.0
    reference[1, 4] = 0.7  # fp32's 2 leads 4 by 0.3
    assert SCOST.lead(reference[1], 2, set()) == pytest.approx(0.3)
    assert SCOST.lead(reference[1], 2, {4}) == pytest.approx(6.0)  # 4 banned: the next allowed is at -5
    features = np.zeros((1, 1, 1), np.float32)
    assert SCOST.untied(steps, speech, features, own, [1, 2, 3], reference, 10, 1.0) == ([1, 2, 3], [1])
    reference[1, 4] = -1.0  # fp32 decided (a lead of 2): the file's own transcript is judged
    assert SCOST.untied(steps, speech, features, own, [1, 2, 3], reference, 10, 1.0) == ([1, 4, 3], [])
    assert SCOST.untied(steps, speech, features, [1, 2, 3], [1, 2, 3], reference, 10, 1.0) == ([1, 2, 3], [])


def test_the_speech_cost_is_the_hand_worked_one():
    """One clip, fp32 says "a b c" (tokens 1 2 3, then the end, 7): at each position fp32 gives its
    token probability 3/4 and token 0 the rest (logits ln 3 and 0, every other -1e4). The file gives
    its token 2/3 and token 0 1/3 at positions 0, 2 and 3: KL = 3/4 ln(9/8) + 1/4 ln(3/4) = 0.0164168
    each; at position 1 it prefers 4 (logits 1, 0.5 for 2, 0 for 0): KL = 3/4 ln(0.75 / q2) +
    1/4 ln(0.25 / q0) with q = softmax(1, 0.5, 0) = 0.742935, and its top-1 is not fp32's (3 of 4).
    Greedy, it says "a d c": 2 of 3 tokens at their places, one word substituted in three (WER 1/3),
    departing at token 1, where fp32 leads by ln 3 = 1.0986 logits: counted at the margin of 1, a near
    tie (taken fp32's way, judged "a b c") at a margin of 2."""
    import math

    import numpy as np

    def file(k, last):
        rows = {0: {1: math.log(2), 0: 0.0}, 1: {4: 1.0, 2: 0.5, 0: 0.0}, 2: {3: math.log(2), 0: 0.0},
                3: {7: math.log(2), 0: 0.0}}
        row = [-1e4] * 8
        for token, value in rows[min(k, 3)].items():
            row[token] = value
        return row
    steps, speech = _fake_whisper(file)
    speech.decode = lambda tokens: " ".join("-abcd"[t] for t in tokens)
    reference = np.full((4, 8), -1e4)
    for t, token in enumerate([1, 2, 3, 7]):
        reference[t, token], reference[t, 0] = math.log(3), 0.0
    features = np.zeros((1, 1, 1), np.float32)
    decided = 3 / 4 * math.log(0.75 / (2 / 3)) + 1 / 4 * math.log(0.25 / (1 / 3))
    z = math.e + math.exp(0.5) + 1
    departed = 3 / 4 * math.log(0.75 / (math.exp(0.5) / z)) + 1 / 4 * math.log(0.25 / (1 / z))
    assert decided == pytest.approx(0.0164168, abs=1e-7) and departed == pytest.approx(0.742935, abs=1e-6)
    cost = SCOST.measure(steps, speech, features, [[1, 2, 3]], [reference], 10, SCOST.SpeechBudget())
    assert cost.kl_mean == pytest.approx((3 * decided + departed) / 4) and cost.kl_max == pytest.approx(departed)
    assert cost.top1 == 0.75 and cost.positions == 4
    assert cost.tokens == [[1, 4, 3]] and cost.first_difference == [1] and cost.near_ties == [[]]
    assert cost.agreement == pytest.approx(2 / 3) and cost.wer == pytest.approx(1 / 3)
    assert cost.failures == ["mean KL 0.198 > 0.05", "top-1 75.0% < 90%", "transcript tokens 66.7% as fp32's < 80%",
                             "WER 33.3% > 10%"]
    tied = SCOST.measure(steps, speech, features, [[1, 2, 3]], [reference], 10, SCOST.SpeechBudget(margin=2.0))
    assert tied.near_ties == [[1]] and tied.agreement == 1.0 and tied.wer == 0.0
    assert tied.greedy_agreement == pytest.approx(2 / 3) and tied.greedy_wer == pytest.approx(1 / 3)
