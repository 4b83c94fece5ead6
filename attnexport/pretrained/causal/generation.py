"""A language model's generation: greedy decoding through its step graph on any runtime (the loop
an app writes, by the form's own feeds), transformers' own `generate` that it is held to, the
prompts it is run on, a sequence stepped through the cache, and the float64 logits of a
generation teacher-forced."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnexport.errors import UsageError
from attnexport.pretrained import model as hf
from attnexport.pretrained import reference as HR
from attnexport.pretrained.causal.forms import CausalForm, left_padded, positions_of

# The prompts of generation parity when the model has a tokenizer (greedy answers a reader can
# check: a fact, code, a physical constant, a story, a list).
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
)


def form_of(layout: hf.Layout) -> CausalForm:
    """The layout's form, a language model's (one that steps and decodes)."""
    form = layout.cache_form
    if not isinstance(form, CausalForm):
        raise UsageError(f"a {layout.family.what} generates no tokens")
    return form


def stepped_logits(run, layout: hf.Layout, ids: np.ndarray, first: int, chunk: int, dtype=np.float32) -> np.ndarray:
    """The logits (B, T, V) of every position of `ids` (B, T) from the step graph `run` (any
    runtime): a prefill of `first` tokens into an empty cache, then blocks of `chunk` tokens, each
    step's cache fed to the next (concat: the presents as pasts; static: the buffers, write_pos the
    tokens so far); the none form runs the whole sequence once."""
    return form_of(layout).stepped_logits(run, layout, ids, first, chunk, dtype)


def prompts_for(layout: hf.Layout, lengths, seed: int = 0) -> list[np.ndarray]:
    """Token ids for prompts of `lengths`, seeded; the pad token and the first few ids (special
    tokens in most vocabularies) left out."""
    rng = np.random.default_rng(seed)
    low = min(3, layout.vocab - 1)
    return [rng.integers(low, layout.vocab, n, dtype=np.int64) for n in lengths]


def prompts(tokenizer, layout: hf.Layout, lengths, seed: int = 0) -> list[np.ndarray]:
    """Generation parity's prompts: PROMPTS tokenized where the model has a tokenizer, else seeded
    token ids of `lengths`."""
    if tokenizer is None:
        return prompts_for(layout, lengths, seed)
    return [np.asarray(tokenizer(p)["input_ids"], np.int64) for p in PROMPTS]


@dataclass
class Generation:
    """A greedy generation: the new tokens (B, N), each step's logits of the last position
    (N arrays (B, V)), and the inputs of the first step whose token differs from the tokens
    watched (what localizes a divergence; None when none differs or none was watched)."""

    tokens: np.ndarray
    logits: list
    diverged_feed: dict | None = None


def generate(run, layout: hf.Layout, prompts, new_tokens: int, watch: np.ndarray | None = None,
             dtype=np.float32) -> Generation:
    """Greedy decoding of `new_tokens` tokens after each prompt with the step graph of `layout`:
    `run(feed) -> {output name: array}` runs one step (any runtime). The loop an app writes, by the
    form's feeds (`decoding`): none: the whole sequence each step; concat: prompts left-padded with
    the mask and position ids, then one token a step with the presents as the next pasts; static:
    prompts right-padded into empty buffers at write_pos 0, each sequence's next write_pos its own
    length, then one token a step at write_pos, the buffers written returned as the next step's
    (prompts a ring cannot take in one batch, see `StaticCache.batches`: each alone).
    `watch`: the tokens expected (B, N), whose first departure's feed is kept; `dtype`: the caches'
    (the model's float type)."""
    batch = len(prompts)
    form = form_of(layout)
    if batch > 1 and not form.batches(layout, prompts):  # each prompt alone (a ring's padding would wrap)
        alone = [generate(run, layout, [p], new_tokens, None if watch is None else watch[b:b + 1], dtype)
                 for b, p in enumerate(prompts)]
        return Generation(np.concatenate([g.tokens for g in alone]),
                          [np.concatenate(step) for step in zip(*(g.logits for g in alone), strict=True)],
                          next((g.diverged_feed for g in alone if g.diverged_feed is not None), None))
    decoding = form.decoding(layout, prompts, new_tokens, dtype)
    tokens, logits, diverged = [], [], None
    for step in range(new_tokens):
        out = run(decoding.feed)
        step_logits = np.asarray(out["logits"])[np.arange(batch), decoding.last]
        token = step_logits.argmax(axis=-1).astype(np.int64)
        if watch is not None and diverged is None and (token != watch[:, step]).any():
            diverged = decoding.feed
        tokens.append(token)
        logits.append(step_logits)
        decoding.advance(token, out)
    return Generation(np.stack(tokens, axis=1), logits, diverged)


def reference_generation(model, layout: hf.Layout, prompts, new_tokens: int) -> Generation:
    """transformers' own `generate(do_sample=False)` on the prompts (left-padded, with the mask),
    with its own cache and attention: exactly `new_tokens` tokens (no end-of-sequence stop), and
    each step's logits."""
    from transformers import GenerationConfig
    ids, mask, _ = left_padded(prompts, layout.pad_token)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=layout.pad_token, output_logits=True, return_dict_in_generate=True)
    # generate() fills what a config leaves at its default from the model's own generation config
    # (its end-of-sequence token among them, which would stop it): that one has none either while it runs.
    own = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig(pad_token_id=layout.pad_token)
    try:
        with torch.no_grad(), hf.quiet_transformers():
            out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 generation_config=config)
    finally:
        model.generation_config = own
    tokens = out.sequences[:, ids.shape[1]:].numpy()
    if tokens.shape[1] != new_tokens:
        raise RuntimeError(f"transformers' generate gave {tokens.shape[1]} tokens for {new_tokens}")
    return Generation(tokens, [t.double().numpy() for t in out.logits])


def logits64(reference: HR.Reference, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' own forward in float64 over whole (left-padded) sequences: (B, T, V) logits."""
    positions = positions_of(mask)
    with torch.no_grad(), reference.in_float64():
        out = reference.model64(input_ids=torch.from_numpy(sequences), attention_mask=torch.from_numpy(mask),
                                position_ids=torch.from_numpy(positions), use_cache=False)
    return out.logits.double().numpy()


def generation_logits64(reference: HR.Reference, prompts, tokens: np.ndarray) -> list[np.ndarray]:
    """Each step's logits (B, V) of a greedy generation of `tokens` (B, N) after `prompts`, from
    the model in float64 over the prompts (left-padded) and the tokens, teacher-forced."""
    ids, mask, _ = left_padded(prompts, reference.layout.pad_token)
    width, steps = ids.shape[1], tokens.shape[1]
    sequences = np.concatenate([ids, tokens[:, :-1]], axis=1)
    mask = np.concatenate([mask, np.ones((len(prompts), steps - 1), np.int64)], axis=1)
    logits = logits64(reference, sequences, mask)
    return [logits[:, width - 1 + i] for i in range(steps)]
