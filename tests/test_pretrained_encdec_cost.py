"""What a lossy encoder-decoder folder costs in answers (`attnexport.pretrained.encdec.cost`), pinned by
hand on a stand-in whose logits are written out: the budget and its overrides (Whisper's speech budget),
token agreement and word errors, near ties taken fp32's way, the teacher-forced KL and top-1."""

import pytest

from attnexport.errors import UsageError
from attnexport.pretrained.encdec import cost as COST
from attnexport.pretrained.whisper import cost as SCOST


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
    assert COST.agreement([1, 2, 3, 4], [1, 2, 3, 4], text) == (1.0, 0.0)
    assert COST.agreement([1, 2, 4, 4], [1, 2, 3, 4], text) == (0.75, 0.25)
    assert COST.agreement([1, 2, 3, 4, 4], [1, 2, 3, 4], text) == (1.0, 0.25)  # a word said twice: 1 edit in fp32's 4
    assert COST.agreement([1, 2], [1, 2, 3, 4], text) == (0.5, 0.5)  # two words left out
    assert COST.word_errors(["a", "b"], ["a", "c", "b"]) == 1  # one word left out
    assert COST.first_departure([1, 2], [1, 2]) is None
    assert COST.first_departure([1, 3], [1, 2]) == 1 and COST.first_departure([1], [1, 2]) == 1


def test_a_cost_over_its_budget_names_each_limit_and_nan_passes_none():
    cost = COST.AnswerCost(0.2, 0.5, 0.9, 0.8, 20, 0.5, 0.3, [3], [[1, 2]])
    cost.judge(SCOST.SpeechBudget())
    assert len(cost.failures) == 4 and "mean KL 0.2 > 0.05" in cost.failures[0]
    nan = COST.AnswerCost(float("nan"), 0, 0, float("nan"), 20, float("nan"), float("nan"), [None], [[1]])
    assert len(nan.judge(SCOST.SpeechBudget()).failures) == 4
    assert not any(c.passed for c in nan.comparisons(SCOST.SpeechBudget()))


def _fake_whisper(next_token):
    """(steps, speech) of a Whisper stand-in: vocabulary 8, start tokens 5 6, end token 7, one layer;
    its decoder's logits after k text tokens, the last `last`, are `next_token(k, last)` (a list of 8).
    The self cache carries the count of tokens seen in its third axis; `later.ids` the tokens so far."""
    import types

    import numpy as np

    from attnexport.pretrained.encdec import graphs as G
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
    speech = types.SimpleNamespace(tokens=G.Tokens(start, 7, (), ()), layers=1, end=7, start=list(start),
                                   answers="transcripts")
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
    assert COST.lead(reference[1], 2, set()) == pytest.approx(0.3)
    assert COST.lead(reference[1], 2, {4}) == pytest.approx(6.0)  # 4 banned: the next allowed is at -5
    feed = {"input_features": np.zeros((1, 1, 1), np.float32)}
    assert COST.untied(steps, speech, feed, own, [1, 2, 3], reference, 10, 1.0) == ([1, 2, 3], [1])
    reference[1, 4] = -1.0  # fp32 decided (a lead of 2): the file's own transcript is judged
    assert COST.untied(steps, speech, feed, own, [1, 2, 3], reference, 10, 1.0) == ([1, 4, 3], [])
    assert COST.untied(steps, speech, feed, [1, 2, 3], [1, 2, 3], reference, 10, 1.0) == ([1, 2, 3], [])


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
    feed = {"input_features": np.zeros((1, 1, 1), np.float32)}
    decided = 3 / 4 * math.log(0.75 / (2 / 3)) + 1 / 4 * math.log(0.25 / (1 / 3))
    z = math.e + math.exp(0.5) + 1
    departed = 3 / 4 * math.log(0.75 / (math.exp(0.5) / z)) + 1 / 4 * math.log(0.25 / (1 / z))
    assert decided == pytest.approx(0.0164168, abs=1e-7) and departed == pytest.approx(0.742935, abs=1e-6)
    cost = COST.measure(steps, speech, feed, [[1, 2, 3]], [reference], 10, SCOST.SpeechBudget())
    assert cost.kl_mean == pytest.approx((3 * decided + departed) / 4) and cost.kl_max == pytest.approx(departed)
    assert cost.top1 == 0.75 and cost.positions == 4
    assert cost.tokens == [[1, 4, 3]] and cost.first_difference == [1] and cost.near_ties == [[]]
    assert cost.agreement == pytest.approx(2 / 3) and cost.wer == pytest.approx(1 / 3)
    assert cost.failures == ["mean KL 0.198 > 0.05", "top-1 75.0% < 90%", "transcript tokens 66.7% as fp32's < 80%",
                             "WER 33.3% > 10%"]
    tied = COST.measure(steps, speech, feed, [[1, 2, 3]], [reference], 10, SCOST.SpeechBudget(margin=2.0))
    assert tied.near_ties == [[1]] and tied.agreement == 1.0 and tied.wer == 0.0
    assert tied.greedy_agreement == pytest.approx(2 / 3) and tied.greedy_wer == pytest.approx(1 / 3)
