"""A text encoder-decoder's clients generating from its deployment folder, as their users run them:
Optimum's ORTModelForSeq2SeqLM (transformers' generation over the folder's graphs) and
transformers.js' text2text-generation pipeline (Node); each text alone, greedy, the folder's
tokenizer and generation config."""

from __future__ import annotations

import time
from pathlib import Path

from attnexport.errors import ProviderUnavailableError
from attnexport.pretrained import clients as CL
from attnexport.pretrained.clients import ClientRun
from attnexport.pretrained.encdec import export as ED

# The transformers.js script this family's Node client runs (beside this module).
SCRIPT = Path(__file__).with_name("generate_text.mjs")


def generate(client: str, folder: Path, texts: list[str], new_tokens: int, threads: int | None = None) -> ClientRun:
    """Greedy outputs of `texts` by `client` from a text encoder-decoder's deployment folder, each
    text alone, as its users run it (the folder's tokenizer and generation config): each text's
    tokens after the start token, without the end token."""
    ok, why = CL.status(client)
    if not ok:
        raise ProviderUnavailableError(f"client {client} is not available: {why}")
    if client == "optimum":
        return _optimum(folder, texts, new_tokens, threads)
    answer = CL.node(SCRIPT, {"folder": CL.local(folder), "texts": list(texts), "max_new_tokens": new_tokens,
                              "threads": threads or 0})
    return ClientRun("transformers.js", [], answer["tokens"], float(answer["ms"]))


def _optimum(folder: Path, texts: list[str], new_tokens: int, threads) -> ClientRun:
    generate = optimum_generator(folder, new_tokens, threads)
    started = time.perf_counter()
    tokens = generate(texts)
    return ClientRun("optimum", [], tokens, (time.perf_counter() - started) * 1e3)


def optimum_generator(folder: Path, new_tokens: int, threads):
    """Optimum's ORTModelForSeq2SeqLM over `folder` (its graphs in onnx/, its merged decoder) with
    the folder's tokenizer, as a function of texts -> each one's greedy tokens (alone, after the start
    token, without the end token)."""
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM
    from transformers import AutoTokenizer

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    model = ORTModelForSeq2SeqLM.from_pretrained(CL.local(folder), subfolder=ED.GRAPH_DIR, use_cache=True,
                                                 use_merged=True, provider="CPUExecutionProvider",
                                                 session_options=options)
    tok = AutoTokenizer.from_pretrained(CL.local(folder))
    start, end = model.generation_config.decoder_start_token_id, model.generation_config.eos_token_id

    def generate(texts):
        out = []
        for text in texts:
            with torch.no_grad():
                ids = model.generate(**tok(text, return_tensors="pt"), max_new_tokens=new_tokens, do_sample=False,
                                     num_beams=1)
            out.append(said(ids[0].tolist(), [start], end))
        return out
    return generate


def said(ids: list, start: list[int], end) -> list[int]:
    """A generated row's tokens: after the start tokens, up to the end token (without it); the
    padding after an ended row left out."""
    end = end[0] if isinstance(end, list) else end
    row = [int(t) for t in ids]
    if row[:len(start)] == list(start):
        row = row[len(start):]
    return row[:row.index(end)] if end in row else row

