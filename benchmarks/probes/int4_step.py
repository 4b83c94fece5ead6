"""One decode step of SmolLM2's int4 exports and onnxruntime-genai's int4 graph, each run the same
way: a plain ONNX Runtime session on the CPU provider, IO binding with the cache buffers bound as
both input and output (attnexport's static buffers; genai's shared past/present buffer, its
attention mask one longer than the context), one token after `--context` positions, interleaved in
one process (rounds of `--iters` runs each, the medians' median and their spread). This takes
genai's generator loop out of its time, which `bench --hf` keeps in (genai runs as users run it).

Timing-only variants (answers wrong), to see what each part of a form costs:
- `NAME:no-minimums`: an exact export's minimums taken out (its block sums, the MatMul by the
  minimums and the Add);
- `NAME:no-zero-points`: every MatMulNBits without its zero points (the kernel's implied 8);
- `NAME:bare`: a folded export without its zero points, residual rows and block sums: one
  MatMulNBits a matrix reading the plain input, as onnxruntime-genai's int4 graph has it.

`--profile` runs each graph under ONNX Runtime's profiler instead and prints its kernel time a step
by op type (the block sums and the Concats that append them apart), which is where the time goes
(the profiler's own cost inflates every op, so compare graphs with each other, not with the timings).

    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 4200 --flavor ort \\
        --precision int4 -o folded.onnx
    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 4200 --flavor ort \\
        --precision int4 --minimums exact -o exact.onnx
    python benchmarks/probes/int4_step.py --genai GENAI_INT4/model.onnx folded.onnx exact.onnx exact.onnx:no-minimums
    python benchmarks/probes/int4_step.py --genai GENAI_INT4/model.onnx folded.onnx folded.onnx:no-zero-points \\
        folded.onnx:bare
    python benchmarks/probes/int4_step.py --profile --genai GENAI_INT4/model.onnx folded.onnx
"""

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P


def without_minimums(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of an exact export with its minimums' ops taken out (for timing only)."""
    out = _copy(model)
    nodes = []
    for node in out.graph.node:
        if P.MINIMUMS in node.name or node.name.endswith("_block_sums"):
            if node.op_type == "Add":  # product + minimums -> the product alone
                nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            continue
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return _pruned(out)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def without_zero_points(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every MatMulNBits's zero points dropped (for timing only)."""
    out = _copy(model)
    for node in out.graph.node:
        if node.op_type == "MatMulNBits":
            del node.input[3:]
    return _pruned(out)


def bare(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a folded export with one MatMulNBits a matrix: no zero points, no residual rows, the
    plain input instead of the one with its block sums appended (for timing only)."""
    out = without_zero_points(model)
    inits = {i.name: i for i in out.graph.initializer}
    concats = {n.output[0]: n for n in out.graph.node if n.op_type == "Concat"}
    for node in out.graph.node:
        if node.op_type != "MatMulNBits" or not node.input[0].endswith(P.FOLDED):
            continue
        attrs = {a.name: a for a in node.attribute}
        n, block, k = attrs["N"].i, attrs["block_size"].i, attrs["K"].i
        node.input[0] = concats[node.input[0]].input[0]
        width = k - P.folded_width(k, block)  # K without the appended sums
        kept = width // block
        codes, scales = (numpy_helper.to_array(inits[name]) for name in node.input[1:3])
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(codes[:, :kept]), node.input[1]))
        inits[node.input[2]].CopyFrom(numpy_helper.from_array(
            np.ascontiguousarray(scales.reshape(n, -1)[:, :kept].reshape(-1)), node.input[2]))
        attrs["K"].i = width
    return _pruned(out)


def _pruned(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without the nodes and initializers nothing reads any more."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {i for node in model.graph.node for i in node.input} | outputs
        kept = [node for node in model.graph.node if any(o in read for o in node.output)]
        if len(kept) == len(model.graph.node):
            break
        del model.graph.node[:]
        model.graph.node.extend(kept)
    read = {i for node in model.graph.node for i in node.input}
    inits = [i for i in model.graph.initializer if i.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    return model


VARIANTS = {"": lambda m: m, "no-minimums": without_minimums, "no-zero-points": without_zero_points, "bare": bare}


def _options(threads: int, profile: str | None):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if profile:
        options.enable_profiling, options.profile_file_prefix = True, profile
    return options


def profiled(session, warmup: int) -> dict:
    """{op type: ms a step} from the session's profile, the first `warmup` runs left out (block sums
    and the Concats that append them apart)."""
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    start, steps = runs[warmup], len(runs) - warmup
    totals: dict = collections.defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < start:
            continue
        node, op = e["name"][:-len("_kernel_time")], e["args"].get("op_name", "?")
        if P.FOLDED in node or node.endswith("_block_sums"):
            op += " (block sums)" if op == "MatMul" else " (appending them)"
        totals[op] += e["dur"] / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def step(model: onnx.ModelProto, threads: int, context: int, profile: str | None = None):
    """(one decode step of an attnexport static export, its buffers bound in place, the buffers,
    the session)."""
    layout = hf.Layout.of(model)
    options = _options(threads, profile)
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
    return lambda: session.run_with_iobinding(binding), held, session


def genai_step(path: str, threads: int, context: int, profile: str | None = None):
    """genai's decoder graph with its past and present bound to one buffer per layer (as its
    generator runs it: past_present_share_buffer), sized by its genai_config's context length."""
    from pathlib import Path
    config = json.loads((Path(path).parent / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    options = _options(threads, profile)
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
    return lambda: session.run_with_iobinding(binding), held, session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="attnexport static exports (NAME:VARIANT for a timing-only "
                                                  "variant: no-minimums, no-zero-points, bare)")
    parser.add_argument("--genai", help="onnxruntime-genai's model.onnx (its folder holds genai_config.json)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="kernel time a step by op type, from ONNX Runtime's "
                                                              "profiler (rounds x iters steps each)")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "profile") if a.profile else None
        runs = {}
        if a.genai:
            runs[f"onnxruntime-genai {a.genai}"] = genai_step(a.genai, a.threads, a.context, profile)
        for name in a.models:
            path, _, how = name.partition(":")
            if how not in VARIANTS:
                parser.error(f"{name}: the variant after ':' is one of {', '.join(v for v in VARIANTS if v)}")
            runs[name] = step(VARIANTS[how](onnx.load(path)), a.threads, a.context, profile)
        if a.profile:
            for name, (run, _held, session) in runs.items():
                steps = a.rounds * a.iters
                for _ in range(5 + steps):
                    run()
                print(f"{name} ({a.threads} threads, context {a.context}, {steps} steps after 5):")
                ops = profiled(session, 5)
                small = {op: ms for op, ms in ops.items() if ms < 0.1}
                for op, ms in ops.items():
                    if op not in small:
                        print(f"  {op:45s} {ms:7.3f} ms a step")
                print(f"  {f'{len(small)} other op types':45s} {sum(small.values()):7.3f} ms a step")
                print(f"  {'total':45s} {sum(ops.values()):7.3f} ms a step")
            return
        times: dict = {k: [] for k in runs}
        for _ in range(a.rounds):
            for name, (run, _held, _session) in runs.items():
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
