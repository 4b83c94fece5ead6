"""The cache property: a step graph decoded from an empty cache, a token at a time and in
chunks, must give the full forward's outputs (golden cache cases, and users' modules' caches)."""

from __future__ import annotations

import functools

import numpy as np
import onnx

from attnexport import golden, seeding
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.cases import seed_of
from attnexport.compare import compare_outputs, past_ends_zeroed
from attnexport.decode import (
    CHUNKS,
    STATIC_PROMPT,
    decode,
    decode_all,
    decode_static_all,
    empty_cache,
    split_inputs,
    static_prompts,
    static_reach,
    stream_axis,
)
from attnexport.errors import UsageError
from attnexport.report import Row
from attnexport.signature import CachePair, StepSignature, WritePos
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




def decode_run(prepared, variant, o, stream, chunk, signature: StepSignature):
    """The cache property: the stream decoded in chunks from an empty cache: {"output": ...}.
    `signature`: the step's, as its export recorded it (torch's module: the one its export records),
    which says whether the cache is static and which inputs are its buffers."""
    dtype = next(iter(stream.values())).dtype
    if signature.static:
        garbage = seeding.make_inputs(variant, o, 7)  # buffers whose unwritten positions must not be read
        specs = {s.name: s for s in variant.inputs(o)}
        buffers = {c.past: garbage[c.past].astype(dtype) for c in signature.caches if c.kind == "static"}
        # A decoder's cross cache starts empty and is carried; its memory is given once.
        buffers.update({n: v for n, v in empty_cache(variant, o, dtype, signature).items() if n not in buffers})
        streamed, once, masks = split_inputs(variant, o, stream, signature)
        streamed.update(masks)

        def run(feed):  # in the inputs' order: the torch runtime passes them to forward by position
            return prepared.run({n: feed[n] for n in specs})
        out = decode_static_all(run, streamed, stream_axis(variant, o), static_prompts(o["batch"]), chunk, buffers,
                                once, signature)[0]["output"]
        return {"output": out}
    stream, once, masks = split_inputs(variant, o, stream, signature)
    out = decode(prepared.run, stream, chunk, empty_cache(variant, o, dtype, signature), stream_axis(variant, o), once,
                 masks, layout=signature)
    return {"output": out}


def cache_of(model, pairs: dict, static: bool = False) -> dict:
    """{input: output} -> {input: {"output", "axis"}}, the axis being the input's positions: its
    symbolic one besides the batch; a static cache's (`static`) buffers, axis -2."""
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    cache = {}
    for past, present in pairs.items():
        if past not in inputs or present not in outputs:
            raise UsageError(f"--cache {past}:{present}: the model has no input {past!r} or no output {present!r}")
        dims = inputs[past].type.tensor_type.shape.dim
        if static:
            if len(dims) < 2 or dims[-2].dim_param:
                raise UsageError(f"--cache {past}:{present} with --write-pos: a static cache's buffers have a fixed "
                                 "positions axis (axis -2)")
            cache[past] = {"output": present, "axis": len(dims) - 2}
            continue
        axes = [a for a, d in enumerate(dims) if d.dim_param and a != 0]
        if len(axes) != 1:
            raise UsageError(f"--cache {past}:{present}: {past} has {len(axes)} symbolic axes besides the batch; a "
                             "cache has one, its positions")
        cache[past] = {"output": present, "axis": axes[0]}
    return cache


def write_pos_of(model, name: str, cache: dict):
    """The WritePos of a static cache's step that does not record it (`verify --write-pos`): its
    form read from the graph, by the axis its write position shares with the buffers (the batch)
    or with the block."""
    inputs = {i.name: i for i in model.graph.input}
    if name not in inputs:
        raise UsageError(f"--write-pos {name}: the model has no input {name!r}")
    elem = inputs[name].type.tensor_type.elem_type
    dtype = {onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32"}.get(elem)
    if dtype is None:
        raise UsageError(f"--write-pos {name}: an integer input (int64 or int32), the model's is another type")
    dims = inputs[name].type.tensor_type.shape.dim
    if len(dims) > 1:
        raise UsageError(f"--write-pos {name}: rank 0 or 1, the model's has {len(dims)} axes")
    if not dims or not dims[0].dim_param:
        return WritePos(name, "shared", tuple(d.dim_value for d in dims), dtype)
    batch = inputs[next(iter(cache))].type.tensor_type.shape.dim[0].dim_param
    return WritePos(name, "start" if dims[0].dim_param == batch else "positions", (), dtype)


def _stream_of(spec, spec_inputs, skip) -> tuple[str, dict]:
    """(the symbolic length of the inputs that run along the sequence, {input: its axis}); the
    inputs in `skip` (caches, a write position) left out."""
    length_dims = {d for i in spec_inputs if i["name"] not in skip for a, d in i["dynamic"].items() if a != "0"}
    if len(length_dims) != 1:
        raise UsageError(f"{spec}: the decode check splits one sequence axis, the inputs besides the cache have "
                         f"{len(length_dims)} symbolic lengths ({', '.join(sorted(length_dims)) or 'none'})")
    (length,) = length_dims
    stream = {i["name"]: int(a) for i in spec_inputs if i["name"] not in skip
              for a, d in i["dynamic"].items() if d == length}
    if len(set(stream.values())) != 1:
        raise UsageError(f"{spec}: the inputs along the sequence ({', '.join(stream)}) have it on different axes")
    return length, stream


def _along(m: LoadedModule, cache: dict, length: str) -> dict:
    """{output: its sequence axis} of the outputs besides the cache's that run along `length`."""
    updated = {c["output"] for c in cache.values()}
    return {o.name: a for o in m.model.graph.output if o.name not in updated
            for a, d in enumerate(o.type.tensor_type.shape.dim) if d.dim_param == length}


def _module_step(m: LoadedModule, names, outputs):
    """The torch module as a step: {input: array} -> {output: array}, under the export's semantics."""
    import torch

    def step(given):
        with torch.no_grad(), M.export_semantics():
            out = M.call_forward(m.module, tuple(torch.from_numpy(np.asarray(given[n])) for n in names), m.spec)
        return {n: t.detach().numpy() for n, t in zip(outputs, M.outputs_of(out), strict=True)}
    return step


def _decode_rows(m: LoadedModule, feed, expected, kind, decode_with) -> None:
    """The decode property's rows, a token a step and in chunks, on every runtime, run by `m.executor`: `decode_with(
    step, chunk)` runs the decode with `step` ({input: array} -> {output: array}) and returns
    the outputs to compare with `expected`."""
    names = [i["name"] for i in m.spec_inputs]
    module_step = _module_step(m, names, [o.name for o in m.model.graph.output])
    for chunk in CHUNKS:
        label = "decode, a token a step" if chunk == 1 else f"decode, {chunk} tokens a step"
        for rt in m.used:
            row = Row(case=label, variant=m.spec, flavor="-" if R.runs_module(rt) else m.flavor, runtime=rt,
                      dtype=m.dtype, model=m.model_name, tolerance=m.tol, expected_kind=kind,
                      inputs=feed, expected=expected)
            run = module_step if R.runs_module(rt) and not R.on_cuda(rt) else \
                m.prepared[rt].run if rt in m.prepared else None
            if run is None:
                row.skipped = f"{rt} runs no module"
            # Timed once: the whole decode, every step.
            m.executor.run(row, functools.partial(decode_with, run, chunk),
                           functools.partial(compare_outputs, list(expected), expected=expected, tol=m.tol),
                           cpu_nodes=m.prepared[rt].cpu_nodes if rt in m.prepared else ())


def module_decode_rows(m: LoadedModule, example, cache: dict) -> None:
    """The decode property of a module with its own cache (`cache`: {input: {"output", "axis"}}):
    run from empty caches over the export's inputs, a token at a time and in chunks, feeding each
    step's updated cache back, on every runtime (torch: the module itself), it must give the
    module's full forward: the outputs along the sequence, and the last cache."""
    names = [i["name"] for i in m.spec_inputs]
    feed = dict(zip(names, (t.numpy() for t in example), strict=True))
    for n, c in cache.items():  # empty caches
        feed[n] = np.take(feed[n], np.arange(0), axis=c["axis"])
    length, stream = _stream_of(m.spec, m.spec_inputs, cache)
    axis = next(iter(stream.values()))
    along = _along(m, cache, length)
    always = {n: v for n, v in feed.items() if n not in stream and n not in cache}
    full = _module_step(m, names, [o.name for o in m.model.graph.output])(feed)
    expected = {n: full[n].astype(np.float64) for n in along}
    expected.update({c["output"]: full[c["output"]].astype(np.float64) for c in cache.values()})
    layout = StepSignature(caches=tuple(CachePair(n, c["output"], c["axis"]) for n, c in cache.items()), along=along)

    def decode_with(run, chunk):
        got, last = decode_all(lambda given: run({**given, **always}), {n: feed[n] for n in stream}, chunk,
                               {n: feed[n] for n in cache}, axis, layout=layout)
        return {**got, **{cache[n]["output"]: v for n, v in last.items()}}
    _decode_rows(m, feed, expected, "the torch module's full forward from empty caches", decode_with)


STATIC_LENGTH = 8  # positions a static cache's decode check runs through (at most the buffers')


def module_static_rows(m: LoadedModule, example, cache: dict, write: WritePos) -> None:
    """The decode property of a module with a static cache (`cache`: {buffer input: {"output",
    "axis"}}, `write`: where each step writes): from buffers full of noise (attention must read
    only what was written), the sequences' prompts as one block, then a token at a time and in
    chunks, each sequence from its own position (prompts of different lengths, where `write`
    gives one position per sequence), feeding each step's buffers back; on every runtime it must
    give the module's full forward over the whole sequence written at 0 into the same buffers:
    the outputs along the sequence, and the buffers, each sequence up to where it ran."""
    names = [i["name"] for i in m.spec_inputs]
    tensors = dict(zip(names, example, strict=True))
    example = {n: t.numpy() for n, t in tensors.items()}
    length_dim, stream_axes = _stream_of(m.spec, m.spec_inputs, {*cache, write.name})
    axis = next(iter(stream_axes.values()))
    buffers = {n: example[n] for n in cache}
    positions = min(v.shape[cache[n]["axis"]] for n, v in buffers.items())
    if positions < 2:
        raise UsageError(f"{m.spec}: the static cache's buffers hold {positions} position(s); the decode check "
                         "needs 2 or more")
    total = min(STATIC_LENGTH, positions)
    batch = next(iter(buffers.values())).shape[0]
    rng = np.random.default_rng(0)
    feed = {}
    for n in stream_axes:
        shape = list(example[n].shape)
        shape[axis] = total
        feed[n] = rng.standard_normal(shape).astype(example[n].dtype) if example[n].dtype.kind == "f" else \
            np.full(shape, M.common_value(tensors[n]), example[n].dtype)  # ids: the example's most common one
    noise = {n: rng.standard_normal(v.shape).astype(v.dtype) for n, v in buffers.items()}
    always = {n: v for n, v in example.items() if n not in stream_axes and n not in cache and n != write.name}
    prompts = static_prompts(batch) if write.ragged else np.full(batch, STATIC_PROMPT)
    prompts = np.minimum(prompts, total - 1)
    reach = static_reach(prompts, total)
    along = _along(m, cache, length_dim)
    outs = {c["output"]: c["axis"] for c in cache.values()}
    static = tuple(CachePair(n, c["output"], c["axis"], "static") for n, c in cache.items())

    def up_to_reach(values: dict) -> dict:  # each sequence as far as it ran, zeros past it
        values = dict(values)
        for name, a in {**along, **outs}.items():
            values = past_ends_zeroed(values, [name], reach, a)
        return values
    full_feed = {**feed, **noise, **always, write.name: write.value(np.zeros(batch, np.int64), total)}
    full = _module_step(m, names, [o.name for o in m.model.graph.output])(full_feed)
    expected = up_to_reach({n: full[n].astype(np.float64) for n in [*along, *outs]})

    def decode_with(run, chunk):
        got, last = decode_static_all(lambda given: run({**given, **always}), feed, axis, prompts, chunk, noise,
                                      layout=StepSignature(caches=static, write_pos=write, along=along))
        return up_to_reach({**got, **{cache[n]["output"]: v for n, v in last.items()}})
    kind = (f"the torch module's full forward written at 0 into the same noisy buffers, each sequence up to where "
            f"it ran ({', '.join(map(str, reach))} positions)")
    _decode_rows(m, full_feed, expected, kind, decode_with)
