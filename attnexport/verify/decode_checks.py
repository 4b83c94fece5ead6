"""The cache property: a step graph decoded from an empty cache, a token at a time and in
chunks, must give the full forward's outputs (golden cache cases, and users' modules' caches)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from attnexport import golden, seeding
from attnexport import modules as M
from attnexport import variants as V
from attnexport.cases import seed_of
from attnexport.compare import compare_outputs
from attnexport.decode import (
    CHUNKS,
    Layout,
    decode,
    decode_all,
    decode_static,
    empty_cache,
    split_inputs,
    static_prompts,
    static_reach,
    stream_axis,
)
from attnexport.errors import UsageError, reason
from attnexport.report import Row
from attnexport.verify.run import LoadedModule, case_tolerance

DECODE_LENGTH = 7  # tokens decoded by the cache property check: 7 steps of 1, chunks of 3, 3 and 1


def golden_decode_checks(variant, case, params, dtype, rtol, atol) -> list:
    """The cache property's checks of a causal cache-step case: (case, expected, kind, tolerance,
    chunk) for each chunk size; the expected output is the full causal forward's, from the reference."""
    o = case.options
    if not (o.get("kv_cache") and o.get("causal", True)):  # causal; the decoder always is
        return []
    sizes = {"seq": DECODE_LENGTH, **({"kv_seq": DECODE_LENGTH} if "kv_seq" in o else {})}
    full = variant.resolve({**o, "kv_cache": False, **({"max_seq": None} if "max_seq" in o else {}), **sizes})
    stream = seeding.make_inputs(variant, full, seed_of(case.name) + 1)
    expected = {"output": np.asarray(variant.reference(params, stream, full)["output"], np.float64)}
    if V.static_cache(o):  # sequences of different lengths: each compared up to where it ran
        reached = static_reach(static_prompts(o["batch"]), DECODE_LENGTH)
        axis = stream_axis(variant, o)
        past = np.arange(DECODE_LENGTH)[None, :] >= reached[:, None]  # (B, L)
        shape = [1] * expected["output"].ndim
        shape[0], shape[axis] = o["batch"], DECODE_LENGTH
        expected["output"][np.broadcast_to(past.reshape(shape), expected["output"].shape)] = 0.0
    tol = case_tolerance(variant, params, stream, full, expected, dtype, rtol, atol)
    out = []
    for chunk in CHUNKS:
        c = golden.GoldenCase(f"{case.name}/decode-{chunk}", case.variant, o, stream, params, expected,
                              {"source": f"decode {DECODE_LENGTH} tokens in chunks of {chunk} from an empty cache"})
        out.append((c, expected, "reference (the full causal forward)", tol, chunk))
    return out




def decode_run(prepared, variant, o, stream, chunk):
    """The cache property: the stream decoded in chunks from an empty cache; ({"output": ...}, ms)."""
    dtype = next(iter(stream.values())).dtype
    t0 = time.perf_counter()
    if V.static_cache(o):
        garbage = seeding.make_inputs(variant, o, 7)  # buffers whose unwritten positions must not be read
        specs = {s.name: s for s in variant.inputs(o)}
        names = [n for n in specs if n.endswith("_cache")]
        buffers = {n: garbage[n].astype(dtype) for n in names}
        pairs = {n: n + "_out" for n in names}
        once = {}
        if "past_cross_key" in specs:  # a decoder: its memory is given once, its cross cache carried
            once = {"memory": stream["memory"]}
            buffers.update({n: np.zeros((o["batch"], *specs[n].shape({**o, "past_kv_seq": 0})[1:]), dtype)
                            for n in ("past_cross_key", "past_cross_value")})
            pairs.update(past_cross_key="present_cross_key", past_cross_value="present_cross_value")
        streamed = {n: v for n, v in stream.items() if n not in buffers and n not in once and n != "write_pos"}
        def run(feed):  # in the inputs' order: the torch runtime passes them to forward by position
            return prepared.run({n: feed[n] for n in specs})
        out = decode_static(run, streamed, stream_axis(variant, o), static_prompts(o["batch"]), chunk, buffers,
                            pairs, once)
        return {"output": out}, (time.perf_counter() - t0) * 1e3
    stream, once, masks = split_inputs(variant, o, stream)
    out = decode(prepared.run, stream, chunk, empty_cache(variant, o, dtype), stream_axis(variant, o), once, masks)
    return {"output": out}, (time.perf_counter() - t0) * 1e3


def cache_of(model, pairs: dict) -> dict:
    """{input: output} -> {input: {"output", "axis"}}, the axis being the input's symbolic one
    besides the batch (the positions)."""
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    cache = {}
    for past, present in pairs.items():
        if past not in inputs or present not in outputs:
            raise UsageError(f"--cache {past}:{present}: the model has no input {past!r} or no output {present!r}")
        axes = [a for a, d in enumerate(inputs[past].type.tensor_type.shape.dim) if d.dim_param and a != 0]
        if len(axes) != 1:
            raise UsageError(f"--cache {past}:{present}: {past} has {len(axes)} symbolic axes besides the batch; a "
                             "cache has one, its positions")
        cache[past] = {"output": present, "axis": axes[0]}
    return cache


def module_decode_rows(m: LoadedModule, example, cache: dict) -> list:
    """The decode property of a module with its own cache (`cache`: {input: {"output", "axis"}}):
    run from empty caches over the export's inputs, a token at a time and in chunks, feeding each
    step's updated cache back, on every runtime (torch: the module itself), it must give the
    module's full forward: the outputs along the sequence, and the last cache."""
    import torch
    module, model, spec, spec_inputs, used, prepared, dtype, tol, flavor, model_name = (
        m.module, m.model, m.spec, m.spec_inputs, m.used, m.prepared, m.dtype, m.tol, m.flavor, m.model_name)
    names = [i["name"] for i in spec_inputs]
    outputs = [o.name for o in model.graph.output]
    feed = dict(zip(names, (t.numpy() for t in example), strict=True))
    for n, c in cache.items():  # empty caches
        feed[n] = np.take(feed[n], np.arange(0), axis=c["axis"])
    length_dims = {d for i in spec_inputs if i["name"] not in cache for a, d in i["dynamic"].items() if a != "0"}
    if len(length_dims) != 1:
        raise UsageError(f"{spec}: the decode check splits one sequence axis, the inputs besides the cache have "
                         f"{len(length_dims)} symbolic lengths ({', '.join(sorted(length_dims)) or 'none'})")
    (length,) = length_dims
    stream = {i["name"]: int(a) for i in spec_inputs if i["name"] not in cache
              for a, d in i["dynamic"].items() if d == length}
    if len(set(stream.values())) != 1:
        raise UsageError(f"{spec}: the inputs along the sequence ({', '.join(stream)}) have it on different axes")
    axis = next(iter(stream.values()))
    along = {o.name: a for o in model.graph.output if o.name not in {c["output"] for c in cache.values()}
             for a, d in enumerate(o.type.tensor_type.shape.dim) if d.dim_param == length}
    always = {n: v for n, v in feed.items() if n not in stream and n not in cache}

    def module_step(given):
        with torch.no_grad(), M.export_semantics():
            out = M.call_forward(module, tuple(torch.from_numpy(np.asarray(given[n])) for n in names), spec)
        return {n: t.detach().numpy() for n, t in zip(outputs, M.outputs_of(out), strict=True)}

    full = module_step(feed)
    expected = {n: full[n].astype(np.float64) for n in along}
    expected.update({c["output"]: full[c["output"]].astype(np.float64) for c in cache.values()})
    rows = []
    for chunk in CHUNKS:
        label = "decode, a token a step" if chunk == 1 else f"decode, {chunk} tokens a step"
        for rt in used:
            row = Row(case=label, variant=spec, flavor="-" if rt.startswith("torch") else flavor, runtime=rt,
                      dtype=dtype, model=model_name, tolerance=tol,
                      expected_kind="the torch module's full forward from empty caches",
                      inputs=feed, expected=expected)
            rows.append(row)
            run = module_step if rt == "torch" else prepared[rt].run if rt in prepared else None
            if run is None:
                row.skipped = f"{rt} runs no module"
                continue
            started = time.perf_counter()
            try:
                def step(given: dict, run: Callable = run) -> dict:
                    return run({**given, **always})
                got, last = decode_all(step, {n: feed[n] for n in stream}, chunk, {n: feed[n] for n in cache}, axis,
                                       layout=Layout(pairs={n: c["output"] for n, c in cache.items()},
                                                     cache_axes={n: c["axis"] for n, c in cache.items()},
                                                     outputs=along))
            except Exception as e:  # noqa: BLE001 - a runtime failing on a step fails the check
                row.error = reason(e)
                continue
            row.median_ms = (time.perf_counter() - started) * 1e3  # the whole decode, every step
            got.update({cache[n]["output"]: v for n, v in last.items()})
            row.comparisons = compare_outputs(list(expected), got, expected, tol)
            row.passed = bool(row.comparisons) and all(c.passed for c in row.comparisons)
    return rows
