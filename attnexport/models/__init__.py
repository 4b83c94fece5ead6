"""PyTorch modules for every attention variant, one file per family.

The package imports none of them (they import torch): a file or a class read from it
(`models.core`, `models.MultiHeadAttention`) is imported when first read, so that naming a
variant, listing them and the float64 reference stay light."""

import importlib

# The modules the variants build, by the file each is in.
CLASSES = {
    "ScaledDotProductAttention": "dot_product", "SelfAttention": "dot_product",
    "MultiHeadAttention": "multi_head", "CachedSelfAttention": "multi_head",
    "StaticCachedSelfAttention": "multi_head", "TiedMultiHeadAttention": "multi_head", "CrossAttention": "multi_head",
    "AdditiveAttention": "additive", "MaskedSoftmax": "additive", "KernelRegression": "kernel",
    "PositionalEncoding": "transformer", "EncoderLayer": "transformer", "DecoderLayer": "transformer",
    "CachedDecoderLayer": "transformer", "StaticCachedDecoderLayer": "transformer",
}


def __getattr__(name: str):
    if name in CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{CLASSES[name]}"), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":  # the module exists; something it imports does not
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
