"""Every block of examples/transformers_modules.py, and the examples' own modules, exported in
every flavour and verified against themselves: the table the README's "transformers, timm and
torch blocks" section quotes (attention op, calls routed and how they were found, worst error over
every verify run). On the GPU machine the same blocks run on ort-cuda in fp16 (see
benchmarks/gpu-run.sh).

    pip install -e ".[hf]"
    python benchmarks/real_modules.py [--flavors primitives,attention,ort] [--runtimes torch,onnx-ref,ort-cpu]
                                      [--dtype fp32] [--examples] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

MODULES = ("llama", "mistral", "qwen2", "gpt2_block", "gpt2_eager_block", "gpt2_model", "bert_layer", "bert_model",
           "bert_model_eager", "t5_attention", "whisper_attention", "vit_block", "torch_decoder_layer")
# The examples' modules, and the cache each keeps ({input: output}, as for export --module --cache).
EXAMPLES = {"causal_self_attention": None, "cross_attention": None, "encoder_layer": None, "rotary_attention": None,
            "handwritten_attention": None,
            "kv_cache_module": {"past_key": "present_key", "past_value": "present_value"}}


def main() -> None:
    from attnexport import export as E
    from attnexport import modules as M
    from attnexport.verify import verify_module
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavors", default="primitives,attention,ort")
    parser.add_argument("--runtimes", default="torch,onnx-ref,ort-cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--examples", action="store_true", help="also the examples' modules (examples/*.py:example)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    specs = [(f"examples/transformers_modules.py:{n}", None) for n in MODULES]
    if args.examples:
        specs += [(f"examples/{n}.py:example", cache) for n, cache in EXAMPLES.items()]
    rows = []
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for spec, cache in specs:
            name = spec.split(":")[-1] if "transformers_modules" in spec else Path(spec.split(":")[0]).stem
            try:
                module, example = M.load(spec)
            except Exception as e:  # noqa: BLE001 - timm without a torchvision for this torch
                print(f"{name:22} cannot be built here: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            for flavor in args.flavors.split(","):
                path = Path(tmp) / f"{name}-{flavor}.onnx"
                try:
                    result = E.export_module(module, example, flavor=flavor, dtype=args.dtype, output=path, name=spec,
                                             cache=cache)
                    report = verify_module(path, spec, args.runtimes.split(","))
                except Exception as e:  # noqa: BLE001 - said in the table, counted as a failure
                    failed += 1
                    print(f"{name:22} {flavor:10} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    rows.append({"module": name, "flavor": flavor, "dtype": args.dtype, "error": str(e)[:500]})
                    continue
                compared = [c for r in report.rows for c in r.comparisons]
                worst = max((c.max_abs for c in compared), default=float("nan"))
                bad = [r.describe() for r in report.rows if not r.passed and not r.skipped]
                failed += bool(bad)
                kinds = Counter(f.kind for f in result.recognized if f.kind)
                row = {"module": name, "flavor": flavor, "dtype": args.dtype, "attention_op": result.attention_op,
                       "routed": result.routed, "hand_written": kinds.get("hand-written", 0),
                       "runtimes": sorted({r.runtime for r in report.rows if not r.skipped}),
                       "runs": len(report.rows), "passed": sum(r.passed for r in report.rows),
                       "worst_abs_error": worst if worst == worst else None, "failures": bad[:5]}
                rows.append(row)
                print(f"{name:22} {flavor:10} {row['attention_op']:34} routed {row['routed']} "
                      f"(by hand {row['hand_written']})  verify {row['passed']}/{row['runs']}  worst {worst:.2e}")
                for b in bad[:3]:
                    print(f"    {b}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
