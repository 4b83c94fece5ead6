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
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport.errors import ExportError, reason
from attnexport.export import torch_sped_up

COS, SIN = "attnexport_rotary_cos", "attnexport_rotary_sin"
_MS = "com.microsoft"


def rotary_tables(model, positions: int, np_dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin), each (positions, head_dim / 2), of the model's rotary embedding at positions
    0 .. positions - 1 (its scaling applied), or None when it has none or it is not rotate-half."""
    import torch
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return None
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    cos, sin = cos[0].float(), sin[0].float()
    half = cos.shape[-1] // 2
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        return None
    return cos[:, :half].numpy().astype(np_dtype), sin[:, :half].numpy().astype(np_dtype)


def fuse_for_ort(model: onnx.ModelProto, tables, static: bool, what: str) -> onnx.ModelProto:
    """The step graph with ONNX Runtime's fused ops (see the module docstring); `tables`: the
    rotary (cos, sin) to freeze, or None."""
    import onnx_ir as ir
    import onnx_ir.passes.common as passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions import shape_optimization
    from onnxscript.rewriter.ort_fusions.cos_sin_cache import fuse_cos_sin_cache
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization
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
                _float_frequencies().apply_to_model(graph)
                fuse_rotary_embedding(graph)
                fuse_cos_sin_cache(graph)
                _positions_times_frequencies().apply_to_model(graph)
            fused = ir.to_proto(graph)
    except Exception as e:  # noqa: BLE001 - a fusion failing is the export's error, said in one line
        raise ExportError(f"{what}: ONNX Runtime's fusions failed: {reason(e)}") from None
    rotaries = [n for n in fused.graph.node if n.domain == _MS and n.op_type == "RotaryEmbedding"]
    if rotaries and tables is not None:
        _freeze_tables(fused, rotaries, tables)
        if static:
            _rotary_into_gqa(fused)
    _attention_output_as_is(fused)
    _unfuse_plain_rms(fused)
    graph = ir.from_proto(fused)
    passes.RemoveUnusedNodesPass()(graph)
    return ir.to_proto(graph)


def _float_frequencies():
    """The rule that lets onnxscript's rotary rules see a model in half: transformers 5.17 keeps
    the rotary's frequencies in the model's dtype and casts them, expanded to the batch, to float32
    in the graph (Cast(Expand(inv_freq))), where the rules want the expanded float32 constant. The
    constant is cast here instead; `_freeze_tables` then replaces what it computes with the model's
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


def _positions_times_frequencies():
    """The rule that turns onnxscript's intermediate rotary embedding (its cos and sin computed in
    the graph) into ONNX Runtime's op with the position ids and constant tables, for the angles as
    transformers 5 writes them: Cast(Unsqueeze(positions, -1)) * inv_freq, each angle twice
    (onnxscript's own rule knows transformers 4's form, a MatMul by the frequencies, transposed).
    The tables here are the graph's own angles at positions 0 .. 1 of the frozen tables' length;
    `_freeze_tables` then makes every such node read the model's (`rotary_tables`)."""
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
                                      interleaved=interleaved, num_heads=num_heads, _domain=_MS)

    class HalfPositionsTimesFrequencies(PositionsTimesFrequencies):
        half = True

    return pattern.RewriteRuleSet([PositionsTimesFrequencies.rule("PositionsTimesFrequencies", remove_nodes=False),
                                   HalfPositionsTimesFrequencies.rule("HalfPositionsTimesFrequencies",
                                                                      remove_nodes=False)])


def _freeze_tables(model: onnx.ModelProto, rotaries, tables) -> None:
    """Every RotaryEmbedding reads the constant tables."""
    cos, sin = tables
    model.graph.initializer.extend([numpy_helper.from_array(cos, COS), numpy_helper.from_array(sin, SIN)])
    for node in rotaries:
        node.input[2], node.input[3] = COS, SIN


def tied_head(model: onnx.ModelProto) -> None:
    """A vocabulary matrix (V, D) read twice, by the embedding's Gather and transposed by the head's
    MatMul, kept once as (D, V): the head's MatMul reads it as it is (ONNX Runtime packs a MatMul's
    constant weights when the session starts, but not a Transpose it folds: the head of SmolLM2-135M
    took 4.3 ms a token that way and 3.9 ms this way, on 2 threads), and the embedding gathers its
    columns (axis 1) and puts the model axis last."""
    inits = {i.name: i for i in model.graph.initializer}
    readers: dict = {}
    for node in model.graph.node:
        for name in node.input:
            if name in inits:
                readers.setdefault(name, []).append(node)
    for name, nodes in readers.items():
        kinds = sorted(n.op_type for n in nodes)
        if kinds != ["Gather", "Transpose"] or len(inits[name].dims) != 2:
            continue
        gather, turn = sorted(nodes, key=lambda n: n.op_type)
        if _attr(gather, "axis", 0) != 0 or gather.input[0] != name or _attr(turn, "perm") != [1, 0]:
            continue
        flipped = f"{name}.transposed"
        model.graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(numpy_helper.to_array(inits[name]).T), flipped))
        model.graph.initializer.remove(inits[name])
        for node in model.graph.node:  # the head's MatMul: the (D, V) matrix itself
            for i, x in enumerate(node.input):
                if x == turn.output[0]:
                    node.input[i] = flipped
        rank = _rank(model, gather.input[1])
        if rank is None:
            raise ExportError(f"the rank of {gather.input[1]} is not known")
        out = gather.output[0]
        columns = f"{out}_columns"
        gather.input[0], gather.output[0] = flipped, columns
        kept = [a for a in gather.attribute if a.name != "axis"]
        del gather.attribute[:]
        gather.attribute.extend([*kept, helper.make_attribute("axis", 1)])
        order = list(model.graph.node)
        order.remove(turn)
        order.insert(order.index(gather) + 1, helper.make_node(
            "Transpose", [columns], [out], f"{gather.name}_model_axis_last", perm=[*range(1, rank + 1), 0]))
        del model.graph.node[:]
        model.graph.node.extend(order)


def _rank(model: onnx.ModelProto, name: str) -> int | None:
    for v in [*model.graph.input, *model.graph.value_info]:
        if v.name == name and v.type.tensor_type.HasField("shape"):
            return len(v.type.tensor_type.shape.dim)
    return None


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _rotary_into_gqa(model: onnx.ModelProto) -> None:
    """Each GroupQueryAttention fed by Reshape(Transpose(RotaryEmbedding(Transpose(Reshape(x)))))
    for its queries and keys (x: the projection, (B, S, heads * d)) and Reshape(Reshape(v)) for its
    values takes x and v as they come and rotates itself (do_rotary, the frozen tables)."""
    made = {o: n for n in model.graph.node for o in n.output}

    def op(name, op_type, domain=""):
        node = made.get(name)
        ok = node is not None and node.op_type == op_type and node.domain in ({domain} if domain else {"", "ai.onnx"})
        return node if ok else None

    def rotated(name):  # (the projection, the RotaryEmbedding) or None
        out = op(name, "Reshape")
        back = out and op(out.input[0], "Transpose")
        rot = back and op(back.input[0], "RotaryEmbedding", _MS)
        there = rot and op(rot.input[0], "Transpose")
        split = there and op(there.input[0], "Reshape")
        if not (split and _attr(back, "perm") == [0, 2, 1, 3] and _attr(there, "perm") == [0, 2, 1, 3]
                and not _attr(rot, "interleaved", 0) and rot.input[2] == COS):
            return None
        return split.input[0], rot

    def plain(name):  # the values' projection under two reshapes, or None
        out = op(name, "Reshape")
        split = out and op(out.input[0], "Reshape")
        return split.input[0] if split else None

    for node in model.graph.node:
        if node.domain != _MS or node.op_type != "GroupQueryAttention" or _attr(node, "do_rotary", 0):
            continue
        q, k, v = rotated(node.input[0]), rotated(node.input[1]), plain(node.input[2])
        if q is None or k is None or v is None or q[1].input[1] != k[1].input[1]:
            continue
        inputs = list(node.input) + [""] * max(0, 9 - len(node.input))
        for old, new in ((inputs[0], q[0]), (inputs[1], k[0]), (inputs[2], v)):
            _shapes_read_from(model, old, new)
        inputs[0], inputs[1], inputs[2], inputs[7], inputs[8] = q[0], k[0], v, COS, SIN
        del node.input[:]
        node.input.extend(inputs)
        node.attribute.extend([helper.make_attribute("do_rotary", 1), helper.make_attribute("rotary_interleaved", 0)])
    _pack_qkv(model, made)


def _attention_output_as_is(model: onnx.ModelProto) -> None:
    """GroupQueryAttention's output is (B, S, heads * d). Where it (or the static step's NaN guard
    over it) is reshaped to (B, S, heads, -1) (a constant shape that keeps the first two dims) and
    that, alone, back to (B, S, -1) with B and S read off the step's inputs (Shape slices of inputs
    whose dims are input_ids' batch and block), the second Reshape's readers read the operator's
    output and both Reshapes go."""
    made = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(_attr(n, "value")) for n in model.graph.node
                   if n.op_type == "Constant" and _attr(n, "value") is not None})
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    ids = dims.get("input_ids")

    def dim_of_ids(name: str, axis: int) -> bool:  # a 1-element Shape slice equal to input_ids' dim `axis`
        node = made.get(name)
        if ids is None or node is None or node.op_type != "Shape" or node.input[0] not in dims:
            return False
        start, end = _attr(node, "start", 0), _attr(node, "end", None)
        if end is None or end - start != 1:
            return False
        got = dims[node.input[0]]
        return start < len(got) and isinstance(got[start], str) and got[start] == ids[axis]

    def restores_batch_and_block(shape: str) -> bool:
        node = made.get(shape)
        if node is None or node.op_type != "Concat" or len(node.input) != 3:
            return False
        last = consts.get(node.input[2])
        return (dim_of_ids(node.input[0], 0) and dim_of_ids(node.input[1], 1) and last is not None
                and last.reshape(-1).tolist() == [-1])

    drop, renamed = set(), {}
    outputs = {o.name for o in model.graph.output}
    attention = {n.output[0] for n in model.graph.node if n.domain == _MS and n.op_type == "GroupQueryAttention"}
    # the output itself, or the static step's NaN guard over it, Where(flag, NaN, output): the same shape
    sources = attention | {n.output[0] for n in model.graph.node if n.op_type == "Where" and n.input[2] in attention}
    for node in model.graph.node:
        if not set(node.output) & sources:
            continue
        split = readers.get(node.output[0], [])
        if len(split) != 1 or split[0].op_type != "Reshape":
            continue
        heads = consts.get(split[0].input[1])
        join = readers.get(split[0].output[0], [])
        if heads is None or heads.size != 4 or heads.reshape(-1)[:2].tolist() != [0, 0] or len(join) != 1 or \
                join[0].op_type != "Reshape" or not restores_batch_and_block(join[0].input[1]) or \
                {split[0].output[0], join[0].output[0]} & outputs:
            continue
        drop |= {id(split[0]), id(join[0])}
        renamed[join[0].output[0]] = node.output[0]
    if not drop:
        return
    kept = []
    for node in model.graph.node:
        if id(node) in drop:
            continue
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _shapes_read_from(model: onnx.ModelProto, old: str, new: str) -> None:
    """Each Shape node that reads the batch and block dims (the first two) of `old` reads them from
    `new` instead, which a fusion feeds the attention in its place (both (B, S, ...)): the step's
    total length (attnexport.onnx_attention._gqa_total) would otherwise keep the replaced nodes
    alive for their shape alone."""
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input[0] == old and 0 < _attr(node, "end", 99) <= 2:
            node.input[0] = new


def _pack_qkv(model: onnx.ModelProto, made: dict) -> None:
    """A GroupQueryAttention whose queries, keys and values are three MatMuls of one input by
    constant weights (no bias) takes them packed: one MatMul by the weights side by side, its
    output as the query input, key and value left empty (the operator's packed form). Each weight
    stays fingerprinted, as its columns of the packed one (`attnexport.weights.record`)."""
    weights = {i.name: i for i in model.graph.initializer}
    packed_inits, nodes = [], []
    for node in model.graph.node:
        if node.domain != _MS or node.op_type != "GroupQueryAttention" or not _attr(node, "do_rotary", 0):
            continue
        found = [made.get(name) for name in node.input[:3]]
        mms = [m for m in found if m is not None and m.op_type == "MatMul" and m.domain in ("", "ai.onnx")]
        if len(mms) != 3 or len({m.input[0] for m in mms}) != 1 or not all(m.input[1] in weights for m in mms):
            continue
        arrays = [numpy_helper.to_array(weights[m.input[1]]) for m in mms]
        if any(a.ndim != 2 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
            continue
        name = f"{node.name}_qkv"
        _shapes_read_from(model, node.input[0], name)
        packed_inits.append(numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}.weight"))
        nodes.append((node, helper.make_node("MatMul", [mms[0].input[0], f"{name}.weight"], [name], name)))
        node.input[0], node.input[1], node.input[2] = name, "", ""
    if not nodes:
        return
    model.graph.initializer.extend(packed_inits)
    order = list(model.graph.node)
    # Each packed MatMul just before the first node that reads it (its attention, or a Shape that
    # `_shapes_read_from` moved onto it), after what feeds it.
    first = {m.output[0]: min(i for i, n in enumerate(order) if m.output[0] in n.input) for _, m in nodes}
    for _, matmul in sorted(nodes, key=lambda pair: -first[pair[1].output[0]]):
        order.insert(first[matmul.output[0]], matmul)
    del model.graph.node[:]
    model.graph.node.extend(order)


def _unfuse_plain_rms(model: onnx.ModelProto) -> None:
    """SimplifiedLayerNormalization (an RMS norm with no residual add before it) is ONNX Runtime's
    op in ONNX's own domain, which onnx's checker refuses: each such node back as the ops it
    stands for, x / sqrt(mean(x^2) + eps) * gamma (the norms after a residual add stay fused)."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    types = {i.name: i.data_type for i in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        eps = float(_attr(node, "epsilon", 1e-5))
        x, gamma = node.input[0], node.input[1]
        t = [f"{node.name or node.output[0]}_{k}" for k in ("sq", "mean", "eps", "plus", "root", "normed", "axes")]
        if opset >= 18:  # ReduceMean's axes: an input from opset 18, an attribute before
            mean = [helper.make_node("Constant", [], [t[6]], value_ints=[-1]),
                    helper.make_node("ReduceMean", [t[0], t[6]], [t[1]], keepdims=1)]
        else:
            mean = [helper.make_node("ReduceMean", [t[0]], [t[1]], axes=[-1], keepdims=1)]
        kind = types.get(gamma, onnx.TensorProto.FLOAT)  # eps in the norm's own type (an fp16 model's is fp16)
        value = helper.make_tensor(t[2], kind, [], [np.array(eps, helper.tensor_dtype_to_np_dtype(kind)).item()])
        nodes += [helper.make_node("Constant", [], [t[2]], value=value),
                  helper.make_node("Mul", [x, x], [t[0]]), *mean,
                  helper.make_node("Add", [t[1], t[2]], [t[3]]),
                  helper.make_node("Sqrt", [t[3]], [t[4]]),
                  helper.make_node("Div", [x, t[4]], [t[5]]),
                  helper.make_node("Mul", [t[5], gamma], [node.output[0]])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
