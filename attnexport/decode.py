"""Decoding with a key/value cache, and the property that makes a cache trustworthy.

`decode` runs a cache-step model over a sequence in chunks (1 token at a time, or several),
starting from empty caches and feeding each step's `present_*` back as the next `past_*`, the way
a deployment app generates. For a causal block its outputs must equal those of the full causal
forward over the whole sequence: verify and the tests check exactly that.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

CHUNKS = (1, 3)  # token by token, and in chunks of 3 (the last one shorter)


def decode(step: Callable[[dict], dict], stream: dict[str, np.ndarray], chunk: int,
           empty_cache: dict[str, np.ndarray], axis: int, once: dict[str, np.ndarray] | None = None,
           masks: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The outputs of `step` run over a sequence in chunks of `chunk`, from empty caches.

    Args:
        step: one call of the model: {stream inputs, once inputs, past_*} -> {output, present_*}.
        stream: the inputs that run along the sequence (`x`; or `query`, `key`, `value`), whole.
        empty_cache: every `past_*` input with 0 positions (axis 2).
        axis: the sequence axis of the stream inputs and of `output`.
        once: inputs given whole at the first step and empty (0 long on axis 1) at the later
            ones, their keys and values being cached by then (the decoder's memory).
        masks: masks over the whole sequence, (..., T, T): each step gets the rows of its block
            and the columns of every key so far, (..., block, end).

    Returns:
        the outputs of every chunk, concatenated along `axis`.
    """
    length = next(iter(stream.values())).shape[axis]
    cache = dict(empty_cache)
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        block = {k: np.take(v, np.arange(start, end), axis=axis) for k, v in stream.items()}
        given = {k: v if start == 0 else v[:, :0] for k, v in (once or {}).items()}
        given.update({k: v[..., start:end, :end] for k, v in (masks or {}).items()})
        got = step({**block, **given, **cache})
        outs.append(np.asarray(got["output"]))
        cache = {name: np.asarray(got["present_" + name.removeprefix("past_")]) for name in cache}
        if cache["past_key"].shape[2] != end:
            raise ValueError(f"present_key has {cache['past_key'].shape[2]} positions after {end} tokens")
    return np.concatenate(outs, axis=axis)


def stream_axis(variant, o: dict) -> int:
    """The sequence axis of a cache-step variant's stream inputs (the position of `seq`)."""
    first = variant.inputs(o)[0]
    return list(first.dims).index("seq")


def split_inputs(variant, o: dict, inputs: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """(stream, once, masks): a cache step's non-cache inputs that run along the sequence (a
    `seq` axis, or the keys and values a `past_*` cache extends), those given once (the decoder's
    memory) and masks over past and new keys (an axis that is a sum: past_seq+seq)."""
    names = {s.name for s in variant.inputs(o)}
    specs = [s for s in variant.inputs(o) if not s.name.startswith("past_")]
    masks = {s.name: inputs[s.name] for s in specs if any(isinstance(d, str) and "+" in d for d in s.dims)}
    streamed = [s.name for s in specs if s.name not in masks and ("seq" in s.dims or f"past_{s.name}" in names)]
    stream = {n: inputs[n] for n in streamed}  # in the inputs' order
    once = {s.name: inputs[s.name] for s in specs if s.name not in masks and s.name not in streamed}
    return stream, once, masks


def empty_cache(variant, o: dict, dtype) -> dict[str, np.ndarray]:
    """Every past_* input of a cache-step variant at options o, with 0 positions."""
    empty = {**o, **{k: 0 for k in o if k.startswith("past_")}}
    return {s.name: np.zeros(s.shape(empty), dtype) for s in variant.inputs(empty) if s.name.startswith("past_")}
