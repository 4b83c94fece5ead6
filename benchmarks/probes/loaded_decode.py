"""Does ONNX Runtime's spinning pool help a language model's decode, quiet and under a fixed
background load? `bench --hf MODEL --decode` run twice in this process, its engines' sessions
spinning between steps (bench's setting until 2026-12-03) and not, on a quiet machine and under
`bench --load`'s busy processes; the rows of each go to OUT as JSON. docs/language-models.md's
table of decode under load is this script's output:

    python benchmarks/probes/loaded_decode.py MODEL OUT.json --context 1024 --load 0,1 [bench options]

Any further options are bench's (`--flavor ort --kv-cache static`, `--iters`, ...)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from click.testing import CliRunner

from attnexport import cli
from attnexport.pretrained.causal import bench as causal_bench


def main() -> None:
    model, out, *rest = sys.argv[1:]
    loads = ["0", "1"]
    if "--load" in rest:
        k = rest.index("--load")
        loads = rest[k + 1].split(",")
        del rest[k:k + 2]
    runs = []
    for spinning in (True, False):
        causal_bench.SPINNING = spinning
        for load in loads:
            r = CliRunner().invoke(cli.main, ["bench", "--hf", model, "--decode", "--json", "--load", load, *rest])
            if r.exit_code != 0:
                raise SystemExit(r.output)
            doc = json.loads(r.stdout)
            runs.append({"spinning": spinning, "load": int(load), "rows": doc["rows"]})
            for row in doc["rows"]:
                print(spinning, load, row.get("engine"), row.get("form"), row.get("context"),
                      row.get("step_ms") or row.get("median_ms"), flush=True)
    Path(out).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
