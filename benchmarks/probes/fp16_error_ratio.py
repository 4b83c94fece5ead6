"""How close each fp16 run comes to its derived tolerance: error / fp16-emulated reference error.

Reads the JSON of `attnexport verify --dtype fp16 --json` and, for every compared output whose
tolerance was derived (basis "fp16-emulated reference error E x 4"), divides the run's max abs
error by E. The README's statement about the factor 4 quotes what this prints.

    attnexport verify --dtype fp16 --runtimes torch,ort-cpu --json > benchmarks/results/2026-11-23-cpu/verify-fp16.json
    python benchmarks/probes/fp16_error_ratio.py benchmarks/results/2026-11-23-cpu/verify-fp16.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys


def ratios(doc: dict) -> dict[str, list[float]]:
    """{runtime: [max abs error / emulated error]} over every derived-tolerance output."""
    out: dict[str, list[float]] = {}
    for row in doc["results"]:
        m = re.match(r"fp16-emulated reference error ([0-9.e+-]+) x ", (row.get("tolerance") or {}).get("basis", ""))
        if not m or float(m.group(1)) == 0:
            continue
        emulated = float(m.group(1))
        for o in row.get("outputs", []):
            if o.get("max_abs") is not None:
                out.setdefault(row["runtime"], []).append(o["max_abs"] / emulated)
    return out


def main(path: str) -> None:
    doc = json.load(open(path))
    s = doc["summary"]
    print(f"{path}: {s['passed']} passed, {s['failed']} failed, {s['not_applicable']} n/a")
    for runtime, values in sorted(ratios(doc).items()):
        values.sort()
        print(f"{runtime}: {len(values)} outputs, error / emulated error: min {values[0]:.2f}, "
              f"median {statistics.median(values):.2f}, p95 {values[int(0.95 * (len(values) - 1))]:.2f}, "
              f"max {values[-1]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
