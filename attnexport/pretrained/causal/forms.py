"""A causal language model's cache forms (`attnexport.pretrained.forms`' classes, registered by
this family): beside what every form says, how a decode's and a generation's steps are fed, a
sequence stepped through the cache, and bench's timed step.

- `none`: input_ids, attention_mask, position_ids -> logits.
- `concat`: the names Optimum's exports use (`input_ids`, `attention_mask`, `position_ids`,
  `past_key_values.{i}.key`/`.value` -> `logits`, `present.{i}.key`/`.value`), so the file loads
  where those do; each present is the past with the block's keys after it. Each layer's attention
  is attnexport's core with the layer's past as its cache (`_concat_attention`), grouped heads as
  they are; transformers makes its masks as for sdpa.
- `static`: `input_ids`, `write_pos`, `past_key_values.{i}.key`/`.value` buffers of `max_seq`
  positions -> `logits`, `present.{i}.key`/`.value` (the buffers written). Each layer's attention
  is attnexport's static step (`attnexport.models.core.attend_static`): the block's keys and
  values written at each sequence's `write_pos`, attention over its valid prefix; the ort flavour
  makes that one GroupQueryAttention that writes the buffers in place. A sequence's positions are
  write_pos + 0..T-1, so prompts of different lengths go in right-padded (each sequence's next
  write_pos is its own length) and no mask is needed. A sliding-window layer whose window is
  shorter than `max_seq` keeps a ring of its window instead (`attnexport.models.core.attend_ring`:
  position p at slot p % window, the ring returned rewritten), so that Gemma's local layers hold
  512 positions whatever `max_seq` is.

Grouped heads stay grouped in every cache. A form's methods take the model's layout
(`attnexport.pretrained.model.Layout`: layers, cache heads and head size, vocabulary, buffers).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

import numpy as np
import torch

from attnexport import signature as SG
from attnexport import stamping as ST
from attnexport.errors import UsageError
from attnexport.models.core import attend, attend_ring, attend_static
from attnexport.pretrained import forms as FM
from attnexport.semantics import Core


def positions_of(mask: np.ndarray) -> np.ndarray:
    """Position ids of a padding mask as transformers' generate makes them: each token's count of
    tokens before it; 1 on padding (never attended)."""
    return np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)


def left_padded(prompts, pad: int):
    """(ids, mask, positions) of prompts left-padded to the longest, as transformers' generate
    takes them."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    return ids, mask, positions_of(mask)


class Decoding:
    """A greedy generation's feeds as one form makes them: `feed` (the next step's inputs) and
    `last` (B,): the position of each sequence's last token in the step's logits."""

    feed: dict
    last: np.ndarray

    def advance(self, token: np.ndarray, out: dict) -> None:
        """The next step's feed after `token` (B,) was chosen from the step's outputs `out`."""
        raise NotImplementedError


class CausalForm(FM.CacheForm):
    """A language model's form: token ids, a padding mask and position ids in (and the cache),
    logits out; its feeds, steps and decoding."""

    def repeat(self, wrapper, layout) -> ST.Repeat | None:
        """How the export traces the model (`wrapper`, this form's step) with three of its layers
        and stamps the rest (`attnexport.stamping`): where it has more than three, all of one kind
        (one class, the same parameters' shapes, one attention type and window); None else."""
        found = _layer_list(wrapper, layout.layers)
        if found is None or layout.layers <= ST.TRACED:
            return None
        path, layers = found
        config = wrapper.model.config
        kinds = set(getattr(config, "layer_types", None) or ()) | set(layout.extra.get("windows") or ())
        shapes = {tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()) for layer in layers}
        if len(kinds) > 1 or len(shapes) > 1 or len({type(layer) for layer in layers}) > 1:
            return None
        pairs = list(layout.cache_pairs.items())
        per = len(pairs) // layout.layers

        def names(i: int) -> list[str]:
            own = pairs[i * per:(i + 1) * per]
            return [p for p, _ in own] + [q for _, q in own]
        return ST.Repeat(layout.layers, path, names, lambda module: _shallow(module, path, ST.TRACED))

    def inputs(self, layout) -> list[str]:
        return ["input_ids", "attention_mask", "position_ids", *self.cache_names(layout, "past_key_values")]

    def outputs(self, layout) -> list[str]:
        return ["logits", *self.cache_names(layout, "present")]

    def dynamic_axes(self, layout) -> dict:
        """The symbolic axes of each input of the step graph."""
        dims = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_len"},
                "position_ids": {0: "batch", 1: "sequence"}}
        return {**dims, **{n: {0: "batch", 2: "past_len"} for n in self.cache_names(layout, "past_key_values")}}

    # --- feeds ---------------------------------------------------------------------------------

    def cache_shapes(self, layout, batch: int, positions: int = 0) -> dict:
        """{past input: its shape} of caches of `positions` positions, each layer's key and value."""
        shape = (batch, layout.kv_heads, positions, layout.head_dim)
        return {n: shape for n in self.cache_names(layout, "past_key_values")}

    def empty_caches(self, layout, batch: int, dtype, positions: int = 0) -> dict:
        """{past input: zeros} of `positions` positions, each layer's key and value."""
        return {n: np.zeros(shape, dtype) for n, shape in self.cache_shapes(layout, batch, positions).items()}

    def cache_positions(self, layout, past: int = 0) -> int:
        """The positions of a cache holding `past` positions (0: a first step's, empty)."""
        return past

    def example_feed(self, layout, batch: int, block: int, past: int, seed: int, padded: int) -> dict:
        """One step's inputs: `block` random tokens after `past` cached positions of random keys
        and values, every position a token but sequence 0's first `padded` (left padding, masked
        out, the positions counting tokens only)."""
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, layout.vocab, (batch, block), dtype=np.int64)
        mask = np.ones((batch, past + block), np.int64)
        mask[0, :padded] = 0
        feed = self._example_step(layout, ids, mask, past)
        for name, shape in self.cache_shapes(layout, batch, self.cache_positions(layout, past)).items():
            feed[name] = rng.standard_normal(shape).astype(np.float32)
        return feed

    def _example_step(self, layout, ids, mask, past) -> dict:
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions_of(mask)[:, past:]}

    def prefilled_feed(self, run, layout, ids: np.ndarray, past: int, padded: int, dtype) -> dict:
        """The feed of one step over ids[:, past:] after a cache `run` (the model) wrote from
        ids[:, :past]: sequence 0's first `padded` positions padding (mask 0, positions counting
        tokens only)."""
        batch, total = ids.shape
        mask = np.ones((batch, total), np.int64)
        mask[0, :padded] = 0
        positions = positions_of(mask)
        pasts = self.empty_caches(layout, batch, dtype)
        if past:
            out = run({"input_ids": ids[:, :past], "attention_mask": mask[:, :past],
                       "position_ids": positions[:, :past], **pasts})
            pasts = {p: out[q] for p, q in layout.cache_pairs.items()}
        return {"input_ids": ids[:, past:], "attention_mask": mask, "position_ids": positions[:, past:], **pasts}

    def valid_positions(self, layout, feed: dict) -> dict:
        """{output: boolean array broadcastable to it}: the positions a check compares. Logits of
        padding tokens and the cache entries of padding positions are not (`attention_mask` is 0
        there)."""
        block = feed["input_ids"].shape[1]
        mask = np.asarray(feed["attention_mask"]).astype(bool)  # (B, past + T)
        return {"logits": mask[:, -block:, None],
                **{n: mask[:, None, :, None] for n in self.cache_names(layout, "present")}}

    def block_feed(self, layout, block: np.ndarray, start: int, state: dict) -> dict:
        """The step of the tokens `block` (B, T) at positions start.. after the cache `state`."""
        end = start + block.shape[1]
        return {"input_ids": block, "attention_mask": np.ones((block.shape[0], end), np.int64),
                "position_ids": np.broadcast_to(np.arange(start, end), block.shape).copy(), **state}

    def stepped_logits(self, run, layout, ids: np.ndarray, first: int, chunk: int, dtype) -> np.ndarray:
        """The logits (B, T, V) of every position of `ids` (B, T) from the step graph `run`: a
        prefill of `first` tokens into an empty cache, then blocks of `chunk` tokens, each step's
        cache fed to the next."""
        batch, total = ids.shape
        state = self.empty_caches(layout, batch, dtype, self.cache_positions(layout))
        logits, start = [], 0
        while start < total:
            end = first if start == 0 else min(start + chunk, total)
            out = run(self.block_feed(layout, ids[:, start:end], start, state))
            logits.append(np.asarray(out["logits"], np.float64))
            state = {past: out[present] for past, present in layout.cache_pairs.items()}
            start = end
        return np.concatenate(logits, axis=1)

    def decoding(self, layout, prompts, new_tokens: int, dtype) -> Decoding:
        """A greedy generation's feeds after `prompts` (left-padded, with the mask and position
        ids), one token a step with the presents as the next pasts."""
        return _Padded(self, layout, prompts, dtype)

    def batches(self, layout, prompts) -> bool:
        """Whether `prompts` decode together in one batch (else generation runs each alone)."""
        return True

    def bench_feed(self, layout, ids: np.ndarray, context: int, caches) -> dict:
        """A timed step's feed: the tokens `ids` (1, T) after `context` cached positions, the
        caches made by `caches(positions)`."""
        end = context + ids.shape[1]
        return {"input_ids": ids, "attention_mask": np.ones((1, end), np.int64),
                "position_ids": np.arange(context, end)[None, :], **caches(self.cache_positions(layout, context))}

    def bench_mode(self, in_place: bool) -> str:
        """How bench's row says the step's cache goes."""
        return self.name


class NoCache(CausalForm):
    """The whole sequence every step: input_ids, attention_mask, position_ids -> logits."""

    name = "none"
    export_checks = (("batch 2, 6 tokens", 2, 6, 0, 0), ("batch 1, one token", 1, 1, 0, 0),
                     ("batch 3, 7 tokens, sequence 0 left-padded by 3", 3, 7, 0, 3))
    verify_checks = (("batch 2, 5 tokens", 2, 5, 0, 0), ("batch 1, 1 token", 1, 1, 0, 0),
                     ("batch 3, 7 tokens, sequence 0 left-padded by 3", 3, 7, 0, 3))
    cannot = {"transformers.js": "transformers.js 4 feeds only the new token after the first step (it assumes a "
                                 "cache), so a model without one sees one token: export with --kv-cache"}

    def dynamic_axes(self, layout) -> dict:
        return {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                "position_ids": {0: "batch", 1: "sequence"}}

    def wrapper(self, model, layout) -> torch.nn.Module:
        return LogitsOnly(model)

    def example_feed(self, layout, batch, block, past, seed, padded):
        return super().example_feed(layout, batch, block, 0, seed, padded)  # no cache: the mask covers the block

    def prefilled_feed(self, run, layout, ids, past, padded, dtype):
        return super().prefilled_feed(run, layout, ids, 0, padded, dtype)  # the whole of ids: no cache

    def stepped_logits(self, run, layout, ids, first, chunk, dtype):
        """The whole sequence run once (a form without a cache has no steps)."""
        mask = np.ones(ids.shape, np.int64)
        return np.asarray(run({"input_ids": ids, "attention_mask": mask, "position_ids": positions_of(mask)})["logits"],
                          np.float64)

    def decoding(self, layout, prompts, new_tokens, dtype):
        return _Whole(layout, prompts)


class ConcatCache(CausalForm):
    """Optimum's step: each present is the past with the block's keys and values after it."""

    name = "concat"
    kind = "concat"
    export_checks = (("batch 1, one token after 1", 1, 1, 1, 0),
                     ("batch 3, block 6 after 4, sequence 0 left-padded by 2", 3, 6, 4, 2),
                     ("batch 2, block 4, no past", 2, 4, 0, 0))
    verify_checks = (("batch 2, block 5 after 3", 2, 5, 3, 0), ("batch 1, one token after 1", 1, 1, 1, 0),
                     ("batch 3, block 6 after 4, sequence 0 left-padded by 2", 3, 6, 4, 2),
                     ("batch 2, block 4, no past", 2, 4, 0, 0))

    def wrapper(self, model, layout):
        return ConcatStep(model, layout.layers)

    def fit_pasts(self, onnx_model, layout) -> None:
        """Each past first reshaped to (the block's batch, kv heads, -1, head size): a past as it
        comes (no copy), and an empty one of any batch as (batch, kv heads, 0, head size).
        transformers.js 4 feeds the first step's empty pasts with batch 0, which a fused attention
        op (Attention, MultiHeadAttention) refuses next to a block of batch 1, and from which the
        exporter may take the batch size for the whole graph."""
        import onnx
        from onnx import helper

        pasts = self.cache_names(layout, "past_key_values")
        renamed = {p: f"{p}.batched" for p in pasts}
        for node in onnx_model.graph.node:
            for i, name in enumerate(node.input):
                if name in renamed:
                    node.input[i] = renamed[name]
        dims = helper.make_tensor("attnexport_past_dims", onnx.TensorProto.INT64, [3],
                                  [layout.kv_heads, -1, layout.head_dim])
        first = [helper.make_node("Shape", ["input_ids"], ["attnexport_batch"], "attnexport_batch", start=0, end=1),
                 helper.make_node("Constant", [], ["attnexport_past_dims"], "attnexport_past_dims", value=dims),
                 helper.make_node("Concat", ["attnexport_batch", "attnexport_past_dims"], ["attnexport_past_shape"],
                                  "attnexport_past_shape", axis=0)]
        first += [helper.make_node("Reshape", [p, "attnexport_past_shape"], [renamed[p]], f"attnexport_fit_{p}")
                  for p in pasts]
        nodes = first + list(onnx_model.graph.node)
        del onnx_model.graph.node[:]
        onnx_model.graph.node.extend(nodes)


class StaticCache(CausalForm):
    """Buffers of --max-seq positions written in place at each sequence's write_pos; a
    sliding-window layer whose window is shorter: a ring of its window (`rings`)."""

    name = "static"
    kind = "static"
    deploy_file = "onnx/model_static.onnx"  # its inputs are attnexport's own: the file says what it is
    # Within 8 positions (the least --max-seq), a block over written positions at batch 1 only
    # (GroupQueryAttention's limit, see attnexport.export.GQA_BLOCKS).
    export_checks = (("batch 1, one token into empty buffers", 1, 1, 0, 0),
                     ("batch 3, block 6 into empty buffers", 3, 6, 0, 0), ("batch 2, one token after 7", 2, 1, 7, 0),
                     ("batch 1, block 3 after 5", 1, 3, 5, 0))
    verify_checks = (("batch 2, block 3 into empty buffers", 2, 3, 0, 0), ("batch 1, one token", 1, 1, 0, 0),
                     ("batch 3, one token after 5", 3, 1, 5, 0), ("batch 1, block 3 after 7", 1, 3, 7, 0))
    _own = "the static form's inputs (write_pos, fixed buffers) are attnexport's own: "
    cannot = {"optimum": _own + "docs/language-models.md's loop runs it; export with --kv-cache for Optimum",
              "transformers.js": _own + "export with --kv-cache for transformers.js"}
    needs = ("--kv-cache static",)
    trace_shape = (3, 0)
    writes_in_place = True
    MIN_MAX_SEQ = 8

    def inputs(self, layout):
        return ["input_ids", "write_pos", *self.cache_names(layout, "past_key_values")]

    def dynamic_axes(self, layout):
        return {"input_ids": {0: "batch", 1: "sequence"}, "write_pos": {0: "batch"},
                **{n: {0: "batch"} for n in self.cache_names(layout, "past_key_values")}}

    def signature(self, layout):
        rings = self.ring_sizes(layout)
        caches = tuple(SG.CachePair(p, q, 2, "ring" if p in rings else "static") for p, q in layout.cache_pairs.items())
        return SG.StepSignature(caches=caches, write_pos=SG.WritePos("write_pos"))

    @staticmethod
    def rings(layout) -> tuple[int, ...]:
        """Each layer's ring: its sliding window where that is shorter than the buffers (the
        layer's keys and values kept in as many slots, position p at slot p % window), else 0 (a
        buffer of --max-seq positions). Layers see their window only (`layout.extra["windows"]`,
        read from the model's config: 0 for a layer that sees every position)."""
        windows = layout.extra.get("windows") or [0] * layout.layers
        return tuple(w if 0 < w < layout.max_seq else 0 for w in windows)

    def ring_sizes(self, layout) -> dict[str, int]:
        """{past input and present output of a ring layer: its slots}."""
        rings = self.rings(layout)
        return {n: rings[i] for prefix in ("past_key_values", "present") for i in range(layout.layers) if rings[i]
                for n in (f"{prefix}.{i}.key", f"{prefix}.{i}.value")}

    def cache_shapes(self, layout, batch, positions=0):
        rings = self.rings(layout)
        return {n: (batch, layout.kv_heads, rings[i // 2] or positions, layout.head_dim)
                for i, n in enumerate(self.cache_names(layout, "past_key_values"))}

    def batches(self, layout, prompts):
        """Right-padded prompts decode in one batch unless a ring would lose what it holds: a prompt
        shorter than the longest, when the longest passes a ring's window (its padding, written
        after it, would wrap onto positions the window still sees). Then each goes alone."""
        rings = [w for w in self.rings(layout) if w]
        lengths = {len(p) for p in prompts}
        return not rings or len(lengths) == 1 or max(lengths) <= min(rings)

    def check_max_seq(self, max_seq):
        if max_seq < self.MIN_MAX_SEQ:
            raise UsageError(f"--kv-cache static needs --max-seq N, the buffers' positions (at least "
                             f"{self.MIN_MAX_SEQ}), got {max_seq}")

    def wrapper(self, model, layout):
        return StaticStep(model, layout.layers, self.rings(layout))

    def rotary_positions(self, model, layout):
        return layout.max_seq

    def notes(self, attention_op, dtype):
        if attention_op.endswith("GroupQueryAttention") and dtype == "fp32":
            return [CPU_ONLY_STATIC]
        return []

    def room(self, layout):
        return layout.max_seq

    def check_room(self, layout, needs, what):
        if layout.max_seq < needs:
            raise UsageError(f"{what} through the static cache: it needs buffers of {needs} positions, the "
                             f"model's hold {layout.max_seq} (export with --max-seq {needs} or more)")

    def cache_positions(self, layout, past=0):
        return layout.max_seq  # the buffers, whatever is written in them

    def _example_step(self, layout, ids, mask, past):
        return {"input_ids": ids, "write_pos": np.full((ids.shape[0],), past, np.int64)}

    def prefilled_feed(self, run, layout, ids, past, padded, dtype):
        """Buffers of max_seq positions written up to `past` (the model run over those alone, the
        rest 0; a ring: whole, as the model wrote it), write_pos `past`."""
        batch = ids.shape[0]
        buffers = self.empty_caches(layout, batch, dtype, self.cache_positions(layout))
        rings = self.ring_sizes(layout)
        if past:
            out = run({"input_ids": ids[:, :past], "write_pos": np.zeros(batch, np.int64),
                       **{n: b if n in rings else b[:, :, :past] for n, b in buffers.items()}})
            for p, q in layout.cache_pairs.items():
                if p in rings:
                    buffers[p] = np.array(out[q], dtype)
                else:
                    buffers[p][:, :, :past] = out[q]
        return {"input_ids": ids[:, past:], "write_pos": np.full(batch, past, np.int64), **buffers}

    def valid_positions(self, layout, feed):
        """The logits of every token (no padding); the buffers up to each sequence's write_pos +
        the block (past it a buffer holds what the runtime left there). A buffer's array covers
        positions up to the furthest written one only: `reference.masked` cuts the buffer to it
        before anything is copied, so a check at 8,000 positions holds a few rows."""
        batch, block = feed["input_ids"].shape
        ends = np.asarray(feed["write_pos"]).reshape(-1) + block
        end = int(min(ends.max(initial=0), layout.max_seq))
        rings = self.ring_sizes(layout)

        def written(positions):  # (B, 1, positions, 1): a slot once any position reached it
            return (np.arange(positions)[None, :] < ends[:, None])[:, None, :, None]
        return {"logits": np.ones((batch, block, 1), bool),
                **{n: written(rings.get(n, end)) for n in self.cache_names(layout, "present")}}

    def window(self, layout, feed, valid):
        """The step over its buffers cut to the furthest written position: the positions past it
        are masked out of every attention, so the model's outputs over the window are those over
        the whole buffers, and a check at thousands of positions computes a few rows in float64.
        Its presents' whole shapes are their buffers'. A ring is never cut (its slots are not
        positions)."""
        rings = self.ring_sizes(layout)
        pairs = {p: q for p, q in layout.cache_pairs.items() if p not in rings}
        if not pairs:
            return feed, {}
        end = valid[next(iter(pairs.values()))].shape[2]
        return ({n: v[:, :, :end] if n in pairs else v for n, v in feed.items()},
                {q: tuple(np.shape(feed[p])) for p, q in pairs.items()})

    def block_feed(self, layout, block, start, state):
        return {"input_ids": block, "write_pos": np.full(block.shape[0], start, np.int64), **state}

    def decoding(self, layout, prompts, new_tokens, dtype):
        return _RightPadded(self, layout, prompts, new_tokens, dtype)

    def bench_feed(self, layout, ids, context, caches):
        return {"input_ids": ids, "write_pos": np.array([context], np.int64),
                **caches(self.cache_positions(layout, context))}

    def bench_mode(self, in_place):
        return "in-place (IO binding)" if in_place else "copies"


# What export says of a static step whose GroupQueryAttention computes in float32 (fp32, int8,
# int4): ONNX Runtime's CUDA provider has no float32 kernel for it, and the node it leaves on the
# CPU between buffers bound in place on the device answers wrong (H200, 2026-11-26: KL 0.94 on a
# random Llama in fp32 and int4 alike; docs/benchmarks.md).
CPU_ONLY_STATIC = ("not for CUDA: ONNX Runtime's CUDA provider has no float32 GroupQueryAttention, and the one it "
                   "leaves on the CPU gives wrong answers over device buffers; for CUDA export --dtype fp16 or "
                   "--precision q4f16 (verify --runtimes ort-cuda --strict-placement refuses this one)")

FORMS = (NoCache(), ConcatCache(), StaticCache())


# --- generation feeds ------------------------------------------------------------------------------

class _Whole(Decoding):
    """No cache: the whole sequence each step, the new token appended."""

    def __init__(self, layout, prompts):
        ids, mask, positions = left_padded(prompts, layout.pad_token)
        self.feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        self.last = np.full(len(prompts), ids.shape[1] - 1)

    def advance(self, token, out):
        feed, batch = self.feed, len(token)
        self.feed = {"input_ids": np.concatenate([feed["input_ids"], token[:, None]], axis=1),
                     "attention_mask": np.concatenate([feed["attention_mask"], np.ones((batch, 1), np.int64)], axis=1),
                     "position_ids": np.concatenate([feed["position_ids"], feed["position_ids"][:, -1:] + 1], axis=1)}
        self.last = np.full(batch, self.feed["input_ids"].shape[1] - 1)


class _Padded(Decoding):
    """Prompts left-padded with the mask and position ids into empty pasts, then one token a step
    with the presents as the next pasts."""

    def __init__(self, form: CausalForm, layout, prompts, dtype):
        ids, mask, positions = left_padded(prompts, layout.pad_token)
        self.feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                     **form.empty_caches(layout, len(prompts), dtype)}
        self.pairs = layout.cache_pairs
        self.last = np.full(len(prompts), ids.shape[1] - 1)

    def advance(self, token, out):
        batch = len(token)
        mask = np.concatenate([self.feed["attention_mask"], np.ones((batch, 1), np.int64)], axis=1)
        self.feed = {"input_ids": token[:, None], "attention_mask": mask,
                     "position_ids": self.feed["position_ids"][:, -1:] + 1,
                     **{past: out[present] for past, present in self.pairs.items()}}
        self.last = np.zeros(batch, np.int64)


class _RightPadded(Decoding):
    """Prompts right-padded into empty buffers at write_pos 0, each sequence's next write_pos its
    own length, then one token a step at write_pos, the buffers written returned as the next
    step's."""

    def __init__(self, form: CausalForm, layout, prompts, new_tokens: int, dtype):
        lengths = np.array([len(p) for p in prompts])
        if lengths.max() + new_tokens > layout.max_seq:
            raise UsageError(f"prompts of up to {lengths.max()} tokens and {new_tokens} new ones need --max-seq "
                             f">= {lengths.max() + new_tokens}; the model's buffers hold {layout.max_seq}")
        ids = np.full((len(prompts), lengths.max()), layout.pad_token, np.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p
        self.feed = {"input_ids": ids, "write_pos": np.zeros(len(prompts), np.int64),
                     **form.empty_caches(layout, len(prompts), dtype, form.cache_positions(layout))}
        self.pairs = layout.cache_pairs
        self.last = lengths - 1
        self.write_pos = lengths.copy()

    def advance(self, token, out):
        self.feed = {"input_ids": token[:, None], "write_pos": self.write_pos.copy(),
                     **{past: out[present] for past, present in self.pairs.items()}}
        self.write_pos = self.write_pos + 1
        self.last = np.zeros(len(token), np.int64)


# --- the torch wrappers --------------------------------------------------------------------------

class _Step:
    """One step while the model runs it: what the attention function reads (each layer's past or
    buffers, the static form's write_pos) and fills (each layer's keys and values written)."""

    def __init__(self, buffers, write_pos, rings=()):
        self.buffers, self.write_pos, self.rings = buffers, write_pos, rings
        self.written: dict = {}


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("attnexport_hf_step", default=None)
STATIC_ATTENTION = "attnexport_static"
CONCAT_ATTENTION = "attnexport_concat"


def _static_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface for the static form: the layer's step through
    attnexport's static core (its buffers from the step under way), in place of the cache update
    and the attention; returns (output (B, T, H, d), None) as transformers' attention functions do."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the attnexport_static attention runs inside a StaticStep only")
    softcap = kwargs.get("softcap") or 0.0
    i = module.layer_idx
    window, ring = kwargs.get("sliding_window"), step.rings[i] if step.rings else 0
    buffers = (step.buffers[2 * i], step.buffers[2 * i + 1])
    if ring:
        if window != ring:
            raise UsageError(f"layer {i} of the model attends over a window of {window}, its config says {ring}: "
                             "the static form cannot size its ring; export with --kv-cache")
        out, key_out, value_out = attend_ring(query, key, value, buffers, step.write_pos, ring,
                                              Core(scaling, True, softcap))
    elif window is not None and window < buffers[0].shape[2]:
        raise UsageError(f"layer {i} of the model sees the last {window} positions only, and its config names no "
                         "sliding window for it: the static form cannot keep a ring for it; export with --kv-cache, "
                         "or --max-seq at most the window")
    else:
        out, key_out, value_out = attend_static(query, key, value, buffers, step.write_pos,
                                                Core(scaling, True, softcap))
    step.written[i] = (key_out, value_out)
    return out.transpose(1, 2).contiguous(), None


def _concat_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention interface for the concat form: the layer's past (from the step
    under way) and the block's keys and values through attnexport's core with its cache, grouped
    heads as they are (transformers' sdpa function repeats them to the query heads first, a copy of
    the whole cache each step); the present joined by the core. Returns (output (B, T, H, d), None)."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the attnexport_concat attention runs inside a ConcatStep or LogitsOnly only")
    i = module.layer_idx
    past = (step.buffers[2 * i], step.buffers[2 * i + 1]) if step.buffers is not None else None
    if attention_mask is not None and attention_mask.ndim == 4:  # as transformers' sdpa function takes it
        attention_mask = attention_mask[:, :, :, :(past[0].shape[2] if past else 0) + key.shape[2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    a = attend(query, key, value, attention_mask, cache=past,
               core=Core(scaling, bool(is_causal), kwargs.get("softcap") or 0.0))
    step.written[i] = (a.present_key, a.present_value)
    return a.output.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    """The two attention functions in transformers' registry; the concat one's masks made as for
    sdpa (the static one reads none: its core masks by write_pos)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface.register(STATIC_ATTENTION, _static_attention)
    AttentionInterface.register(CONCAT_ATTENTION, _concat_attention)
    AttentionMaskInterface.register(CONCAT_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def _stepping(model, step: _Step, attention: str):
    """The model's layers calling `attention` with `step` under way."""
    token = _STEP.set(step)
    before = model.config._attn_implementation
    model.config._attn_implementation = attention
    try:
        yield
    finally:
        model.config._attn_implementation = before
        _STEP.reset(token)


def _written(step: _Step, layers: int, form: str) -> tuple:
    """Each layer's key and value written by the step, in order."""
    missing = [i for i in range(layers) if i not in step.written]
    if missing:
        raise UsageError(f"the {form} form needs every layer's attention through transformers' attention "
                         f"interface; layer(s) {missing} did not call it")
    return tuple(t for i in range(layers) for t in step.written[i])


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _past_only(past, layers: int):
    """What a concat step's model sees as its cache: the past's positions (the mask's size), and
    an update that hands the block's keys and values on as they are (the attention joins them)."""
    from transformers import DynamicCache

    class PastOnly(DynamicCache):
        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states
    cache = PastOnly()
    for i in range(layers):
        DynamicCache.update(cache, past[2 * i], past[2 * i + 1], i)
    return cache


def _cache_keyword(model) -> str:
    """The name forward takes the cache by: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class LogitsOnly(torch.nn.Module):
    """input_ids, attention_mask, position_ids -> logits (no cache). Position ids are an input, as
    for the concat form: with left padding they count tokens, which absolute position embeddings
    (GPT-2's) see. Each layer's attention is attnexport's core (`_concat_attention` with no past),
    whichever implementation the model was built with (eager where it has no sdpa)."""

    def __init__(self, model):
        super().__init__()
        _register_attention()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        with _stepping(self.model, _Step(None, None), CONCAT_ATTENTION):
            return _logits(self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=False))


class ConcatStep(torch.nn.Module):
    """Optimum's step: input_ids, attention_mask (B, P + T), position_ids, each layer's past key
    and value (B, Hkv, P, d) -> logits, each layer's present (the past, then the block's). Each
    layer's attention is attnexport's core with the past as its cache (`_concat_attention`)."""

    def __init__(self, model, layers: int):
        super().__init__()
        _register_attention()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        step = _Step(past, None)
        with _stepping(self.model, step, CONCAT_ATTENTION):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, **{_cache_keyword(self.model): _past_only(past, self.layers)})
        return (_logits(out), *_written(step, self.layers, "concat"))


class StaticStep(torch.nn.Module):
    """input_ids (B, T), write_pos (B,), each layer's key and value buffers (B, Hkv, max_seq, d) ->
    logits, each layer's buffers with the block written at write_pos. Position ids are
    write_pos + 0..T-1; the attention of every layer is attnexport's static step, or, where
    `rings` gives the layer a window, its ring step (buffers (B, Hkv, window, d))."""

    def __init__(self, model, layers: int, rings: tuple = ()):
        super().__init__()
        _register_attention()
        self.model, self.layers, self.rings = model, layers, rings

    def forward(self, input_ids, write_pos, *buffers):
        positions = write_pos.reshape(-1, 1) + torch.arange(input_ids.shape[1], device=input_ids.device)
        step = _Step(buffers, write_pos, self.rings)
        with _stepping(self.model, step, STATIC_ATTENTION):
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False)
        return (_logits(out), *_written(step, self.layers, "static"))


def _layer_list(wrapper, count: int):
    """(path, the module list) of the model's decoder layers in `wrapper`: its one list of `count`
    modules; None where there is not exactly one."""
    lists = [(n, m) for n, m in wrapper.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    return lists[0] if len(lists) == 1 else None


@contextlib.contextmanager
def _shallow(wrapper, path: str, keep: int):
    """`wrapper` running its model's first `keep` layers only, taking and returning their caches
    only: the layer list, the config's count (and layer types) and the step's count cut, then put
    back."""
    parent, _, name = path.rpartition(".")
    owner = wrapper.get_submodule(parent) if parent else wrapper
    layers, config = getattr(owner, name), wrapper.model.config
    saved = (config.num_hidden_layers, getattr(config, "layer_types", None), getattr(wrapper, "layers", None),
             getattr(wrapper, "rings", None))
    setattr(owner, name, torch.nn.ModuleList(list(layers)[:keep]))
    config.num_hidden_layers = keep
    if saved[2] is not None:
        wrapper.layers = keep
    if saved[1] is not None:
        config.layer_types = saved[1][:keep]
    if saved[3]:
        wrapper.rings = saved[3][:keep]
    try:
        yield
    finally:
        setattr(owner, name, layers)
        config.num_hidden_layers = saved[0]
        if saved[2] is not None:
            wrapper.layers = saved[2]
        if saved[1] is not None:
            config.layer_types = saved[1]
        if saved[3] is not None:
            wrapper.rings = saved[3]
