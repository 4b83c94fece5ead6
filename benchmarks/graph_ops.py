"""The op counts of ONNX models as ONNX Runtime runs them: each session's optimized graph (with
the provider's own fusions), written to a temporary file and counted by op type, beside where each
node was placed. On a GPU a decode step of a small model is launch-bound, so the node count of the
optimized graph is most of what a step costs.

    python benchmarks/graph_ops.py --provider cuda --json OUT LABEL=MODEL.onnx...
"""

import argparse
import collections
import json
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

PROVIDERS = {"cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"], "cpu": ["CPUExecutionProvider"]}


def count(path: str, provider: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3
        session = ort.InferenceSession(path, options, providers=PROVIDERS[provider])
        if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise SystemExit(f"{path}: the CUDA provider did not load: {session.get_providers()}")
        model = onnx.load(options.optimized_model_filepath, load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    return {"nodes": len(model.graph.node), "ops": dict(ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="LABEL=MODEL.onnx")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    out = {}
    for spec in args.models:
        label, _, path = spec.partition("=")
        if not Path(path).is_file():
            print(f"{label}: {path} is not there")
            continue
        out[label] = count(path, args.provider)
        top = ", ".join(f"{op} {n}" for op, n in list(out[label]["ops"].items())[:8])
        print(f"{label}: {out[label]['nodes']} nodes ({top})")
    if args.json:
        Path(args.json).write_text(json.dumps({"provider": args.provider, "onnxruntime": ort.__version__,
                                               "models": out}, indent=1))


if __name__ == "__main__":
    main()
