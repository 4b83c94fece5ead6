"""The export flavours, as frozen specs beside the variant registry: what graph each promises.

Everything else reads its flavour names, its ops and its help from here: the CLI's choices, the
attention op an export is checked for (`FUSED_OPS`), the flavour a graph has (`of_op`). What a
flavour's graph is, and each rule that follows from it, is said once, here: its opsets and what
needs a newer one, whether its attention is one fused op (a graph that keeps torch's NaN rows, or
a variant without a dot-product core, is the unfused flavour's), whether a language model's step
is rewritten into the runtime's fused ops. Its translations of attnexport's custom ops live in
`attnexport.onnx_attention` (`TRANSLATIONS`, keyed by the same names, checked to match at import):
adding a flavour touches this file and that one; adding a rule, this one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from attnexport.errors import UsageError

UNFUSED = "MatMul+Softmax"  # the attention of a flavour with no fused op, as its expected ops name it


@dataclass(frozen=True)
class Flavor:
    name: str
    opsets: tuple[int, int]  # the opsets a graph of this flavour can declare (lowest, highest)
    default_opset: int
    expected_ops: tuple[str, ...]  # the attention op a dot-product variant's graph must have (one of)
    summary: str
    # What a graph of this flavour needs a newer opset for: {the option that asks for it: its lowest opset}.
    needs: tuple[tuple[str, int], ...] = ()
    # A language model's step is rewritten into the runtime's fused ops (attnexport.pretrained.fusions).
    fuses_language_models: bool = False

    @property
    def fused(self) -> bool:
        """Whether its attention is one op (else MatMul and Softmax, as torch computes it)."""
        return self.expected_ops != (UNFUSED,)


FLAVORS: dict[str, Flavor] = {f.name: f for f in (
    Flavor("primitives", (17, 18), 18, (UNFUSED,),
           "standard ops only (MatMul, Softmax, Where, ...): runs on any runtime, old ones too"),
    Flavor("attention", (23, 24), 23, ("Attention",),
           "the standard ONNX Attention op: one fused node, no vendor lock-in",
           # The operator's valid key counts (nonpad_kv_seqlen) and TensorScatter, which writes
           # a static cache in place, came with opset 24.
           needs=(("--nonpad", 24), ("--kv-cache static", 24))),
    Flavor("ort", (17, 18), 18, ("com.microsoft.MultiHeadAttention", "com.microsoft.Attention",
                                 "com.microsoft.GroupQueryAttention"),
           "ONNX Runtime's fused contrib ops: its fastest kernels, ONNX Runtime only", fuses_language_models=True),
)}
# The flavour every graph can fall back to: attention as MatMul and Softmax (the only one without a fused op).
UNFUSED_FLAVOR = next(f.name for f in FLAVORS.values() if not f.fused)
# The standard Attention op: one fused node any opset-23 runtime runs, fast on ONNX Runtime's
# CUDA provider, with no vendor lock-in (see the README).
DEFAULT = "attention"


def opset_for(flavor: str, opset: int | None, needs=()) -> int:
    """The opset to export `flavor` at: `opset`, checked, or the flavour's default, at least what
    the options in `needs` (e.g. "--kv-cache static") take in this flavour (`Flavor.needs`)."""
    lo, hi = FLAVORS[flavor].opsets
    wanted = [(option, least) for option, least in FLAVORS[flavor].needs if option in needs]
    for option, least in wanted:
        if opset is not None and opset < least:
            raise UsageError(f"--opset {opset}: {option} needs opset {least} for the {flavor} flavor")
    lo = max([lo, *(least for _, least in wanted)])
    opset = max(FLAVORS[flavor].default_opset, lo) if opset is None else opset
    if not lo <= opset <= hi:
        allowed = str(lo) if lo == hi else f"{lo} to {hi}"
        raise UsageError(f"--opset {opset} is not available for the {flavor} flavor (allowed: {allowed})")
    return opset


def check(name: str) -> str:
    """A flavour name, checked: an unknown one is a UsageError listing the valid ones."""
    if name not in FLAVORS:
        close = difflib.get_close_matches(str(name), FLAVORS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown flavor {name!r}{hint}; valid: {', '.join(FLAVORS)}")
    return name


def check_all(names) -> list[str]:
    """Flavour names, checked; none given: every flavour, in the registry's order."""
    return [check(n) for n in names] if names else list(FLAVORS)


def help_text() -> str:
    return " | ".join(FLAVORS)


# The fused attention ops, as (domain, op type) -> the name a summary shows: every op a flavour
# promises other than MatMul+Softmax.
FUSED_OPS: dict[tuple[str, str], str] = {
    (name.rpartition(".")[0], name.rpartition(".")[2]): name
    for f in FLAVORS.values() for name in f.expected_ops if name != UNFUSED}


def of_op(op_name: str) -> str:
    """The flavour whose graph has this attention op (`export.attention_op_of`'s answer)."""
    for f in FLAVORS.values():
        if any(op in f.expected_ops for op in op_name.split(", ")):
            return f.name
    return UNFUSED_FLAVOR
