"""The clients that load a deployment folder (`export --hf --deploy`), each with its own tokenizer,
loader and loop: which are installed here (Python's Optimum and sentence-transformers; transformers.js
in Node, one of attnexport's pinned npm packages, installed on first use), how a family's verify
selects them (a client that cannot run here is a broken setup, exit 2), and what runs one of
transformers.js' scripts. What each client does with a family's folder is in that family's package
(its `clients` module); a family names its clients (`registry.Family.clients`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attnexport.errors import ProviderUnavailableError, UsageError, reason
from attnexport.pretrained import registry
from attnexport.runtimes import js

SECONDS = 1800  # a client that takes longer has hung


@dataclass
class ClientRun:
    """A client's greedy generation, prompt by prompt (batch 1: no padding for a client to handle its
    own way): how it encoded each prompt and the new tokens, and how long it took in all."""

    client: str
    prompt_ids: list
    tokens: list
    ms: float


def known() -> tuple[str, ...]:
    """Every family's clients."""
    return tuple(dict.fromkeys(c for f in registry.families().values() for c in f.clients))


def parse(text: str | None) -> list[str]:
    """`--clients a,b` -> the clients' names (`all`: ["all"], the model family's own, which verify
    knows once it has read the model); an unknown one is a UsageError naming them."""
    if not text:
        return []
    if text.strip() == "all":
        return ["all"]
    names = [t.strip() for t in text.split(",") if t.strip()]
    every = known()
    unknown = [n for n in names if n not in every]
    if unknown:
        raise UsageError(f"--clients: unknown {', '.join(unknown)} (the clients: {', '.join(every)}, or all)")
    return names


def of_family(names, family) -> list[str]:
    """`parse`'s names for a model of `family` (`all`: its clients); a client that does not load its
    models is a UsageError."""
    wanted = list(family.clients) if list(names) == ["all"] else list(names)
    foreign = [n for n in wanted if n not in family.clients]
    if foreign:
        raise UsageError(f"--clients {', '.join(foreign)}: a {family.what}'s clients are {', '.join(family.clients)}")
    return wanted


def select(names, skip_unavailable: bool = False) -> list[dict]:
    """Each client of `names` with its status ({name, available, reason, used}), as verify reports
    its runtimes: one that cannot run here is a ProviderUnavailableError (exit 2, a broken setup, not
    a mismatch) unless `skip_unavailable`, when its row is skipped with the reason."""
    table = []
    for name in names:
        ok, why = status(name)
        if not ok and not skip_unavailable:
            raise ProviderUnavailableError(f"client {name} is not available: {why} (use --skip-unavailable to skip it)")
        table.append({"name": name, "available": ok, "reason": why, "used": ok})
    return table


def skipped(client: str) -> str:
    """Why a client's row is skipped ("" when the client is available)."""
    ok, why = status(client)
    return "" if ok else f"{client} is not available: {why}"


def status(client: str) -> tuple[bool, str]:
    """(available, what it is or why not)."""
    from importlib.metadata import version
    if client == "optimum":
        try:
            import optimum.onnxruntime  # noqa: F401
            return True, f"Optimum's ORTModel classes (optimum-onnx {version('optimum-onnx')})"
        except ImportError as e:
            return False, f"optimum-onnx is not installed (pip install optimum-onnx): {reason(e)}"
    if client == "sentence-transformers":
        try:
            import optimum.onnxruntime  # noqa: F401
            import sentence_transformers  # noqa: F401
            return True, f"sentence-transformers {version('sentence-transformers')} (backend onnx)"
        except ImportError as e:
            return False, ("sentence-transformers' ONNX backend is not installed (pip install "
                           f"'sentence-transformers<6' optimum-onnx): {reason(e)}")
    node, why = js.find_node()
    if node is None:
        return False, why
    ok, missing = js.packages()  # installed on first use, as the runtimes' are
    if not ok:
        return False, missing
    return True, f"transformers.js (@huggingface/transformers {js.pins()['@huggingface/transformers']}), Node {why}"


def local(folder) -> str:
    """A deployment folder as the clients are given it: its absolute path. A relative one that reads
    as a model id ("whisper-onnx") is looked up by transformers' loaders as one first, and Optimum then
    takes its files from the subfolder alone (measured: the Whisper folder's generation config missed,
    so Optimum generated without the model's suppression and <|notimestamps|>)."""
    return str(Path(folder).resolve())


def node(script: Path, request: dict) -> dict:
    """The answer of a family's transformers.js script (`script`, a file of its package, run by Node
    with the pinned npm packages) to `request`."""
    binary, _ = js.find_node()
    js.install()  # the pinned npm packages, once (nothing to do when they are there)
    with tempfile.TemporaryDirectory(prefix="attnexport-client-") as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        env = {**os.environ, "ATTNEXPORT_JS_HOME": str(js.home())}
        try:
            done = subprocess.run([str(binary), str(script), str(path)], capture_output=True,
                                  text=True, env=env, timeout=SECONDS)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"transformers.js took more than {SECONDS} s") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    answer: dict = json.loads(lines[-1]) if lines else \
        {"error": (done.stderr.strip().splitlines() or ["no answer"])[-1]}
    if "error" in answer:
        raise RuntimeError(f"transformers.js: {answer['error'][:300]}")
    return answer
