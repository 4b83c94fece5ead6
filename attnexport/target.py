"""What an export traces and what torch runs beside it: one `Target`.

A target is a module with its parameters, the inputs its forward takes (in order), the outputs it
declares, and the step signature its export records (`attnexport.signature`). export traces it,
verify's torch runtimes and bench's torch eager run it, and every reader of an exported file takes
the same signature back from the file's metadata. `of_variant` makes a variant's target from its
options and parameters: the one place the module is built, loaded, cast and fed. `of_module` makes
a user's module's: its inputs, outputs and cache pairs worked out once, for its export and its
bench alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnexport import dtypes as D
from attnexport import modules as M
from attnexport import seeding
from attnexport import variants as V
from attnexport.errors import UsageError
from attnexport.schema import Variant
from attnexport.signature import CachePair, StepSignature, WritePos


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


def of_module(module, example_inputs: tuple, name: str, input_names=None, output_names=None,
              cache: Mapping[str, str] | None = None, write_pos: str | None = None) -> Target:
    """A user's module with example arguments for its forward (one run of it, routed through the
    core, says what it returns). Its inputs: `input_names`, or forward's parameters; its outputs:
    `output_names`, or named from what forward returns (none for a nested return); its step
    signature: the `cache` pairs (input -> output; `{i}` patterns expanded over the inputs),
    static where the module has a `write_pos`, each on its input's axis -2 until its export reads
    the graph's. A UsageError names what does not match forward."""
    import copy

    import torch

    names = list(input_names or M.forward_names(module, len(example_inputs)))
    if len(names) != len(example_inputs):
        raise UsageError(f"{name}: {len(names)} input name(s) for {len(example_inputs)} example input(s)")
    pairs = M.expand_cache_patterns(dict(cache or {}), names)
    unknown = sorted(set(pairs) - set(names))
    if unknown:
        raise UsageError(f"--cache {', '.join(unknown)}: not an input of {name} (inputs: {', '.join(names)})")
    with torch.no_grad(), M.routed():
        sample = M.call_forward(module, tuple(example_inputs), name)
    returned = len(M.outputs_of(sample))
    if output_names and len(output_names) != returned:
        raise UsageError(f"--output-names gives {len(output_names)} name(s) ({', '.join(output_names)}); "
                         f"{name} returns {returned} output(s)")
    outputs = list(output_names) if output_names else M.default_output_names(sample) or []
    missing = sorted(set(pairs.values()) - set(outputs))
    if missing:
        raise UsageError(f"--cache: {', '.join(missing)} is not an output of {name} (outputs: "
                         f"{', '.join(outputs or ['nested, unnamed'])})")
    kind = "static" if write_pos is not None else "concat"
    caches = tuple(CachePair(n, o, example_inputs[names.index(n)].dim() - 2, kind) for n, o in pairs.items())
    return Target(name, lambda: copy.deepcopy(module), tuple(names), tuple(outputs),
                  StepSignature(caches=caches, write_pos=WritePos(write_pos) if write_pos is not None else None))
