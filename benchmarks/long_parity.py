"""Greedy parity over long generations: an exported step graph in a plain ONNX Runtime loop (the one
verify runs, `generation.generate`) against transformers' own `generate`, one prompt at a time, each
token compared, with both loops' wall times. For generations longer than a model's sliding window
(Gemma 3's local layers keep a ring of 512 in the static form), which verify's default 48 tokens
do not reach.

    attnexport export --hf gemma-3-270m-q4_k_m.gguf --kv-cache static --max-seq 8200 --flavor ort -o g.onnx
    python benchmarks/long_parity.py g.onnx gemma-3-270m-q4_k_m.gguf --new-tokens 560 --prompts 2 --out r.json

The prompts are verify's (`generation.PROMPTS`); ONNX Runtime runs on its CPU provider with
--threads threads (torch too).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("source", help="the model's --hf source (folder or GGUF file)")
    parser.add_argument("--new-tokens", type=int, default=560)
    parser.add_argument("--prompts", type=int, default=2, help="how many of verify's prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import onnx
    import onnxruntime as ort
    import torch

    from attnexport.pretrained import model as hf
    from attnexport.pretrained.causal import generation as G

    torch.set_num_threads(args.threads)
    layout = hf.Layout.of(onnx.load(args.model, load_external_data=False))
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(feed):
        return dict(zip(names, session.run(None, feed), strict=True))

    model, _ = hf.load(args.source)
    tokenizer = hf.tokenizer_of(args.source)
    rows = []
    for text in G.PROMPTS[:args.prompts]:
        prompt = np.asarray(tokenizer(text)["input_ids"], np.int64)
        t0 = time.perf_counter()
        got = G.generate(run, layout, [prompt], args.new_tokens).tokens[0]
        t1 = time.perf_counter()
        want = G.reference_generation(model, layout, [prompt], args.new_tokens).tokens[0]
        t2 = time.perf_counter()
        differ = np.flatnonzero(got != want)
        rows.append({"prompt": text, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                     "equal_tokens": int((got == want).sum()),
                     "first_difference": int(differ[0]) if differ.size else None,
                     "onnx_runtime_s": round(t1 - t0, 1), "transformers_s": round(t2 - t1, 1)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "source": str(args.source), "form": layout.form,
                                        "max_seq": layout.max_seq, "windows": layout.extra.get("windows"),
                                        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
