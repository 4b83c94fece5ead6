"""What verify is asked to do, as objects: `Checking`, where and how strictly any of verify's
modes runs (golden cases, model files, a module's export, a language model's), declared once and
taken by each mode's request and by the executor; `VerifyRequest`, the golden and model-file
modes' request. The command line's options (`attnexport.options.VERIFY`) bear the same names
and take their defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Checking:
    """Where and how strictly the rows of a verify call run.

    Attributes:
        runtimes: the runtimes to run on (default: every available one).
        rtol, atol: the tolerance instead of the policy's.
        skip_unavailable: skip requested runtimes that cannot run here instead of failing them.
        strict_placement: a compute node an accelerated runtime left on the CPU fails the row.
        localize: localize every ONNX run, not only failing ones; a divergence fails the run.
        baseline: a known-good baseline folder (`attnexport.baseline`) every run is compared with;
            a run fails where an output's error grew more than `max_growth` times.
        save_baseline: write the runs as a baseline folder there.
    """

    runtimes: list[str] | None = None
    rtol: float | None = None
    atol: float | None = None
    skip_unavailable: bool = False
    strict_placement: bool = False
    localize: bool = False
    baseline: str | Path | None = None
    save_baseline: str | Path | None = None
    max_growth: float = 10.0

    @classmethod
    def taken(cls, values) -> dict:
        """The Checking fields of `values` (an object with them as attributes, such as the
        options `attnexport.options.read` returns), as keywords for any request."""
        return {f.name: getattr(values, f.name) for f in fields(Checking)}

    @property
    def checking(self) -> Checking:
        """This request's Checking fields alone (what the executor takes)."""
        return Checking(**Checking.taken(self))


@dataclass(frozen=True, kw_only=True)
class VerifyRequest(Checking):
    """What to verify: golden cases (no `models`) or model files, with the Checking fields.

    Attributes:
        dtype: fp32 or fp16; default fp32 for golden cases, the model's own for model files.
        model_variant, model_options, seed: the variant, options and parameter seed of a model
            file without metadata (refused, when they disagree, for one that has it).
        flavors: golden mode: the flavours to export; model mode: at most one, checked against
            the model's.
    """

    variants: list[str] | None = None
    flavors: list[str] | None = None
    dtype: str | None = None
    golden_dir: str | Path | None = None
    models: list[str | Path] | None = None
    model_variant: str | None = None
    model_options: dict | None = None
    seed: int | None = None
    cases: list[str] | None = None
