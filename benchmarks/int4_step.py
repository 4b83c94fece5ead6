"""One decode step of SmolLM2's int4 exports and onnxruntime-genai's int4 graph, each run the same
way: a plain ONNX Runtime session on the CPU provider, IO binding with the cache buffers bound as
both input and output (attnexport's static buffers; genai's shared past/present buffer, its
attention mask one longer than the context), one token after `--context` positions, interleaved in
one process (rounds of `--iters` runs each, the medians' median and their spread). This takes
genai's generator loop out of its time, which `bench --hf` keeps in (genai runs as users run it).

An export whose name ends in `:no-minimums` is timed with an exact export's minimums taken out
(its block sums, the MatMul by the minimums and the Add: answers wrong, for timing only).

    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 4200 --flavor ort \\
        --precision int4 -o folded.onnx
    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 4200 --flavor ort \\
        --precision int4 --minimums exact -o exact.onnx
    python benchmarks/int4_step.py --genai GENAI_INT4/model.onnx folded.onnx exact.onnx exact.onnx:no-minimums
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
    """A copy of an exact export with its minimums' ops taken out (for timing only)."""
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
    """(one decode step of an attnexport static export, its buffers bound in place, the buffers)."""
    layout = hf.Layout.of(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding, held = session.io_binding(), []
    shape = (1, layout.kv_heads, layout.max_seq, layout.head_dim)
    half = any(i.type == "tensor(float16)" for i in session.get_inputs())  # a q4f16 or fp16 export's caches
    for name in layout.cache_names("past_key_values"):
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float16 if half else np.float32))
        held.append(value)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(layout.cache_pairs[name], value)
    binding.bind_cpu_input("input_ids", np.array([[5]], np.int64))
    binding.bind_cpu_input("write_pos", np.array([context], np.int64))
    binding.bind_output("logits", "cpu")
    return lambda: session.run_with_iobinding(binding), held


def genai_step(path: str, threads: int, context: int):
    """genai's decoder graph with its past and present bound to one buffer per layer (as its
    generator runs it: past_present_share_buffer), sized by its genai_config's context length."""
    import json
    from pathlib import Path
    config = json.loads((Path(path).parent / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    binding, held = session.io_binding(), []
    shape = (1, decoder["num_key_value_heads"], config["context_length"], decoder["head_size"])
    for layer in range(decoder["num_hidden_layers"]):
        for kind in ("key", "value"):
            value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
            held.append(value)
            binding.bind_ortvalue_input(decoder["inputs"][f"past_{kind}_names"] % layer, value)
            binding.bind_ortvalue_output(decoder["outputs"][f"present_{kind}_names"] % layer, value)
    binding.bind_cpu_input("input_ids", np.array([[5]], np.int64))
    binding.bind_cpu_input("attention_mask", np.ones((1, context + 1), np.int64))
    binding.bind_output("logits", "cpu")
    return lambda: session.run_with_iobinding(binding), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="attnexport static exports (NAME:no-minimums for an exact "
                                                  "one's floor)")
    parser.add_argument("--genai", help="onnxruntime-genai's model.onnx (its folder holds genai_config.json)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=30)
    a = parser.parse_args()
    runs = {}
    if a.genai:
        runs[f"onnxruntime-genai {a.genai}"] = genai_step(a.genai, a.threads, a.context)
    for name in a.models:
        path, _, how = name.partition(":")
        model = onnx.load(path)
        runs[name] = step(without_minimums(model) if how == "no-minimums" else model, a.threads, a.context)
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
