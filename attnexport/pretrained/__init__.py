"""Whole pretrained models: a transformers model (a `save_pretrained` folder, a model id or a GGUF
file) exported as step graphs with a known cache, checked against itself in float64, quantized,
timed, and loaded by the clients its users run. docs/layout.md names each module's job.

The package imports none of its modules (most import torch and transformers): one read from it
(`pretrained.export`) is imported when first read, so that the command line starts without them."""

import importlib


def __getattr__(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":  # the module exists; something it imports does not
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
