"""A digest of the graphs `export --hf` makes, to show that a change to the code changed none:
the small random models of examples/tiny_lms.py (Llama and GPT-2) in every cache form and
flavour, and Llama's concat form in fp16, int8 and int4 (and its static form in int4), each
exported by `python -m attnexport` and reduced to a hash of its nodes (op, domain, inputs,
outputs, attributes), a hash of its initializers, its inputs' and outputs' names and its metadata
(the version left out). Run it against two checkouts and compare the files:

    PYTHONPATH=/path/to/old python benchmarks/graph_digest.py old.json
    PYTHONPATH=/path/to/new python benchmarks/graph_digest.py new.json
    python benchmarks/graph_digest.py --compare old.json new.json

Each export runs in its own process in a temporary folder (the export memo off).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
FORMS = {"none": [], "concat": ["--kv-cache"], "static": ["--kv-cache", "static", "--max-seq", "64"]}
FLAVORS = ("attention", "primitives", "ort")


def jobs() -> list[tuple[str, str, str, str]]:
    """(architecture, form, flavour, precision) of every export digested."""
    out = [(arch, form, flavor, "fp32") for arch in ("llama", "gpt2") for form in FORMS for flavor in FLAVORS]
    out += [("llama", "concat", "ort", p) for p in ("fp16", "int8", "int4")]
    return out + [("llama", "static", "ort", "int4")]


def digest(path: Path) -> dict:
    model = onnx.load(path)
    nodes = [(n.op_type, n.domain, list(n.input), list(n.output),
              sorted((a.name, repr(onnx.helper.get_attribute_value(a))[:200]) for a in n.attribute))
             for n in model.graph.node]
    inits = sorted((i.name, hashlib.sha256(i.SerializeToString()).hexdigest()) for i in model.graph.initializer)
    meta = {p.key: p.value for p in model.metadata_props if p.key != "attnexport.version"}
    return {"nodes": hashlib.sha256(json.dumps(nodes).encode()).hexdigest(), "node_count": len(nodes),
            "initializers": hashlib.sha256(json.dumps(inits).encode()).hexdigest(),
            "inputs": [i.name for i in model.graph.input], "outputs": [o.name for o in model.graph.output],
            "metadata": meta}


def make(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("tiny_lms", ROOT / "examples" / "tiny_lms.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    result = {}
    with tempfile.TemporaryDirectory(prefix="attnexport-digest-") as tmp:
        env = {**os.environ, "ATTNEXPORT_CACHE": str(Path(tmp) / "memo")}
        for arch in ("llama", "gpt2"):
            tiny.save(arch, Path(tmp) / arch)
        for arch, form, flavor, precision in jobs():
            name = f"{arch}-{form}-{flavor}-{precision}"
            path = Path(tmp) / f"{name}.onnx"
            args = [sys.executable, "-m", "attnexport", "export", "--hf", str(Path(tmp) / arch), *FORMS[form],
                    "--flavor", flavor, "-o", str(path)] + (["--precision", precision] if precision != "fp32" else [])
            done = subprocess.run(args, capture_output=True, text=True, cwd=tmp, env=env)
            result[name] = digest(path) if done.returncode == 0 else {"failed": (done.stderr or done.stdout)[-300:]}
            print(name, "ok" if done.returncode == 0 else "FAILED", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


def compare(old: Path, new: Path) -> int:
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    differ = [f"{name}: {', '.join(k for k in a[name] if a[name].get(k) != b.get(name, {}).get(k))}"
              for name in sorted(a) if a[name] != b.get(name)]
    print("\n".join(differ) or f"{len(a)} graphs: the same nodes, initializers, inputs, outputs and metadata")
    return 1 if differ or set(a) != set(b) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="the digest to write, or with --compare the two to compare")
    parser.add_argument("--compare", action="store_true")
    ns = parser.parse_args()
    sys.exit(compare(*ns.files) if ns.compare else make(ns.files[0]))
