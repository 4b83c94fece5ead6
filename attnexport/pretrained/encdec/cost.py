"""What a lossy encoder-decoder export (quantized, or in half) costs in its answers (Whisper's
transcripts, a text model's generated text), measured against the model in fp32 and judged against a
budget.

Two measurements an input, each on the runtime under test running the folder's graphs as a client
does (the encoder once, the first decoder step over the start tokens, then a token a step through
the self cache):

- **teacher-forced distributions**: the fp32 model's answer (transformers' greedy `generate`)
  fed a token at a time; at every position, from the last start token to the end token, the
  file's next-token distribution against transformers' fp32 forward over the same tokens:
  KL(fp32 || file) in nats (mean, 99th percentile, max) and the share of positions whose most
  likely token is the same (top-1);
- **greedy answers**: the file's own answer against the fp32 one: the share of the fp32 answer's
  tokens it has at their places (token agreement), where it first departs, and the word error rate
  of its words against the fp32 answer's. A departure where fp32 itself is undecided (its token
  ahead of the next by less than the budget's `margin` in logits, among the tokens generation allows
  there: a near tie, which any rounding may turn) is reported, not counted, as the language models'
  first-token rule does: the input is answered again with fp32's tokens up to and including the
  tie, and judged from there (the file's own greedy answers' agreement and WER are reported beside,
  unjudged).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from attnexport.compare import Comparison
from attnexport.pretrained import cost as B
from attnexport.pretrained import model as hf
from attnexport.pretrained.encdec import graphs as G


@dataclass(frozen=True)
class AnswerBudget:
    """What a lossy encoder-decoder export may cost against the model in fp32 (a limit of None is not
    checked). The defaults are Whisper's, in docs/whisper.md with the measurements behind them.

    Attributes:
        kl_mean: the mean KL(fp32 || file) per teacher-forced position, in nats.
        top1: the least share of teacher-forced positions whose most likely token is fp32's.
        agreement: the least share of the fp32 answers' tokens the file's greedy answers have at
            their places (all inputs together).
        wer: the largest word error rate of the file's answers against fp32's (all inputs together).
    """

    kl_mean: float | None = 0.05
    top1: float | None = 0.9
    agreement: float | None = 0.8
    wer: float | None = 0.1
    margin: float = 1.0  # fp32's lead, in logits, below which a departure is a near tie (not a limit)

    def with_overrides(self, text: str | None) -> AnswerBudget:
        """This budget with `--budget KEY=VALUE,...` applied (a value `none` drops that limit)."""
        return B.overridden(self, text, shares=("top1", "agreement"), fixed=("margin",))

    def text(self, answer: str = "answer") -> str:
        parts = []
        if self.kl_mean is not None:
            parts.append(f"mean KL <= {self.kl_mean:g}")
        if self.top1 is not None:
            parts.append(f"top-1 >= {self.top1:.0%}")
        if self.agreement is not None:
            parts.append(f"{answer} tokens >= {self.agreement:.0%} as fp32's")
        if self.wer is not None:
            parts.append(f"WER <= {self.wer:.0%}")
        return ", ".join(parts) or "no limits"


@dataclass
class AnswerCost:
    """One runtime's cost on the inputs (the module docstring); `failures` names each limit of the
    budget it exceeds."""

    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    positions: int
    agreement: float
    wer: float
    first_difference: list  # per input: the first token that departs from fp32's answer, or None
    tokens: list  # the file's own greedy answers
    near_ties: list = field(default_factory=list)  # per input: the positions taken fp32's way (near ties)
    greedy_agreement: float = math.nan  # agreement and WER of the file's own greedy answers (unjudged)
    greedy_wer: float = math.nan
    failures: list = field(default_factory=list)
    answer: str = "answer"  # what the failures call an answer

    def judge(self, budget: AnswerBudget) -> AnswerCost:
        """Fills `failures` with each limit of `budget` this cost exceeds (a NaN exceeds every one)."""
        out = []
        if budget.kl_mean is not None and not self.kl_mean <= budget.kl_mean:
            out.append(f"mean KL {self.kl_mean:.3g} > {budget.kl_mean:g}")
        if budget.top1 is not None and not self.top1 >= budget.top1:
            out.append(f"top-1 {self.top1:.1%} < {budget.top1:.0%}")
        if budget.agreement is not None and not self.agreement >= budget.agreement:
            out.append(f"{self.answer} tokens {self.agreement:.1%} as fp32's < {budget.agreement:.0%}")
        if budget.wer is not None and not self.wer <= budget.wer:
            out.append(f"WER {self.wer:.1%} > {budget.wer:.0%}")
        self.failures = out
        return self

    def comparisons(self, budget: AnswerBudget, name: str = "the accuracy budget") -> list[Comparison]:
        """Each measurement against its limit as a Comparison (max_abs: the value; atol: the limit;
        a limit of None compares nothing and passes)."""
        rows = [("mean KL vs fp32 (nats)", self.kl_mean, budget.kl_mean, self.positions),
                ("top-1 disagreement vs fp32", 1 - self.top1, None if budget.top1 is None else 1 - budget.top1,
                 self.positions),
                (f"{self.answer} tokens unlike fp32's", 1 - self.agreement,
                 None if budget.agreement is None else 1 - budget.agreement, len(self.tokens)),
                ("word error rate vs fp32", self.wer, budget.wer, len(self.tokens))]
        out = []
        for name, value, limit, compared in rows:
            ok = limit is None or bool(value <= limit)
            out.append(Comparison(name, ok, float(value), math.nan, 0, 0, 0.0, math.inf if limit is None else
                                  float(limit), float(value), math.inf, compared=compared,
                                  basis=name + (" (no limit)" if limit is None else "")))
        return out

    def text(self, item: str = "input", answer: str = "answer") -> str:
        firsts = ", ".join("-" if f is None else str(f) for f in self.first_difference)
        ties = sum(len(t) for t in self.near_ties)
        where = ", ".join(f"{item} {i} token {t}" for i, ts in enumerate(self.near_ties) for t in ts)
        tied = (f"; {ties} near tie(s) taken fp32's way ({where}): its own greedy {answer}s "
                f"{self.greedy_agreement:.1%} as fp32's, WER {self.greedy_wer:.1%}") if ties else ""
        return (f"mean KL {self.kl_mean:.3g} (p99 {self.kl_p99:.3g}, max {self.kl_max:.3g}), top-1 {self.top1:.1%} of "
                f"{self.positions} positions, {answer} tokens {self.agreement:.1%} as fp32's (first departure per "
                f"{item}: {firsts}), WER {self.wer:.1%}{tied}")

    def to_dict(self) -> dict:
        return asdict(self)


def agreement(got: list[int], want: list[int], text) -> tuple[float, float]:
    """(the share of `want`'s tokens `got` has at their places, the word error rate of `got`'s words
    against `want`'s: edits over `want`'s words; `text(tokens) -> str` decodes)."""
    return answers_against([got], [want], text)


def word_errors(got: list[str], want: list[str]) -> int:
    """The edit distance (substitutions, insertions, deletions) between two word lists."""
    d = list(range(len(got) + 1))
    for j in range(1, len(want) + 1):
        prev, d[0] = d[0], j
        for i in range(1, len(got) + 1):
            prev, d[i] = d[i], min(d[i] + 1, d[i - 1] + 1, prev + (got[i - 1] != want[j - 1]))
    return d[len(got)]


def first_departure(got: list[int], want: list[int]) -> int | None:
    """The first place `got` departs from `want` (a token, or one ending sooner or later), or None."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def measure(steps, m, feed: dict, want: list[list[int]], reference: list[np.ndarray],
            new_tokens: int, budget: AnswerBudget) -> AnswerCost:
    """The cost of the graphs `steps` runs (`graphs.teacher_forced`'s) on each input of the encoder's
    `feed` against the fp32 answers `want` and transformers' fp32 logits along them (`reference`: an
    input's (len(want) + 1, V), `reference_logits`), judged against `budget`; `m`: the family's model
    (`encdec.export.Model`)."""
    first, layers = len(m.start), m.layers
    kl, top1 = [], []
    for i, tokens in enumerate(want):
        got = G.teacher_forced(steps, G.row_of(feed, i), [*m.start, *tokens, m.end], first, layers)
        kl.append(B.kl_per_position(reference[i], got))
        top1.append(reference[i].argmax(-1) == got.argmax(-1))
    said = G.greedy(steps[0], steps[1], steps[2], feed, m.tokens, layers, new_tokens)
    judged, ties = [], []
    for i, (own, fp32) in enumerate(zip(said, want, strict=True)):
        taken, at = untied(steps, m, G.row_of(feed, i), own, fp32, reference[i], new_tokens, budget.margin)
        judged.append(taken)
        ties.append(at)
    k = np.concatenate(kl)
    return AnswerCost(float(k.mean()), float(np.percentile(k, 99)), float(k.max()), float(np.concatenate(top1).mean()),
                      int(k.size), *answers_against(judged, want, m.decode),
                      [first_departure(g, w) for g, w in zip(said, want, strict=True)], said, ties,
                      *answers_against(said, want, m.decode), answer=m.answers.rstrip("s")).judge(budget)


def answers_against(got: list[list[int]], want: list[list[int]], text) -> tuple[float, float]:
    """(the share of `want`'s tokens `got` has at their places, the word error rate of `got`'s words
    against `want`'s), all inputs together; `text(tokens) -> str` decodes."""
    same = sum(sum(a == b for a, b in zip(g, w, strict=False)) for g, w in zip(got, want, strict=True))
    words = [(text(g).split(), text(w).split()) for g, w in zip(got, want, strict=True)]
    errors = sum(word_errors(g, w) for g, w in words)
    return same / max(sum(len(w) for w in want), 1), errors / max(sum(len(w) for _, w in words), 1)


def lead(logits: np.ndarray, token: int, banned) -> float:
    """How far `token`'s logit is ahead of the best other token's among those not `banned`."""
    allowed = np.array(logits, np.float64)
    allowed[list(banned)] = -np.inf
    chosen = allowed[token]
    allowed[token] = -np.inf
    return float(chosen - allowed.max())


def untied(steps, m, feed: dict, own: list[int], want: list[int], reference: np.ndarray,
           new_tokens: int, margin: float) -> tuple[list[int], list[int]]:
    """(the input's answer judged, the near ties taken fp32's way): `own` (the file's greedy answer
    to the input whose encoder feed is `feed`, a batch of one) where it departs from fp32's `want`
    only where fp32 leads by `margin` logits or more (`reference`: fp32's teacher-forced logits along
    `want`, row t predicting its token t, the last the end); at each departure where fp32 leads by
    less, the input answered again from fp32's tokens up to and including that one."""
    tokens = m.tokens
    got, ties = list(own), []  # type: list[int], list[int]
    while True:
        at = first_departure(got, want)
        if at is None:
            return got, ties
        wanted = want[at] if at < len(want) else m.end
        banned = set(tokens.suppress) | (set(tokens.suppress_first) if at == 0 else set())
        if lead(reference[at], wanted, banned) >= margin:
            return got, ties
        ties.append(at)
        prefix = list(want[:at + 1])
        if at >= len(want) or len(prefix) >= new_tokens:  # fp32 ended there, or the budget is spent
            return list(want[:new_tokens]), ties
        forced = G.Tokens((*tokens.start, *prefix), tokens.end, tokens.suppress, (), tokens.forced_end)
        rest = G.greedy(steps[0], steps[1], steps[2], feed, forced, m.layers, new_tokens - len(prefix))[0]
        got = prefix + rest


def reference_logits(m, feed: dict, want: list[list[int]]) -> list[np.ndarray]:
    """transformers' fp32 forward over each input's start tokens and fp32 answer, teacher-forced (the
    encoder's `feed` of the inputs): an input's logits from its last start token on ((len(want) + 1,
    V), the last predicting the end)."""
    import torch
    first, out = len(m.start), []
    for i, tokens in enumerate(want):
        ids = torch.tensor([[*m.start, *tokens]], dtype=torch.int64)
        inputs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in G.row_of(feed, i).items()}
        with torch.no_grad(), hf.quiet_transformers():
            logits = m.model(**inputs, decoder_input_ids=ids).logits
        out.append(logits[0, first - 1:].numpy().astype(np.float64))
    return out
