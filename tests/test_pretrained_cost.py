"""What every family's cost shares (`attnexport.pretrained.cost`): KL between next-token distributions, in nats,
from the reference to the model, and a budget's `--budget` overrides."""

import math

import numpy as np

from attnexport.pretrained import cost as COST


def test_kl_is_zero_for_the_same_distribution_and_infinite_for_nan():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 11))
    assert np.abs(COST.kl_per_position(logits, logits + 3.0)).max() < 1e-12  # a shift is the same distribution
    other = logits.copy()
    other[2] *= 3
    kl = COST.kl_per_position(logits, other)
    assert kl[2] > 0.01 and np.abs(np.delete(kl, 2)).max() < 1e-12
    other[4, 0] = np.nan
    assert math.isinf(COST.kl_per_position(logits, other)[4])


def test_a_budget_s_overrides_are_its_own_limits_and_are_checked():
    """`--budget KEY=VALUE,...` of any family's budget: each key one of its limits (named in the
    refusal), `none` drops a limit but not a fixed one, counts are whole, shares at most 1."""
    from dataclasses import dataclass

    import pytest

    from attnexport.errors import UsageError
    from attnexport.pretrained import cost as COST

    @dataclass(frozen=True)
    class Limits:
        loss: float | None = 0.5
        share: float | None = 0.9
        count: int | None = 0
        margin: float = 1.0

    def over(text):
        return COST.overridden(Limits(), text, counts=("count",), shares=("share",), fixed=("margin",))
    assert over("loss=0.25, share=none, count=3") == Limits(0.25, None, 3, 1.0)
    assert over(None) == Limits()
    for text, said in (("speed=2", "the limits are loss, share, count, margin"), ("margin=none", "not a limit to drop"),
                       ("count=1.5", "a whole number"), ("share=2", "at most 1"), ("loss=-1", "finite number >= 0"),
                       ("loss=fast", "is not a number")):
        with pytest.raises(UsageError, match=said):
            over(text)
