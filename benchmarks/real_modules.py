"""Every block of examples/transformers_modules.py exported in every flavour and verified against
itself on every CPU runtime: the table the README's "transformers, timm and torch blocks" section
quotes (attention op, calls routed and how they were found, worst error over every verify run).

    pip install -e ".[hf]"
    python benchmarks/real_modules.py [--flavors primitives,attention,ort] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

MODULES = ("llama", "mistral", "qwen2", "gpt2_block", "gpt2_eager_block", "gpt2_model", "bert_layer", "bert_model",
           "bert_model_eager", "t5_attention", "whisper_attention", "vit_block", "torch_decoder_layer")


def main() -> None:
    from attnexport import export as E
    from attnexport import modules as M
    from attnexport.verify import verify_module
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavors", default="primitives,attention,ort")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODULES:
            spec = f"examples/transformers_modules.py:{name}"
            try:
                module, example = M.load(spec)
            except Exception as e:  # noqa: BLE001 - timm without a torchvision for this torch
                print(f"{name:20} cannot be built here: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            for flavor in args.flavors.split(","):
                path = Path(tmp) / f"{name}-{flavor}.onnx"
                result = E.export_module(module, example, flavor=flavor, output=path, name=spec)
                report = verify_module(path, spec, ["torch", "onnx-ref", "ort-cpu"])
                worst = max(c.max_abs for r in report.rows for c in r.comparisons)
                kinds = Counter(f.kind for f in result.recognized if f.kind)
                row = {"module": name, "flavor": flavor, "attention_op": result.attention_op, "routed": result.routed,
                       "hand_written": kinds.get("hand-written", 0), "runs": len(report.rows),
                       "passed": sum(r.passed for r in report.rows), "worst_abs_error": worst}
                rows.append(row)
                print(f"{name:20} {flavor:10} {row['attention_op']:34} routed {row['routed']} "
                      f"(by hand {row['hand_written']})  verify {row['passed']}/{row['runs']}  worst {worst:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
