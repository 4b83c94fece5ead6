"""The ONNX Attention operator's enumerations and attributes, shared by the models, the registry
and the translations: a leaf that imports nothing of attnexport and no torch."""

from __future__ import annotations

from dataclasses import dataclass

# The operator's score outputs (`qk_matmul_output_mode`), by the name the CLI takes for each, in
# mode order: raw = scale * Q K^T (0), softcap = after the softcap (1), bias = after the softcap
# and the mask (2), softmax = the attention weights (3).
WEIGHT_MODES = ("raw", "softcap", "bias", "softmax")
MODE_OF = {name: mode for mode, name in enumerate(WEIGHT_MODES)}
NO_WEIGHTS = -1  # no score output

# The softmax precisions offered, as the operator's `softmax_precision` (an ONNX TensorProto type).
# Only float: the operator also allows a softmax narrower than its input (float16, bfloat16),
# which no one wants and the float64 reference cannot stand for; double is not in ONNX Runtime.
SOFTMAX_PRECISION_TYPES_BY_NAME = {"float": 1}


@dataclass(frozen=True)
class Core:
    """The attention core's attributes, the ONNX Attention operator's: `scale` multiplies QK^T
    (None: 1/sqrt(head size)); `is_causal` (offset-aligned, see attnexport.models.core); `softcap`
    (> 0: scores become softcap * tanh(scores / softcap) before the mask); `weights`, the score
    output (NO_WEIGHTS, or a qk_matmul_output_mode); `softmax_precision` (None, or an ONNX type)."""

    scale: float | None = None
    is_causal: bool = False
    softcap: float = 0.0
    weights: int = NO_WEIGHTS
    softmax_precision: int | None = None

    @staticmethod
    def mode(weights: str | None) -> int:
        """The score output called `weights` (a WEIGHT_MODES name), or NO_WEIGHTS for None."""
        return NO_WEIGHTS if weights is None else MODE_OF[weights]

    def attributes(self) -> tuple:
        """The attributes in the core op's order (after its seven tensor inputs)."""
        return self.scale, self.is_causal, self.softcap, self.weights, self.softmax_precision


PLAIN = Core()  # no option: scaled by 1/sqrt(head size), not causal, no softcap, no score output
