"""The ONNX Attention operator's enumerations, shared by the models, the registry and the
translations: a leaf that imports nothing of attnexport and no torch."""

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
