"""What the ort flavour's rewrites share: reading a node's attribute and a value's rank, the domain
of ONNX Runtime's contrib ops, and moving the Shape nodes that read a value onto another."""

from __future__ import annotations

import onnx
from onnx import helper

MS = "com.microsoft"


def rank_of(model: onnx.ModelProto, name: str) -> int | None:
    for v in [*model.graph.input, *model.graph.value_info]:
        if v.name == name and v.type.tensor_type.HasField("shape"):
            return len(v.type.tensor_type.shape.dim)
    return None


def attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def shapes_read_from(model: onnx.ModelProto, old: str, new: str) -> None:
    """Each Shape node that reads the batch and block dims (the first two) of `old` reads them from
    `new` instead, which a fusion feeds the attention in its place (both (B, S, ...)): the step's
    total length (attnexport.onnx_attention._gqa_total) would otherwise keep the replaced nodes
    alive for their shape alone."""
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input[0] == old and 0 < attr(node, "end", 99) <= 2:
            node.input[0] = new
