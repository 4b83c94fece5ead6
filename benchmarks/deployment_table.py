"""The worst error of every variant x flavour on each deployment runtime, from a verify JSON:

    attnexport verify --runtimes ort-node,ort-wasm,ort-webgpu --json \
        > benchmarks/results/2026-11-24-cpu/deployment-verify.json
    python benchmarks/deployment_table.py benchmarks/results/2026-11-24-cpu/deployment-verify.json

A cell is the largest max-abs error over the variant's golden cases (and their decode checks) in
that flavour, `FAIL n` when n runs failed (their error counted), `n/a` when the flavour cannot
express any of them.
"""

import json
import sys
from collections import defaultdict


def table(doc) -> str:
    runtimes = [r["name"] for r in doc["runtimes"] if r["used"]]
    worst: dict = defaultdict(float)
    failed: dict = defaultdict(int)
    ran: set = set()
    for r in doc["results"]:
        key = (r["variant"], r["flavor"], r["runtime"])
        if r["skipped"]:
            continue
        ran.add(key)
        errors = [o["max_abs"] for o in r["outputs"] if o["max_abs"] is not None]
        if errors:
            worst[key] = max(worst[key], max(errors))
        if not r["passed"]:
            failed[key] += 1
    rows = sorted({(r["variant"], r["flavor"]) for r in doc["results"]})
    lines = ["| variant | flavor | " + " | ".join(runtimes) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in runtimes) + " |"]
    for variant, flavor in rows:
        cells = []
        for rt in runtimes:
            key = (variant, flavor, rt)
            if key not in ran:
                cells.append("n/a")
            elif failed[key]:
                cells.append(f"FAIL {failed[key]} ({worst[key]:.1e})" if worst[key] else f"FAIL {failed[key]}")
            else:
                cells.append(f"{worst[key]:.1e}")
        lines.append(f"| {variant} | {flavor} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
