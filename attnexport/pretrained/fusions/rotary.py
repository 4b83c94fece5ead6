"""The rotary embedding's tables made constants: onnxscript's rules fuse each rotate-half rotary
embedding into com.microsoft.RotaryEmbedding (two rules here let them see the forms transformers 5
writes), and the tables those rules compute every step, from position 0 to the longest position
(work that grows with the context), become constants: the model's own rotary module's cos and sin
at every position the graph can see, computed by torch as transformers computes them."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from attnexport.pretrained.fusions.graph import MS

COS, SIN = "attnexport_rotary_cos", "attnexport_rotary_sin"


def rotary_tables(model, positions: int, np_dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin), each (positions, head_dim / 2), of the model's rotary embedding at positions
    0 .. positions - 1 (its scaling applied), or None when it has none, it is not rotate-half, or
    it has one table a kind of layer (Gemma 3's local and global bases: its forward takes the layer's
    type; each layer's rotary then stays as traced)."""
    import inspect

    import torch
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or "layer_type" in inspect.signature(rotary.forward).parameters:
        return None
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    cos, sin = cos[0].float(), sin[0].float()
    half = cos.shape[-1] // 2
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        return None
    return cos[:, :half].numpy().astype(np_dtype), sin[:, :half].numpy().astype(np_dtype)


def float_frequencies():
    """The rule that lets onnxscript's rotary rules see a model in half: transformers 5.17 keeps
    the rotary's frequencies in the model's dtype and casts them, expanded to the batch, to float32
    in the graph (Cast(Expand(inv_freq))), where the rules want the expanded float32 constant. The
    constant is cast here instead; `freeze_tables` then replaces what it computes with the model's
    own tables, so the frequencies' fp16 rounding reaches no answer. Without it, SmolLM2's q4f16
    step under transformers 5.17 kept 60 separate RotaryEmbedding nodes and three projections a
    layer: 1041 nodes, 605 fused."""
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class FloatFrequencies(pattern.RewriteRuleClassBase):
        def pattern(self, op, inv_freq, shape):
            return op.Cast(op.Expand(inv_freq, shape), to=ir.DataType.FLOAT)

        def check(self, context, inv_freq, **_):
            result = pattern.MatchResult()
            value = inv_freq.const_value
            if value is None or value.dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT):
                return result.fail("the frequencies are not a floating-point constant")
            return result

        def rewrite(self, op, inv_freq, shape, **_):
            frequencies = inv_freq.const_value.numpy().astype(np.float32)
            return op.Expand(op.Constant(value=ir.tensor(frequencies)), shape)

    return pattern.RewriteRuleSet([FloatFrequencies.rule("FloatFrequencies")])


def positions_times_frequencies():
    """The rule that turns onnxscript's intermediate rotary embedding (its cos and sin computed in
    the graph) into ONNX Runtime's op with the position ids and constant tables, for the angles as
    transformers 5 writes them: Cast(Unsqueeze(positions, -1)) * inv_freq, each angle twice
    (onnxscript's own rule knows transformers 4's form, a MatMul by the frequencies, transposed).
    The tables here are the graph's own angles at positions 0 .. 1 of the frozen tables' length;
    `freeze_tables` then makes every such node read the model's (`rotary_tables`)."""
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class PositionsTimesFrequencies(pattern.RewriteRuleClassBase):
        half = False  # a model in half casts its cos and sin to fp16 (transformers 5): the rule below

        def pattern(self, op, x, positions, axis, inv_freq, interleaved, num_heads):
            angles = op.Mul(op.Cast(op.Unsqueeze(positions, axis), to=ir.DataType.FLOAT), inv_freq)
            both = op.Concat(angles, angles, axis=-1)
            cos, sin = op.Cos(both), op.Sin(both)
            if self.half:
                cos, sin = op.Cast(cos, to=ir.DataType.FLOAT16), op.Cast(sin, to=ir.DataType.FLOAT16)
            return op.RotaryEmbedding(x, op.Unsqueeze(cos, [1]), op.Unsqueeze(sin, [1]),
                                      interleaved=interleaved, num_heads=num_heads,
                                      _domain="ai.onnxruntime._fusion")

        def check(self, context, positions, axis, inv_freq, **_):
            result = pattern.MatchResult()
            axes = axis.const_value.numpy().ravel().tolist() if axis.const_value is not None else None
            if positions.shape is None or len(positions.shape) != 2 or axes not in ([-1], [2]):
                return result.fail("the positions are not (batch, sequence), unsqueezed last")
            if inv_freq.const_value is None or inv_freq.const_value.numpy().ndim != 1:
                return result.fail("the frequencies are not a constant vector")
            return result

        def rewrite(self, op, x, positions, inv_freq, interleaved, num_heads, **_):
            frequencies = inv_freq.const_value.numpy().astype(np.float32)
            angles = np.arange(2, dtype=np.float32)[:, None] * frequencies[None, :]
            real = np.float16 if self.half else np.float32
            return op.RotaryEmbedding(x, positions, op.Constant(value=ir.tensor(np.cos(angles).astype(real))),
                                      op.Constant(value=ir.tensor(np.sin(angles).astype(real))),
                                      interleaved=interleaved, num_heads=num_heads, _domain=MS)

    class HalfPositionsTimesFrequencies(PositionsTimesFrequencies):
        half = True

    return pattern.RewriteRuleSet([PositionsTimesFrequencies.rule("PositionsTimesFrequencies", remove_nodes=False),
                                   HalfPositionsTimesFrequencies.rule("HalfPositionsTimesFrequencies",
                                                                      remove_nodes=False)])


def freeze_tables(model: onnx.ModelProto, rotaries, tables) -> None:
    """Every RotaryEmbedding reads the constant tables."""
    cos, sin = tables
    model.graph.initializer.extend([numpy_helper.from_array(cos, COS), numpy_helper.from_array(sin, SIN)])
    for node in rotaries:
        node.input[2], node.input[3] = COS, SIN
