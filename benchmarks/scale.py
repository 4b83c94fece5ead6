"""Export at scale: random Llama folders of the sizes people ship, and attnexport's export and verify
timed beside onnxruntime-genai's builder on the same folder, each under /usr/bin/time -v (wall time,
peak resident memory), one after the other.

    python benchmarks/scale.py make 135m /tmp/llama-135m               # SmolLM2-135M's shape
    python benchmarks/scale.py make 1b /tmp/llama-1b                    # Llama-3.2-1B's layers
    python benchmarks/scale.py make 3b /tmp/llama-3b --dtype bfloat16   # Llama-3.2-3B's shape
    python benchmarks/scale.py run /tmp/llama-135m --out results.json [--precision int4] [--no-builder] [--rounds 4]

Each row gives the command's wall time and peak resident memory (its `x the fp32 weights` counts the
folder's parameters in float32, whatever its type), and for attnexport's commands the peak of the
process's own memory (`peak_own_bytes`: not counting the pages of the files it maps, which the kernel
can drop and read again) from their --json.

Every folder has tied embeddings and the vocabulary of 49152 (SmolLM2's), weights drawn with torch
seeded 0 at transformers' initialisation (normal, std 0.02), written as one model.safetensors;
`--tokenizer DIR` copies a tokenizer's files in (the builder needs one: SmolLM2's, saved from its
GGUF file with transformers' AutoTokenizer, fits the vocabulary).
The builder is onnxruntime-genai's (`pip install --no-deps onnxruntime-genai onnx_ir`):
`python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32|int4 -e cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # hidden, layers, heads, kv heads, ffn
    "135m": (576, 30, 9, 3, 1536),
    "360m": (960, 32, 15, 5, 2560),
    "1b": (2048, 16, 32, 8, 8192),
    "3b": (3072, 28, 24, 8, 8192),
}
VOCAB = 49152


def make(shape: str, folder: Path, dtype: str = "float32", seed: int = 0, tokenizer: Path | None = None) -> None:
    """A random Llama folder of `shape`: config.json and model.safetensors (in `dtype`)."""
    import torch
    import transformers as T
    from safetensors.torch import save_file

    hidden, layers, heads, kv, ffn = SHAPES[shape]
    config = T.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv, intermediate_size=ffn, vocab_size=VOCAB,
                           tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["LlamaForCausalLM"],
                           torch_dtype=dtype)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the embedding's
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.empty(p.shape).normal_(0, 0.02, generator=g)
        tensors[name] = t.to(getattr(torch, dtype)).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in sorted(tokenizer.iterdir()) if tokenizer is not None else ():
        shutil.copyfile(f, folder / f.name)
    n = sum(t.numel() for t in tensors.values())
    print(f"{folder}: {shape} Llama, {n / 1e6:.0f}M parameters, {dtype}")


def timed(command: list[str], log: Path) -> dict:
    """`command` under /usr/bin/time -v: its exit code, wall seconds and peak resident memory (bytes)."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.call(["/usr/bin/time", "-v", *command], stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    text = log.read_text()
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    row = {"command": " ".join(command), "rc": rc, "seconds": round(wall, 1),
           "peak_bytes": int(peak.group(1)) * 1024 if peak else None, "tail": text.splitlines()[-40:-23]}
    if "{" in text:  # attnexport's --json: its phases, and the peak of its own memory (not files' pages)
        try:
            doc, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
            row["resources"] = doc.get("resources")
        except ValueError:
            pass
    return row


def run(folder: Path, out: Path, precision: str, builder: bool, verify: bool, rounds: int = 1) -> None:
    """Each command under /usr/bin/time -v, `rounds` times: attnexport's export (and verify) and the
    builder, the order turned every round (attnexport first in round 1, the builder in round 2, ...),
    each one's files removed once it is timed, so that neither always runs where the other has just
    let go of gigabytes of page cache (on this virtual machine the second of two runs in a row was
    often much faster, whichever it was)."""
    rows = []
    for k in range(rounds):
        commands = [lambda work: _attnexport(folder, work, precision, verify)]
        if builder:
            commands.append(lambda work: _builder(folder, work, precision))
        for command in commands if k % 2 == 0 else commands[::-1]:
            work = Path(tempfile.mkdtemp(prefix="scale-"))
            try:
                rows.extend({**row, "round": k + 1} for row in command(work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    from attnexport.pretrained.model import parameter_count
    weights = 4 * parameter_count(folder)  # in float32, whatever the folder's type
    for r in rows:
        if r["peak_bytes"]:
            r["peak_over_weights"] = round(r["peak_bytes"] / weights, 2)
        own = (r.get("resources") or {}).get("peak_own_bytes")
        if own:
            r["peak_own_over_weights"] = round(own / weights, 2)
        print(f"{r['engine']}: rc {r['rc']}, {r['seconds']} s, peak {r['peak_bytes'] / 2**30:.2f} GiB "
              f"({r.get('peak_over_weights')}x the fp32 weights"
              + (f"; its own {own / 2**30:.2f} GiB, {r['peak_own_over_weights']}x" if own else "") + ")"
              if r["peak_bytes"] else f"{r['engine']}: rc {r['rc']}")
    if rounds > 1:
        for engine in dict.fromkeys(r["engine"] for r in rows):
            times = sorted(r["seconds"] for r in rows if r["engine"] == engine and r["rc"] == 0)
            if times:
                median = round(statistics.median(times), 1)
                print(f"{engine}: median {median} s of {len(times)} ({times[0]}-{times[-1]} s)")
    record = {"folder": str(folder), "weights_bytes": weights,
              "file_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")), "precision": precision,
              "cpus": os.cpu_count(), "rows": rows}
    out.write_text(json.dumps(record, indent=2) + "\n")


def _attnexport(folder: Path, work: Path, precision: str, verify: bool) -> list:
    model = work / "attnexport" / "model.onnx"
    model.parent.mkdir()
    rows = [{"engine": "attnexport export", **timed(
        [sys.executable, "-m", "attnexport", "export", "--hf", str(folder), "--kv-cache", "--precision", precision,
         "-o", str(model), "--json"], work / "attnexport.log")}]
    if verify and rows[-1]["rc"] == 0:
        rows.append({"engine": "attnexport verify", **timed(
            [sys.executable, "-m", "attnexport", "verify", str(model), "--hf", str(folder), "--runtimes", "ort-cpu",
             "--json"], work / "verify.log")})
    return rows


def _builder(folder: Path, work: Path, precision: str) -> list:
    return [{"engine": "onnxruntime-genai builder", **timed(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(work / "genai"),
         "-p", precision, "-e", "cpu"], work / "genai.log")}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("shape", choices=sorted(SHAPES))
    m.add_argument("folder", type=Path)
    m.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    m.add_argument("--tokenizer", type=Path, default=None)
    r = sub.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--precision", default="fp32", choices=("fp32", "int4"))
    r.add_argument("--no-builder", action="store_true")
    r.add_argument("--verify", action="store_true")
    r.add_argument("--rounds", type=int, default=1,
                   help="run each command this many times, the order turned every round")
    a = parser.parse_args()
    if a.command == "make":
        make(a.shape, a.folder, a.dtype, tokenizer=a.tokenizer)
    else:
        run(a.folder, a.out, a.precision, not a.no_builder, a.verify, a.rounds)


if __name__ == "__main__":
    main()
