"""What verify is asked to do, as one object: the command line parses into it, the Python API
takes it or its fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VerifyRequest:
    """What to verify: golden cases (no `models`) or model files, where and how strictly.

    Attributes:
        dtype: fp32 or fp16; default fp32 for golden cases, the model's own for model files.
        model_variant, model_options, seed: the variant, options and parameter seed of a model
            file without metadata (refused, when they disagree, for one that has it).
        flavors: golden mode: the flavours to export; model mode: at most one, checked against
            the model's.
        localize: localize every ONNX run, not only failing ones; a divergence fails the run.
        baseline, save_baseline, max_growth: compare with / write a known-good baseline folder.
    """

    variants: list[str] | None = None
    flavors: list[str] | None = None
    runtimes: list[str] | None = None
    dtype: str | None = None
    golden_dir: str | Path | None = None
    models: list[str | Path] | None = None
    rtol: float | None = None
    atol: float | None = None
    skip_unavailable: bool = False
    strict_placement: bool = False
    model_variant: str | None = None
    model_options: dict | None = None
    seed: int | None = None
    localize: bool = False
    baseline: str | Path | None = None
    save_baseline: str | Path | None = None
    max_growth: float = 10.0
    cases: list[str] | None = None
