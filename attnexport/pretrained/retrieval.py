"""What an embedding costs as a retriever's users judge it: each item's embedding against the
model's own in float64 (the cosine between them), and retrieval over a small corpus (for each
query, the items the export ranks first against those the float64 model ranks first), shared by
every family whose answers are embeddings.

A retrieved item agrees when it is among the float64 model's top k, or scores within the ranking's
own uncertainty of the k-th: twice the largest score error the export makes, at most the error its
cosine budget allows (`EmbeddingBudget.tie`). Two items whose float64 scores differ by less than
that are a tie the export may order either way; an export whose scores move further than its
budget allows has its swaps counted. The budget is one table, by precision (`BUDGETS`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attnexport.pretrained import cost as B

TOP_K = 5



@dataclass(frozen=True)
class EmbeddingBudget:
    """What an export may cost: the lowest cosine of any item's embedding to the float64 one,
    and the least share of each query's top-k retrieved documents that agree with the float64
    ranking's (see the module's text)."""

    cosine: float
    retrieval: float

    def text(self) -> str:
        return f"cosine >= {self.cosine:g}, top-{TOP_K} agreement >= {self.retrieval:g}"

    def with_overrides(self, text: str | None) -> EmbeddingBudget:
        """This budget with `--budget cosine=...,retrieval=...` applied."""
        return B.overridden(self, text, shares=("cosine", "retrieval"), fixed=("cosine", "retrieval"))

    @property
    def tie(self) -> float:
        """The largest score change the cosine budget allows: unit vectors at cosine c lie
        sqrt(2 (1 - c)) apart, and a score moves by that for the query and for the document."""
        return 2 * float(np.sqrt(2 * (1 - self.cosine)))


# By precision: fp32 rounds as torch's fp32 does; fp16 and the quantized ones as sentence-transformers'
# and fastembed's users accept them.
BUDGETS = {"fp32": EmbeddingBudget(0.99999, 1.0), "fp16": EmbeddingBudget(0.999, 0.95),
           "int8": EmbeddingBudget(0.99, 0.9), "int4": EmbeddingBudget(0.98, 0.85)}
# A precision judged by another's budget: q4f16 holds int4's weights.
_JUDGED_AS = {"q4f16": "int4"}


@dataclass(frozen=True)
class Overrides:
    """`verify --budget` of an encoder: its limits (`cosine`, `retrieval`) applied to the budget of
    the file's precision, which verify knows once it has read the file; a key that is not one of
    them refused when given."""

    text: str | None = None

    def __post_init__(self):
        BUDGETS["fp32"].with_overrides(self.text)  # a key that is no limit of an encoder's: refused now

    def for_precision(self, precision: str) -> EmbeddingBudget:
        return budget_for(precision).with_overrides(self.text)


def budget_for(precision: str) -> EmbeddingBudget:
    """The embedding budget a file of `precision` (its dtype, or int8/int4/q4f16 when quantized) is
    judged by; a precision with none is a ValueError (never a silent fallback)."""
    name = _JUDGED_AS.get(precision, precision)
    if name not in BUDGETS:
        raise ValueError(f"no embedding budget for precision {precision!r} (budgets: {', '.join(BUDGETS)})")
    return BUDGETS[name]


@dataclass
class EmbeddingCost:
    """The cosines of each item's embedding to the float64 one, and retrieval agreement; `item`: what
    an item is (a sentence, an image), as its reports say it."""

    cosines: np.ndarray
    agreement: float  # the share of each query's top-k documents that agree, averaged over queries
    top1: float  # the share of queries whose first document is the float64 ranking's first
    score_error: float  # the largest difference of a query-document score from the float64 one

    item: str = "sentence"
    failures: list = field(default_factory=list)  # each limit of the budget it was judged by that it exceeds

    def judge(self, budget: EmbeddingBudget) -> EmbeddingCost:
        """Fills `failures` with each limit of `budget` this cost exceeds (a NaN exceeds every one)."""
        out = []
        if not np.isfinite(self.cosines).all():
            out.append("an embedding is not finite")
        elif self.cosines.min() < budget.cosine:
            worst = int(self.cosines.argmin())
            out.append(f"{self.item} {worst}'s cosine {self.cosines.min():.7f} < {budget.cosine:g}")
        if not self.agreement >= budget.retrieval:
            out.append(f"top-{TOP_K} agreement {self.agreement:.3f} < {budget.retrieval:g}")
        self.failures = out
        return self

    def to_dict(self) -> dict:
        return {f"{self.item}s": int(self.cosines.size), "cosine_min": float(self.cosines.min()),
                "cosine_mean": float(self.cosines.mean()), f"top{TOP_K}_agreement": self.agreement,
                "top1_agreement": self.top1, "score_error": self.score_error}

    def text(self) -> str:
        return (f"1 - cosine max {1 - self.cosines.min():.2g} mean {1 - self.cosines.mean():.2g} over "
                f"{self.cosines.size} {self.item}s; top-{TOP_K} agreement {self.agreement:.3f}, top-1 {self.top1:.3f}")


def unit(vectors: np.ndarray) -> np.ndarray:
    v = np.asarray(vectors, np.float64)
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-300)


def measure(got: np.ndarray, want: np.ndarray, budget: EmbeddingBudget, queries: int,
            item: str = "sentence") -> EmbeddingCost:
    """The cost of the embeddings `got` (N, D) against the float64 model's `want`: the first
    `queries` rows are the queries, the rest the corpus they retrieve from; ties within `budget`'s."""
    g, w = unit(got), unit(want)
    cosines = np.sum(g * w, axis=-1)
    scores_got, scores_want = g[:queries] @ g[queries:].T, w[:queries] @ w[queries:].T
    error = float(np.abs(scores_got - scores_want).max()) if np.isfinite(scores_got).all() else float("inf")
    shares, firsts = [], []
    if not np.isfinite(error):
        return EmbeddingCost(cosines, 0.0, 0.0, error, item)
    tie = min(2 * error, budget.tie)
    for q in range(queries):
        mine = np.argsort(-scores_got[q], kind="stable")[:TOP_K]
        kth = np.sort(scores_want[q])[::-1][TOP_K - 1]
        shares.append(float(np.mean(scores_want[q][mine] >= kth - tie)))
        firsts.append(float(scores_want[q][mine[0]] >= scores_want[q].max() - tie))
    return EmbeddingCost(cosines, float(np.mean(shares)), float(np.mean(firsts)), error, item)
