"""Whole pretrained models: a transformers model (a `save_pretrained` folder, a model id or a GGUF
file) exported as step graphs with a known cache, checked against itself in float64, quantized,
timed, and loaded by the clients its users run. docs/layout.md names each module's job.

The package imports none of its modules (most import torch and transformers): one read from it
(`pretrained.export`) is imported when first read, so that the command line starts without them."""

import importlib

MODULES = ("accuracy", "bench", "check", "clients", "export", "families", "forms", "fusions", "model", "precision",
           "reference")


def __getattr__(name: str):
    if name in MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
