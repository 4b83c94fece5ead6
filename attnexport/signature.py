"""A step graph's signature: what an app feeds it, what it gives back, and which outputs go back in.

Every export (a variant, a user's module, a language model) writes one `StepSignature` into
the model's metadata (`attnexport.signature`); verify, bench and the deployment folder read it
back instead of working it out again from the variant's options, the module's flags or the
model family's cache form. Its cache pairs say of each cache input which output returns it
updated, on which axis its positions lie, and its kind:

- "concat": the cache grows by the block at each step (past_key -> present_key);
- "static": a preallocated buffer written in place at `write_pos`; the positions axis is fixed;
- "ring": a sliding-window layer's buffer of as many slots as its window, position p at slot
  p % window; the step returns it rewritten (a new array, not written in place) beside the static
  buffers of its other layers, at the same `write_pos`;
- "cross": a decoder's cache of its memory's keys and values, filled at the first step, then
  carried unchanged.

A static cache's write position comes with its form (`WritePos`): one position per sequence
("start"), the block's positions ("positions"), or one position for every sequence ("shared").

A whole model's step also records the model's sizes (`model`: its family's task, cache form,
layers, cache heads and head size, vocabulary, static buffers, pad token; see
`attnexport.pretrained.model.Layout`), so that one record says all an app needs to drive it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnexport.errors import UsageError
from attnexport.record import ExportRecord

META = "attnexport.signature"
KINDS = ("concat", "static", "ring", "cross")
WRITE_FORMS = ("start", "positions", "shared")


@dataclass(frozen=True)
class WritePos:
    """How a static cache's step is told where its block goes: the input `name` holds, in `form`,

    - "start": each sequence's first position, (B,) (sequences may be at different positions);
    - "positions": the block's positions, (T,), the same for every sequence (transformers'
      `cache_position`);
    - "shared": the block's first position, the same for every sequence, a scalar or (1,).
    `shape` and `dtype`: the input's, for the "shared" form."""

    name: str
    form: str = "start"
    shape: tuple = ()
    dtype: str = "int64"

    @property
    def ragged(self) -> bool:
        """Whether sequences may be at different positions."""
        return self.form == "start"

    def value(self, starts, length: int) -> np.ndarray:
        """The input for a block of `length` positions written at `starts` (B,), each sequence's
        first position (one value for all but in the "start" form)."""
        starts = np.asarray(starts).reshape(-1)
        if self.form == "start":
            return starts.astype(self.dtype)
        if starts.min() != starts.max():
            raise ValueError(f"{self.name} ({self.form}) writes every sequence at one position, got {starts.tolist()}")
        first = int(starts[0])
        if self.form == "positions":
            return np.arange(first, first + length, dtype=self.dtype)
        return np.full(self.shape, first, self.dtype)

    def drawn(self, rng, batch: int, length: int, positions: int) -> np.ndarray:
        """The input for a block of `length` positions at a place drawn where it fits in buffers of
        `positions`: one per sequence in the "start" form, one for all in the others."""
        starts = rng.integers(0, positions - length + 1, size=batch if self.ragged else 1)
        return self.value(starts.repeat(1 if self.ragged else batch), length)

    def ends(self, value, length: int, batch: int) -> np.ndarray:
        """Each sequence's end of the written positions (B,) after a block of `length` written
        where the input `value` says."""
        value = np.asarray(value).reshape(-1)
        if self.form == "positions":
            return np.full(batch, value.max() + 1)
        return value + length if self.ragged else np.full(batch, value[0] + length)

    def meta(self) -> dict:
        return {"input": self.name, "form": self.form, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_meta(cls, fields: Mapping) -> WritePos:
        return cls(fields["input"], fields.get("form", "start"), tuple(fields.get("shape", ())),
                   fields.get("dtype", "int64"))


@dataclass(frozen=True)
class CachePair:
    """A cache input, the output that returns it updated, its positions' axis and its kind."""

    past: str
    present: str
    axis: int = 2
    kind: str = "concat"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a cache's kind is one of {', '.join(KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class StepSignature:
    """A step graph's interface.

    Attributes:
        inputs, outputs: the graph's inputs and outputs, by name, in order.
        dynamic_axes: name -> {axis: its symbolic size}, for every input and output with one.
        caches: the cache pairs (see the module's text).
        write_pos: a static cache's write position, or None.
        along: the outputs that run along the sequence -> their sequence axis (None: `output`,
            on the stream inputs' axis, as a variant's).
        model: a whole model's sizes (see the module's text); None for a variant's or a module's.
    """

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    dynamic_axes: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    caches: tuple[CachePair, ...] = ()
    write_pos: WritePos | None = None
    along: Mapping[str, int] | None = None
    model: Mapping[str, Any] | None = None

    @property
    def pairs(self) -> dict[str, str]:
        """{cache input: the output that returns it updated}."""
        return {c.past: c.present for c in self.caches}

    @property
    def cache_axes(self) -> dict[str, int]:
        """{cache input: its positions' axis}."""
        return {c.past: c.axis for c in self.caches}

    @property
    def growing(self) -> set[str]:
        """The cache inputs that grow by the block at each step."""
        return {c.past for c in self.caches if c.kind == "concat"}

    @property
    def static(self) -> bool:
        """Whether the step writes a static cache (buffers or rings) at a write position."""
        return any(c.kind in ("static", "ring") for c in self.caches)

    def cache(self) -> dict[str, dict]:
        """{cache input: {"output", "axis"}}, the form verify's module checks take."""
        return {c.past: {"output": c.present, "axis": c.axis} for c in self.caches}

    def to_json(self) -> str:
        return json.dumps({
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "dynamic_axes": {n: {str(a): d for a, d in axes.items()} for n, axes in self.dynamic_axes.items()},
            "caches": [{"past": c.past, "present": c.present, "axis": c.axis, "kind": c.kind} for c in self.caches],
            "write_pos": self.write_pos.meta() if self.write_pos else None,
            **({"along": dict(self.along)} if self.along is not None else {}),
            **({"model": dict(self.model)} if self.model is not None else {})}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StepSignature:
        f = json.loads(text)
        return cls(tuple(f["inputs"]), tuple(f["outputs"]),
                   {n: {int(a): d for a, d in axes.items()} for n, axes in f.get("dynamic_axes", {}).items()},
                   tuple(CachePair(c["past"], c["present"], int(c["axis"]), c["kind"]) for c in f.get("caches", ())),
                   WritePos.from_meta(f["write_pos"]) if f.get("write_pos") else None,
                   {n: int(a) for n, a in f["along"].items()} if f.get("along") is not None else None,
                   f.get("model"))

    def with_graph(self, model) -> StepSignature:
        """This signature with the graph's inputs (initializers left out), outputs and symbolic
        axes filled in; a ValueError if a cache or the write position names what the graph lacks."""
        inits = {i.name for i in model.graph.initializer}
        ins = [i for i in model.graph.input if i.name not in inits]
        outs = list(model.graph.output)
        axes = {}
        for vi in ins + outs:
            dims = {a: d.dim_param for a, d in enumerate(vi.type.tensor_type.shape.dim) if d.dim_param}
            if dims:
                axes[vi.name] = dims
        signature = StepSignature(tuple(i.name for i in ins), tuple(o.name for o in outs), axes, self.caches,
                                  self.write_pos, self.along, self.model)
        problem = signature.disagreement(model)
        if problem:
            raise ValueError(problem)
        return signature

    def disagreement(self, model) -> str:
        """What in the graph disagrees with this signature ('' when nothing does): its inputs and
        outputs, a cache input or output, the write position."""
        inits = {i.name for i in model.graph.initializer}
        ins = tuple(i.name for i in model.graph.input if i.name not in inits)
        outs = tuple(o.name for o in model.graph.output)
        if ins != self.inputs:
            return f"its inputs are {', '.join(ins) or 'none'}; its signature says {', '.join(self.inputs) or 'none'}"
        if outs != self.outputs:
            return f"its outputs are {', '.join(outs)}; its signature says {', '.join(self.outputs)}"
        for c in self.caches:
            if c.past not in ins or c.present not in outs:
                return f"its signature pairs the cache {c.past} -> {c.present}, which the graph lacks"
        if self.write_pos is not None and self.write_pos.name not in ins:
            return f"its signature writes at {self.write_pos.name}, which is not an input"
        if self.static != (self.write_pos is not None):
            return "its signature has a static cache without a write position, or one without a static cache"
        return ""

PLAIN = StepSignature()  # a step that carries no cache (its inputs and outputs filled in from the graph)


def describe(signature: StepSignature) -> str:
    """One line: each cache pair with its kind and axis, and the write position."""
    caches = "; ".join(f"{c.past} -> {c.present} ({c.kind}, axis {c.axis})" for c in signature.caches)
    write = f"; written at {signature.write_pos.name} ({signature.write_pos.form})" if signature.write_pos else ""
    return f"{len(signature.inputs)} inputs, {len(signature.outputs)} outputs; " + \
        (f"caches: {caches}{write}" if caches else "no cache")


def of(model, what: str = "the model") -> StepSignature | None:
    """The signature `model` records (None for a file exported before signatures); a one-line
    UsageError if the record is damaged or disagrees with the graph."""
    text = ExportRecord.of(model).signature
    if text is None:
        return None
    try:
        signature = StepSignature.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{what}: its {META} metadata is damaged ({e})") from None
    problem = signature.disagreement(model)
    if problem:
        raise UsageError(f"{what}: {problem} (the graph was changed after export)")
    return signature
