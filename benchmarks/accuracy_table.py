"""The accuracy table of docs/quantization.md from `verify MODEL --hf SOURCE --json` reports of lossy
exports (one file each): per model and runtime, teacher-forced KL and top-1 against the fp32 model,
the held-out perplexity's growth, the greedy tokens equal to transformers' and where each prompt
departs ("near tie" where the fp32 model's first token leads its second by less than the budget's
margin), the verdict against the budget, and the three layers that cost most alone.

    python benchmarks/accuracy_table.py benchmarks/results/2026-11-26-cpu/smollm2-accuracy-*.json
"""

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    print("| export | runtime | mean KL | top-1 | perplexity | greedy tokens | first departure per prompt | budget |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
    layers = []
    for path in paths:
        report = json.load(open(path))
        name = Path(path).stem.split("accuracy-", 1)[-1]
        for row in report["results"]:
            detail = row.get("detail", {})
            if "accuracy" in detail:
                a = detail["accuracy"]
                firsts = ", ".join("-" if f is None else f"{f} (near tie)" if f == 0 and m < a["margin"] else str(f)
                                   for f, m in zip(a["first_difference"], a["margins"], strict=True))
                verdict = "pass" if row["passed"] else "FAIL: " + "; ".join(a["failures"])
                print(f"| {name} | {row['runtime']} | {a['kl_mean']:.2g} | {a['top1']:.1%} | "
                      f"{a['perplexity_delta']:+.1%} | {a['equal_tokens']}/{a['new_tokens']} | {firsts} | {verdict} |")
            if "layer_costs" in detail:
                top = ", ".join(f"{c['group']} {c['kl_mean']:.2g}" for c in detail["layer_costs"][:3])
                layers.append(f"{name}: {top}")
    if layers:
        print("\nLayers that cost most, each quantized alone (mean KL vs fp32, emulated in torch):")
        for line in layers:
            print(f"- {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
