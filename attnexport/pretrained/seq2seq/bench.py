"""`bench --hf T5_OR_MARIAN`: a text encoder-decoder's greedy generation of the project's texts (each
text alone, as a client serves a request, up to `new_tokens` tokens), per flavour and precision of
attnexport's deployment folder on ONNX Runtime's CPU provider (the loop a client writes over its
encoder and merged decoder: `encdec.graphs.greedy`), beside transformers eager `generate` in the
same run and Optimum's own export run by its ORTModelForSeq2SeqLM where optimum-onnx is installed;
every engine on the same threads, the median of `iters` runs after `warmup` with the 10th and 90th
percentiles (`attnexport.pretrained.bench`'s Row and ratios).

Beside each time is its accuracy: each text's tokens against transformers' fp32 greedy ones (the
share at their places and the word error rate, `encdec.cost.agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport import runtimes as R
from attnexport.bench import stats_of
from attnexport.errors import UsageError, reason
from attnexport.pretrained import bench as B
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import model as hf
from attnexport.pretrained.encdec import cost as COST
from attnexport.pretrained.encdec import export as ED
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.seq2seq import check as SC
from attnexport.pretrained.seq2seq import clients as CL
from attnexport.pretrained.seq2seq import texts as T

UNIT = "texts"
NEW_TOKENS = 32


@dataclass(frozen=True)
class TextBenchRequest:
    """What `bench --hf T5_OR_MARIAN` measures: the model, attnexport's flavours and precisions, the
    tokens each text may generate, and how long."""

    source: str | Path
    flavors: tuple = ("attention",)
    precisions: tuple = ("fp32", "int8")
    new_tokens: int = NEW_TOKENS
    threads: int = 0  # 0: every core
    iters: int = 10
    warmup: int = 2
    seed: int | None = None  # a config-only folder's weights (None: such a folder is refused)
    anchors: bool = True


def _folder_engine(folder: Path, m: T.TextModel, threads: int, new_tokens: int):
    """attnexport's deployment folder as a client runs it: its two graphs on ONNX Runtime's CPU
    provider, the greedy loop over them; each text alone."""
    files = {g: folder / ED.GRAPH_DIR / f"{g}.onnx" for g in (G.ENCODER, G.MERGED)}
    sessions = {g: R.ort_session("ort-cpu", f, threads=threads)[0] for g, f in files.items()}

    def run_of(session):
        names = [o.name for o in session.get_outputs()]
        return lambda feed: dict(zip(names, session.run(names, feed), strict=True))
    first, later = G.merged_steps(run_of(sessions[G.MERGED]), m.spec)
    encoder = run_of(sessions[G.ENCODER])

    def generate(texts):
        return [G.greedy(encoder, first, later, T.encoded(m.tok, [t]), m.tokens, m.layers, new_tokens)[0]
                for t in texts]
    return generate


def bench_texts(request: TextBenchRequest, said=lambda text: None) -> tuple[list[B.Row], dict]:
    """Every engine generating the project's texts; returns (rows, what the run measured besides)."""
    import torch

    r = request if request.threads else dataclasses.replace(request, threads=os.cpu_count() or 1)
    if r.new_tokens < 1:
        raise UsageError("--new-tokens is >= 1")
    model, _ = hf.load(r.source, r.seed)
    m = T.TextModel.of(model, r.source)
    torch.set_num_threads(r.threads)
    texts = list(T.TEXTS)
    want = SC.reference_outputs(m, T.encoded(m.tok, texts), r.new_tokens)
    info: dict = {"skipped": {}, "threads": r.threads, "layers": m.layers, "texts": len(texts),
                  "new_tokens": r.new_tokens, "parameters": int(sum(p.numel() for p in model.parameters())),
                  "transformers_tokens": want}
    engines: list[tuple[str, str, str, Callable[[list[str]], list[list[int]]]]] = []

    def eager(batch):
        out = []
        for text in batch:
            enc = m.tok(text, return_tensors="pt")
            with torch.no_grad(), hf.quiet_transformers():
                ids = model.generate(**enc, max_new_tokens=r.new_tokens, do_sample=False, num_beams=1)
            out.append(CL.said(ids[0].tolist(), m.start, m.end))
        return out
    engines.append(("transformers", "-", "fp32", eager))
    rows: list[B.Row] = []
    with tempfile.TemporaryDirectory(prefix="attnexport-text-bench-") as tmp:
        for precision in r.precisions:
            for flavor in r.flavors:
                said(f"exporting attnexport {flavor} {precision}")
                folder = Path(tmp) / f"{flavor}-{precision}"
                try:
                    hf_export.export(hf_export.HFExport(r.source, flavor=flavor, precision=precision, deploy=folder,
                                                        seed=r.seed))
                except Exception as x:  # noqa: BLE001 - a flavour that cannot express the model: a row saying why
                    rows.append(B.failed_row("attnexport", flavor, precision, r.threads, f"export failed: {reason(x)}",
                                             UNIT))
                    continue
                engines.append(("attnexport", flavor, precision, _folder_engine(folder, m, r.threads, r.new_tokens)))
        if r.anchors:
            engines += _optimum(r, m, Path(tmp), info, said)
        for engine, flavor, precision, generate in engines:
            said(f"timing {engine} {precision} {flavor}")
            try:
                got = generate(texts)
            except Exception as x:  # noqa: BLE001 - an engine failing to answer: a row saying why
                rows.append(B.failed_row(engine, flavor, precision, r.threads, f"failed: {reason(x)}", UNIT))
                continue
            median, p10, p90 = stats_of(R.time_calls(functools.partial(generate, texts), r.warmup, r.iters))
            rows.append(B.Row(engine, flavor, precision, len(texts), r.new_tokens, median, p10, p90,
                              len(texts) * 1e3 / median, r.threads, accuracy=accuracy(got, want, m),
                              unit=UNIT))
    B.ratios(rows, {})
    return rows, info


def accuracy(got: list[list[int]], want: list[list[int]], m: T.TextModel) -> dict:
    """An engine's outputs against transformers' fp32 ones: the share of their tokens at their places
    and the word error rate over every text, and the tokens it generated."""
    pairs = [COST.agreement(g, w, m.decode) for g, w in zip(got, want, strict=True)]
    return {"agreement": float(np.mean([a for a, _ in pairs])), "wer": float(np.mean([w for _, w in pairs])),
            "tokens": sum(len(g) for g in got), "equal": sum(g == w for g, w in zip(got, want, strict=True))}


def _optimum(r: TextBenchRequest, m: T.TextModel, tmp: Path, info: dict, said) -> list:
    """Optimum's export of the same weights, run by its ORTModelForSeq2SeqLM with its merged decoder
    (as its users generate), or none where optimum-onnx is not installed or its export fails."""
    try:
        import optimum.onnxruntime  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed (or broken): said in the run's info
        info["skipped"]["optimum"] = f"optimum-onnx is not installed ({type(e).__name__}): pip install optimum-onnx"
        return []
    said("exporting with optimum")
    weights, out = tmp / "weights", tmp / "optimum"
    try:
        m.model.save_pretrained(str(weights))
        m.write_files(weights)
        B.optimum_export(weights, out, "text2text-generation-with-past")
        (out / ED.GRAPH_DIR).mkdir(exist_ok=True)
        for f in out.glob("*.onnx"):
            f.rename(out / ED.GRAPH_DIR / f.name)
        generate = CL.optimum_generator(out, r.new_tokens, r.threads)
    except Exception as e:  # noqa: BLE001 - Optimum's own failure, said in one line
        info["skipped"]["optimum"] = f"Optimum's export failed: {reason(e)[:200]}"
        return []
    return [("optimum", "-", "fp32", generate)]


def from_options(source, v, said) -> tuple[list[B.Row], dict]:
    """`bench --hf` of a text encoder-decoder from the command line's values `v`."""
    B.refuse_others(v, v.options, (), "a text encoder-decoder (beside transformers and Optimum)")
    request = B.request_of(TextBenchRequest, v, source=source, flavors=tuple(v.flavors) or TextBenchRequest.flavors,
                           threads=v.threads or 0,
                           precisions=B.precisions(v.precisions_text, "--precision", ("fp32", "fp16", "int8", "int4"))
                           if v.precisions_text else TextBenchRequest.precisions)
    return bench_texts(request, said=said)


def lines(rows: list[B.Row], info: dict, path: str) -> list[str]:
    """What bench prints: each engine, precision and flavour, its time for the texts beside its
    outputs' agreement with transformers'."""
    out = [f"{path}: {info['layers']} decoder layers, {info['parameters']:,} parameters, {info['texts']} texts each "
           f"alone, up to {info['new_tokens']} new tokens, {info['threads']} thread(s)"]
    for row in rows:
        if row.median_ms != row.median_ms:  # NaN: the engine could not be made
            out.append(f"{row.engine} {row.precision} {row.flavor}: {row.note}")
            continue
        a = row.accuracy or {}
        ratio = f", {row.ratio_to_transformers:.2f}x transformers" if row.ratio_to_transformers else ""
        out.append(f"{row.engine} {row.precision} {row.flavor}: {row.median_ms:.1f} ms (p10 {row.p10_ms:.1f}, p90 "
                   f"{row.p90_ms:.1f}), {a.get('tokens', 0) * 1e3 / row.median_ms:,.0f} tokens/s{ratio}; "
                   f"{a.get('equal', 0)} of {row.batch} outputs equal to transformers', tokens "
                   f"{a.get('agreement', 0):.0%}, WER {a.get('wer', 0):.2f}")
    return out + B.skipped_lines(info)
