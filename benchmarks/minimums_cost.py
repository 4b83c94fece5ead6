"""What a carried Q4_1 grid's minimums cost a decode step, in each form: an int4 static export (ort
flavour) with `--minimums exact` timed as it is and with the minimums' ops taken out (its block sums,
the MatMul by the minimums and the Add: answers wrong, for timing only: the floor), and any other
exports given (the default, folded), interleaved in one process, IO binding, one token after
`--context` positions.

    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 300 --flavor ort \\
        --precision int4 --minimums exact -o smollm2-int4-exact.onnx
    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 300 --flavor ort \\
        --precision int4 -o smollm2-int4.onnx
    python benchmarks/minimums_cost.py smollm2-int4-exact.onnx smollm2-int4.onnx --threads 2
"""

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

from attnexport import hf
from attnexport import precision as P


def without_minimums(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for node in out.graph.node:
        if P.MINIMUMS in node.name or node.name.endswith("_block_sums"):
            if node.op_type == "Add":  # product + minimums -> the product alone
                nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            continue
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    kept = [i for i in out.graph.initializer if i.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def step(model: onnx.ModelProto, threads: int, context: int):
    layout = hf.Layout.of(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding, held = session.io_binding(), []
    shape = (1, layout.kv_heads, layout.max_seq, layout.head_dim)
    for name in layout.cache_names("past_key_values"):
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        held.append(value)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(layout.cache_pairs[name], value)
    binding.bind_cpu_input("input_ids", np.array([[5]], np.int64))
    binding.bind_cpu_input("write_pos", np.array([context], np.int64))
    binding.bind_output("logits", "cpu")
    return lambda: session.run_with_iobinding(binding), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="an export with --minimums exact")
    parser.add_argument("others", nargs="*", help="exports timed beside it (the folded default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    a = parser.parse_args()
    model = onnx.load(a.model)
    runs = {f"{a.model} (exact minimums)": step(model, a.threads, a.context),
            f"{a.model} with the minimums taken out (answers wrong)": step(without_minimums(model), a.threads,
                                                                           a.context)}
    for other in a.others:
        runs[other] = step(onnx.load(other), a.threads, a.context)
    times: dict = {k: [] for k in runs}
    for _ in range(a.rounds):
        for name, (run, _held) in runs.items():
            for _ in range(5):
                run()
            ms = []
            for _ in range(a.iters):
                started = time.perf_counter()
                run()
                ms.append((time.perf_counter() - started) * 1e3)
            times[name].append(statistics.median(ms))
    for name, medians in times.items():
        print(f"{name}: {statistics.median(medians):.2f} ms a token (rounds' medians {min(medians):.2f}-"
              f"{max(medians):.2f}), {a.threads} threads, context {a.context}")


if __name__ == "__main__":
    main()
