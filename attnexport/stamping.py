"""A model of many alike layers traced with three of them, its graph then stamped out to all of them.

torch.export and torch.onnx take time in proportion to the nodes they trace and translate: about 16 s
of a 1.07B Llama's export (16 layers) went there. Where every layer is the same computation on its
own weights and its own cache, the graph of layers 3..N-1 is layer 2's, its weights and cache
renamed and its input the previous layer's output. So the model is traced with its first three
layers (`Repeat.shallow`), and `stamp` copies layer 2's nodes for every further layer.

Layer 0 is not the template: torch.export shares what layer 0 computes from the step's inputs (the
mask as the first layer's past sizes it) with every later layer. Layers 1 and 2 are compared node for
node first; anything that is not the same computation, on the same shared values, their own weights
(the same views of the same parameters) and their own cache, leaves the graph as traced and `stamp`
says why (`Unstampable`): the caller then traces the whole model. What a stamped graph computes is
checked like any other export's, against the model in float64, layer by layer.
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

TEMPLATE = 2  # the layer copied; layer 1 is what it is compared with
TRACED = TEMPLATE + 1  # the layers the shallow model keeps
SCOPES = "pkg.torch.onnx.name_scopes"  # torch.onnx's record of the modules a node was traced in


@dataclass(frozen=True)
class Repeat:
    """A model whose `count` layers are alike.

    Attributes:
        count: the model's layers.
        layers: where the traced module holds them (the module list's path: "model.model.layers").
        names: layer i's own graph inputs and outputs, in the order the template's are (its cache).
        shallow: a context manager under which the traced module (its argument) runs only its first
            `TRACED` layers and takes and returns only their caches.
    """

    count: int
    layers: str
    names: Callable[[int], Sequence[str]]
    shallow: Callable[[object], contextlib.AbstractContextManager]

    def kept(self, name: str) -> bool:
        """Whether the shallow model has the graph input or output `name` (not a later layer's)."""
        return not any(name in self.names(i) for i in range(TRACED, self.count))


class Unstampable(Exception):
    """The traced layers are not alike; the message says where."""


def _layer(node, prefix: str) -> int | None:
    """The layer a node was traced in, from torch.onnx's record of its modules."""
    scopes = node.metadata_props.get(SCOPES)
    if not scopes:
        return None
    with contextlib.suppress(ValueError, SyntaxError):
        for scope in ast.literal_eval(scopes):
            if scope.startswith(prefix + "."):
                index = scope[len(prefix) + 1:].split(".", 1)[0]
                if index.isdigit():
                    return int(index)
    return None


@dataclass
class _View:
    """An initializer that is a parameter of the template layer: the parameter's name in the layer
    and how the initializer holds it (as it is, or turned: the MatMul weights torch.onnx turns)."""

    name: str
    turned: bool
    numpy: bool


def _address(raw) -> int | None:
    import torch
    if isinstance(raw, torch.Tensor):
        return raw.data_ptr() if raw.device.type == "cpu" else None
    if isinstance(raw, np.ndarray):
        return raw.__array_interface__["data"][0]
    return None


def _views(layer, initializers) -> dict:
    """{initializer value: _View} for those of `initializers` that hold a parameter of `layer` (a
    torch module) as it is or turned; found by memory, which is the parameter's own."""
    by_address: dict[int, list] = {}
    for name, p in layer.named_parameters():
        if p.device.type == "cpu" and p.numel():
            by_address.setdefault(p.data_ptr(), []).append((name, p))
    found = {}
    for value in initializers:
        raw: Any = getattr(value.const_value, "raw", None)
        address = _address(raw)
        for name, p in by_address.get(address, []) if address is not None else []:
            shape, numpy = tuple(raw.shape), isinstance(raw, np.ndarray)
            if numpy and raw.dtype.itemsize != p.element_size():
                continue
            strides = tuple(s // p.element_size() for s in raw.strides) if numpy else tuple(raw.stride())
            if shape == tuple(p.shape) and strides == tuple(p.stride()):
                found[value] = _View(name, False, numpy)
            elif p.dim() == 2 and shape == tuple(p.shape)[::-1] and strides == tuple(p.stride())[::-1]:
                found[value] = _View(name, True, numpy)
            if value in found:
                break
    return found


def _signature(node) -> tuple:
    """What makes two nodes the same computation, their inputs aside: a tensor attribute by its
    values (a layer's own constant, a fill value, must not pass for another's)."""
    def value(a):
        v = a.value
        if hasattr(v, "numpy") and hasattr(v, "dtype"):
            x = v.numpy()
            return x.dtype.str, x.shape, x.tobytes()
        return repr(v)
    attributes = tuple(sorted((k, value(a)) for k, a in node.attributes.items()))
    return node.domain, node.op_type, node.overload, len(node.inputs), len(node.outputs), attributes


def _same_constant(a, b) -> bool:
    """Two constants (initializers that are not parameters, or Constant nodes' outputs: shapes,
    axes) hold the same values."""
    from onnx_ir.convenience import get_const_tensor
    if a is b:
        return True
    ta, tb = (get_const_tensor(v) if v is not None else None for v in (a, b))
    if ta is None or tb is None:
        return False
    x, y = ta.numpy(), tb.numpy()
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()  # a NaN is its own equal


def _constant(node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and not node.inputs


def _where(graph, prefix: str) -> dict:
    """{node: the layer it computes for, or None}: torch.onnx's record of its module, else (a node
    a rewrite made without one) the one layer it reads from and is read by. A Constant is in no
    layer: torch.onnx makes one and lets every later layer read it."""
    where = {node: None if _constant(node) else _layer(node, prefix) for node in graph}
    changed = True
    while changed:
        changed = False
        for node in graph:
            if where[node] is not None or _constant(node):
                continue
            reads = {where[v.producer()] for v in node.inputs if v is not None and v.producer() is not None} - {None}
            read_by = {where.get(user) for v in node.outputs for user, _ in v.uses()} - {None}
            if len(reads) == 1 and reads == read_by:
                where[node] = next(iter(reads))
                changed = True
    return where


@dataclass
class _Plan:
    """How each input of the template layer's nodes is had in a stamped layer."""

    nodes: list  # the template's nodes, in order
    index: dict  # template node -> its position
    inputs: list  # per template node, per input: (kind, what)
    views: dict  # template initializer -> _View
    last: object  # the template's last node
    where: dict  # every traced node -> its layer (None: in none)


def _plan(graph, r: Repeat, module) -> _Plan:
    """Layers 1 and 2 compared node for node; what layer k >= 3 reads at each input of each node:
    its own node's output ("own"), layer k-1's ("previous"), its own cache input ("cache"), its
    own parameter ("param") or what every layer reads ("shared")."""
    by_layer: dict = {1: [], TEMPLATE: []}
    where = _where(graph, r.layers)
    for node in graph:
        if where[node] in by_layer:
            by_layer[where[node]].append(node)
    one, two = by_layer[1], by_layer[TEMPLATE]
    if not two or len(one) != len(two):
        raise Unstampable(f"layer 1 has {len(one)} nodes, layer {TEMPLATE} {len(two)}")
    layers = _submodule(module, r.layers)
    pair = _Pair(where, {n: k for k, n in enumerate(two)}, {n: k for k, n in enumerate(one)},
                 {TEMPLATE: list(r.names(TEMPLATE)), 1: list(r.names(1))}, {v: v.name for v in graph.inputs},
                 _views(layers[TEMPLATE], graph.initializers.values()), _views(layers[1], graph.initializers.values()))
    plan_inputs = []
    for a, b in zip(one, two, strict=True):
        if _signature(a) != _signature(b):
            raise Unstampable(f"layer 1's {a.op_type} node {a.name} and layer {TEMPLATE}'s {b.op_type} node {b.name} "
                              "differ")
        plan_inputs.append([pair.input(x, y, b) for x, y in zip(a.inputs, b.inputs, strict=True)])
    # What follows the layers reads layer 2's outputs only (the last layer's, once stamped), after it.
    position = {node: k for k, node in enumerate(graph)}
    for node in graph:
        if where[node] is not None:
            continue
        for v in node.inputs:
            producer = v.producer() if v is not None else None
            if producer is None or where.get(producer) is None:
                continue
            if where[producer] != TEMPLATE or position[node] < position[two[-1]]:
                raise Unstampable(f"{node.op_type} node {node.name}, in no layer, reads layer {where[producer]}'s "
                                  f"{v.name}")
    return _Plan(two, pair.index, plan_inputs, pair.views, two[-1], where)


@dataclass
class _Pair:
    """Layers 1 and 2 of the shallow graph, as `_plan` compares them."""

    where: dict  # node -> its layer
    index: dict  # layer 2's node -> its position
    index_one: dict  # layer 1's node -> its position
    names: dict  # layer -> its own graph inputs and outputs
    graph_inputs: dict  # graph input value -> its name
    views: dict  # layer 2's parameters among the initializers
    views_one: dict  # layer 1's

    def input(self, x, y, node) -> tuple:
        """How a stamped layer has the template's input y (layer 1's at the same place: x)."""
        where, nothing = self.where, x.name if x is not None else "nothing"
        if y is None:
            if x is not None:
                raise Unstampable(f"{node.name}: an input layer 1 gives is missing in layer {TEMPLATE}")
            return ("none", None)
        py, px = y.producer(), x.producer() if x is not None else None
        if py is not None and where.get(py) == TEMPLATE:
            if px is None or where.get(px) != 1 or self.index_one[px] != self.index[py] or x.index() != y.index():
                raise Unstampable(f"{node.name} reads {y.name} of its own layer where layer 1 reads {nothing}")
            return ("own", (self.index[py], y.index()))
        if py is not None and where.get(py) == 1:
            if px is None or where.get(px) != 0:
                raise Unstampable(f"{node.name} reads layer 1's {y.name} where layer 1 reads {nothing}")
            return ("previous", (self.index_one[py], y.index()))
        own = self.names[TEMPLATE]
        if y in self.graph_inputs and y.name in own:
            k = own.index(y.name)
            if x is None or self.graph_inputs.get(x) != self.names[1][k]:
                raise Unstampable(f"{node.name} reads {y.name} where layer 1 reads {nothing}")
            return ("cache", k)
        if y in self.views:
            v, w = self.views[y], self.views_one.get(x)
            if w is None or (w.name, w.turned) != (v.name, v.turned):
                raise Unstampable(f"{node.name} reads the parameter {v.name} where layer 1 reads {nothing}")
            return ("param", y)
        if _alike(x, y, where, self.names):
            return ("shared", y)
        raise Unstampable(f"{node.name} reads {y.name} where layer 1 reads {nothing}")


def _alike(x, y, where, names: dict, depth: int = 12) -> bool:
    """Whether x (read by layer 1) and y (read by layer 2) are the same value computed twice outside
    the layers: the same nodes over the same inputs and constants, or over the shapes of the two
    layers' own caches (which every cache shares: a stamped layer may read layer 2's)."""
    if x is y or _same_constant(x, y):
        return True
    if x is None or y is None or depth == 0:
        return False
    px, py = x.producer(), y.producer()
    if px is None or py is None or where.get(px) is not None or where.get(py) is not None or _constant(px):
        return False  # two constants are alike only by their values (`_same_constant`)
    if x.index() != y.index() or _signature(px) != _signature(py):
        return False
    if px.op_type == "Shape":
        a, b = px.inputs[0], py.inputs[0]
        return a is b or (a.name in names[1] and b.name in names[TEMPLATE] and
                          names[1].index(a.name) == names[TEMPLATE].index(b.name))
    return all(_alike(a, b, where, names, depth - 1) for a, b in zip(px.inputs, py.inputs, strict=True))


def _submodule(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def stamp(model, r: Repeat, module) -> int:
    """The onnx_ir `model` of the shallow trace (layers 0..2) stamped out to `r.count` layers, in
    place, its inputs and outputs in the order `r.names` gives; each stamped layer reads its own
    parameters (the same views of them as the template's) from `module`'s layers. Returns the
    nodes added; raises Unstampable (the graph untouched) where the traced layers are not alike."""
    import onnx_ir as ir
    graph = model.graph
    plan = _plan(graph, r, module)
    layers = _submodule(module, r.layers)
    template_io = list(r.names(TEMPLATE))
    by_name = {v.name: v for v in (*graph.inputs, *graph.outputs)}
    inputs, outputs = list(graph.inputs), list(graph.outputs)
    previous = {n: n for n in plan.nodes}  # template node -> the node of the layer before the next one
    made = 0
    after = plan.last
    scope = re.compile(re.escape(f"{r.layers}.{TEMPLATE}") + r"(?![0-9])")
    for k in range(TRACED, r.count):
        own_names = list(r.names(k))
        params = {}
        cache = {}
        for j, name in enumerate(template_io):
            v = by_name.get(name)
            if v is not None and v in graph.inputs:
                cache[j] = ir.Value(name=own_names[j], type=v.type, shape=v.shape)
                inputs.append(cache[j])
        made_nodes: list = []
        for node, row in zip(plan.nodes, plan.inputs, strict=True):
            args: list = []
            for kind, what in row:
                if kind == "none":
                    args.append(None)
                elif kind == "own":
                    args.append(made_nodes[what[0]].outputs[what[1]])
                elif kind == "previous":
                    args.append(previous[plan.nodes[what[0]]].outputs[what[1]])
                elif kind == "cache":
                    args.append(cache[what])
                elif kind == "param":
                    if what not in params:
                        params[what] = _stamped_param(what, plan.views[what], layers[k], k)
                        graph.register_initializer(params[what])
                    args.append(params[what])
                else:
                    args.append(what)
            copy = ir.Node(node.domain, node.op_type, args, attributes=list(node.attributes.values()),
                           overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                           name=f"{node.name}_layer{k}")
            copy.metadata_props.update({key: scope.sub(f"{r.layers}.{k}", text)
                                        for key, text in node.metadata_props.items()})
            for out, template in zip(copy.outputs, node.outputs, strict=True):
                out.type, out.shape = template.type, template.shape
                out.name = _renamed(template.name, template_io, own_names, k)
            made_nodes.append(copy)
        graph.insert_after(after, made_nodes)
        after = made_nodes[-1]
        made += len(made_nodes)
        for name in template_io:
            v = by_name.get(name)
            if v is not None and v in graph.outputs:
                outputs.append(made_nodes[plan.index[v.producer()]].outputs[v.index()])
        previous = dict(zip(plan.nodes, made_nodes, strict=True))
    # What read the template's outputs after the layers now reads the last layer's.
    last = previous
    for node in list(graph):
        if plan.where.get(node, -1) is not None:  # in a layer, or stamped
            continue
        for i, v in enumerate(node.inputs):
            if v is not None and v.producer() in plan.index:
                node.replace_input_with(i, last[v.producer()].outputs[v.index()])
    outputs = [last[v.producer()].outputs[v.index()] if v.producer() in plan.index and v.name not in template_io
               else v for v in outputs]
    graph.inputs.clear()
    graph.inputs.extend(_ordered(inputs, r))
    graph.outputs.clear()
    graph.outputs.extend(_ordered(outputs, r))
    return made


def _ordered(values, r: Repeat) -> list:
    """The graph's inputs or outputs with each layer's cache in layer order, where the traced
    graph has the template's (others keep their places)."""
    layer = {n: i for i in range(r.count) for n in r.names(i)}
    fixed = [v for v in values if v.name not in layer]
    caches = sorted((v for v in values if v.name in layer),
                    key=lambda v: (layer[v.name], list(r.names(layer[v.name])).index(v.name)))
    first = next((k for k, v in enumerate(values) if v.name in layer), len(values))
    before = sum(1 for v in values[:first] if v.name not in layer)
    return fixed[:before] + caches + fixed[before:]


def _renamed(name: str, template_io: list, own: list, k: int) -> str:
    return own[template_io.index(name)] if name in template_io else f"{name}_layer{k}"


def _stamped_param(value, view: _View, layer, k: int):
    """Layer k's initializer in the place of the template's `value`: its own parameter, held the
    same way (its NumPy view, turned where the template's is)."""
    import onnx_ir as ir
    p = layer.get_parameter(view.name).detach()
    if view.numpy:
        array = p.numpy()
        tensor = ir.Tensor(array.T if view.turned else array, name=f"{value.name}_layer{k}")
    else:
        from torch.onnx._internal.exporter._core import TorchTensor
        tensor = TorchTensor(p.T if view.turned else p, name=f"{value.name}_layer{k}")
    return ir.Value(name=tensor.name, type=value.type, shape=value.shape, const_value=tensor)


@contextlib.contextmanager
def deduplication_off() -> Iterator[None]:
    """onnxscript's optimizer without its merging of equal small initializers: in the shallow
    graph it would give layer 2 layer 0's norm where both are ones (a random model's), and layer k
    would then read layer 0's. The stamped graph is deduplicated after (`deduplicate`)."""
    import onnx_ir.passes.common as common
    cls = common.DeduplicateInitializersPass
    call = cls.call

    def skipped(self, model):
        import onnx_ir as ir
        return ir.passes.PassResult(model=model, modified=False)
    setattr(cls, "call", skipped)  # noqa: B010 - mypy will not have a method assigned
    try:
        yield
    finally:
        setattr(cls, "call", call)  # noqa: B010


def deduplicate(model) -> None:
    """What the optimizer does last to a traced graph, for the stamped one: equal small
    initializers merged, then repeated computations."""
    import onnx_ir.passes.common as common
    common.DeduplicateInitializersPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.NameFixPass()(model)
