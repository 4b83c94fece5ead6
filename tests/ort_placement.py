"""Where ONNX Runtime's CUDA provider would place each node of a graph, without a GPU.

ONNX Runtime moves some nodes to the CPU even when the CUDA provider has a kernel for them: a
node that reads a value the CPU holds (the output of Shape or Size, or of a node already moved)
goes to the CPU too when each of its inputs is a graph input, a small initializer (100 elements
at most) or such a CPU value, none is float16, and the CUDA kernel does not itself read that
input on the host (Reshape's shape, Range's bounds, ...). What is left on the device and reads a
CPU value at an input it wants on the device needs a copy from the host.

An input the kernel reads on the host (GroupQueryAttention's total_sequence_length, say) that the
device computed is copied to the host. A node of an op with no CUDA kernel at its type
(GroupQueryAttention in float32) runs on the CPU whatever it reads.

A CUDA graph's capture takes CPU nodes only when they are shape arithmetic and no copy between
host and device is needed, so these two lists, checked here on every machine, say whether a graph can be
captured (the H100 runs of benchmarks/gpu-run.sh check the same on the real provider).
"""

from __future__ import annotations

import heapq

import numpy as np
import onnx
from onnx import TensorProto

# Inputs that the CUDA provider's kernels read in host memory (by op type: input indices).
HOST_INPUTS = {
    "Reshape": {1}, "Expand": {1}, "Tile": {1}, "Range": {0, 1, 2}, "ConstantOfShape": {0}, "Slice": {1, 2, 3, 4},
    "Unsqueeze": {1}, "Squeeze": {1}, "ReduceSum": {1}, "ReduceMax": {1}, "ReduceMean": {1}, "Split": {1},
    "Pad": {1, 2, 3}, "TopK": {1}, "Trilu": {1}, "CumSum": {1},
    "GroupQueryAttention": {6},  # total_sequence_length
}
# Ops the CUDA provider has no kernel for at some float types: the node runs on the CPU.
NO_CUDA_KERNEL = {"GroupQueryAttention": {TensorProto.FLOAT}}  # float16 and bfloat16 only (1.31.1)


def cuda_placement(model: onnx.ModelProto, missing_kernels: bool = True) -> tuple[list[str], list[str]]:
    """(nodes moved to the CPU, "op_type:name"; values copied between host and device,
    "op_type:name <- value", "(to the host)" when the copy goes that way). `missing_kernels`
    False: as if every op had a CUDA kernel at every type (what a float32 graph's float16 twin
    meets, NO_CUDA_KERNEL being float32 only)."""
    g = model.graph
    small = {i.name for i in g.initializer if int(np.prod(i.dims)) <= 100}
    for n in g.node:  # ONNX Runtime turns Constant nodes into initializers
        if n.op_type == "Constant":
            t = onnx.helper.get_attribute_value(n.attribute[0])
            if not isinstance(t, onnx.TensorProto) or int(np.prod(t.dims)) <= 100:
                small.update(n.output)
    graph_inputs = {i.name for i in g.input}
    inferred = onnx.shape_inference.infer_shapes(model)
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.input, *inferred.graph.value_info,
                                                               *inferred.graph.output]}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for x in n.input:
            consumers.setdefault(x, []).append(i)
    on_cpu_values: set[str] = set()
    queue: list[int] = []
    moved, seen = set(), set()
    for i, n in enumerate(g.node):  # no kernel at this input's type: on the CPU whatever it reads
        if missing_kernels and elem.get(n.input[0] if n.input else "") in NO_CUDA_KERNEL.get(n.op_type, ()):
            moved.add(i)
            on_cpu_values.update(n.output)
            queue += [c for o in n.output for c in consumers.get(o, [])]
    for n in g.node:
        if n.op_type in ("Shape", "Size"):
            on_cpu_values.update(n.output)
            queue += [c for o in n.output for c in consumers.get(o, [])]
    heapq.heapify(queue)
    while queue:
        i = heapq.heappop(queue)
        if i in seen:
            continue
        seen.add(i)
        n = g.node[i]
        if n.op_type == "Constant":
            continue
        host = HOST_INPUTS.get(n.op_type, set())
        to_cpu = True
        for k, x in enumerate(n.input):
            if not x:
                continue
            if elem.get(x) == TensorProto.FLOAT16:
                to_cpu = False
                break
            if x in small or x in graph_inputs:
                continue
            if x not in on_cpu_values or k in host:
                to_cpu = False
                break
        if to_cpu:
            moved.add(i)
            on_cpu_values.update(n.output)
            for o in n.output:
                for c in consumers.get(o, []):
                    heapq.heappush(queue, c)
    copies = []
    for i, n in enumerate(g.node):
        if n.op_type in ("Shape", "Size", "Constant"):
            continue
        if i in moved:  # a CPU node reading what the device computed
            copies += [f"{n.op_type}:{n.name} <- {x} (to the host)" for x in n.input
                       if x and x not in on_cpu_values and x not in small and x not in graph_inputs]
            continue
        host = HOST_INPUTS.get(n.op_type, set())
        copies += [f"{n.op_type}:{n.name} <- {x}" for k, x in enumerate(n.input)
                   if x in on_cpu_values and k not in host]
        copies += [f"{n.op_type}:{n.name} <- {x} (to the host)" for k, x in enumerate(n.input)
                   if k in host and x and x not in on_cpu_values and x not in small and x not in graph_inputs]
    copies += [f"graph output <- {o.name}" for o in g.output if o.name in on_cpu_values]
    return [f"{g.node[i].op_type}:{g.node[i].name}" for i in sorted(moved)], copies
