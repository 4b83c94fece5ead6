"""Decoding with a key/value cache, and the property that makes a cache trustworthy.

`decode` runs a cache-step model over a sequence in chunks (1 token at a time, or several),
starting from an empty cache and feeding each step's `present_*` back as the next `past_*`, the
way a deployment app generates. For a causal block its outputs must equal those of the full
causal forward over the whole sequence: verify and the tests check exactly that.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

CHUNKS = (1, 3)  # token by token, and in chunks of 3 (the last one shorter)


def decode(step: Callable[[dict], dict], stream: dict[str, np.ndarray], chunk: int,
           empty_cache: dict[str, np.ndarray], axis: int) -> np.ndarray:
    """The outputs of `step` run over a sequence in chunks of `chunk`, from an empty cache.

    Args:
        step: one call of the model: {stream inputs, past_key, past_value} ->
            {output, present_key, present_value}.
        stream: the inputs that run along the sequence (`x`; or `query`, `key`, `value`), whole.
        empty_cache: `past_key` and `past_value` with 0 positions (axis 2).
        axis: the sequence axis of the stream inputs and of `output`.

    Returns:
        the outputs of every chunk, concatenated along `axis`.
    """
    length = next(iter(stream.values())).shape[axis]
    cache = dict(empty_cache)
    outs = []
    for start in range(0, length, chunk):
        block = {k: np.take(v, np.arange(start, min(start + chunk, length)), axis=axis) for k, v in stream.items()}
        got = step({**block, **cache})
        outs.append(np.asarray(got["output"]))
        cache = {"past_key": np.asarray(got["present_key"]), "past_value": np.asarray(got["present_value"])}
        if cache["past_key"].shape[2] != min(start + chunk, length):
            raise ValueError(f"present_key has {cache['past_key'].shape[2]} positions after "
                             f"{min(start + chunk, length)} tokens")
    return np.concatenate(outs, axis=axis)


def stream_axis(variant, o: dict) -> int:
    """The sequence axis of a cache-step variant's stream inputs (the position of `seq`)."""
    first = variant.inputs(o)[0]
    return list(first.dims).index("seq")


def empty_cache(variant, o: dict, dtype) -> dict[str, np.ndarray]:
    """past_key and past_value of 0 positions for a cache-step variant at options o."""
    specs = {s.name: s for s in variant.inputs({**o, "past_seq": 0})}
    return {n: np.zeros(specs[n].shape({**o, "past_seq": 0}), dtype) for n in ("past_key", "past_value")}
