"""A variant's example inputs and parameters, drawn with NumPy from a seed (so that golden
cases never depend on torch's random number generator)."""

from __future__ import annotations

import math

import numpy as np

from attnexport.schema import Variant


def make_inputs(variant: Variant, o: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded example inputs: float32 data, masks as the spec's kind says."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in variant.inputs(o):
        shape = spec.shape(o)
        if spec.kind == "data":
            out[spec.name] = rng.standard_normal(shape).astype(np.float32)
        elif spec.kind == "sorted":
            out[spec.name] = np.sort(rng.uniform(0, 5, shape), axis=-1).astype(np.float32)
        elif spec.kind in ("bool_mask", "additive_mask"):
            keep = rng.random(shape) < 0.8
            if spec.kind == "bool_mask":
                out[spec.name] = keep
            else:
                # -inf, not -1e9: -1e9 overflows to -inf in fp16 anyway and hides the intent.
                small = 0.5 * rng.standard_normal(shape)
                out[spec.name] = np.where(keep, small, -np.inf).astype(np.float32)
        elif spec.kind == "padding":
            B, T_ = shape
            lens = rng.integers(1, T_ + 1, size=B)
            out[spec.name] = np.arange(T_)[None, :] < lens[:, None]
        elif spec.kind in ("true", "false", "zeros"):  # a user's mask or ids: one value throughout
            out[spec.name] = np.full(shape, spec.kind == "true") if spec.dtype == "bool" else \
                np.zeros(shape, np.dtype(spec.dtype))
        elif spec.kind == "write_pos":
            out[spec.name] = write_positions(o)
        elif spec.kind == "valid_lens":
            limit = o["kv_seq"]
            out[spec.name] = rng.integers(1, limit + 1, size=shape).astype(np.int64)
        else:
            raise ValueError(f"unknown input kind {spec.kind!r}")
    return out


def write_positions(o: dict) -> np.ndarray:
    """A static cache's positions written so far, per sequence: past_seq - b, at least 0 (so a
    batch holds sequences of different lengths, and batch 1 is at past_seq)."""
    return np.maximum(o["past_seq"] - np.arange(o["batch"]), 0).astype(np.int64)


def init_params(variant: Variant, o: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 parameters for the module, named as in its state_dict.

    Drawn with NumPy from the parameter shapes, so that golden cases do not depend on torch's
    random number generator (which may change between torch releases).
    """
    module = variant.build(o)
    rng = np.random.default_rng(seed)
    params = {}
    for name, t in module.state_dict().items():
        shape = tuple(t.shape)
        if len(shape) >= 2:
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        elif name.endswith(".weight"):  # layer norm gain
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        else:  # scalar parameters such as the kernel bandwidth
            value = rng.uniform(0.5, 2.0, shape)
        params[name] = value.astype(np.float32)
    return params


def load_params(module, params: dict[str, np.ndarray]):
    """Loads NumPy parameters into a module (strict: every name must match)."""
    import torch
    module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in params.items()}, strict=True)
    return module
