"""An encoder's attention as ONNX Runtime runs it fastest (`export --hf ENCODER --flavor ort`).

The ort flavour's attention translation is general: it takes queries, keys and values in heads,
(B, H, S, d), turns them back into (B, S, H*d) for com.microsoft.MultiHeadAttention, turns the
output into heads again and back, and takes the padding mask as an additive bias expanded to
(B, 1, S, S) a layer, with a guard that answers zeros for a row the mask empties. In an encoder
those are six transposes or reshapes and a (B, S, S) tensor a layer spent on nothing: the padding
mask is one (B, S) row of ones and zeros for every layer, and every query sees at least its own
sentence's first token.

Here each such layer becomes what ONNX Runtime's transformer optimizer makes of a BERT layer:

- packed (fp32): com.microsoft.Attention(x, [Wq Wk Wv], [bq bk bv], mask): the three projections
  one GEMM inside the kernel, which reads (B, S, hidden) and the (B, S) mask as they are;
- else (half, or weights to be quantized: the quantizer replaces MatMuls, and the CPU provider's
  Attention is float only): com.microsoft.MultiHeadAttention(x Wq, x Wk, x Wv, [bq bk bv], mask),
  the three MatMuls kept, their bias added by the kernel, the mask as its key_padding_mask.

The mask is the step's attention_mask cast to int32 once (the kernel masks a zero key with
-10000 before its softmax, as BERT's own finfo.min mask does: a row never empties, the guard is
not needed). What is rewritten is found by its form, each piece checked, and left alone if any
piece differs: the projections one input times a constant matrix plus a constant bias; between
them and the attention only reshapes and transposes whose permutations cancel, ending in the
(B, S, -1) the kernel reads; after it the same, with the guard, into one MatMul; its bias read
off attention_mask and nothing else the step takes. The export's check against the model in
float64 at its padded shapes (`attnexport.pretrained.export.check_before_writing`) follows.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport.pretrained.fusions.graph import MS, attr

MASK = "attention_mask"
MASK_INT32 = "attention_mask_int32"


def attention_with_padding_mask(model: onnx.ModelProto, packed: bool) -> int:
    """Each layer's MultiHeadAttention with its transposes and its expanded bias rewritten as the
    module docstring says; returns how many were. The nodes left without readers stay for the
    caller's unused-node pass."""
    g = model.graph
    if MASK not in {i.name for i in g.input}:
        return 0
    made = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for node in g.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    weights = {i.name: i for i in g.initializer}
    consts = {n.output[0] for n in g.node if n.op_type == "Constant"} | set(weights)
    inputs = {i.name for i in g.input}

    def plain(node, op_type):
        return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")

    def projection(name):
        """(x, MatMul, bias initializer) of Reshape/Transpose...(Add(MatMul(x, W), b)), or None."""
        perm = [0, 1, 2, 3]
        node = made.get(name)
        if not plain(node, "Reshape") or _shape_value(node.input[1], made, weights) != [0, 0, -1]:
            return None
        while plain(node, "Reshape") or plain(node, "Transpose"):
            if node.op_type == "Transpose":
                p = attr(node, "perm")
                if p is None or len(p) != 4:
                    return None
                perm = [p[i] for i in perm]
            node = made.get(node.input[0])
        if perm != [0, 1, 2, 3] or not plain(node, "Add"):
            return None
        mm = next((made[i] for i in node.input if plain(made.get(i), "MatMul")), None)
        bias = next((i for i in node.input if i in weights), None)
        if mm is None or bias is None or mm.input[1] not in weights:
            return None
        w, b = numpy_helper.to_array(weights[mm.input[1]]), numpy_helper.to_array(weights[bias])
        if w.ndim != 2 or b.shape != (w.shape[1],):
            return None
        return mm.input[0], mm, bias

    def joined(name):
        """The (B, S, hidden) the output becomes through reshapes, transposes that cancel and the
        empty-row guard, read by a MatMul alone; or None."""
        perm = [0, 1, 2, 3]
        while True:
            # a CastLike reading the value only for its type, as the guard's constants do
            on = [r for r in readers.get(name, []) if not (r.op_type == "CastLike" and r.input[1] == name)]
            if len(on) != 1:
                return None
            r = on[0]
            if plain(r, "MatMul") and r.input[0] == name:
                return name if perm == [0, 1, 2, 3] else None
            if plain(r, "Transpose"):
                p = attr(r, "perm")
                if p is None or len(p) != 4:
                    return None
                perm = [p[i] for i in perm]
            elif not (plain(r, "Reshape") or (plain(r, "Where") and r.input[2] == name and r.input[1] != name)):
                return None
            name = r.output[0]

    def from_mask_alone(name) -> bool:
        """Whether the values of `name` are computed from attention_mask and constants (a Shape
        reads no values: the bias is expanded to the attention's sizes)."""
        seen, todo, reached = set(), [name], False
        while todo:
            v = todo.pop()
            if v in seen or v == "" or v in consts:
                continue
            seen.add(v)
            if v in inputs:
                if v != MASK:
                    return False
                reached = True
                continue
            node = made.get(v)
            if node is None:
                return False
            if not plain(node, "Shape"):
                todo.extend(node.input)
        return reached

    done, added, dropped = 0, [], set()
    for node in list(g.node):
        if node.domain != MS or node.op_type != "MultiHeadAttention" or len(node.input) < 3:
            continue
        rest = list(node.input[3:]) + [""] * (8 - len(node.input))
        if rest[0] or rest[1] or any(rest[3:]) or not rest[2] or not from_mask_alone(rest[2]):
            continue  # a bias of its own, a key padding mask already, a cache: not this form
        qkv = [projection(name) for name in node.input[:3]]
        out = joined(node.output[0])
        if any(p is None for p in qkv) or out is None or len({p[0] for p in qkv}) != 1:
            continue
        x, stem = qkv[0][0], node.name or node.output[0]
        kept = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in ("num_heads", "scale")}
        bias = f"{stem}.qkv_bias"
        g.initializer.append(numpy_helper.from_array(
            np.concatenate([numpy_helper.to_array(weights[b]) for _, _, b in qkv]), bias))
        if packed:
            weight = f"{stem}.qkv_weight"
            g.initializer.append(numpy_helper.from_array(
                np.concatenate([numpy_helper.to_array(weights[mm.input[1]]) for _, mm, _ in qkv], axis=1), weight))
            added.append(helper.make_node("Attention", [x, weight, bias, MASK_INT32], [out], f"{stem}_packed",
                                          domain=MS, **kept))
        else:
            added.append(helper.make_node("MultiHeadAttention", [mm.output[0] for _, mm, _ in qkv] + [bias, MASK_INT32],
                                          [out], f"{stem}_masked", domain=MS, **kept))
        dropped.add(id(made[out]))
        done += 1
    if not done:
        return 0
    order = [helper.make_node("Cast", [MASK], [MASK_INT32], f"{MASK_INT32}_cast", to=onnx.TensorProto.INT32)]
    # Each new node where the node it replaces (the last of the output's chain) was: after what it reads.
    by_out = {a.output[0]: a for a in added}
    for node in g.node:
        if id(node) in dropped:
            order.append(by_out[node.output[0]])
        else:
            order.append(node)
    del g.node[:]
    g.node.extend(order)
    return done


def _shape_value(name: str, made: dict, weights: dict) -> list | None:
    if name in weights:
        return numpy_helper.to_array(weights[name]).reshape(-1).tolist()
    node = made.get(name)
    if node is not None and node.op_type == "Constant" and attr(node, "value") is not None:
        return numpy_helper.to_array(attr(node, "value")).reshape(-1).tolist()
    if node is not None and node.op_type == "Concat":  # Concat(0, 0, -1) of constants
        values: list = []
        for part in (_shape_value(i, made, weights) for i in node.input):
            if part is None:
                return None
            values += part
        return values
    return None
