"""A tied vocabulary matrix stored once, as the head reads it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport import weights as W
from attnexport.errors import ExportError
from attnexport.pretrained.fusions.graph import attr, rank_of


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
        if attr(gather, "axis", 0) != 0 or gather.input[0] != name or attr(turn, "perm") != [1, 0]:
            continue
        flipped = f"{name}.transposed"
        model.graph.initializer.append(  # written beside the traced weights where they are on disk
            W.transposed_external(inits[name], flipped, over=True)
            or numpy_helper.from_array(np.ascontiguousarray(W.values(inits[name]).T), flipped))
        model.graph.initializer.remove(inits[name])
        for node in model.graph.node:  # the head's MatMul: the (D, V) matrix itself
            for i, x in enumerate(node.input):
                if x == turn.output[0]:
                    node.input[i] = flipped
        _gather_columns(model, gather, flipped, turn)


def folded_head(model: onnx.ModelProto) -> None:
    """The same, where the exporter folded the head's Transpose into a constant of its own: an
    embedding's table (V, D) gathered on axis 0 and a MatMul reading an initializer that holds its
    transpose (D, V) exactly (T5's head, scaled before it reads the table) keep the (D, V) one, which
    the embedding gathers the columns of."""
    inits = {i.name: i for i in model.graph.initializer}
    readers: dict = {}
    for node in model.graph.node:
        for name in node.input:
            if name in inits:
                readers.setdefault(name, []).append(node)
    heads: dict = {}  # (D, V) initializers a MatMul reads, by their transpose's bytes
    for name, nodes in readers.items():
        if len(inits[name].dims) == 2 and all(n.op_type == "MatMul" and n.input[1] == name for n in nodes):
            w = W.values(inits[name]).T
            heads.setdefault((w.shape, w.dtype.str, w.tobytes()), []).append(name)
    for name, nodes in readers.items():
        if [n.op_type for n in nodes] != ["Gather"] or len(inits[name].dims) != 2:
            continue
        gather = nodes[0]
        table = W.values(inits[name])
        twins = heads.get((table.shape, table.dtype.str, table.tobytes()), [])
        if attr(gather, "axis", 0) != 0 or gather.input[0] != name or not twins:
            continue
        model.graph.initializer.remove(inits[name])
        _gather_columns(model, gather, twins[0])


def _gather_columns(model: onnx.ModelProto, gather, flipped: str, dropped=None) -> None:
    """`gather` (axis 0 of a (V, D) table) made to gather the columns of `flipped`, the (D, V)
    matrix the head reads, with the model axis put last after it (`dropped`: a node that no longer
    has a use, the Transpose the head read)."""
    rank = rank_of(model, gather.input[1])
    if rank is None:
        raise ExportError(f"the rank of {gather.input[1]} is not known")
    out = gather.output[0]
    columns = f"{out}_columns"
    gather.input[0], gather.output[0] = flipped, columns
    kept = [a for a in gather.attribute if a.name != "axis"]
    del gather.attribute[:]
    gather.attribute.extend([*kept, helper.make_attribute("axis", 1)])
    order = list(model.graph.node)
    if dropped is not None:
        order.remove(dropped)
    order.insert(order.index(gather) + 1, helper.make_node(
        "Transpose", [columns], [out], f"{gather.name}_model_axis_last", perm=[*range(1, rank + 1), 0]))
    del model.graph.node[:]
    model.graph.node.extend(order)
