"""A causal language model's clients generating from its deployment folder, greedy, as their
users run them: Optimum's ORTModelForCausalLM (its `generate`) and transformers.js (its own
`generate` in Node); each prompt encoded by the client's tokenizer (a conversation by its chat
template) or given as token ids."""

from __future__ import annotations

import json
import time
from pathlib import Path

from attnexport.errors import ProviderUnavailableError
from attnexport.pretrained import clients as CL
from attnexport.pretrained.clients import ClientRun

# The transformers.js script this family's Node client runs (beside this module).
SCRIPT = Path(__file__).with_name("generate.mjs")


def generate(client: str, folder: Path, prompts: list, new_tokens: int, threads: int | None = None) -> ClientRun:
    """Greedy generation of `new_tokens` tokens after each prompt (texts, encoded by the client's
    tokenizer from the folder; conversations, encoded by its chat template; or token id lists) by
    `client` from `folder`; no end-of-sequence stop."""
    ok, why = CL.status(client)
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
    model = ORTModelForCausalLM.from_pretrained(CL.local(folder), subfolder="onnx", file_name="model.onnx",
                                                provider="CPUExecutionProvider", session_options=options,
                                                use_cache=use_cache)
    texts = all(isinstance(p, str) or _is_chat(p) for p in prompts)
    tokenizer = AutoTokenizer.from_pretrained(CL.local(folder)) if texts else None
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
        if _is_chat(p):  # as its users encode a conversation: the chat template, with the generation prompt
            ids = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]  # transformers 5 gives an encoding
        else:
            ids = tokenizer(p)["input_ids"] if tokenizer is not None else [int(t) for t in p]
        encoded.append(list(ids))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), generation_config=config,
                                 attention_mask=torch.ones((1, len(ids)), dtype=torch.long))
        tokens.append(out[0, len(ids):].tolist())
    return encoded, tokens


def _transformers_js(folder: Path, prompts: list, new_tokens: int, threads: int | None) -> ClientRun:
    texts = all(isinstance(p, str) for p in prompts)
    chats = all(_is_chat(p) for p in prompts)
    request = {"folder": CL.local(folder), "prompts": list(prompts) if texts else None,
               "chats": list(prompts) if chats else None,
               "ids": None if texts or chats else [[int(t) for t in p] for p in prompts], "new_tokens": new_tokens,
               "threads": threads or 0}
    answer = CL.node(SCRIPT, request)
    return ClientRun("transformers.js", answer["prompt_ids"], answer["tokens"], float(answer["ms"]))


def _is_chat(prompt) -> bool:
    """Whether a prompt is a conversation ([{role, content}, ...]), encoded with the chat template."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
