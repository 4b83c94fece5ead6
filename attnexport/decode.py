"""Decoding with a key/value cache, and the property that makes a cache trustworthy.

`decode` runs a cache-step model over a sequence in chunks (1 token at a time, or several),
starting from empty caches and feeding each step's `present_*` back as the next `past_*`, the way
a deployment app generates. For a causal block its outputs must equal those of the full causal
forward over the whole sequence: verify and the tests check exactly that.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attnexport.signature import PLAIN, StepSignature, WritePos

__all__ = ["StepSignature", "WritePos"]  # WritePos was defined here before signatures; its name stays

CHUNKS = (1, 3)  # token by token, and in chunks of 3 (the last one shorter)


def decode(step: Callable[[dict], dict], stream: dict[str, np.ndarray], chunk: int,
           empty_cache: dict[str, np.ndarray], axis: int, once: dict[str, np.ndarray] | None = None,
           masks: dict[str, np.ndarray] | None = None, *, layout: StepSignature) -> np.ndarray:
    """The `output` of a variant's cache-step model run over a sequence in chunks of `chunk`,
    from empty caches (see `decode_all`; each cache input is fed the output its signature pairs
    with it)."""
    return decode_all(step, stream, chunk, empty_cache, axis, once, masks, layout)[0]["output"]


def decode_all(step: Callable[[dict], dict], stream: dict[str, np.ndarray], chunk: int,
               empty_cache: dict[str, np.ndarray], axis: int, once: dict[str, np.ndarray] | None = None,
               masks: dict[str, np.ndarray] | None = None, layout: StepSignature = PLAIN):
    """The outputs of `step` run over a sequence in chunks of `chunk`, from empty caches.

    Args:
        step: one call of the model: {stream inputs, once inputs, past_*} -> {output, present_*}.
        stream: the inputs that run along the sequence (`x`; or `query`, `key`, `value`), whole.
        empty_cache: every cache input with 0 positions.
        axis: the sequence axis of the stream inputs.
        once: inputs given whole at the first step and empty (0 long on axis 1) at the later
            ones, their keys and values being cached by then (the decoder's memory).
        masks: masks over the whole sequence, (..., T, T): each step gets the rows of its block
            and the columns of every key so far, (..., block, end).
        layout: the step's signature: which output returns each cache input, on which axis its
            positions lie, which caches grow by the block (concat) and which are carried (cross),
            and the outputs along the sequence (None: `output`, on `axis`). Every cache input
            must be paired: nothing is guessed from the names.

    Returns:
        ({output: the chunks' values concatenated along its axis}, {cache input: its last value}).
    """
    pairs, cache_axes, growing = layout.pairs, layout.cache_axes, layout.growing
    unpaired = [name for name in empty_cache if name not in pairs]
    if unpaired:
        raise ValueError(f"the step's signature pairs no output with the cache input(s) {', '.join(unpaired)}")
    outputs = layout.along or {"output": axis}
    length = next(iter(stream.values())).shape[axis]
    cache = dict(empty_cache)
    outs: dict[str, list] = {name: [] for name in outputs}
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        block = {k: np.take(v, np.arange(start, end), axis=axis) for k, v in stream.items()}
        given = {k: v if start == 0 else v[:, :0] for k, v in (once or {}).items()}
        given.update({k: v[..., start:end, :end] for k, v in (masks or {}).items()})
        got = step({**block, **given, **cache})
        for name in outputs:
            outs[name].append(np.asarray(got[name]))
        cache = {name: np.asarray(got[pairs[name]]) for name in cache}
        for name, value in cache.items():  # self-attention caches grow by the block (a decoder's cross caches do not)
            if name in growing and value.shape[cache_axes[name]] != end:
                raise ValueError(f"{pairs[name]} has {value.shape[cache_axes[name]]} positions after {end} tokens")
    return {name: np.concatenate(v, axis=outputs[name]) for name, v in outs.items()}, cache


def stream_axis(variant, o: dict) -> int:
    """The sequence axis of a cache-step variant's stream inputs (the position of `seq`)."""
    first = variant.inputs(o)[0]
    return list(first.dims).index("seq")


def split_inputs(variant, o: dict, inputs: dict[str, np.ndarray],
                 signature: StepSignature) -> tuple[dict, dict, dict]:
    """(stream, once, masks): a cache step's inputs besides its caches and write position (those
    `signature` names), split by what their axes say: masks over past and new keys (an axis that
    is a sum: past_seq+seq), those given once (the decoder's memory: an axis a cross cache grows
    by, and none the sequence runs along) and those that run along the sequence (the rest: a `seq`
    axis, or the keys and values a concat cache grows by)."""
    pos = signature.write_pos.name if signature.write_pos else None
    specs = [s for s in variant.inputs(o) if s.name not in signature.pairs and s.name != pos]
    masks = {s.name: inputs[s.name] for s in specs if any(isinstance(d, str) and "+" in d for d in s.dims)}
    along = {"seq"} | new_lengths(variant, o, signature, "concat")
    cross = new_lengths(variant, o, signature, "cross")
    once = {s.name: inputs[s.name] for s in specs if s.name not in masks and set(s.dims) & cross
            and not set(s.dims) & along}
    stream = {s.name: inputs[s.name] for s in specs if s.name not in masks and s.name not in once}
    return stream, once, masks


def growth(variant, o: dict, signature: StepSignature, kind: str | None = None) -> dict[str, str]:
    """{the size of a cache's positions axis: the size it grows by at a step}, as the variant
    declares them (a pair's returned positions axis, `past_seq+kv_seq`: the input's own size and
    the other summand), for the caches of `kind` ("concat", "cross"; None: both). A static
    buffer's positions axis is its fixed size, which no step grows."""
    ins, outs = {s.name: s for s in variant.inputs(o)}, {s.name: s for s in variant.outputs(o)}
    grown = {}
    for c in signature.caches:
        own, total = ins[c.past].dims[c.axis], outs[c.present].dims[c.axis]
        if c.kind != "static" and (kind is None or c.kind == kind) and isinstance(total, str) and "+" in total:
            grown[own] = next(iter(set(total.split("+")) - {own}))
    return grown


def new_lengths(variant, o: dict, signature: StepSignature, kind: str) -> set[str]:
    """The sizes the caches of `kind` grow by at a step (see growth)."""
    return set(growth(variant, o, signature, kind).values())


def cache_lengths(variant, o: dict, signature: StepSignature, kind: str | None = None) -> set[str]:
    """The sizes of the growing caches' positions axes that are the variant's options (`past_seq`
    and the like), of the caches of `kind` (None: every growing one; see growth)."""
    return {d for d in growth(variant, o, signature, kind) if d in o}


def empty_cache(variant, o: dict, dtype, signature: StepSignature) -> dict[str, np.ndarray]:
    """Every cache input of a cache-step variant's `signature` at options o, with 0 positions
    (the sizes of its positions axes, `past_seq` and the like, at 0)."""
    empty = {**o, **dict.fromkeys(cache_lengths(variant, o, signature), 0)}
    specs = {s.name: s for s in variant.inputs(empty)}
    return {c.past: np.zeros(specs[c.past].shape(empty), dtype) for c in signature.caches}


STATIC_PROMPT = 3  # the static cache's check: sequence b's prompt is STATIC_PROMPT - b tokens (at least 1)


def static_prompts(batch: int) -> np.ndarray:
    """Prompt lengths of the static cache's decode check: a different one per sequence."""
    return np.maximum(STATIC_PROMPT - np.arange(batch), 1)


def static_reach(prompts: np.ndarray, length: int) -> np.ndarray:
    """How many positions each sequence of `decode_static_all` runs through: its prompt, then as many
    steps as the longest prompt leaves of `length`."""
    return prompts + length - prompts.max()


def decode_static_all(step: Callable[[dict], dict], stream: dict[str, np.ndarray], axis: int, prompts: np.ndarray,
                      chunk: int, buffers: dict[str, np.ndarray], once: dict[str, np.ndarray] | None = None,
                      layout: StepSignature = PLAIN):
    """The outputs of a static-cache step model over sequences of different prompt lengths.

    Sequence b's prompt is its first prompts[b] positions. The prompts run as one block (the
    batch's longest: a shorter prompt's block runs on into its next positions, whose keys and
    values the later steps write again at the same places), then every sequence runs on from its
    own position in chunks of `chunk`, each step's `write_pos` being the positions that sequence
    has cached, until each has run n = L - max(prompts) positions past its prompt.

    Args:
        step: one call of the model: {stream inputs, every buffer, write_pos} -> {outputs, every
            updated buffer}.
        stream: the inputs that run along the sequence (`x`; or `query`, `key`, `value`), whole:
            L positions on `axis`, which is also the outputs'.
        buffers: the caches: static buffers (B, H, S, d) with S >= L, their contents garbage
            (attention must read only what was written); and any other cache carried from step
            to step (a decoder's cross cache, empty at first).
        once: inputs given whole at the first step and empty (0 long on axis 1) at the later
            ones, their keys and values being cached by then (the decoder's memory).
        layout: the step's signature: its cache pairs; `along`, the outputs that run along the
            sequence -> their axis (default: `output` on the stream's axis); `write_pos`, the
            input telling the step where to write (a form other than "start" needs prompts of
            one length).

    Returns:
        ({output: sequence b's values at positions below prompts[b] + n, zeros past them},
        {cache input: its last value}).
    """
    pairs, outputs = layout.pairs, layout.along or {"output": axis}
    write_pos = layout.write_pos or WritePos("write_pos")
    first_input = next(iter(stream.values()))
    batch, length = first_input.shape[0], first_input.shape[axis]
    longest = int(prompts.max())
    n = length - longest  # positions each sequence runs past its prompt (see static_reach)
    cache = dict(buffers)

    def take(b, start, size):  # sequence b's positions start .. start+size-1, batch axis kept
        return {k: np.take(v[b:b + 1], np.arange(start, start + size), axis=axis) for k, v in stream.items()}

    def run(blocks, starts, size, first=False):
        nonlocal cache
        given = {k: np.concatenate([blk[k] for blk in blocks]) for k in stream}
        given.update({k: v if first else v[:, :0] for k, v in (once or {}).items()})
        got = step({**given, **cache, write_pos.name: write_pos.value(starts, size)})
        cache = {name: np.asarray(got[pairs[name]]) for name in cache}
        return {name: np.asarray(got[name]) for name in outputs}

    first = run([take(b, 0, longest) for b in range(batch)], np.zeros(batch, np.int64), longest, first=True)
    out = {}
    for name, values in first.items():
        shape = list(values.shape)
        shape[outputs[name]] = length
        out[name] = np.zeros(shape, values.dtype)

    def put(b, start, got):  # got: the step's outputs; sequence b's from position start
        for name, values in got.items():
            along = outputs[name]
            at: list = [slice(None)] * values.ndim
            at[0], at[along] = b, slice(start, start + values.shape[along])
            out[name][tuple(at)] = values[b]

    for b in range(batch):
        put(b, 0, {name: np.take(v, np.arange(prompts[b]), axis=outputs[name]) for name, v in first.items()})
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        at = prompts + start
        got = run([take(b, at[b], size) for b in range(batch)], at, size)
        for b in range(batch):
            put(b, at[b], got)
    return out, cache
