"""A step graph's form: how a whole model of one graph takes and returns its cache (if it keeps
one), one class a form, registered in `FORMS` by the family that exports it (as the flavours are in
`attnexport.flavors.FLAVORS`). A form says everything the shared export, check and reference code
asks of a step graph: its inputs, outputs and symbolic axes, its step signature, the torch wrapper
the export traces, the feed of a check and the positions it compares, the shapes export and verify
check at, its deployment file, what each client cannot load. What only one family's forms do (a
language model's decoding, a cache's steps) is in that family's base form. Nothing outside these
classes asks a form's name.

A form's methods take the model's layout (`attnexport.pretrained.model.Layout`: layers, cache
heads and head size, vocabulary, buffers).
"""

from __future__ import annotations

from typing import ClassVar

from attnexport import signature as SG
from attnexport.errors import UsageError

# The shape of a check: (label, batch, block, past, padded).
Check = tuple[str, int, int, int, int]


class CacheForm:
    """One form. Subclasses set the class attributes and override what differs; the methods
    without a body here are what every form says of itself."""

    name: ClassVar[str]
    # The step signature's kind of each cache pair (None: the form has no cache).
    kind: ClassVar[str | None] = None
    # Where the step graph goes in a deployment folder.
    deploy_file: ClassVar[str] = "onnx/model.onnx"
    # The shapes an export is checked at before it is written, and verify's. Each cache is written
    # by the model from a token prefix.
    export_checks: ClassVar[tuple[Check, ...]] = ()
    verify_checks: ClassVar[tuple[Check, ...]] = ()
    # {client: why it cannot run this form} (checked: tests/test_pretrained_clients.py).
    cannot: ClassVar[dict[str, str]] = {}
    # The flavour rules this form asks for (`flavors.Flavor.needs`' names).
    needs: ClassVar[tuple[str, ...]] = ()
    # The trace's example step: (block, past).
    trace_shape: ClassVar[tuple[int, int]] = (5, 3)
    # Whether each present is its past's buffer written (of --max-seq positions): a runtime that
    # writes in place may bind one buffer to both (ONNX Runtime's GroupQueryAttention does).
    writes_in_place: ClassVar[bool] = False
    # Whether --kv-cache names it (a family's only form is never asked for).
    kv_cache: ClassVar[bool] = True

    @property
    def caches(self) -> bool:
        return self.kind is not None

    # --- names -----------------------------------------------------------------------------------

    def cache_names(self, layout, prefix: str) -> list[str]:
        """`prefix.{i}.key`, `prefix.{i}.value` of every layer, in order (none without a cache)."""
        if not self.caches:
            return []
        return [f"{prefix}.{i}.{kv}" for i in range(layout.layers) for kv in ("key", "value")]

    def inputs(self, layout) -> list[str]:
        raise NotImplementedError

    def outputs(self, layout) -> list[str]:
        raise NotImplementedError

    def dynamic_axes(self, layout) -> dict:
        """The symbolic axes of each input of the step graph."""
        raise NotImplementedError

    def float32_inputs(self, layout) -> tuple[str, ...]:
        """The float inputs the graph takes in float32 whatever its dtype (its wrapper casts them): a
        client's preprocessing gives float32 (none by default: a cache's inputs are the graph's dtype)."""
        return ()

    def signature(self, layout) -> SG.StepSignature:
        """The caches and write position of this form's step (the graph fills in the rest)."""
        pairs = layout.cache_pairs.items()
        return SG.StepSignature(caches=tuple(SG.CachePair(p, q, 2, self.kind or "concat") for p, q in pairs))

    # --- export ------------------------------------------------------------------------------------

    def check_max_seq(self, max_seq: int) -> None:
        """A one-line refusal of a --max-seq this form does not take."""
        no_max_seq(max_seq)

    def wrapper(self, model, layout):
        """The module the export traces: `model` as this form's step of flat tensors."""
        raise NotImplementedError

    def repeat(self, wrapper, layout):
        """How the export may trace `wrapper` with a few of its layers and stamp the rest
        (`attnexport.stamping.Repeat`); None: it traces every layer."""
        return None

    def rotary_positions(self, model, layout) -> int:
        """The positions the ort flavour's rotary tables cover (0: none)."""
        return int(getattr(model.config, "max_position_embeddings", 0) or 0)

    def fit_pasts(self, onnx_model, layout) -> None:
        """The traced graph made what a deployment wants of this form's pasts (nothing by default)."""

    def notes(self, attention_op: str, dtype: str) -> list[str]:
        """What export says of this form's model beyond the check."""
        return []

    def room(self, layout) -> int | None:
        """The positions this form's model holds (None: as many as the model's)."""
        return None

    def check_room(self, layout, needs: int, what: str) -> None:
        """A one-line refusal where the model's step cannot hold `needs` positions."""

    # --- the feeds of a check ------------------------------------------------------------------------

    def example_feed(self, layout, batch: int, block: int, past: int, seed: int, padded: int) -> dict:
        """One step's inputs of random tokens (and caches), sequence 0's `padded` positions padding."""
        raise NotImplementedError

    def prefilled_feed(self, run, layout, ids, past: int, padded: int, dtype) -> dict:
        """The feed of one step over ids[:, past:] after a cache `run` (the model) wrote from
        ids[:, :past] (a form without a cache: of ids), sequence 0's `padded` positions padding."""
        raise NotImplementedError

    def valid_positions(self, layout, feed: dict) -> dict:
        """{output: boolean array broadcastable to it}: the positions a check compares (never padding)."""
        raise NotImplementedError

    def window(self, layout, feed: dict, valid: dict) -> tuple[dict, dict]:
        """(the feed the model runs for a check, the whole shape of each output it cuts): the feed
        itself, nothing cut."""
        return feed, {}


def no_max_seq(max_seq: int) -> None:
    """A one-line refusal of a --max-seq where the form takes none."""
    if max_seq:
        raise UsageError("--max-seq sizes the static cache's buffers: give it with --kv-cache static")


# The forms, by the name --kv-cache takes, put here by the families that export them (`register`).
FORMS: dict[str, CacheForm] = {}


def register(*forms: CacheForm) -> None:
    """Each form in FORMS (a family package registers its own as it is imported)."""
    for f in forms:
        FORMS[f.name] = f


def form(name: str, among=None) -> CacheForm:
    """The form `name`; a UsageError naming the forms --kv-cache takes (`among`: a family's, of
    FORMS) otherwise."""
    names = tuple(FORMS) if among is None else among
    if name not in names:
        chosen = [n for n in names if FORMS[n].kv_cache]
        raise UsageError(f"--kv-cache for --hf is one of {', '.join(chosen)}, got {name!r}")
    return FORMS[name]
