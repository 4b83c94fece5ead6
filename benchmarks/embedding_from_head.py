"""What a quantized export with a tied head would weigh if its embedding read the head's own 8-bit
bytes: a copy of the export in which the embedding's Gather of the float (D, V) table (and the
Transpose after it) becomes com.microsoft.GatherBlockQuantized over the head's MatMulNBits data,
when that table is exactly the head's grid; then both files' sizes and their logits on one
seeded prefill, on ONNX Runtime's CPU provider.

A measurement for issue 42, not yet an export option: SmolLM2-135M's int4 export (its tied head a
Q8_0 grid carried at 8 bits) is 229 MiB, 108 of them the float table the Gather reads.

    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 300 --flavor ort \\
        --precision int4 -o smollm2-int4.onnx
    python benchmarks/embedding_from_head.py smollm2-int4.onnx smollm2-int4-gbq.onnx
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def rewrite(model: onnx.ModelProto) -> str:
    """Rewrites `model` in place; returns what it did, or raises SystemExit saying why it cannot."""
    inits = {i.name: i for i in model.graph.initializer}
    gather = next((n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
                   and _attr(n, "axis", 0) == 1 and len(inits[n.input[0]].dims) == 2), None)
    if gather is None:
        raise SystemExit("no Gather of a (D, V) table's columns: not an export with a tied head")
    d, v = inits[gather.input[0]].dims
    turn = [n for n in model.graph.node if gather.output[0] in n.input]
    if len(turn) != 1 or turn[0].op_type != "Transpose":
        raise SystemExit("the Gather's rows are not put model axis last by one Transpose")
    head = next((n for n in model.graph.node if n.op_type == "MatMulNBits" and _attr(n, "bits") == 8
                 and _attr(n, "N") == v and _attr(n, "K") == d), None)
    if head is None or len(head.input) > 3 and head.input[3]:
        raise SystemExit("no 8-bit head without zero points of the table's size")
    block = _attr(head, "block_size")
    q = numpy_helper.to_array(inits[head.input[1]])  # (V, D / block, block)
    scales = numpy_helper.to_array(inits[head.input[2]]).astype(np.float32).reshape(v, d // block, 1)
    grid = ((q.astype(np.float32) - 128) * scales).reshape(v, d)
    table = numpy_helper.to_array(inits[gather.input[0]]).T
    off = float(np.abs(grid - table).max())
    if off != 0.0:
        raise SystemExit(f"the table is not the head's grid (max abs {off:.3g}): the rows would change")
    model.graph.initializer.extend([numpy_helper.from_array(scales, "embedding_scales"),
                                    numpy_helper.from_array(np.array([0, 0, d], np.int64), "embedding_shape")])
    rows = [helper.make_node("GatherBlockQuantized", [head.input[1], gather.input[1], "embedding_scales"],
                             ["embedding_blocks"], name="embedding_from_head", domain="com.microsoft",
                             gather_axis=0, quantize_axis=2, block_size=block, bits=8),
            helper.make_node("Reshape", ["embedding_blocks", "embedding_shape"], [turn[0].output[0]],
                             name="embedding_rows")]
    nodes = []
    for n in model.graph.node:
        if n is gather:
            nodes += rows
        elif n is not turn[0]:
            nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.remove(inits[gather.input[0]])
    return f"the ({d}, {v}) float table replaced by the head's {block}-block 8-bit grid (equal: max abs 0)"


def seeded_feed(model: onnx.ModelProto) -> dict:
    """input_ids of one sequence of 7 tokens, write_pos 0, every cache zeros (a symbolic batch 1,
    any other symbolic length 0)."""
    rng = np.random.default_rng(0)
    feed = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else (1 if "batch" in d.dim_param else 0)
                for d in i.type.tensor_type.shape.dim]
        if i.name == "input_ids":
            feed[i.name] = rng.integers(0, 1000, (1, 7)).astype(np.int64)
        elif i.name == "write_pos":
            feed[i.name] = np.zeros(dims, np.int64)
        else:
            feed[i.name] = np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
    return feed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("out")
    a = p.parse_args(argv)
    import onnxruntime as ort
    model = onnx.load(a.source)
    print(rewrite(model))
    onnx.save(model, a.out)
    feed = seeded_feed(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    logits = [ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(["logits"], feed)[0]
              for path in (a.source, a.out)]
    print(f"{a.source}: {os.path.getsize(a.source) / 2**20:.1f} MiB; {a.out}: {os.path.getsize(a.out) / 2**20:.1f} MiB")
    print(f"logits max abs difference {np.abs(logits[0] - logits[1]).max():.3g} (largest logit "
          f"{np.abs(logits[0]).max():.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
