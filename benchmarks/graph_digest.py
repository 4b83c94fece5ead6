"""A digest of the graphs `export --hf` makes, to show that a change to the code changed none:
the small random models of examples/tiny_lms.py (Llama and GPT-2) in every cache form and
flavour, and Llama's concat form in fp16, int8 and int4 (and its static form in int4); the
sentence encoders of examples/tiny_encoders.py (BERT and RoBERTa in every flavour, BERT in fp16
and int8); Whisper's deployment folder of examples/tiny_whisper.py (concat in two flavours, static,
fp16 and int8: each of its graphs); and the vision transformers of examples/tiny_vision.py (ViT and
DINOv2, fp32 and int8). Each is exported by `python -m attnexport` and reduced to a hash of its
nodes (op, domain, inputs, outputs, attributes), a hash of its initializers, its inputs' and
outputs' names and its metadata (the version left out). Run it against two checkouts and compare
the files (a graph only the second has, a family the first did not know, is listed, not failed):

    PYTHONPATH=/path/to/new python benchmarks/graph_digest.py new.json --models MODELS
    PYTHONPATH=/path/to/old python benchmarks/graph_digest.py old.json --models MODELS
    python benchmarks/graph_digest.py --compare old.json new.json

Each export runs in its own process in a temporary folder (the export memo off). `--models DIR`
keeps the small models there (made by the first run that finds them missing, read by the next): an
older checkout may not hold the code the makers import.
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
    out += [("llama", "static", "ort", "int4")]
    out += [(arch, "embed", flavor, "fp32") for arch in ("bert", "roberta") for flavor in FLAVORS]
    out += [("bert", "embed", "ort", p) for p in ("fp16", "int8")]
    out += [("whisper", "concat", flavor, "fp32") for flavor in ("attention", "ort")]
    out += [("whisper", "static", "attention", "fp32"), ("whisper", "concat", "attention", "fp16"),
            ("whisper", "concat", "attention", "int8")]
    return out + [(arch, "image", "attention", p) for arch in ("vit", "dinov2") for p in ("fp32", "int8")]


# Where each architecture's small model comes from: (examples/ module, how its `save` is called).
MAKERS = {"llama": "tiny_lms", "gpt2": "tiny_lms", "bert": "tiny_encoders", "roberta": "tiny_encoders",
          "whisper": "tiny_whisper", "vit": "tiny_vision", "dinov2": "tiny_vision"}
# The cache forms' options (a Whisper export's static form says its buffers' positions).
OPTIONS = {**FORMS, "embed": [], "image": [], "whisper-static": ["--kv-cache", "static", "--max-seq", "32"]}


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def make(out: Path, models: Path | None = None) -> None:
    result = {}
    with tempfile.TemporaryDirectory(prefix="attnexport-digest-") as tmp:
        env = {**os.environ, "ATTNEXPORT_CACHE": str(Path(tmp) / "memo")}
        where = models or Path(tmp)
        for arch, maker in MAKERS.items():
            if (where / arch).exists():
                continue
            module = _example(maker)
            if maker == "tiny_whisper":
                module.save(where / arch)
            else:
                module.save(arch, where / arch)
        for arch, form, flavor, precision in jobs():
            name = f"{arch}-{form}-{flavor}-{precision}"
            path = Path(tmp) / (name if arch == "whisper" else f"{name}.onnx")
            options = OPTIONS[f"{arch}-{form}" if f"{arch}-{form}" in OPTIONS else form]
            args = [sys.executable, "-m", "attnexport", "export", "--hf", str(where / arch), *options,
                    "--flavor", flavor, *(["--deploy"] if arch == "whisper" else ["-o"]), str(path)]
            args += ["--precision", precision] if precision != "fp32" else []
            done = subprocess.run(args, capture_output=True, text=True, cwd=tmp, env=env)
            if done.returncode != 0:
                result[name] = {"failed": (done.stderr or done.stdout)[-300:]}
            elif arch == "whisper":  # a folder: each of its graphs
                result.update({f"{name}/{f.stem}": digest(f) for f in sorted((path / "onnx").glob("*.onnx"))})
            else:
                result[name] = digest(path)
            print(name, "ok" if done.returncode == 0 else "FAILED", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


def compare(old: Path, new: Path) -> int:
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    differ = [f"{name}: {', '.join(k for k in a[name] if a[name].get(k) != b.get(name, {}).get(k))}"
              for name in sorted(a) if a[name] != b.get(name)]
    failed = [name for name in sorted(a) if "failed" in a[name]]
    print("\n".join(differ) or f"{len(a)} graphs: the same nodes, initializers, inputs, outputs and metadata")
    if failed:
        print(f"failed in the first: {', '.join(failed)}")
    added = sorted(set(b) - set(a))
    if added:
        print(f"only in the second: {', '.join(added)}")
    return 1 if differ or failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="the digest to write, or with --compare the two to compare")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--models", type=Path, help="the folder the small models are kept in (made where missing)")
    ns = parser.parse_args()
    sys.exit(compare(*ns.files) if ns.compare else make(ns.files[0], ns.models))
