"""What verify pays a step of a static export on the deployment runtimes: the export's step run
through `runtimes.prepare_onnx(...).run` (what verify and the accuracy measurement call), its
buffers fed back as the last step returned them, on `ort-node` (or another runtime) beside
`ort-cpu`, with the runtime's own time of one run (`time_runs`, timed in JavaScript) for the pipe's
share. Prints each step's seconds and the logits' largest difference from `ort-cpu`.

    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache static --max-seq 4200 --flavor ort \\
        --precision int4 -o smollm2-int4.onnx
    python benchmarks/probes/js_step.py smollm2-int4.onnx [--runtime ort-node] [--steps 6]
"""

import argparse
import statistics
import time

import numpy as np
import onnx

from attnexport import runtimes as R
from attnexport.pretrained import model as hf


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--runtime", default="ort-node")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    model = onnx.load(args.model)
    layout = hf.Layout.of(model)
    names = layout.cache_names("past_key_values")
    runs = {name: R.prepare_onnx(name, model) for name in (args.runtime, "ort-cpu")}
    shape = (1, layout.kv_heads, layout.max_seq, layout.head_dim)
    feeds = {name: {n: np.zeros(shape, np.float32) for n in names} for name in runs}
    seconds = []
    for step in range(args.steps):
        token = {"input_ids": np.array([[5 + step]]), "write_pos": np.array([step])}
        outs = {}
        for name, prepared in runs.items():
            t0 = time.perf_counter()
            outs[name] = prepared.run({**token, **feeds[name]})
            if name == args.runtime:
                seconds.append(time.perf_counter() - t0)
            feeds[name] = {n: outs[name][layout.cache_pairs[n]] for n in names}
        diff = float(np.abs(outs[args.runtime]["logits"] - outs["ort-cpu"]["logits"]).max())
        print(f"step {step}: {args.runtime} {seconds[-1]:.3f} s, logits {diff:.2g} from ort-cpu's", flush=True)
    inside = runs[args.runtime].time_runs({**token, **feeds["ort-cpu"]}, 5)
    print(f"{args.runtime}: median {statistics.median(seconds[1:] or seconds):.3f} s a step through the pipe; "
          f"its own run {statistics.median(inside):.0f} ms (median of 5, timed in JavaScript)")


if __name__ == "__main__":
    main()
