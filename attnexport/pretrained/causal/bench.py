"""`bench --hf PATH --decode`: a language model's prefill and per-token decode at several contexts,
per cache form and flavour, beside transformers eager with its own cache in the same run, and
Optimum's export and onnxruntime-genai's model builder on the same weights when installed.

Every engine runs the same weights on the same threads. A decode row is one token after a cache
of `context` positions (concat: the past given as inputs and returned grown; static: buffers
written in place through IO binding on the ort flavour, else returned as new arrays); a prefill
row is a prompt of `context` tokens into an empty cache. The least bytes a decode step must read
are the parameters once (of the input embedding table, the one row gathered, unless a tied head
reads it whole) and the cache's valid prefix once; `bandwidth_fraction` is that over the step's
time, as a fraction of the memory's read rate measured in the same run: the faster of a large
reduction (`attnexport.bench.memory_bandwidth`) and a one-row MatMul (`attnexport.bench.gemv_bandwidth`),
each measured before every context's timings and after the last, the highest kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnexport import dtypes as D
from attnexport import runtimes as R
from attnexport.bench import gemv_bandwidth, memory_bandwidth, stats_of
from attnexport.errors import UsageError, reason
from attnexport.pretrained import bench as B
from attnexport.pretrained import cost as COST
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import forms as FM
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained.causal import accuracy as A
from attnexport.pretrained.causal import forms as CF
from attnexport.pretrained.causal import generation as G

CONTEXTS = (128, 1024, 4096)
FORMS = tuple(form.name for form in CF.FORMS if form.caches)  # a step to time: a cache
# Generation agreement: this many greedy tokens after each prompt (the tokenizer's PROMPTS, else
# seeded ids of these lengths), one prompt at a time.
AGREEMENT_TOKENS = 48
AGREEMENT_LENGTHS = (5, 9, 2, 7, 4)


@dataclass(frozen=True)
class HFBenchRequest:
    """What `bench --hf` measures: the model, its contexts, forms and flavours, and how long."""

    source: str | Path
    contexts: tuple = CONTEXTS
    forms: tuple = FORMS
    flavors: tuple = ("ort", "attention", "primitives")
    threads: int = 0  # 0: every core, as the command line takes it
    iters: int = 30
    warmup: int = 5
    seed: int | None = None  # a config-only folder's weights (None: such a folder is refused)
    prefill: bool = True
    # The Python that runs onnxruntime-genai's model builder (it may need another transformers
    # than Optimum does); None: this one.
    genai_python: str | None = None
    # attnexport's precisions (`export --precision`) and onnxruntime-genai's builder's (`-p`), each timed.
    precisions: tuple = ("fp32",)
    genai_precisions: tuple = ("fp32",)


@dataclass
class HFBenchRow:
    engine: str  # attnexport, transformers, optimum
    form: str  # concat, static, or the engine's own cache
    flavor: str
    mode: str  # how it ran: in-place (IO binding), copies, eager
    phase: str  # prefill or decode
    context: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    tokens_per_s: float
    threads: int
    ratio_to_transformers: float | None = None  # transformers' median over this one (> 1: faster)
    bandwidth_fraction: float | None = None
    bandwidth_gbs: float | None = None
    step_bytes: int | None = None
    note: str = ""
    # What the engine's answers cost: its greedy tokens against transformers' (AGREEMENT_TOKENS after
    # each prompt) and, for an ONNX step graph, teacher-forced KL, top-1 and perplexity against the fp32
    # model (`attnexport.pretrained.accuracy`), measured once per engine and shown beside each of its times.
    agreement: dict | None = None
    precision: str = "fp32"


def _timed(fn, warmup: int, iters: int) -> tuple[float, float, float]:
    return stats_of(R.time_calls(fn, warmup, iters))


def cache_bytes(layout: hf.Layout, context: int, itemsize: int = 4) -> int:
    """Each layer's cached keys and values up to `context`, read once."""
    return 2 * layout.layers * layout.kv_heads * context * layout.head_dim * itemsize


def file_weight_bytes(path) -> int:
    """The least bytes of an ONNX file's weights one decode step reads: every initializer once, but
    of a table only gathered (an input embedding the head does not read), one row. Quantized and
    half-precision files count as they store their weights (packed 4-bit blocks, their scales)."""
    import onnx
    model = onnx.load(str(path), load_external_data=True)
    readers: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    total = 0
    for init in model.graph.initializer:
        size = onnx.numpy_helper.to_array(init).nbytes
        if readers.get(init.name, set()) <= {"Gather", "GatherBlockQuantized"} and init.dims:
            rows = max(int(d) for d in init.dims)  # the vocabulary axis: one of its rows is gathered
            size //= rows
        total += size
    return total


def step_bytes(model, layout: hf.Layout, context: int) -> int:
    """The least bytes one decode step reads: every parameter once but the input embedding table
    (one row of it, unless the head reads the same matrix whole: tied weights), and each layer's
    cached keys and values up to `context` once (fp32)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    params = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter, counted once
    if head is None or head.weight is not embedding:
        params += embedding.shape[1] - embedding.numel()
    cache = 2 * layout.layers * layout.kv_heads * context * layout.head_dim
    return 4 * (params + cache)


# Whether the engines' ONNX Runtime pools spin between steps. They do not: on SmolLM2-135M at 1024
# positions a spinning pool's step was as fast on a quiet machine (static 23.4 ms against 24.2, concat
# 58.8 against 49.6) and 1.3-1.9x slower beside one busy core (`benchmarks/probes/loaded_decode.py`,
# which sets it to compare; docs/runtimes.md).
SPINNING = False


def _session(path, threads: int):
    """The engine's session on ONNX Runtime's CPU provider (`runtimes.ort_session`), its pool
    spinning between steps or not as SPINNING says."""
    return R.ort_session("ort-cpu", path, threads=threads, spinning=SPINNING)[0]


class _Sessions:
    """An engine's ONNX Runtime session, made when first asked for and dropped after each context: a
    session keeps what its longest run allocated (a prefill of 4096 tokens of SmolLM2-135M left 1.6 GB
    beside its 1.1 GB of weights), which for seven engines outgrew a 24 GB machine."""

    def __init__(self, path, threads: int):
        self.path, self.threads, self.session = path, threads, None

    def get(self):
        if self.session is None:
            self.session = _session(self.path, self.threads)
        return self.session

    def drop(self) -> None:
        self.session = None


def _cache_arrays(layout: hf.Layout, positions: int, rng, dtype=np.float32) -> dict:
    """Random caches of `positions` positions at batch 1 (a static form's ring layers: their window)."""
    shapes = G.form_of(layout).cache_shapes(layout, 1, positions)
    return {n: rng.standard_normal(shape).astype(dtype) for n, shape in shapes.items()}


def _cache_dtype(session, layout: hf.Layout):
    """The float type the session's caches are in (fp16 for an export in half: fp16, q4f16)."""
    types = {i.type for i in session.get_inputs() if i.name in layout.cache_pairs}
    return np.float16 if "tensor(float16)" in types else np.float32


def _decode_call(session, layout: hf.Layout, context: int, in_place: bool):
    """One decode step at `context` on an ONNX Runtime session, as a callable; `in_place`: each
    static buffer bound as its own present (the step writes it where it lies; a ring's present is
    a new array, bound to a place of its own)."""
    import onnxruntime as ort
    rng = np.random.default_rng(0)
    token = np.array([[5]], np.int64)
    dtype = _cache_dtype(session, layout)
    names = {i.name for i in session.get_inputs()}
    feed = G.form_of(layout).bench_feed(layout, token, context, lambda n: _cache_arrays(layout, n, rng, dtype))
    feed = {k: v for k, v in feed.items() if k in names}
    if not in_place:
        return lambda: session.run(None, feed)
    binding = session.io_binding()
    buffers = {c.past: c.present for c in layout.signature.caches if c.kind == "static"}
    values = {n: ort.OrtValue.ortvalue_from_numpy(feed[n]) for n in buffers}
    for n, v in values.items():
        binding.bind_ortvalue_input(n, v)
        binding.bind_ortvalue_output(buffers[n], v)
    for n in feed.keys() - values.keys():
        binding.bind_cpu_input(n, feed[n])
    for n in ["logits", *(q for p, q in layout.cache_pairs.items() if p not in buffers)]:
        binding.bind_output(n, "cpu")
    return lambda binding=binding, values=values: session.run_with_iobinding(binding)


def _prefill_call(session, layout: hf.Layout, context: int):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, layout.vocab, (1, context), dtype=np.int64)
    names = {i.name for i in session.get_inputs()}
    dtype = _cache_dtype(session, layout)
    feed = G.form_of(layout).bench_feed(layout, ids, 0, lambda n: _cache_arrays(layout, n, rng, dtype))
    feed = {k: v for k, v in feed.items() if k in names}
    # A prompt of thousands of tokens makes logits of hundreds of MB (SmolLM2's: 805 MB at 4096): each
    # session's memory arena hands it back after the run, or seven engines' arenas outgrow the machine.
    import onnxruntime as ort
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return lambda: session.run(None, feed, options)


def _transformers_decode(model, layout: hf.Layout, context: int):
    """One decode step of transformers' own model at `context`, its DynamicCache filled anew."""
    import torch
    from transformers import DynamicCache
    past = list(_cache_arrays(layout, context, np.random.default_rng(0)).values())
    token, position = torch.tensor([[5]]), torch.tensor([[context]])
    mask = torch.ones((1, context + 1), dtype=torch.int64)

    def decode():
        cache = DynamicCache()
        for i in range(layout.layers):
            cache.update(torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1]), i)
        with torch.no_grad():
            model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
    return decode


def _transformers_prefill(model, layout: hf.Layout, context: int):
    import torch
    ids = torch.from_numpy(np.random.default_rng(1).integers(3, layout.vocab, (1, context), dtype=np.int64))

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
    return prefill


def _row(engine, form, flavor, mode, phase, context, stats, threads, note="") -> HFBenchRow:
    median, p10, p90 = stats
    tokens = context if phase == "prefill" else 1
    return HFBenchRow(engine, form, flavor, mode, phase, context, median, p10, p90, tokens * 1e3 / median, threads,
                      note=note)


@dataclass
class _Engine:
    """One thing timed: its labels, and the callables of a decode step and of a prefill at a
    context (made once per context; the decode step is called many times)."""

    engine: str
    form: str
    flavor: str
    mode: str
    decode: Callable
    prefill: Callable | None = None
    note: Callable = lambda context: ""
    generate: Callable | None = None  # (prompt ids, new tokens) -> the greedy tokens it generates
    release: Callable = lambda: None  # what it holds between contexts, given back
    precision: str = "fp32"
    step: Callable | None = None  # () -> (its step graph's run function, its layout, its caches' float type)
    path: Path | None = None  # its ONNX file (what a lossy engine's step reads)

    @property
    def key(self) -> tuple:
        return (self.engine, self.form, self.flavor, self.precision)


# At each context every engine's decode step is warmed up first, then each engine's runs are timed
# back to back after SETTLE more untimed ones: the engine timed before may leave its threads
# spinning for a while (ONNX Runtime's pool, torch's OpenMP). Engines taking turns within a context
# (tried) widened every spread for that reason; drift over minutes shows by running the bench again.
SETTLE = 3


def bench_hf(request: HFBenchRequest, said=lambda text: None) -> tuple[list[HFBenchRow], dict]:
    """Every engine, form and flavour at every context; returns (rows, what the run measured
    besides: the bandwidth, the model's sizes, the engines skipped and why)."""
    import torch

    r = request if request.threads else dataclasses.replace(request, threads=os.cpu_count() or 1)
    if any(c < 1 for c in r.contexts):
        raise UsageError("--context values are >= 1")
    model, _ = hf.load(r.source, r.seed)
    hf.loaded_readers_dropped(r.source)
    torch.set_num_threads(r.threads)
    layout = hf.layout_of(model, "concat")
    rows: list[HFBenchRow] = []
    info: dict = {"skipped": {}, "threads": r.threads}
    with tempfile.TemporaryDirectory(prefix="attnexport-hf-bench-") as tmp:
        weights = Path(tmp) / "weights"
        model.save_pretrained(str(weights))  # every engine reads these very weights
        engines = [_Engine("transformers", "DynamicCache", "-", "eager (sdpa)",
                           lambda c: _transformers_decode(model, layout, c),
                           lambda c: _transformers_prefill(model, layout, c),
                           generate=lambda ids, n: G.reference_generation(model, layout, [ids], n).tokens[0])]
        for precision in r.precisions:
            for form in r.forms:
                for flavor in r.flavors:
                    said(f"exporting attnexport {form} {flavor} {precision}")
                    made = _attnexport_engine(weights, form, flavor, r, Path(tmp), precision)
                    if isinstance(made, HFBenchRow):
                        rows.append(made)
                    else:
                        engines.append(made)
        engines += _optimum_engines(weights, layout, r, Path(tmp), info, said)
        for precision in r.genai_precisions:
            engines += _genai_engines(weights, model.config.model_type, r, Path(tmp), info, said, precision)
        # The memory's read rate: the faster of a large reduction (what bench --decode uses) and
        # the one-row MatMul a step's projections are, both over 512 MiB on the run's threads,
        # measured before each context's timings and after the last (a shared machine's rate
        # drifts): the highest of them.
        probes = []
        for c in r.contexts:
            probes.append((memory_bandwidth(r.threads), gemv_bandwidth(r.threads)))
            said(f"timing context {c}")
            rows += _timed_at(engines, c, r)
        probes.append((memory_bandwidth(r.threads), gemv_bandwidth(r.threads)))
        said("generating with every engine")
        agreements = _agreements(engines, model, layout, r)
        # A lossy engine's weights are what its file holds: its step reads those bytes.
        weight_bytes = {(e.engine, e.precision): file_weight_bytes(e.path) for e in engines
                        if e.precision != "fp32" and e.path is not None}
    for row in rows:
        row.agreement = agreements.get((row.engine, row.form, row.flavor, row.precision))
    reduction, gemv = max(p[0] for p in probes), max(p[1] for p in probes)
    bandwidth = max(reduction, gemv)
    info.update(bandwidth_gbs=bandwidth / 1e9, reduction_gbs=reduction / 1e9, gemv_gbs=gemv / 1e9,
                layers=layout.layers, kv_heads=layout.kv_heads, head_dim=layout.head_dim, vocab=layout.vocab,
                parameters=int(sum(p.numel() for p in model.parameters())))
    eager = {(row.phase, row.context): row.median_ms for row in rows if row.engine == "transformers"}
    for row in rows:
        base = eager.get((row.phase, row.context))
        row.ratio_to_transformers = base / row.median_ms if base else None
        if row.phase == "decode" and row.median_ms == row.median_ms:
            held = weight_bytes.get((row.engine, row.precision))
            row.step_bytes = step_bytes(model, layout, row.context) if held is None else \
                held + cache_bytes(layout, row.context, D.ITEMSIZE[P.TABLE[row.precision.split(':')[0]].activations])
            row.bandwidth_gbs = bandwidth / 1e9
            row.bandwidth_fraction = row.step_bytes / (row.median_ms * 1e-3) / bandwidth
            if row.bandwidth_fraction > 1:
                row.note = (row.note + "; " if row.note else "") + "faster than the memory's read rate measured: " \
                    "the bytes counted were not all read from memory (a measurement to distrust)"
    return rows, info


def _timed_at(engines: list[_Engine], context: int, r: HFBenchRequest) -> list[HFBenchRow]:
    """Each engine's decode step at `context` (see SETTLE), then each prefill (3 runs after 1)."""
    calls = [engine.decode(context) for engine in engines]
    for call in calls:
        for _ in range(r.warmup):
            call()
    rows = []
    for e, call in zip(engines, calls, strict=True):
        rows.append(_row(e.engine, e.form, e.flavor, e.mode, "decode", context, _timed(call, SETTLE, r.iters),
                         r.threads, e.note(context)))
        rows[-1].precision = e.precision
    del calls
    for e in engines:
        if r.prefill and e.prefill is not None:
            rows.append(_row(e.engine, e.form, e.flavor, e.mode, "prefill", context, _timed(e.prefill(context), 1, 3),
                             r.threads))
            rows[-1].precision = e.precision
        e.release()
    return rows


def _agreements(engines: list[_Engine], model, layout: hf.Layout, r: HFBenchRequest) -> dict:
    """{(engine, form, flavor): its agreement with transformers' greedy tokens}: per prompt, the
    first token that differs (None: all AGREEMENT_TOKENS equal), and the tokens equal in all."""
    tokenizer = hf.tokenizer_of(r.source)
    prompts = G.prompts(tokenizer, layout, AGREEMENT_LENGTHS, seed=5)
    want = [G.reference_generation(model, layout, [p], AGREEMENT_TOKENS).tokens[0] for p in prompts]
    base = A.baseline(HR.Reference(model, hf.layout_of(model, "none")), tokenizer, prompts[:1], 1) \
        if any(e.step is not None for e in engines) else None
    out: dict[tuple, dict] = {}
    for e in engines:
        if e.generate is None:
            continue
        try:
            got = [np.asarray(e.generate(p, AGREEMENT_TOKENS)) for p in prompts]
            teacher = _teacher_forced(e, base) if base is not None and e.step is not None else None
        except Exception as x:  # noqa: BLE001 - an engine failing to generate: said beside its times
            out[e.key] = {"error": reason(x)}
            continue
        finally:
            e.release()
        first = [_first_difference(g, w) for g, w in zip(got, want, strict=True)]
        out[e.key] = {**(teacher or {}),
            "prompts": len(prompts), "new_tokens": AGREEMENT_TOKENS, "first_difference": first,
            "equal_prompts": sum(f is None for f in first), "real_prompts": tokenizer is not None,
            "compared_tokens": int(sum(min(len(g), len(w)) for g, w in zip(got, want, strict=True))),
            "equal_tokens": int(sum(min(len(g), len(w)) if f is None else f for g, w, f in zip(got, want, first,
                                                                                                strict=True)))}
    return out


def _teacher_forced(e: _Engine, base) -> dict:
    """An ONNX engine's teacher-forced cost on accuracy.EVAL_TEXT and HELD_OUT against the fp32 model:
    mean KL, top-1 agreement, perplexity growth (`attnexport.pretrained.accuracy`)."""
    assert e.step is not None
    run, layout, dtype = e.step()
    got = G.stepped_logits(run, layout, base.eval_ids, A.PREFILL, 1, dtype)[0]
    held = G.stepped_logits(run, layout, base.held_ids, A.PREFILL, 1, dtype)[0]
    ppl, ppl32 = A.perplexity(held, base.held_ids[0]), A.perplexity(base.held32, base.held_ids[0])
    return {"kl_mean": float(COST.kl_per_position(base.eval32, got).mean()),
            "top1": float((base.eval32.argmax(-1) == got.argmax(-1)).mean()), "perplexity": ppl,
            "perplexity_fp32": ppl32, "perplexity_delta": ppl / ppl32 - 1, "teacher_forced_tokens": int(got.shape[0])}


def _first_difference(got: np.ndarray, want: np.ndarray) -> int | None:
    """The first step where `got` departs from `want`; a `got` that stopped early (an engine that
    ends at its end-of-sequence token: its last token) agrees where it stopped if `want` has that
    token there, else departs where it stops."""
    for i, w in enumerate(want):
        if i >= len(got):
            return None if len(got) and int(got[-1]) == int(want[len(got) - 1]) else i
        if int(got[i]) != int(w):
            return i
    return None


def agreement_text(a: dict | None) -> str:
    """An engine's agreement in a few words: `240/240 tokens as transformers` or where it departs."""
    if not a:
        return ""
    if "error" in a:
        return f"no generation: {a['error']}"
    total = a["prompts"] * a["new_tokens"]
    stopped = a["compared_tokens"] < total
    teacher = (f"; KL {a['kl_mean']:.2g}, top-1 {a['top1']:.0%}, perplexity {a['perplexity_delta']:+.1%}"
               if "kl_mean" in a else "")
    if a["equal_prompts"] == a["prompts"]:
        return f"{a['equal_tokens']}/{a['compared_tokens']} greedy tokens as transformers" + \
            (" (it stops at its end-of-sequence token)" if stopped else "") + teacher
    firsts = ", ".join("-" if f is None else str(f) for f in a["first_difference"])
    return f"{a['equal_tokens']}/{total} greedy tokens as transformers; first departure per prompt: {firsts}" + teacher


def _session_runner(session):
    """A session's step as `generation.generate` calls it: the inputs it has, every output by name."""
    names = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    return lambda feed: dict(zip(names, session.run(None, {k: v for k, v in feed.items() if k in inputs}),
                                 strict=True))


def _stepping(session, layout: hf.Layout) -> tuple:
    """What teacher-forced accuracy steps: (the session's run, the layout, its caches' float type)."""
    return _session_runner(session), layout, _cache_dtype(session, layout)


def _generated(session, layout: hf.Layout, ids, n: int):
    """`n` greedy tokens after `ids` from the session's step, its caches in the session's float type."""
    return G.generate(_session_runner(session), layout, [ids], n, dtype=_cache_dtype(session, layout)).tokens[0]


def _attnexport_engine(weights: Path, form: str, flavor: str, r: HFBenchRequest, tmp: Path, precision: str = "fp32"):
    """The engine of one form, flavour and precision, or a row saying why the export failed."""
    max_seq = max(max(r.contexts) + 1, AGREEMENT_TOKENS + 64, A.TOKENS)  # the accuracy's prompts and texts fit too
    path = tmp / f"{form}-{flavor}-{precision}.onnx"
    try:
        # The folder holds the source's weights; a GGUF source's own blocks are carried from the file.
        request = hf_export.HFExport(weights, form, max_seq if FM.FORMS[form].writes_in_place else 0, flavor,
                                     output=path, precision=precision, grids_from=r.source)
        result, layout = hf_export.export_hf(request)
    except Exception as e:  # noqa: BLE001 - a flavour that cannot express the model is a row saying why
        return HFBenchRow("attnexport", form, flavor, "-", "decode", 0, float("nan"), float("nan"), float("nan"),
                          0.0, r.threads, note=f"export failed: {reason(e)}", precision=precision)
    sessions = _Sessions(path, r.threads)
    # GroupQueryAttention writes its buffers in place (a model with rings runs MultiHeadAttention beside it)
    ops = result.attention_op.split(", ")
    in_place = layout.cache_form.writes_in_place and "com.microsoft.GroupQueryAttention" in ops
    mode = G.form_of(layout).bench_mode(in_place)
    return _Engine("attnexport", form, flavor, mode, lambda c: _decode_call(sessions.get(), layout, c, in_place),
                   lambda c: _prefill_call(sessions.get(), layout, c),
                   generate=lambda ids, n: _generated(sessions.get(), layout, ids, n),
                   release=sessions.drop, precision=precision,
                   step=lambda: _stepping(sessions.get(), layout), path=path)


def _optimum_engines(weights: Path, layout: hf.Layout, r: HFBenchRequest, tmp: Path, info: dict,
                     said) -> list[_Engine]:
    """Optimum's `text-generation-with-past` export of the same weights, timed as the concat form."""
    try:
        from optimum.exporters.onnx import main_export
    except Exception as e:  # noqa: BLE001 - not installed (or broken): said in the run's info
        info["skipped"]["optimum"] = f"optimum-onnx is not installed ({type(e).__name__}): pip install optimum-onnx"
        return []
    said("exporting with optimum")
    out = tmp / "optimum"
    try:
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            main_export(str(weights), output=str(out), task="text-generation-with-past")
    except Exception as e:  # noqa: BLE001 - Optimum's own failure, said in one line
        info["skipped"]["optimum"] = f"Optimum's export failed: {reason(e)[:200]}"
        return []
    sessions = _Sessions(out / "model.onnx", r.threads)
    return [_Engine("optimum", "concat", "-", "its export", lambda c: _decode_call(sessions.get(), layout, c, False),
                    lambda c: _prefill_call(sessions.get(), layout, c),
                    generate=lambda ids, n: _generated(sessions.get(), layout, ids, n),
                    release=sessions.drop, step=lambda: _stepping(sessions.get(), layout))]


def word_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer.json of `vocab` plain words (onnxruntime-genai's builder wants one; the bench
    feeds token ids, so what the words are does not matter)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def _genai_engines(weights: Path, model_type: str, r: HFBenchRequest, tmp: Path, info: dict,
                   said, precision: str = "fp32") -> list[_Engine]:
    """onnxruntime-genai's model builder on the same weights (`precision`: its `-p`, fp32 or int4;
    CPU), run by its own generator: a prompt of `context` tokens (prefill), then one token a step
    (decode). Its teacher-forced accuracy runs its model.onnx as a concat step graph in ONNX Runtime."""
    import json
    import subprocess
    import sys
    try:
        import onnxruntime_genai as og
    except Exception as e:  # noqa: BLE001 - not installed (or broken): said in the run's info
        info["skipped"]["onnxruntime-genai"] = (f"onnxruntime-genai is not installed ({type(e).__name__}): pip install "
                                                "--no-deps onnxruntime-genai onnx_ir")
        return []
    said(f"building with onnxruntime-genai ({precision})")
    vocab = json.loads((weights / "config.json").read_text())["vocab_size"]
    tokenizer = hf.tokenizer_of(r.source)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(weights))  # the model's own (the builder copies it)
    if not (weights / "tokenizer.json").exists():
        word_tokenizer(weights, vocab)
    out = tmp / ("genai-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in precision))
    command = [r.genai_python or sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", model_type,
               "-i", str(weights), "-o", str(out), *builder_arguments(precision), "-e", "cpu"]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["(no output)"])[-1]
        info["skipped"][f"onnxruntime-genai {precision}"] = f"its model builder failed: {last[:200]}"
        return []
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {}).update(
        intra_op_num_threads=r.threads, inter_op_num_threads=1)
    config_path.write_text(json.dumps(config))
    model = og.Model(str(out))
    steps = r.warmup + SETTLE + r.iters + 2  # every run of a context extends the sequence

    def primed(context: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=context + steps, do_sample=False)
        generator = og.Generator(model, params)
        prompt = np.random.default_rng(1).integers(3, vocab, context).astype(np.int32)
        return generator, prompt

    def decode(context: int):
        generator, prompt = primed(context)
        generator.append_tokens(prompt)
        return generator.generate_next_token

    def prefill(context: int):
        def run():
            generator, prompt = primed(context)
            generator.append_tokens(prompt)
        return run

    def generate(ids, n: int):  # greedy, until n tokens or its end-of-sequence stop
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray(ids, np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        tokens = np.asarray(generator.get_sequence(0))[len(ids):]
        if len(tokens) < n:  # it stopped at its end-of-sequence token, which it leaves out
            tokens = np.append(tokens, eos)
        return tokens
    eos = config["model"]["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    decoder = config["model"]["decoder"]
    layout = hf.Layout("concat", decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"],
                       vocab)
    sessions = _Sessions(out / decoder["filename"], r.threads)
    return [_Engine("onnxruntime-genai", "shared buffer", "-", "its generator", decode, prefill,
                    lambda c: f"context {c} to {c + steps}", generate, release=sessions.drop, precision=precision,
                    step=lambda: _stepping(sessions.get(), layout), path=out / decoder["filename"])]


def to_json(rows: list[HFBenchRow]) -> list[dict]:
    return [asdict(row) for row in rows]


# onnxruntime-genai model builder's -p values bench --hf times.
GENAI_PRECISIONS = ("fp32", "int4")
# The builder's extra options an int4 `--genai-precision` may carry after colons
# (`int4:algo_config=k_quant_mixed:is_symmetric=false`): its weight-only quantizer's, those that
# change what the file answers or how fast it runs (the default is round-to-nearest, symmetric,
# blocks of 32, int8 activations).
GENAI_OPTIONS = ("algo_config", "is_symmetric", "block_size", "accuracy_level")


def genai_precisions(text: str | None) -> tuple[str, ...]:
    """`--genai-precision` as a tuple (None: fp32 alone): each a builder precision (GENAI_PRECISIONS),
    an int4 one with the builder's options after colons (GENAI_OPTIONS, `NAME=VALUE`), checked."""
    if text is None:
        return ("fp32",)
    specs = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    for spec in specs or ("",):
        base, *options = spec.split(":")
        if base not in GENAI_PRECISIONS or (options and base != "int4") or \
                any(not o.partition("=")[2] or o.partition("=")[0] not in GENAI_OPTIONS for o in options):
            raise UsageError(f"--genai-precision takes {', '.join(GENAI_PRECISIONS)} separated by commas, int4 with "
                             f"the builder's options after colons ({', '.join(GENAI_OPTIONS)}: e.g. "
                             f"int4:algo_config=k_quant_mixed:is_symmetric=false); got {text!r}")
    return specs


def builder_arguments(precision: str) -> list[str]:
    """The model builder's arguments for a `--genai-precision` (`genai_precisions`): its -p, and its
    --extra_options where the precision carries them."""
    base, *options = precision.split(":")
    return ["-p", base, *(["--extra_options", *options] if options else [])]


def from_options(source, v, said) -> tuple[list[HFBenchRow], dict]:
    """`bench --hf` of a causal language model from the command line's values `v` (`--decode`,
    `--context`, `--genai-python`, `--genai-precision` beside every family's)."""
    if not v.decode:
        raise UsageError("bench --hf of a causal language model times its decode: give --decode (with --context, "
                         "--flavor, --threads, --warmup, --iters, --seed and --json; fp32 on ort-cpu, beside "
                         "transformers, Optimum and onnxruntime-genai)")
    B.refuse_others(v, v.options, ("--decode", "--context", "--genai-python", "--genai-precision"),
                    "a causal language model")
    request = B.request_of(HFBenchRequest, v, source=source, contexts=tuple(v.contexts or CONTEXTS),
                           flavors=tuple(v.flavors) or HFBenchRequest.flavors, threads=v.threads or 0,
                           precisions=B.precisions(v.precisions_text, "--precision", P.PRECISIONS),
                           genai_precisions=genai_precisions(v.genai_precisions_text))
    return bench_hf(request, said=lambda text: said(f"timing {text}"))


def lines(rows: list[HFBenchRow], info: dict, path: str) -> list[str]:
    """What bench prints: each engine, precision, form and flavour at each context, its time beside
    its answers' agreement."""
    out = [f"{path}: {info['layers']} layers, {info['parameters']:,} parameters, fp32, {info['threads']} "
           f"thread(s); memory read bandwidth {info['bandwidth_gbs']:.1f} GB/s"]
    for row in rows:
        if row.median_ms != row.median_ms:  # NaN: the export failed
            out.append(f"{row.engine} {row.precision} {row.form} {row.flavor}: {row.note}")
            continue
        ratio = f", {row.ratio_to_transformers:.2f}x transformers" if row.ratio_to_transformers else ""
        band = f", {row.bandwidth_fraction:.2f} of the memory bandwidth" if row.bandwidth_fraction is not None else ""
        agree = agreement_text(row.agreement)
        out.append(f"{row.phase:7s} {row.context:>5d}  {row.engine} {row.precision} {row.form} {row.flavor} "
                   f"({row.mode}): {row.median_ms:.3f} ms (p10 {row.p10_ms:.3f}, p90 {row.p90_ms:.3f}), "
                   f"{row.tokens_per_s:,.0f} tokens/s{ratio}{band}" + (f"; {agree}" if agree else "")
                   + (f"; {row.note}" if row.note else ""))
    return out + B.skipped_lines(info)
