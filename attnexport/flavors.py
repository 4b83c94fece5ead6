"""The export flavours, as frozen specs beside the variant registry: what graph each promises.

The translation of the attention core for each flavour lives in `attnexport.onnx_attention`
(`TRANSLATIONS`, keyed by the same names); the export checks that the graph it made has the op
its flavour promises.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flavor:
    name: str
    opsets: tuple[int, int]  # the opsets a graph of this flavour can declare (lowest, highest)
    default_opset: int
    expected_ops: tuple[str, ...]  # the attention op a dot-product variant's graph must have (one of)
    summary: str


FLAVORS: dict[str, Flavor] = {f.name: f for f in (
    Flavor("primitives", (17, 18), 18, ("MatMul+Softmax",),
           "standard ops only (MatMul, Softmax, Where, ...): runs on any runtime, old ones too"),
    Flavor("attention", (23, 24), 23, ("Attention",),
           "the standard ONNX Attention op: one fused node, no vendor lock-in"),
    Flavor("ort", (17, 18), 18, ("com.microsoft.MultiHeadAttention", "com.microsoft.Attention",
                                 "com.microsoft.GroupQueryAttention"),
           "ONNX Runtime's fused contrib ops: its fastest kernels, ONNX Runtime only"),
)}
# The standard Attention op: one fused node any opset-23 runtime runs, fast on ONNX Runtime's
# CUDA provider, with no vendor lock-in (see the README).
DEFAULT = "attention"


def opset_for(flavor: str, opset: int | None, lowest: int | None = None) -> int:
    """The opset to export `flavor` at: `opset`, checked, or the flavour's default (at least
    `lowest`, when the options need a newer one)."""
    from attnexport.errors import UsageError
    lo, hi = FLAVORS[flavor].opsets
    lo = max(lo, lowest or lo)
    opset = max(FLAVORS[flavor].default_opset, lo) if opset is None else opset
    if not lo <= opset <= hi:
        allowed = str(lo) if lo == hi else f"{lo} to {hi}"
        raise UsageError(f"--opset {opset} is not available for the {flavor} flavor (allowed: {allowed})")
    return opset
