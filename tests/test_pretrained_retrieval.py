"""What an embedding costs as a retriever's users judge it (`attnexport.pretrained.retrieval`), for
any family whose answers are embeddings: each item's cosine to the float64 one whatever its length,
the queries' top-k over the rest, a precision judged by its own budget. Hand-worked; the sentence
encoders' corpus is tests/test_pretrained_encoders_measures.py's."""

import numpy as np
import pytest

from attnexport.pretrained import retrieval as RT


def test_two_queries_over_six_items_by_hand():
    """Queries e0 and e1; items scored (0.9, 0.8, 0.7, 0.6, 0.5, 0.1) by query 0 and reversed by
    query 1. An export that gives item 5 query 0's score 0.85 retrieves it second: the float64 top 5 of
    query 0 are items 0-4, so 4 of its 5 agree (0.8), query 1's all (1.0): agreement 0.9."""
    scores = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.1], [0.1, 0.5, 0.6, 0.7, 0.8, 0.9]]) / 1.5

    def items(s):
        rest = np.sqrt(1 - (s ** 2).sum(axis=0))
        return np.concatenate([np.eye(2, 3), np.stack([s[0], s[1], rest], axis=1)])
    want = items(scores)
    got_scores = scores.copy()
    got_scores[0, 5] = 0.85 / 1.5
    cost = RT.measure(items(got_scores) * 2.0, want, RT.budget_for("fp32"), queries=2)
    assert cost.agreement == pytest.approx(0.9) and cost.top1 == 1.0
    assert cost.score_error == pytest.approx(0.75 / 1.5)
    assert np.allclose(cost.cosines[:7], 1.0) and cost.cosines[7] < 0.9  # the length of a vector is no change
    assert cost.judge(RT.budget_for("fp32")).failures[0].startswith("sentence 7's cosine")
    assert RT.measure(want, want * 0 + want, RT.budget_for("fp32"), 2, item="image").to_dict()["images"] == 8
    assert RT.measure(want, want, RT.budget_for("fp32"), queries=2).judge(RT.budget_for("fp32")).failures == []
