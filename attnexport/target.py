"""What an export traces and what torch runs beside it: one `Target`.

A target is a module with its parameters, the inputs its forward takes (in order), the outputs it
declares, and the step signature its export records (`attnexport.signature`). export traces it,
verify's torch runtimes and bench's torch eager run it, and every reader of an exported file takes
the same signature back from the file's metadata. `of_variant` makes a variant's target from its
options and parameters: the one place the module is built, loaded, cast and fed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnexport import dtypes as D
from attnexport import seeding
from attnexport import variants as V
from attnexport.schema import Variant
from attnexport.signature import StepSignature


@dataclass(frozen=True)
class Target:
    """A module to export and to run in torch.

    Attributes:
        name: its name in messages (the variant's).
        build: makes the module with its parameters loaded, in float32 (called for each use, so
            each copy is cast and moved on its own).
        inputs: the names of forward's arguments, in order.
        outputs: the names of the outputs it declares, in order.
        signature: its step's signature (caches and write position); the export fills in the
            graph's inputs, outputs and symbolic axes.
    """

    name: str
    build: Callable[[], Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    signature: StepSignature

    def module(self, dtype: str = "fp32", device: str = "cpu"):
        """The module in `dtype` on `device`, in eval mode."""
        return self.build().to(device=device, dtype=D.torch_dtype(dtype)).eval()

    def args(self, feed: Mapping[str, np.ndarray], dtype: str = "fp32", device: str = "cpu") -> tuple:
        """forward's arguments from `feed` ({input: array}), in the inputs' order: float arrays
        in `dtype`, the others as they are; a ValueError names an input the feed lacks."""
        import torch
        missing = [n for n in self.inputs if n not in feed]
        if missing:
            raise ValueError(f"{self.name} takes {', '.join(missing)}, which the feed lacks")
        tdtype = D.torch_dtype(dtype)
        return tuple(torch.from_numpy(np.ascontiguousarray(feed[n])).to(
            device=device, dtype=tdtype if np.asarray(feed[n]).dtype.kind == "f" else None) for n in self.inputs)


def of_variant(variant: Variant, options: dict, params: Mapping[str, np.ndarray]) -> Target:
    """A variant with resolved `options` and its parameters (`params`, NumPy arrays by name)."""
    return Target(variant.name, lambda: seeding.load_params(variant.build(options), dict(params)),
                  tuple(s.name for s in variant.inputs(options)), tuple(s.name for s in variant.outputs(options)),
                  V.step_signature(variant, options))
