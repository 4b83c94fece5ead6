"""What a lossy export costs, as every family measures and judges it. A family's budget
(`registry.Family.budget`) is a frozen dataclass of limits (a limit of None is not checked) that
`--budget KEY=VALUE,...` overrides (`overridden`: each key one of its limits, or a one-line refusal
naming them); its cost (`judge(budget)` fills `failures`; `comparisons(budget)`, `text()`,
`to_dict()`) is its own. The KL between next-token distributions is the families' shared measure."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from attnexport.errors import UsageError


def overridden(budget, text: str | None, counts=(), shares=(), fixed=()):
    """`budget` (a frozen dataclass of limits) with `--budget KEY=VALUE,...` applied: a value `none`
    drops that limit (not one of `fixed`); `counts` are whole numbers, `shares` at most 1."""
    if not text:
        return budget
    values = asdict(budget)
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in values:
            raise UsageError(f"--budget {part}: the limits are {', '.join(k.replace('_', '-') for k in values)}")
        if value.strip().lower() == "none":
            if key in fixed:
                raise UsageError(f"--budget {part}: {key} is not a limit to drop")
            values[key] = None
            continue
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--budget {part}: {value!r} is not a number") from None
        if not math.isfinite(number) or number < 0:
            raise UsageError(f"--budget {part}: the limit must be a finite number >= 0")
        if key in counts:
            if number != int(number):
                raise UsageError(f"--budget {part}: {key.replace('_', '-')} counts prompts: a whole number")
            number = int(number)
        if key in shares and number > 1:
            raise UsageError(f"--budget {part}: {key.replace('_', '-')} is a share, at most 1")
        values[key] = number
    return type(budget)(**values)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_per_position(reference: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(reference || got) of the next-token distributions at each position (..., V) -> (...), nats.
    A distribution that is not finite counts as infinitely far."""
    p, q = log_softmax(reference), log_softmax(got)
    with np.errstate(all="ignore"):
        kl = (np.exp(p) * (p - q)).sum(axis=-1)
    return np.where(np.isfinite(kl), np.maximum(kl, 0.0), np.inf)
