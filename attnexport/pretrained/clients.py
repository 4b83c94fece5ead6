"""The clients that load a deployment folder (`export --hf --deploy`), each generating greedily from it
with its own tokenizer, loader and loop: Optimum's ORTModelForCausalLM (Python, `optimum-onnx`) and
transformers.js (`@huggingface/transformers` in Node, one of attnexport's pinned npm packages). What
`verify FOLDER --hf PATH --clients ...` compares with transformers' `generate`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from attnexport.errors import ProviderUnavailableError, UsageError, reason
from attnexport.runtimes import js

CLIENTS = ("optimum", "transformers.js")
SECONDS = 1800  # a client that takes longer has hung


@dataclass
class ClientRun:
    """A client's greedy generation, prompt by prompt (batch 1: no padding for a client to handle its
    own way): how it encoded each prompt and the new tokens, and how long it took in all."""

    client: str
    prompt_ids: list
    tokens: list
    ms: float


def parse(text: str | None) -> list[str]:
    """`--clients a,b` (or `all`) -> the clients' names; an unknown one is a UsageError naming them."""
    if not text:
        return []
    names = list(CLIENTS) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        raise UsageError(f"--clients: unknown {', '.join(unknown)} (the clients: {', '.join(CLIENTS)}, or all)")
    return names


def status(client: str) -> tuple[bool, str]:
    """(available, what it is or why not)."""
    if client == "optimum":
        try:
            from importlib.metadata import version

            import optimum.onnxruntime  # noqa: F401
            return True, f"Optimum's ORTModelForCausalLM (optimum-onnx {version('optimum-onnx')})"
        except ImportError as e:
            return False, f"optimum-onnx is not installed (pip install optimum-onnx): {reason(e)}"
    node, why = js.find_node()
    if node is None:
        return False, why
    if not js.installed():
        return False, f"the npm packages are not installed in {js.home()}: run `attnexport runtimes --install`"
    return True, f"transformers.js (@huggingface/transformers {js.pins()['@huggingface/transformers']}), Node {why}"


def generate(client: str, folder: Path, prompts: list, new_tokens: int, threads: int | None = None) -> ClientRun:
    """Greedy generation of `new_tokens` tokens after each prompt (texts, encoded by the client's
    tokenizer from the folder, or token id lists) by `client` from `folder`; no end-of-sequence stop."""
    ok, why = status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    if client == "optimum":
        return _optimum(folder, prompts, new_tokens, threads)
    return _transformers_js(folder, prompts, new_tokens, threads)


def _optimum(folder: Path, prompts: list, new_tokens: int, threads: int | None) -> ClientRun:
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoTokenizer

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    use_cache = bool(json.loads((Path(folder) / "config.json").read_text()).get("use_cache", True))
    model = ORTModelForCausalLM.from_pretrained(str(folder), subfolder="onnx", file_name="model.onnx",
                                                provider="CPUExecutionProvider", session_options=options,
                                                use_cache=use_cache)
    texts = all(isinstance(p, str) for p in prompts)
    tokenizer = AutoTokenizer.from_pretrained(str(folder)) if texts else None
    started = time.perf_counter()
    encoded, tokens = greedy_each(model, tokenizer, prompts, new_tokens)
    return ClientRun("optimum", encoded, tokens, (time.perf_counter() - started) * 1e3)


def greedy_each(model, tokenizer, prompts: list, new_tokens: int) -> tuple[list, list]:
    """(each prompt's ids, the `new_tokens` tokens `model.generate` gives after it), one prompt at a
    time with no end-of-sequence stop: the loop of the Optimum client, whose model generates with
    transformers' own `generate` (so transformers' model runs it the same way, without Optimum).
    `tokenizer` encodes text prompts; without one the prompts are token ids."""
    import torch
    from transformers import GenerationConfig

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=pad)
    encoded, tokens = [], []
    for p in prompts:
        ids = tokenizer(p)["input_ids"] if tokenizer is not None else [int(t) for t in p]
        encoded.append(list(ids))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), generation_config=config,
                                 attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
        tokens.append(out[0, len(ids):].tolist())
    return encoded, tokens


def _transformers_js(folder: Path, prompts: list, new_tokens: int, threads: int | None) -> ClientRun:
    node, _ = js.find_node()
    texts = all(isinstance(p, str) for p in prompts)
    request = {"folder": str(Path(folder).resolve()), "prompts": list(prompts) if texts else None,
               "ids": None if texts else [[int(t) for t in p] for p in prompts], "new_tokens": new_tokens,
               "threads": threads or 0}
    with tempfile.TemporaryDirectory(prefix="attnexport-client-") as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        env = {**os.environ, "ATTNEXPORT_JS_HOME": str(js.home())}
        try:
            done = subprocess.run([str(node), str(js.PACKAGE / "generate.mjs"), str(path)], capture_output=True,
                                  text=True, env=env, timeout=SECONDS)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"transformers.js took more than {SECONDS} s") from None
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    answer: dict = json.loads(lines[-1]) if lines else \
        {"error": (done.stderr.strip().splitlines() or ["no answer"])[-1]}
    if "error" in answer:
        raise RuntimeError(f"transformers.js: {answer['error'][:300]}")
    return ClientRun("transformers.js", answer["prompt_ids"], answer["tokens"], float(answer["ms"]))
