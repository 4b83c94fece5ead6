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


def decode(step: Callable[[dict], dict], x: np.ndarray, chunk: int, kv_heads: int, head_dim: int,
           names: tuple[str, str, str] = ("x", "past_key", "past_value")) -> np.ndarray:
    """Outputs (B, T, D) of `step` run over x (B, T, D) in chunks of `chunk`, from an empty cache.

    Args:
        step: one call of the model: {x, past_key, past_value} -> {output, present_key, present_value}.
    """
    B, T = x.shape[:2]
    past_key = np.zeros((B, kv_heads, 0, head_dim), x.dtype)
    past_value = np.zeros((B, kv_heads, 0, head_dim), x.dtype)
    outs = []
    for start in range(0, T, chunk):
        got = step({names[0]: x[:, start:start + chunk], names[1]: past_key, names[2]: past_value})
        outs.append(np.asarray(got["output"]))
        past_key, past_value = np.asarray(got["present_key"]), np.asarray(got["present_value"])
        if past_key.shape[2] != start + x[:, start:start + chunk].shape[1]:
            raise ValueError(f"present_key has {past_key.shape[2]} positions after {start + chunk} tokens")
    return np.concatenate(outs, axis=1)
