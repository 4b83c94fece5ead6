"""Localization: the first node of a model whose output diverges from a known-good graph.

Every intermediate value of the model under test is exposed on the runtime under test (ONNX
Runtime: each node output made a graph output; the reference evaluator: `intermediate=True`)
and compared, in the model's node order, with the same value of a known-good graph run on the
ONNX reference evaluator. The known-good graph is the torch module's exported program: the same
variant, options, flavour, opset, dtype and parameters exported afresh, so its values carry the
same names. Values are matched by name; a graph whose names differ is matched node by node when
its op sequence is the same. Initializers and node attributes are compared as well, so a changed
weight or a changed attribute is named even where the numbers alone would only point near it.

Where a whole model's fresh export and every value of both graphs would not fit in memory,
`locate_bounded` compares the graph under test with itself on a known-good runtime, a part at a
time: first the few values the residual stream passes through, then only the nodes between the
last of them that agrees and the first that departs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from attnexport import runtimes as R
from attnexport.compare import divergence
from attnexport.errors import reason


@dataclass
class Localization:
    node: str = ""  # the first node whose output diverges ("" when none does)
    op_type: str = ""
    output: str = ""  # its diverging output
    error: float = 0.0  # max abs error of that output against the known-good value
    scale: float = 0.0  # the value's scale (max |known-good|, at least 1)
    before: float = 0.0  # the largest error among its inputs: small when the node itself is at fault
    inputs: list[dict] = field(default_factory=list)  # name, kind, error
    changed_initializers: list[str] = field(default_factory=list)
    changed_attributes: list[str] = field(default_factory=list)
    missing_nodes: list[str] = field(default_factory=list)  # known-good nodes with no counterpart
    compared: int = 0  # intermediate values compared
    matched_by: str = "name"  # "name" or "position"
    note: str = ""
    kind: str = "divergence"  # or "overflow": `node` is where the first non-finite value an output carries is made

    @property
    def diverged(self) -> bool:
        return bool(self.node or self.changed_initializers or self.changed_attributes or self.missing_nodes)

    def describe(self) -> str:
        if not self.diverged:
            return f"no intermediate value diverges ({self.compared} compared){'; ' + self.note if self.note else ''}"
        parts = []
        if self.kind == "overflow":
            ins = ", ".join(f"{i['name']} (max |value| {_fmt(i['error'])})" for i in self.inputs)
            return (f"first non-finite value at {self.op_type} node {self.node!r} output {self.output!r}, from finite "
                    f"inputs (largest |value| {_fmt(self.before)}): {ins}; {self.note}")
        if self.node:
            ins = ", ".join(f"{i['name']} ({i['kind']}, err {_fmt(i['error'])})" for i in self.inputs)
            parts.append(f"first divergence at {self.op_type} node {self.node!r} output {self.output!r}: "
                         f"max abs {_fmt(self.error)} (scale {self.scale:.3g}), inputs max abs "
                         f"{_fmt(self.before)}: {ins}")
        if self.changed_initializers:
            parts.append("initializers differ from the export: " + ", ".join(self.changed_initializers))
        if self.changed_attributes:
            parts.append("attributes differ: " + "; ".join(self.changed_attributes))
        if self.missing_nodes:
            parts.append("nodes of the export missing here: " + ", ".join(self.missing_nodes[:5]))
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def intermediates(model: onnx.ModelProto, runtime: str, feed: dict,
                  only: set[str] | None = None) -> dict[str, np.ndarray]:
    """Every node output of `model` computed on `runtime`, by name (`only`: those values, and the
    graph's outputs). The graph is given the extra outputs for the run and has them taken back after
    it, not copied: a whole model's weights may be in it. The reference evaluator computes and holds
    every value whatever `only` says; the others compute and return only those asked for."""
    if runtime == "onnx-ref":
        from onnx.reference import ReferenceEvaluator
        ev = ReferenceEvaluator(model, new_ops=R.reference_ops())
        with np.errstate(all="ignore"):
            values: Any = ev.run(None, feed, intermediate=True)  # a dict: every value by name
        outputs = {o.name for o in model.graph.output}
        return {k: np.asarray(v) for k, v in values.items()
                if k and v is not None and (only is None or k in only or k in outputs)}
    declared = len(model.graph.output)
    names = {o.name for o in model.graph.output}
    try:
        for node in model.graph.node:
            for out in node.output:
                if out and out not in names and (only is None or out in only):
                    vi = onnx.ValueInfoProto()
                    vi.name = out  # no type: ONNX Runtime infers it
                    model.graph.output.append(vi)
                    names.add(out)
        prepared = R.prepare_onnx(runtime, model, optimize=False)
    finally:
        del model.graph.output[declared:]
    return prepared.run(feed)


# The values a decoder's residual stream passes through: a residual Add's or Sum's output, a norm's
# (a post-norm layer ends with one), and the residual sum of ONNX Runtime's fused Skip*Normalization
# (its output 3). A few a layer, small for a short feed, and every layer's error passes through them.
STREAM_OPS = {"Add", "Sum", "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
              "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}
SKIP = {"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}
SUM_OUTPUT = 3  # a Skip*Normalization's input + skip (+ bias)


def stream_values(model: onnx.ModelProto) -> list[str]:
    """The values the residual stream may pass through (STREAM_OPS' outputs), in node order."""
    out = []
    for node in model.graph.node:
        if node.op_type not in STREAM_OPS:
            continue
        if node.output and node.output[0]:
            out.append(node.output[0])
        if node.op_type in SKIP and len(node.output) > SUM_OUTPUT and node.output[SUM_OUTPUT]:
            out.append(node.output[SUM_OUTPUT])
    return out


def _ancestors(model: onnx.ModelProto, values, producer: dict[str, int]) -> set[int]:
    """The indices of the nodes `values` are computed from, their own producers included."""
    seen: set[int] = set()
    stack = [producer[v] for v in values if v in producer]
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        stack.extend(producer[i] for i in model.graph.node[k].input if i in producer)
    return seen


def locate_bounded(model: onnx.ModelProto, feed: dict, runtime: str, known: str, dtype: str) -> Localization:
    """Names the first node of `model` whose output on `runtime` diverges from the same graph's on
    `known` (a runtime trusted for this graph), holding few of its values at a time: the residual
    stream's values (`stream_values`) and the graph's outputs first, on both; the first of them that
    departs, in node order; then the nodes it is computed from that no agreeing one of them is (for
    a decoder, the part of one layer up to it), every output of those and what they read, on both.
    It compares the runtime with the graph, not the graph with the model: a graph that computes
    something else everywhere agrees with itself."""
    cannot = R.missing_ops(known, model)
    if cannot:
        return Localization(note=f"not localized: {known}, the runtime compared with, has no kernel for "
                                 f"{', '.join(cannot[:3])}")
    producer = {o: k for k, n in enumerate(model.graph.node) for o in n.output if o}
    marks = sorted({*stream_values(model), *(o.name for o in model.graph.output if o.name in producer)},
                   key=lambda v: producer[v])
    loc = Localization()
    got = intermediates(model, runtime, feed, set(marks))
    good = intermediates(model, known, feed, set(marks))
    agreeing, first = [], None
    for name in marks:
        if name in got and name in good:
            loc.compared += 1
            if divergence(got[name], good[name], dtype)[0]:
                first = name
                break
            agreeing.append(name)
    del got, good
    if first is None:
        loc.note = (f"no value of the residual stream or output departs from {known} on the same graph "
                    f"({loc.compared} compared)")
        return loc
    region = sorted(_ancestors(model, [first], producer) - _ancestors(model, agreeing, producer))
    wanted = {o for k in region for o in model.graph.node[k].output if o}
    wanted |= {i for k in region for i in model.graph.node[k].input if i in producer}
    got = intermediates(model, runtime, feed, wanted)
    good = intermediates(model, known, feed, wanted)
    found = {name: divergence(got[name], good[name], dtype) for name in wanted if name in got and name in good}
    del got, good
    loc.compared += len(found)
    errors = {name: err for name, (_, err, _) in found.items()}
    inits = {i.name: i for i in model.graph.initializer}
    errors.update(dict.fromkeys(inits, 0.0))  # the same tensors on both sides
    loc.note = (f"on the same graph against {known}, a part at a time: {len(marks)} values of the residual "
                f"stream and outputs, the first to depart {first!r}, then the {len(region)} nodes it is "
                "computed from that no agreeing one is")
    for k in region:
        node = model.graph.node[k]
        out = next((o for o in node.output if o in found and found[o][0]), None)
        if out is None:
            continue
        _, loc.error, loc.scale = found[out]
        loc.node, loc.op_type, loc.output = node.name, node.op_type, out
        loc.inputs = [_input_info(i, model, inits, {}, {}, errors, {}, dtype) for i in node.input if i]
        loc.before = max((i["error"] for i in loc.inputs if i["error"] is not None), default=0.0)
        upstream = [i["name"] for i in loc.inputs if i["name"] in found and found[i["name"]][0]]
        if upstream:  # made before this part, within its limit where the stream first read it
            loc.note += (f"; its input {upstream[0]} departs already, made outside this part: the cause may lie "
                         "before it")
        break
    return loc


def nonfinite(arrays) -> bool:
    """Whether any floating-point array among `arrays` (a dict of outputs, or one array) holds a NaN or
    an infinity."""
    values = arrays.values() if isinstance(arrays, dict) else [arrays]
    return any(np.asarray(v).dtype.kind == "f" and not np.isfinite(np.asarray(v)).all() for v in values)


def first_overflow(model: onnx.ModelProto, feed: dict, runtime: str) -> Localization:
    """Where the non-finite values of `model`'s outputs on `runtime` begin: every node output computed
    (`intermediates`), the NaN and infinities followed back from the outputs through the values that
    carry them, and the first node (in the graph's order) that makes one from finite inputs named,
    with the largest |value| among its inputs. An infinity made on purpose (a mask's -inf) that a
    softmax turns back into finite values is not on that path, so it is not named."""
    values = intermediates(model, runtime, feed)
    bad = {name for name, v in (*feed.items(), *values.items()) if nonfinite(v)}
    fed = sorted(n for n in feed if n in bad)
    producer, order = {}, {}  # each output's node, and that node's place in the graph
    for k, n in enumerate(model.graph.node):
        for o in n.output:
            if o:
                producer[o], order[o] = n, k
    reached, origins = set(), []
    stack = [o.name for o in model.graph.output if o.name in bad]
    if not stack:
        return Localization(kind="overflow", note=f"every output is finite on {runtime}")
    while stack:
        name = stack.pop()
        if name in reached:
            continue
        reached.add(name)
        node = producer.get(name)
        if node is None:
            continue
        carried = [i for i in node.input if i in bad]
        if not carried and any(node.input):
            origins.append(node)
        stack.extend(carried)
    if not origins:
        where = f"the inputs {', '.join(fed)}" if fed else "a constant"
        return Localization(kind="overflow", note=f"the non-finite values come from {where}, not from a node")
    first = min(origins, key=lambda n: order[next(o for o in n.output if o)])
    if first.op_type == "If" and first.input[0] in (*values, *feed):
        inside = _inside_if(model, first, {**feed, **values}, runtime)
        if inside is not None:
            return inside
    out = next(o for o in first.output if o in reached)
    made = np.asarray(values[out])
    count = int((~np.isfinite(made)).sum())
    inits = {i.name: i for i in model.graph.initializer if i.name in first.input}
    inputs = []
    for name in first.input:
        kind = "value" if name in values or name in feed else "initializer" if name in inits else ""
        if not kind:
            continue
        v = np.asarray(values[name] if name in values else feed[name] if name in feed
                       else numpy_helper.to_array(inits[name]))
        if v.dtype.kind == "f":
            inputs.append({"name": name, "kind": kind, "error": float(np.abs(v.astype(np.float64)).max(initial=0))})
    dtype = made.dtype.name
    limit = f", beyond {dtype}'s range of {float(np.finfo(made.dtype).max):.6g}" if made.dtype.kind == "f" else ""
    return Localization(node=first.name, op_type=first.op_type, output=out, kind="overflow",
                        before=max((i["error"] for i in inputs), default=0.0), inputs=inputs,
                        compared=len(values), note=f"{count} of {made.size} values not finite ({dtype}{limit})")


def overflow_said(model, feed: dict, runtime: str = "ort-cpu") -> str:
    """`first_overflow`'s answer in a line, for an error message (`model`: a ModelProto, or the path
    of one, read with its external data); where it cannot be found, that."""
    try:
        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(str(model))
        return first_overflow(model, feed, runtime).describe()
    except Exception as e:  # noqa: BLE001 - a diagnosis; its failure is said
        return f"its outputs hold NaN or infinities (where they begin could not be found: {reason(e)})"


def _inside_if(model: onnx.ModelProto, node, known: dict, runtime: str) -> Localization | None:
    """`first_overflow` within the branch an If node took (an encoder-decoder's merged decoder):
    the branch made a graph of its own, the outer values it reads its inputs (fed what they were on
    this run) and the outer initializers it reads its own; None where the branch makes no node's
    overflow of its own."""
    from onnx import helper
    taken = bool(np.asarray(known[node.input[0]]).reshape(-1)[0])
    branch = _attrs(node)["then_branch" if taken else "else_branch"]
    made = {o for n in branch.node for o in n.output} | {i.name for i in branch.initializer}
    outer = sorted({i for n in branch.node for i in n.input if i and i not in made})
    inits = {i.name: i for i in model.graph.initializer if i.name in outer}
    fed = {name: np.asarray(known[name]) for name in outer if name not in inits and name in known}
    if len(inits) + len(fed) != len(outer):
        return None  # it reads what this run did not keep
    graph = onnx.GraphProto()
    graph.CopyFrom(branch)
    graph.initializer.extend(inits.values())
    graph.input.extend(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
                       for name, v in fed.items())
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    found = first_overflow(sub, fed, runtime)
    if not found.node:
        return None
    found.note = f"inside If node {node.name!r}'s {'then' if taken else 'else'} branch; {found.note}"
    return found


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _align(model, good):
    """Pairs each node of `model` with its known-good node: by output names, else by position."""
    good_by_out = {o: n for n in good.graph.node for o in n.output if o}
    pairs = [(n, good_by_out.get(n.output[0])) for n in model.graph.node if n.output]
    matched = sum(1 for _, g in pairs if g is not None)
    if matched >= 0.8 * max(len(good.graph.node), 1):
        return pairs, "name", None
    ops = [n.op_type for n in model.graph.node]
    if ops == [n.op_type for n in good.graph.node]:
        return list(zip(model.graph.node, good.graph.node, strict=True)), "position", None
    return pairs, "name", ("the graph's value names and op sequence differ from the export: "
                           "only same-named values were compared")


def locate(model: onnx.ModelProto, known_good: onnx.ModelProto, feed: dict, runtime: str,
           dtype: str) -> Localization:
    """Names the first node of `model` on `runtime` whose output diverges from `known_good`."""
    loc = Localization()
    pairs, loc.matched_by, note = _align(model, known_good)
    loc.note = note or ""
    good_inits = {i.name: numpy_helper.to_array(i) for i in known_good.graph.initializer}
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for name, arr in inits.items():
        g = good_inits.get(name)
        if g is not None and (g.shape != arr.shape or not np.array_equal(g, arr, equal_nan=True)):
            loc.changed_initializers.append(name)  # even one ulp: these are not the export's weights
    have = {o for n in model.graph.node for o in n.output}
    if loc.matched_by == "name":
        loc.missing_nodes = [f"{g.op_type}:{g.name}" for g in known_good.graph.node
                             if g.output and g.output[0] not in have]
    for node, good in pairs:
        if good is None:
            continue
        if node.op_type != good.op_type:
            loc.changed_attributes.append(f"{node.name}: op {node.op_type}, export has {good.op_type}")
            continue
        a, b = _attrs(node), _attrs(good)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                loc.changed_attributes.append(f"{node.op_type} {node.name!r} {key}={a.get(key)!r} "
                                              f"(export: {b.get(key)!r})")

    values = intermediates(model, runtime, feed)
    good_values = intermediates(known_good, "onnx-ref", feed)
    good_values.update(good_inits)
    rename: dict[str, str] = {}
    if loc.matched_by == "position":
        for node, good in pairs:
            rename.update(zip(node.output, good.output, strict=False))  # an optional output may be left out
    errors: dict[str, float] = {}
    for node, _ in pairs:
        for out in node.output:
            ref_name = rename.get(out, out)
            if not out or out not in values or ref_name not in good_values:
                continue
            loc.compared += 1
            bad, err, scale = divergence(values[out], good_values[ref_name], dtype)
            errors[out] = err
            if bad and not loc.node:
                loc.node, loc.op_type, loc.output, loc.error, loc.scale = node.name, node.op_type, out, err, scale
                loc.inputs = [_input_info(i, model, inits, values, good_values, errors, rename, dtype)
                              for i in node.input if i]
                loc.before = max((i["error"] for i in loc.inputs if i["error"] is not None), default=0.0)
    return loc


def _input_info(name, model, inits, values, good_values, errors, rename, dtype) -> dict:
    graph_inputs = {i.name for i in model.graph.input}
    kind = "initializer" if name in inits else "graph input" if name in graph_inputs else "value"
    if name in errors:
        err = errors[name]
    elif name in graph_inputs:
        err = 0.0  # the same feed on both sides
    else:
        mine = inits.get(name, values.get(name))
        ref = good_values.get(rename.get(name, name))
        err = None if mine is None or ref is None else divergence(mine, ref, dtype)[1]
    return {"name": name, "kind": kind, "error": err}
