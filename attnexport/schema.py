"""What a variant is: its options and their checks, its tensors, the memory one forward pass
needs. The catalogue (`attnexport.variants`) is built from these."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attnexport.errors import UsageError


@dataclass(frozen=True)
class Option:
    name: str  # python name; the CLI flag is --name-with-dashes
    type: type  # int, float, bool or str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None  # for str options
    optional: bool = False  # None is a valid value (and may be the default)
    minimum: int = 1  # for int options (0 for a cache length, which may be empty)
    # For float options: the closed range of values whose models give finite outputs on inputs of
    # ordinary size in fp32 and fp16 (a score of 1e3 x |q.k| stays below fp16's 65504 for |q.k|
    # up to 65); a value outside it, or not finite, is refused with the range.
    bounds: tuple[float, float] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[str | int, ...]  # option names (symbolic sizes), sums of them ("past_seq+seq"), or ints
    dtype: str  # "float", "bool" or "int64"
    kind: str = "data"  # how example values are made: data, bool_mask, additive_mask, padding, valid_lens, sorted
    # A cache input's part in the step: (the output it pairs with, how it carries the cache: "concat",
    # grown by the block; "static", a buffer written in place at the write position; "cross", a
    # decoder's memory, carried as it is). None for every other input. `variants.step_signature`
    # makes the step's signature from it.
    cache: tuple[str, str] | None = None

    def shape(self, o: dict) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sum(o[p] for p in d.split("+")) for d in self.dims)


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str
    options: tuple[Option, ...]
    build: Callable[[dict], Any]  # options -> torch.nn.Module (parameters uninitialized)
    inputs: Callable[[dict], tuple[TensorSpec, ...]]
    outputs: Callable[[dict], tuple[TensorSpec, ...]]
    reference: Callable[[dict, dict, dict], dict]  # (params, inputs, options) -> outputs
    flops: Callable[[dict], int]
    dot_product_core: bool  # True: the attention core is scaled dot-product attention
    dynamic: tuple[str, ...] = ("batch", "seq")  # option names whose sizes are symbolic in ONNX
    # Symbolic sizes that broadcast against another one: 1 or that size (a mask's batch and head
    # axes). The export traces them at the other's size and names them apart in the ONNX inputs.
    broadcast: tuple[tuple[str, str], ...] = ()
    checks: tuple[Callable[[dict], str | None], ...] = field(default=())
    # Given options whose symbolic sizes were changed (verify's probes at other shapes), the sizes
    # that depend on others made to fit them again (sdpa: a short mask stays shorter than the keys).
    refit: Callable[[dict], dict] = lambda o: o
    # How to make its ONNX model: (options, flavor, dtype, params) -> ModelProto; None: the
    # registry's export. A user's module (attnexport.bench.module_variant) brings its own.
    export: Callable[[dict, str, str, dict], Any] | None = None

    def option(self, name: str) -> Option:
        return {o.name: o for o in self.options}[name]

    def sizes(self, o: dict) -> dict:
        """The symbolic sizes that these options' inputs use, with their values (a cache's
        `past_seq` only with the cache)."""
        used = {p for spec in self.inputs(o) for d in spec.dims if isinstance(d, str) for p in d.split("+")}
        if any(spec.kind == "write_pos" for spec in self.inputs(o)):  # a static cache's positions are data
            used.add("past_seq")
        open_ = {k: o[k] for k in self.dynamic if k in used}
        # An axis that broadcasts against a fixed size of 1 (a mask's heads where sdpa's bsd layout
        # fixes heads = 1) can only be 1: it is fixed too.
        return {k: v for k, v in open_.items()
                if not any(k == b and full not in open_ and o[full] == 1 for b, full in self.broadcast)}

    def graph_options(self, o: dict) -> dict:
        """The options that shape the exported graph: all but the sizes it leaves symbolic. Two
        option sets with the same graph options run through one model."""
        symbolic = self.sizes(o)
        return {k: v for k, v in o.items() if k not in symbolic}

    def with_defaults(self, options: dict) -> dict:
        """Stored options (a golden case's, an older export's) with every option they lack at its
        default: an option added after they were stored."""
        return {**{o.name: o.default for o in self.options}, **options}

    def resolve(self, given: dict | None = None) -> dict:
        """Fills defaults, rejects unknown options and bad values; returns the full options."""
        given = {k: v for k, v in (given or {}).items() if v is not None}
        known = {o.name: o for o in self.options}
        for name in given:
            if name not in known:
                flag = "--" + name.replace("_", "-")
                valid = ", ".join(o.flag for o in self.options)
                raise UsageError(f"{flag} is not an option of variant {self.name!r}; its options: {valid}")
        o = {}
        for opt in self.options:
            value = _weights_spelling(opt, given.get(opt.name, opt.default))
            if value is not None and not isinstance(value, opt.type) and not (
                opt.type is float and isinstance(value, int) and not isinstance(value, bool)
            ):
                raise UsageError(f"{opt.flag} must be {opt.type.__name__}, got {value!r}")
            if value is not None and opt.type is float:
                value = float(value)  # type: ignore[arg-type]  # an int or a float: checked just above
                lo, hi = opt.bounds or (-math.inf, math.inf)
                if not (math.isfinite(value) and lo <= value <= hi):
                    within = f" in [{lo:g}, {hi:g}]" if opt.bounds else ""
                    why = " (outside it the model's scores overflow)" if opt.bounds else ""
                    raise UsageError(f"{opt.flag} must be a finite number{within}{why}, got {value:g}")
            if value is not None and opt.choices and value not in opt.choices:
                raise UsageError(f"{opt.flag} must be one of {', '.join(opt.choices)}; got {value!r}")
            if opt.type is int and value is not None and value < opt.minimum:
                raise UsageError(f"{opt.flag} must be an integer >= {opt.minimum}, got {value}")
            o[opt.name] = value
        if "kv_heads" in o and o["kv_heads"] is None:
            o["kv_heads"] = o["heads"]
        if "mask_batch" in o and o["mask_batch"] is None:  # a rank-4 mask per sequence; lower ranks have none
            o["mask_batch"] = o["batch"] if o["mask_rank"] == 4 else 1
        for check in self.checks:
            problem = check(o)
            if problem:
                raise UsageError(f"variant {self.name!r}: {problem}")
        return o


def _weights_spelling(opt: Option, value):
    """`--weights` is a flag in most variants and a mode in sdpa: the flag means the softmax
    weights, and so does True given to sdpa (the API, and model files of earlier releases)."""
    if opt.name != "weights":
        return value
    if opt.type is str and isinstance(value, bool):
        return "softmax" if value else "none"
    if opt.type is bool and value == "softmax":
        return True
    if opt.type is bool and isinstance(value, str):
        raise UsageError(f"--weights {value}: only sdpa has score modes; here --weights takes no value")
    return value


# --- memory ------------------------------------------------------------------------------

def memory_estimate(variant: Variant, o: dict, itemsize: int = 4) -> int:
    """Bytes one forward pass needs, roughly: inputs, parameters, projections and the score matrix.

    A lower bound meant to refuse sizes that cannot fit (a traceback or an OOM kill otherwise),
    not to predict a runtime's peak.
    """
    elems = sum(math.prod(s.shape(o)) for s in variant.inputs(o))
    D, H = o.get("dim", 0), o.get("heads", 1)
    elems += 4 * D * D + 2 * D * o.get("ffn_dim", 0) + o.get("kv_dim", 0) * D * 2  # weights
    B, Tq, Tk = o.get("batch", 1), o.get("seq", 1), o.get("kv_seq", o.get("seq", 1))
    elems += 4 * B * max(Tq, Tk) * max(D, o.get("heads", 1) * o.get("head_dim", 0))  # q, k, v, output
    elems += 3 * B * H * Tq * Tk  # scores, their softmax, and one more copy
    return int(elems * itemsize)


def machine_memory() -> int | None:
    """Physical memory of this machine in bytes (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(variant: Variant, o: dict, itemsize: int = 4) -> None:
    """A UsageError (exit 2) when the sizes cannot fit in this machine's memory."""
    need, have = memory_estimate(variant, o, itemsize), machine_memory()
    if have is not None and need > have:
        sizes = ", ".join(f"--{k.replace('_', '-')} {o[k]}" for k in ("batch", "seq", "kv_seq", "dim", "heads")
                          if k in o)
        raise UsageError(f"{variant.name} at {sizes} needs at least {need / 2**30:.1f} GiB; this machine has "
                         f"{have / 2**30:.1f} GiB")
