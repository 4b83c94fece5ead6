"""The static form's GroupQueryAttention made what ONNX Runtime runs fastest: each layer's two
RotaryEmbedding nodes and the reshapes and transposes around them go into the operator
(`do_rotary`, with the frozen tables), which rotates the block's queries and keys at
write_pos + i itself, and its three projections become one MatMul whose output is the operator's
packed input, as onnxruntime-genai's graphs have it; and in every form, the two Reshapes after each
GroupQueryAttention that split its output into heads and join them again go (the output
projection reads the operator's output)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport.pretrained.fusions.graph import MS, attr, shapes_read_from
from attnexport.pretrained.fusions.rotary import COS, SIN


def rotary_into_gqa(model: onnx.ModelProto) -> None:
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
        rot = back and op(back.input[0], "RotaryEmbedding", MS)
        there = rot and op(rot.input[0], "Transpose")
        split = there and op(there.input[0], "Reshape")
        if not (split and attr(back, "perm") == [0, 2, 1, 3] and attr(there, "perm") == [0, 2, 1, 3]
                and not attr(rot, "interleaved", 0) and rot.input[2] == COS):
            return None
        return split.input[0], rot

    def plain(name):  # the values' projection under two reshapes, or None
        out = op(name, "Reshape")
        split = out and op(out.input[0], "Reshape")
        return split.input[0] if split else None

    for node in model.graph.node:
        if node.domain != MS or node.op_type != "GroupQueryAttention" or attr(node, "do_rotary", 0):
            continue
        q, k, v = rotated(node.input[0]), rotated(node.input[1]), plain(node.input[2])
        if q is None or k is None or v is None or q[1].input[1] != k[1].input[1]:
            continue
        inputs = list(node.input) + [""] * max(0, 9 - len(node.input))
        for old, new in ((inputs[0], q[0]), (inputs[1], k[0]), (inputs[2], v)):
            shapes_read_from(model, old, new)
        inputs[0], inputs[1], inputs[2], inputs[7], inputs[8] = q[0], k[0], v, COS, SIN
        del node.input[:]
        node.input.extend(inputs)
        node.attribute.extend([helper.make_attribute("do_rotary", 1), helper.make_attribute("rotary_interleaved", 0)])
    pack_qkv(model, made)


def attention_output_as_is(model: onnx.ModelProto) -> None:
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
    consts.update({n.output[0]: numpy_helper.to_array(attr(n, "value")) for n in model.graph.node
                   if n.op_type == "Constant" and attr(n, "value") is not None})
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    ids = dims.get("input_ids")

    def dim_of_ids(name: str, axis: int) -> bool:  # a 1-element Shape slice equal to input_ids' dim `axis`
        node = made.get(name)
        if ids is None or node is None or node.op_type != "Shape" or node.input[0] not in dims:
            return False
        start, end = attr(node, "start", 0), attr(node, "end", None)
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
    attention = {n.output[0] for n in model.graph.node if n.domain == MS and n.op_type == "GroupQueryAttention"}
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


def pack_qkv(model: onnx.ModelProto, made: dict) -> None:
    """A GroupQueryAttention whose queries, keys and values are three MatMuls of one input by
    constant weights (no bias) takes them packed: one MatMul by the weights side by side, its
    output as the query input, key and value left empty (the operator's packed form). Each weight
    stays fingerprinted, as its columns of the packed one (`attnexport.weights.record`)."""
    weights = {i.name: i for i in model.graph.initializer}
    packed_inits, nodes = [], []
    for node in model.graph.node:
        if node.domain != MS or node.op_type != "GroupQueryAttention" or not attr(node, "do_rotary", 0):
            continue
        found = [made.get(name) for name in node.input[:3]]
        mms = [m for m in found if m is not None and m.op_type == "MatMul" and m.domain in ("", "ai.onnx")]
        if len(mms) != 3 or len({m.input[0] for m in mms}) != 1 or not all(m.input[1] in weights for m in mms):
            continue
        arrays = [numpy_helper.to_array(weights[m.input[1]]) for m in mms]
        if any(a.ndim != 2 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
            continue
        name = f"{node.name}_qkv"
        shapes_read_from(model, node.input[0], name)
        packed_inits.append(numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}.weight"))
        nodes.append((node, helper.make_node("MatMul", [mms[0].input[0], f"{name}.weight"], [name], name)))
        node.input[0], node.input[1], node.input[2] = name, "", ""
    if not nodes:
        return
    model.graph.initializer.extend(packed_inits)
    order = list(model.graph.node)
    # Each packed MatMul just before the first node that reads it (its attention, or a Shape that
    # `shapes_read_from` moved onto it), after what feeds it.
    first = {m.output[0]: min(i for i, n in enumerate(order) if m.output[0] in n.input) for _, m in nodes}
    for _, matmul in sorted(nodes, key=lambda pair: -first[pair[1].output[0]]):
        order.insert(first[matmul.output[0]], matmul)
    del model.graph.node[:]
    model.graph.node.extend(order)
