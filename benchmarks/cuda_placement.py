"""Where ONNX Runtime's CUDA provider puts each node of every golden case's export, per flavour.

Run on a GPU machine from the project root:  python3 benchmarks/cuda_placement.py [--json FILE]
For each export: nodes on the CUDA provider, nodes on the CPU that are shape arithmetic
(runtimes.shape_computations: kept there by ONNX Runtime on purpose) and nodes on the CPU
that are a fallback (what `verify --strict-placement` fails).
"""

import argparse
import json

from attnexport import export as E
from attnexport import golden
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.errors import UnsupportedByFlavor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for case in golden.load_all():
        v = V.get(case.variant)
        for flavor in E.FLAVORS:
            gf = E.graph_flavor(v, flavor)
            if gf != flavor:
                continue
            try:
                model = E.build_model(case.variant, case.options, gf, params=case.params)[0]
            except UnsupportedByFlavor:
                continue
            _, placement, shapes = R.ort_session("ort-cuda", model)
            cpu = placement.get("CPUExecutionProvider", [])
            fallback = R.cpu_nodes("ort-cuda", placement, shapes)
            rows.append({"case": case.name, "flavor": flavor,
                         "cuda": len(placement.get("CUDAExecutionProvider", [])), "cpu": len(cpu),
                         "cpu_shape_arithmetic": len(cpu) - len(fallback), "cpu_fallback": fallback})
    print("| case | flavor | on CUDA | on CPU | of which shape arithmetic | fallback |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['flavor']} | {r['cuda']} | {r['cpu']} | {r['cpu_shape_arithmetic']} | "
              f"{', '.join(r['cpu_fallback']) or '-'} |")
    bad = [r for r in rows if r["cpu_fallback"]]
    print(f"\n{len(rows)} exports, {len(bad)} with a CPU fallback "
          f"({sorted({r['flavor'] for r in bad}) or 'none'})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
