"""What a quantized or half-precision language model costs in answers, measured against the same
model in fp32 and in float64, and judged against an accuracy budget.

Four measurements, each on the runtime under test running the exported step graph as an app does
(a prefill, then one token a step):

- **teacher-forced distributions**: a passage of text fed token by token (`EVAL_TEXT`); at every
  position the model's next-token distribution against the fp32 model's: KL(fp32 || model) in
  nats (mean, 99th percentile, max) and the share of positions whose most likely token is the same
  (top-1 agreement);
- **perplexity** of a held-out passage (`HELD_OUT`), against the fp32 model's and the float64
  model's on the same text;
- **greedy agreement**: the tokens generated greedily after each prompt against transformers'
  `generate` in fp32: per prompt, the first step that differs;
- **per-layer cost** (`layer_costs`): each group of matrices (a decoder layer, the head) made as
  the file holds it, alone, in the fp32 model in torch, and the KL that alone costs on the same
  text: which layers cost most, and what to keep at higher precision.

The fp32 model is transformers' own forward in float32 (what an fp32 export computes, within the
budget every fp32 export is checked against); the float64 one is `hf_reference`'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from attnexport.compare import Comparison
from attnexport.pretrained import cost as B
from attnexport.pretrained import emulate
from attnexport.pretrained import model as hf
from attnexport.pretrained.causal import generation as G

# A passage the model reads teacher-forced (KL, top-1), and one held out for perplexity. Without a
# tokenizer both are seeded token ids of the same lengths.
EVAL_TEXT = (
    "The bridge over the river was built in the spring of the year the old mill closed. Before it, "
    "people crossed on a flat ferry pulled along a rope, and on windy days the ferry did not run at "
    "all. The new bridge had three stone arches and a road wide enough for two carts to pass. The "
    "engineer who drew it had never built a bridge before; she had built canals, and she said that a "
    "bridge is only a canal turned upside down, with the water underneath instead of inside. The town "
    "council laughed at that, but they paid her, and the bridge still stands. In the first winter the "
    "river froze and the ice pushed against the piers for weeks. Nobody slept well. When the thaw came, "
    "the arches were whole, and the council put up a small sign with her name on it."
)
HELD_OUT = (
    "To make bread you need flour, water, salt and yeast. Mix the flour and the salt in a large bowl, "
    "then add the yeast dissolved in warm water. Stir until the dough comes together, then knead it on "
    "a floured table for about ten minutes, until it is smooth and springs back when pressed. Put it in "
    "a clean bowl, cover it with a cloth and leave it somewhere warm for an hour, or until it has doubled "
    "in size. Shape it into a loaf, let it rise again for half an hour, and bake it in a hot oven for "
    "thirty to forty minutes. The loaf is done when it sounds hollow as you tap the bottom. Let it cool "
    "before you cut it, or the inside will be sticky."
)
# How many tokens of each text are read (a model without a tokenizer reads this many seeded ids).
TOKENS = 160
# The prefill before the text is fed one token a step.
PREFILL = 8


@dataclass(frozen=True)
class Budget:
    """What a lossy model may cost, each limit against the fp32 model (a limit of None is not
    checked). The defaults are in docs/quantization.md with the measurements behind them.

    Attributes:
        kl_mean: the mean KL(fp32 || model) per position of EVAL_TEXT, in nats.
        top1: the least share of EVAL_TEXT's positions whose most likely token is the fp32 model's.
        perplexity: the most HELD_OUT's perplexity may grow, as a fraction of the fp32 model's.
        first_tokens: the most prompts whose first greedy token may differ from transformers' where
            the fp32 model is decided: its most likely first token ahead of the second by at least
            `margin` in logits (a near tie, which any rounding may turn, is reported, not counted).
        margin: that lead, in logits (1.0: the first token at least e times as likely as the second).
    """

    kl_mean: float | None = 0.05
    top1: float | None = 0.85
    perplexity: float | None = 0.05
    first_tokens: int | None = 0
    margin: float = 1.0

    def with_overrides(self, text: str | None) -> Budget:
        """This budget with `--budget KEY=VALUE,...` applied (a value `none` drops that limit)."""
        return B.overridden(self, text, counts=("first_tokens",), shares=("top1",), fixed=("margin",))

    def text(self) -> str:
        parts = []
        if self.kl_mean is not None:
            parts.append(f"mean KL <= {self.kl_mean:g}")
        if self.top1 is not None:
            parts.append(f"top-1 >= {self.top1:.0%}")
        if self.perplexity is not None:
            parts.append(f"perplexity +{self.perplexity:.0%} at most")
        if self.first_tokens is not None:
            parts.append(f"first greedy token differing on at most {self.first_tokens} prompt(s) where fp32 leads by "
                         f">= {self.margin:g} logits")
        return ", ".join(parts) or "no limits"


@dataclass
class Cost:
    """One runtime's accuracy cost (see the module docstring); `failures` names each limit of the
    budget it exceeds."""

    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    positions: int
    perplexity: float
    perplexity_fp32: float
    perplexity_fp64: float
    first_difference: list
    margins: list  # the fp32 model's lead of its first greedy token over the second, per prompt (logits)
    equal_tokens: int
    new_tokens: int
    kl_mean_fp64: float = math.nan
    failures: list = field(default_factory=list)
    margin: float = 1.0

    @property
    def perplexity_delta(self) -> float:
        return self.perplexity / self.perplexity_fp32 - 1

    @property
    def first_tokens_differing(self) -> int:
        """Prompts whose first greedy token differs where the fp32 model is decided (`margin`)."""
        return sum(f == 0 and m >= self.margin for f, m in zip(self.first_difference, self.margins, strict=True))

    def judge(self, budget: Budget) -> Cost:
        """Fills `failures` with each limit of `budget` this cost exceeds (a NaN exceeds every one)."""
        self.margin = budget.margin
        out = []
        if budget.kl_mean is not None and not self.kl_mean <= budget.kl_mean:
            out.append(f"mean KL {self.kl_mean:.3g} > {budget.kl_mean:g}")
        if budget.top1 is not None and not self.top1 >= budget.top1:
            out.append(f"top-1 {self.top1:.1%} < {budget.top1:.0%}")
        if budget.perplexity is not None and not self.perplexity_delta <= budget.perplexity:
            out.append(f"perplexity {self.perplexity_delta:+.1%} > +{budget.perplexity:.0%}")
        if budget.first_tokens is not None and not self.first_tokens_differing <= budget.first_tokens:
            out.append(f"first greedy token differs on {self.first_tokens_differing} prompt(s) where fp32 leads by >= "
                       f"{budget.margin:g} logits > {budget.first_tokens}")
        self.failures = out
        return self

    def comparisons(self, budget: Budget) -> list[Comparison]:
        """Each measurement against its limit as a Comparison (max_abs: the value; atol: the limit;
        a limit of None compares nothing and passes), so reports show them as any output."""
        rows = [("mean KL vs fp32 (nats)", self.kl_mean, budget.kl_mean),
                ("top-1 disagreement vs fp32", 1 - self.top1, None if budget.top1 is None else 1 - budget.top1),
                ("perplexity growth vs fp32", self.perplexity_delta, budget.perplexity),
                ("decided first tokens differing", float(self.first_tokens_differing), budget.first_tokens)]
        out = []
        for name, value, limit in rows:
            ok = limit is None or bool(value <= limit)
            out.append(Comparison(name, ok, float(value), math.nan, 0, 0, 0.0, math.inf if limit is None else
                                  float(limit), float(value), math.inf, compared=self.positions,
                                  basis="accuracy budget" + (" (no limit)" if limit is None else "")))
        return out

    def text(self) -> str:
        firsts = ", ".join("-" if f is None else f"{f} (near tie)" if f == 0 and m < self.margin else str(f)
                           for f, m in zip(self.first_difference, self.margins, strict=True))
        return (f"mean KL {self.kl_mean:.3g} (p99 {self.kl_p99:.3g}, max {self.kl_max:.3g}), top-1 {self.top1:.1%} of "
                f"{self.positions}, perplexity {self.perplexity:.3f} vs fp32 {self.perplexity_fp32:.3f} "
                f"({self.perplexity_delta:+.2%}), greedy {self.equal_tokens}/{self.new_tokens} tokens as transformers "
                f"(first departure per prompt: {firsts})")

    def to_dict(self) -> dict:
        return {**asdict(self), "perplexity_delta": self.perplexity_delta,
                "first_tokens_differing": self.first_tokens_differing}


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1] ((T, V), (T,))."""
    lp = B.log_softmax(logits[:-1])
    nll = -lp[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean())) if np.isfinite(nll).all() else math.inf


def text_ids(tokenizer, text: str, vocab: int, seed: int, length: int = TOKENS) -> np.ndarray:
    """(1, T) token ids of `text` (its first `length`), or seeded ids without a tokenizer."""
    if tokenizer is None:
        return np.random.default_rng(seed).integers(min(3, vocab - 1), vocab, (1, length), dtype=np.int64)
    return np.asarray(tokenizer(text)["input_ids"][:length], np.int64)[None, :]


@dataclass
class Baseline:
    """What every runtime is measured against, computed once: the texts' ids, the fp32 and float64
    models' logits over them, and transformers' greedy tokens after the prompts."""

    eval_ids: np.ndarray
    held_ids: np.ndarray
    eval32: np.ndarray
    eval64: np.ndarray
    held32: np.ndarray
    held64: np.ndarray
    prompts: list
    tokens: np.ndarray
    margins: list


def baseline(reference, tokenizer, prompts, new_tokens: int) -> Baseline:
    """The fp32 and float64 model's logits over EVAL_TEXT and HELD_OUT, and transformers' greedy
    tokens after `prompts` (`reference`: an `hf_reference.Reference` of the source model)."""
    import torch
    layout = reference.layout
    room = layout.cache_form.room(layout)  # a static model's buffers hold the whole text
    length = TOKENS if room is None else min(TOKENS, room)
    eval_ids = text_ids(tokenizer, EVAL_TEXT, layout.vocab, 11, length)
    held_ids = text_ids(tokenizer, HELD_OUT, layout.vocab, 12, length)
    model = reference.model
    with torch.no_grad():
        fp32 = [model(input_ids=torch.from_numpy(ids), use_cache=False).logits[0].double().numpy()
                for ids in (eval_ids, held_ids)]
    fp64 = [G.logits64(reference, ids, np.ones_like(ids))[0] for ids in (eval_ids, held_ids)]
    want = G.reference_generation(model, layout, prompts, new_tokens)
    return Baseline(eval_ids, held_ids, fp32[0], fp64[0], fp32[1], fp64[1], list(prompts), want.tokens,
                    leads(want.logits[0]))


def leads(logits: np.ndarray) -> list[float]:
    """Each row's lead of its most likely token over the second, in logits ((B, V) -> B floats):
    how decided a greedy step is."""
    ranked = np.sort(np.asarray(logits, np.float64), axis=-1)
    return [float(m) for m in ranked[:, -1] - ranked[:, -2]]


def measure(run, layout: hf.Layout, base: Baseline, budget: Budget, dtype=np.float32,
            one_at_a_time: bool = False) -> Cost:
    """The accuracy cost of the step graph `run` (feed -> outputs, any runtime) against `base`; its
    greedy tokens from the prompts in one batch, or one prompt at a time (a graph whose runtime
    drives a sequence alone: onnxruntime-genai's shared-buffer step)."""
    new_tokens = base.tokens.shape[1]
    got_eval = G.stepped_logits(run, layout, base.eval_ids, PREFILL, 1, dtype)[0]
    got_held = G.stepped_logits(run, layout, base.held_ids, PREFILL, 1, dtype)[0]
    kl = B.kl_per_position(base.eval32, got_eval)
    kl64 = B.kl_per_position(base.eval64, got_eval)
    top1 = float((base.eval32.argmax(-1) == got_eval.argmax(-1)).mean())
    tokens = G.generate(run, layout, base.prompts, new_tokens, dtype=dtype, alone=one_at_a_time).tokens
    firsts = []
    for got, want in zip(tokens, base.tokens, strict=True):
        differ = np.flatnonzero(got != want)
        firsts.append(int(differ[0]) if differ.size else None)
    cost = Cost(kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()), top1=top1,
                positions=int(kl.size), perplexity=perplexity(got_held, base.held_ids[0]),
                perplexity_fp32=perplexity(base.held32, base.held_ids[0]),
                perplexity_fp64=perplexity(base.held64, base.held_ids[0]), first_difference=firsts,
                margins=base.margins,
                equal_tokens=int(sum(new_tokens if f is None else f for f in firsts)),
                new_tokens=int(new_tokens * len(firsts)), kl_mean_fp64=float(kl64.mean()))
    return cost.judge(budget)


# --- which layers cost most ---------------------------------------------------------------------------

def layer_costs(reference, onnx_model, base: Baseline, top: int | None = None) -> list[dict]:
    """Each group of quantized matrices (`layer:I`, `head`) made as the file holds it, alone, in the
    fp32 model: the mean KL that alone costs over EVAL_TEXT, most costly first."""
    import torch

    model = reference.model
    ids = torch.from_numpy(base.eval_ids)
    out = []
    for group in emulate.each_group_alone(model, onnx_model):
        logits = model(input_ids=ids, use_cache=False).logits[0].double().numpy()
        kl = B.kl_per_position(base.eval32, logits)
        out.append({"group": group, "kl_mean": float(kl.mean()),
                    "top1": float((base.eval32.argmax(-1) == logits.argmax(-1)).mean())})
    out.sort(key=lambda d: -d["kl_mean"])
    return out[:top] if top else out
