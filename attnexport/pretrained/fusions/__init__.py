"""ONNX Runtime's fused ops in a language model's step graph of the ort flavour (`export --hf --flavor
ort`): what makes a step of thirty small layers cost its MatMuls and little else.

A 135M-parameter model's step is some two hundred MatMuls among twelve hundred small ops (the RMS
norm as seven, the rotary embedding as a dozen a layer, reshapes and transposes around each
attention), and on two threads those small ops cost as much as a sixth of the step. Here:

- onnxscript's rules fuse each RMS norm after a residual add into one
  com.microsoft.SkipSimplifiedLayerNormalization (the norm without one, at the start, stays as
  its ops: its fused form lives in ONNX's own domain, which onnx's checker refuses), and each
  rotate-half rotary embedding into com.microsoft.RotaryEmbedding;
- the rotary tables those rules compute every step, from position 0 to the longest position
  (work that grows with the context), become constants: the model's own rotary module's cos
  and sin at every position the graph can see (the static buffers' positions, else the
  config's max_position_embeddings), computed by torch as transformers computes them;
- in the static form, each layer's two RotaryEmbedding nodes and the reshapes and transposes
  around them go into its GroupQueryAttention (`do_rotary`, with those tables), which rotates
  the block's queries and keys at write_pos + i itself, and its three projections become one
  MatMul whose output is the operator's packed input, as onnxruntime-genai's graphs have it;
- the two Reshapes after each GroupQueryAttention that split its output into heads and join them
  again, (B, S, hidden) to (B, S, heads, d) to (B, S, hidden), go: the output projection reads the
  operator's output (two small ops a layer fewer on every step).

Every rewrite keeps the function: the export is checked against the model in float64 after it
(`attnexport.pretrained.export.check_before_writing`), and a pattern that is not there is left alone.

An encoder's layers (a family that says so: `registry.Family.fuses_encoder_layers`) get what ONNX
Runtime's transformer optimizer makes of a BERT layer: each attention with its projections and the
padding mask as it comes (`encoder`), each layer norm after a residual add one
com.microsoft.SkipLayerNormalization with the bias before it, each exact GELU after a bias add one
com.microsoft.BiasGelu (onnxscript's rules).

One rule (or a few that belong together) a file: `rotary` (the tables made constants), `gqa` (the
static form's attention and its projections, the output reshapes), `tied_head`, `rms`, `encoder`;
`graph` holds what they share. Each file has its test (tests/test_pretrained_fusions_<file>.py).
"""

from __future__ import annotations

import onnx

from attnexport.errors import ExportError, reason
from attnexport.export import torch_sped_up
from attnexport.pretrained.fusions import encoder as encoder_layers
from attnexport.pretrained.fusions import gqa, rms, rotary
from attnexport.pretrained.fusions.graph import MS


def fuse_for_ort(model: onnx.ModelProto, tables, static: bool, what: str, encoder: bool = False,
                 packed: bool = True) -> onnx.ModelProto:
    """The step graph with ONNX Runtime's fused ops (see the module docstring); `tables`: the
    rotary (cos, sin) to freeze, or None; `encoder`: an encoder's layers fused too (`encoder`'s
    module), its three projections `packed` into the attention kernel or kept as MatMuls."""
    import onnx_ir as ir
    import onnx_ir.passes.common as passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions import shape_optimization
    from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
    from onnxscript.rewriter.ort_fusions.cos_sin_cache import fuse_cos_sin_cache
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
    from onnxscript.rewriter.ort_fusions.skip_normalization import (
        fuse_skip_layer_normalization,
        fuse_skip_rms_normalization,
    )
    try:
        with torch_sped_up():  # onnxscript's rewriter as the exporter runs it (export.torch_patches)
            graph = ir.from_proto(model)
            passes.ShapeInferencePass()(graph)
            optimize(graph)
            shape_optimization.rules.apply_to_model(graph)
            optimize(graph)
            fuse_rms_normalization(graph)
            fuse_skip_rms_normalization(graph)
            if tables is not None:
                rotary.float_frequencies().apply_to_model(graph)
                fuse_rotary_embedding(graph)
                fuse_cos_sin_cache(graph)
                rotary.positions_times_frequencies().apply_to_model(graph)
            fused = ir.to_proto(graph)
    except Exception as e:  # noqa: BLE001 - a fusion failing is the export's error, said in one line
        raise ExportError(f"{what}: ONNX Runtime's fusions failed: {reason(e)}") from None
    rotaries = [n for n in fused.graph.node if n.domain == MS and n.op_type == "RotaryEmbedding"]
    if rotaries and tables is not None:
        rotary.freeze_tables(fused, rotaries, tables)
        if static:
            gqa.rotary_into_gqa(fused)
    gqa.attention_output_as_is(fused)
    rms.unfuse_plain_rms(fused)
    if encoder:
        encoder_layers.attention_with_padding_mask(fused, packed)
    graph = ir.from_proto(fused)
    if encoder:
        try:
            with torch_sped_up():
                passes.RemoveUnusedNodesPass()(graph)
                fuse_erfgelu(graph)
                fuse_bias_gelu(graph)
                fuse_skip_layer_normalization(graph)
        except Exception as e:  # noqa: BLE001 - as above
            raise ExportError(f"{what}: ONNX Runtime's fusions failed: {reason(e)}") from None
    passes.RemoveUnusedNodesPass()(graph)
    return ir.to_proto(graph)
