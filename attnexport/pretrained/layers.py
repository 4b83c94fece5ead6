"""The check of each layer alone: a whole model's export, layer by layer, against that layer in float64.

The whole-graph check (`export.check_before_writing`) says whether the logits are within their
budget; this one says which layer departs. For each shape the export is checked at:

- torch runs the model in float64 with each decoder layer's input and output hidden states kept
  (`LayerSide`), and once more in the export's dtype with each layer's input replaced by the
  float64 model's (so each layer's own error is measured, not the sum of the layers before it):
  each layer's budget is derived from that error as the whole graph's is (`reference.budget`);
- in the graph, each layer's output is found by value: the value of the layer's shape nearest
  the float64 model's output of that layer, among the outputs of the ops a layer ends with (an
  Add, a norm, the residual sum of ONNX Runtime's fused Skip*Normalization), where it is near it
  or nearer it than any other layer's output (`boundaries`);
- a twin of the graph is cut there (`cut`): every layer's output becomes a graph output, and what
  read it reads a graph input instead, fed the float64 model's output of that layer; a fused
  Skip*Normalization that both ends a layer and starts the next is computed twice, once as
  exported (its sum: the layer's output) and once from the fed input (the next layer's norm);
- ONNX Runtime runs the twin and each layer's output is compared with the float64 one within its
  budget: the first over it is the departing layer, named.

A layer whose output no value of the graph comes near (a fusion that computes it inside one op, or
a layer that departs) cannot be cut there: its successor is then checked with the graph's own input
and the report says which boundaries were found.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper

from attnexport import localize as L
from attnexport import runtimes as R
from attnexport import usage as U
from attnexport.compare import Comparison, Tolerance, compare

# The ops whose output may be a layer's are the residual stream's (`localize.stream_values`): a residual
# Add, a norm (a post-norm layer ends with one), ONNX Runtime's fused norms (their residual sum is output
# L.SUM_OUTPUT of an L.SKIP op).
# A value is taken for a layer's output when it is this near the float64 one, as a fraction of
# that output's largest magnitude: any layer within its budget is far nearer; a value of another
# part of the layer (a norm's output, an MLP's) is not near at all.
NEAR = 0.05
INPUT = "attnexport.layers.{}.input"


def decoder_layers(model, count: int):
    """The one ModuleList of `count` modules in `model` (its decoder layers), or None where there
    is none or more than one (an encoder-decoder's two stacks)."""
    found = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count and count > 0]
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def layer_io(layers, inputs: dict, outputs: dict, replace: dict | None = None, rows: int = 0):
    """Within the block each layer's hidden-state input and output are kept (`inputs[i]`,
    `outputs[i]`, detached); a layer i in `replace` reads that tensor in place of its input, in
    place of its rows from `rows` on where `rows` is given (the rows before it flow as they are)."""

    def replaced(i, x):
        if i not in (replace or {}):
            return x
        by = replace[i].to(x.dtype)
        return torch.cat([x[:rows], by]) if rows else by

    def before(i):
        def hook(module, args, kwargs):
            if args:
                x, rest = replaced(i, args[0]), args[1:]
                inputs[i] = x.detach()
                return (x, *rest), kwargs
            x = replaced(i, kwargs["hidden_states"])
            inputs[i] = x.detach()
            return args, {**kwargs, "hidden_states": x}
        return hook

    def after(i):
        def hook(module, args, kwargs, out):
            outputs[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(after(i), with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def counting(model, count: int, what: str):
    """Within the block each run of a decoder layer of `model` (its `count` of them: `decoder_layers`)
    is a step of the count `what` (`usage.counted`: a terminal's bar, a layer at a time); nothing
    where no terminal shows counts or the model has no one stack of them."""
    layers = decoder_layers(model, count) if U.counts_shown() else None
    if layers is None:
        yield
        return
    with U.counted(what, len(layers)) as advance:
        handles = [layer.register_forward_hook(lambda *_: advance()) for layer in layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


@dataclass
class LayerSide:
    """The float64 model's layers on one feed: each layer's output (float64), the mask of positions
    compared (broadcastable to them; padding never), and each layer's budget (derived from torch's
    error of that layer alone, its input the float64 one)."""

    outputs: list[np.ndarray]
    valid: np.ndarray | None
    budgets: list[Tolerance]

    def compare(self, i: int, got: np.ndarray) -> Comparison:
        want, got = self.outputs[i], np.asarray(got, np.float64)
        if self.valid is not None:
            want, got = np.where(self.valid, want, 0.0), np.where(self.valid, got, 0.0)
        return compare(f"layer {i} output", got, want, self.budgets[i])


def valid_mask(valid: dict, first: str, shape: tuple) -> np.ndarray | None:
    """The positions of a (batch, positions, hidden) layer output that are compared: the first
    output's (logits) mask where it has the same batch and positions."""
    mask = valid.get(first)
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.ndim == 3 and mask.shape[:2] == tuple(shape[:2]):
        return mask[..., :1]
    return None


# --- the graph ------------------------------------------------------------------------------------

def exposing(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` (its weights where they are: a skeleton stays one) whose candidate layer
    ends are graph outputs, a Skip*Normalization's residual sum added where it was not asked for."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for n, node in enumerate(twin.graph.node):
        if node.op_type in L.SKIP and (len(node.output) <= L.SUM_OUTPUT or not node.output[L.SUM_OUTPUT]):
            while len(node.output) < L.SUM_OUTPUT:
                node.output.append("")
            if len(node.output) == L.SUM_OUTPUT:
                node.output.append("")
            node.output[L.SUM_OUTPUT] = f"attnexport.layers.sum.{n}"
    declared = {o.name for o in twin.graph.output}
    for name in L.stream_values(twin):
        if name not in declared:
            twin.graph.output.append(helper.make_empty_tensor_value_info(name))
    return twin


@dataclass
class Boundaries:
    """Where each layer's output is in the graph: `names[i]` (None where no value is near it), and how
    near the nearest value came (its largest error over the output's largest magnitude)."""

    names: list[str | None]
    nearness: list[float] = field(default_factory=list)


def boundaries(values: dict, side: LayerSide) -> Boundaries:
    """Each layer's output found among `values` (the exposed run of `exposing`'s twin): the value of
    the same shape nearest the float64 one, taken where within NEAR of its magnitude, or nearer it
    than any other layer's output (a layer that departs, or one after it in the uncut graph, whose
    error is the sum of those before it)."""
    arrays = {}
    for name, got in values.items():
        got = np.asarray(got)
        if got.shape == side.outputs[0].shape and np.issubdtype(got.dtype, np.floating) and np.isfinite(got).all():
            g = got.astype(np.float64)
            arrays[name] = g if side.valid is None else np.where(side.valid, g, 0.0)
    wants = [o if side.valid is None else np.where(side.valid, o, 0.0) for o in side.outputs]
    errors = {name: [float(np.abs(g - w).max(initial=0.0)) for w in wants] for name, g in arrays.items()}
    names: list[str | None] = []
    nearness = []
    for i, want in enumerate(wants):
        scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
        best = min(errors, key=lambda n: errors[n][i], default=None)
        if best is None:
            names.append(None)
            nearness.append(np.inf)
            continue
        near = errors[best][i] / scale
        own = all(errors[best][i] < e for j, e in enumerate(errors[best]) if j != i)
        nearness.append(near)
        names.append(best if (near <= NEAR or own) and best not in names else None)  # a value ends one layer
    return Boundaries(names, nearness)


def cut(model: onnx.ModelProto, found: Boundaries, dtype: int) -> onnx.ModelProto:
    """A copy of `model` in which each found layer output is a graph output and what read it reads
    the graph input INPUT.format(i + 1) (of element type `dtype`) instead. A Skip*Normalization whose
    residual sum is a layer's output is kept as exported (its sum the output) and computed again from
    the fed input with a skip of zeros for its other outputs (the next layer's normed input)."""
    twin = exposing(model)  # the sums named as in the exposed twin
    names = {name: i for i, name in enumerate(found.names[:-1]) if name is not None}
    producers = {o: node for node in twin.graph.node for o in node.output if o}
    rename: dict[str, str] = {}
    extra: dict[int, list] = {}  # node index -> nodes to insert after it
    index = {id(node): k for k, node in enumerate(twin.graph.node)}
    for name, i in names.items():
        fed = INPUT.format(i + 1)
        twin.graph.input.append(helper.make_tensor_value_info(fed, dtype, None))
        rename[name] = fed
        node = producers[name]
        if node.op_type in L.SKIP and list(node.output).index(name) == L.SUM_OUTPUT:
            zeros = f"{fed}.zeros"
            again = helper.make_node(node.op_type, [fed, zeros, *node.input[2:]],
                                     [f"{o}.from_input" if o and k != L.SUM_OUTPUT else ""
                                      for k, o in enumerate(node.output)],
                                     name=f"{node.name}.from_input", domain=node.domain)
            again.attribute.extend(node.attribute)
            for k, o in enumerate(node.output):
                if o and k != L.SUM_OUTPUT:
                    rename[o] = f"{o}.from_input"
            extra[index[id(node)]] = [helper.make_node("Sub", [fed, fed], [zeros], name=f"{fed}.zeros"), again]
    nodes = []
    for k, node in enumerate(twin.graph.node):
        if not node.name.endswith(".from_input"):
            for j, x in enumerate(node.input):
                if x in rename:
                    node.input[j] = rename[x]
        nodes.append(node)
        nodes.extend(extra.get(k, []))
    del twin.graph.node[:]
    twin.graph.node.extend(nodes)
    # The graph's own outputs read as before (a renamed value is still computed under its name).
    wanted = [n for n in found.names if n is not None]
    outputs = [o for o in twin.graph.output if o.name in {x.name for x in model.graph.output} or o.name in wanted]
    del twin.graph.output[:]
    twin.graph.output.extend(outputs)
    return twin


def staged(twin: onnx.ModelProto, graph, prefix: str):
    """`twin` as the check's session takes it: the ModelProto itself where the graph is one, else saved
    beside the staged graph `graph` (its external data named as the graph names it) and its path."""
    if isinstance(graph, onnx.ModelProto):
        return twin
    path = Path(graph).with_name(f"{prefix}-{Path(graph).name}")
    onnx.save(twin, str(path))
    return str(path)


@dataclass
class LayerCheck:
    """The layers of one checked shape: each layer's comparison (None where its output was not found)."""

    label: str
    comparisons: list[Comparison | None]

    @property
    def departing(self) -> int | None:
        return next((i for i, c in enumerate(self.comparisons) if c is not None and not c), None)

    def worst(self) -> dict | None:
        done = [(i, c) for i, c in enumerate(self.comparisons) if c is not None]
        if not done:
            return None
        i, c = max(done, key=lambda ic: used(ic[1]))
        return {"layer": i, "max_abs": c.max_abs, "atol": c.atol, "rtol": c.rtol, "of_budget": used(c),
                "basis": c.basis}

    def to_dict(self) -> dict:
        return {"compared": sum(c is not None for c in self.comparisons), "layers": len(self.comparisons),
                "worst": self.worst(), "departing": self.departing,
                "not_found": [i for i, c in enumerate(self.comparisons) if c is None]}


def used(c: Comparison) -> float:
    """The share of its budget a comparison used (its needed atol over its atol, at its rtol)."""
    return float(c.needed_atol / c.atol) if c.atol > 0 else (0.0 if c.needed_atol == 0 else np.inf)


def check_layers(graph, cases: list, prepack: bool = False) -> list[LayerCheck]:
    """Each case (label, feed, LayerSide) run on ONNX Runtime's CPU provider through the twin cut at
    the layers' outputs, found by value on the first case (`graph`: the ModelProto, or the path of
    one staged with its external data: the twins are saved beside it). `prepack`: the sessions
    pack the weights for their kernels (`export.check_before_writing`'s)."""
    onnx_model = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph), load_external_data=False)
    _, feed, side = cases[0]
    exposed = R.prepare_onnx("ort-cpu", staged(exposing(onnx_model), graph, "layers-exposed"), prepack=prepack)
    values = exposed.run(feed)
    del exposed
    found = boundaries(values, side)
    kind = next((np.asarray(values[n]).dtype for n in found.names if n is not None), np.dtype(np.float32))
    del values
    session = R.prepare_onnx("ort-cpu", staged(cut(onnx_model, found, helper.np_dtype_to_tensor_dtype(kind)), graph,
                                               "layers-cut"), prepack=prepack)
    checks = []
    for label, feed, side in cases:
        fed = {INPUT.format(i + 1): side.outputs[i].astype(kind)
               for i, name in enumerate(found.names[:-1]) if name is not None}
        got = session.run({**feed, **fed})
        comparisons = [side.compare(i, got[name]) if name is not None else None for i, name in enumerate(found.names)]
        checks.append(LayerCheck(label, comparisons))
    return checks
