"""Whisper, an encoder-decoder, as its deployments load it: three graphs with Optimum's names.

- `encoder_model.onnx`: input_features (B, mels, 3000) -> last_hidden_state (B, 1500, width);
- `decoder_model.onnx`, the first step: input_ids (B, T), encoder_hidden_states -> logits and, a
  layer each, present.i.decoder.key/value (the self cache of the T tokens) and
  present.i.encoder.key/value (the cross keys and values, computed here once from the encoder's
  output);
- `decoder_with_past_model.onnx`, every later step: input_ids and, a layer each,
  past_key_values.i.decoder.key/value (the self cache so far) and past_key_values.i.encoder.key/value
  (the cross cache as the first step returned it, reused) -> logits and present.i.decoder.key/value
  (the self cache with the step's positions appended).

The graphs are Whisper's forward written out over transformers' own parameters (its modules:
convolutions, layer norms, projections, embeddings), each attention through attnexport's core:
the encoder's and the cross-attention unmasked, the decoder's self-attention causal over its cache.
The log-mel features stay in the client (`attnexport.pretrained.audio`), as in Whisper's clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnexport.models.core import attend, attend_static
from attnexport.semantics import Core

ENCODER, DECODER, DECODER_WITH_PAST = "encoder_model", "decoder_model", "decoder_with_past_model"
GRAPHS = (ENCODER, DECODER, DECODER_WITH_PAST)


def self_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.decoder.{kv}" for i in range(layers) for kv in ("key", "value")]


def cross_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.encoder.{kv}" for i in range(layers) for kv in ("key", "value")]


def both_names(layers: int, prefix: str) -> list[str]:
    """Optimum's order: each layer's self key and value, then its cross key and value."""
    return [f"{prefix}.{i}.{side}.{kv}" for i in range(layers) for side in ("decoder", "encoder")
            for kv in ("key", "value")]


# The static self cache's write position: (batch,) int64, each sequence's first new position.
WRITE_POS = "write_pos"


def inputs(graph: str, layers: int, static: bool = False) -> list[str]:
    """A graph's inputs; `static`: the self cache as fixed buffers written at write_pos, which the
    first step takes too (a client allocates them once)."""
    written = [WRITE_POS] if static else []
    return {ENCODER: ["input_features"],
            DECODER: ["input_ids", "encoder_hidden_states", *written,
                      *(self_names(layers, "past_key_values") if static else [])],
            DECODER_WITH_PAST: ["input_ids", *written, *both_names(layers, "past_key_values")]}[graph]


def outputs(graph: str, layers: int) -> list[str]:
    return {ENCODER: ["last_hidden_state"], DECODER: ["logits", *both_names(layers, "present")],
            DECODER_WITH_PAST: ["logits", *self_names(layers, "present")]}[graph]


def dynamic_axes(graph: str, layers: int, static: bool = False) -> dict:
    """Each input's symbolic axes, Optimum's names (the encoder's frames are fixed: 30 s; a static
    self cache's positions are its buffers')."""
    if graph == ENCODER:
        return {"input_features": {0: "batch_size"}}
    axes = {"input_ids": {0: "batch_size", 1: "decoder_sequence_length"}}
    if static:
        axes[WRITE_POS] = {0: "batch_size"}
        axes.update({n: {0: "batch_size"} for n in self_names(layers, "past_key_values")})
    if graph == DECODER:
        return {**axes, "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"}}
    for name in both_names(layers, "past_key_values"):
        if ".decoder." in name:
            if not static:
                axes[name] = {0: "batch_size", 2: "past_decoder_sequence_length"}
        else:
            axes[name] = {0: "batch_size", 2: "encoder_sequence_length_out"}
    return axes


def cache_pairs(layers: int) -> dict[str, str]:
    """{self past: the present that returns it with the step appended (static: written in)}."""
    return dict(zip(self_names(layers, "past_key_values"), self_names(layers, "present"), strict=True))


# --- the torch graphs ----------------------------------------------------------------------------

def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, H * d) -> (B, H, T, d)."""
    b, t, _ = x.shape
    return x.reshape(b, t, heads, -1).transpose(1, 2)


def _merged(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) -> (B, T, H * d)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def _core(attn, causal: bool) -> Core:
    return Core(attn.head_dim ** -0.5, causal)


def self_attention(attn, x, causal: bool, past=None):
    """A self-attention (transformers' WhisperAttention's parameters) through the core: returns
    (output, the keys, the values), the past's positions first where there is one."""
    q, k, v = (_heads(p(x), attn.num_heads) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    a = attend(q, k, v, cache=past, core=_core(attn, causal))
    if a.present_key is not None and a.present_value is not None:  # the past's positions, then the block's
        k, v = a.present_key, a.present_value
    return attn.out_proj(_merged(a.output)), k, v


def self_attention_static(attn, x, buffers, write_pos):
    """A causal self-attention over fixed buffers (key, value) (B, H, max_seq, d): the block's keys
    and values written at write_pos, attention over each sequence's written prefix (attnexport's
    static core). Returns (output, the key buffer, the value buffer)."""
    q, k, v = (_heads(p(x), attn.num_heads) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    out, key, value = attend_static(q, k, v, buffers, write_pos, _core(attn, True))
    return attn.out_proj(_merged(out)), key, value


def cross_kv(attn, states) -> tuple[torch.Tensor, torch.Tensor]:
    """A cross-attention's keys and values of the encoder's output (B, H, S, d): what the first step
    computes once."""
    return _heads(attn.k_proj(states), attn.num_heads), _heads(attn.v_proj(states), attn.num_heads)


def cross_attention(attn, x, key, value):
    q = _heads(attn.q_proj(x), attn.num_heads)
    return attn.out_proj(_merged(attend(q, key, value, core=_core(attn, False)).output))


def _feed_forward(layer, x):
    return layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))


class Encoder(torch.nn.Module):
    """input_features (B, mels, 3000) -> last_hidden_state (B, 1500, width)."""

    def __init__(self, model):
        super().__init__()
        self.encoder = model.model.encoder

    def forward(self, input_features):
        e = self.encoder
        x = torch.nn.functional.gelu(e.conv1(input_features))
        x = torch.nn.functional.gelu(e.conv2(x)).transpose(1, 2)
        x = x + e.embed_positions.weight[:x.shape[1]]
        for layer in e.layers:
            x = x + self_attention(layer.self_attn, layer.self_attn_layer_norm(x), False)[0]
            x = x + _feed_forward(layer, x)
        return e.layer_norm(x)


class _DecoderStep(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.decoder, self.proj_out = model.model.decoder, model.proj_out

    def step(self, input_ids, past_len, pasts, crosses, write_pos=None):
        """logits, each layer's self keys and values, each layer's cross keys and values. With
        `write_pos` (B,), `pasts` are static buffers, written at each sequence's write_pos."""
        d = self.decoder
        if write_pos is None:
            positions = d.embed_positions.weight[past_len:past_len + input_ids.shape[1]]
        else:  # each sequence's own positions, (B, T, width)
            positions = d.embed_positions.weight[write_pos.reshape(-1, 1) + torch.arange(input_ids.shape[1])]
        x = d.embed_tokens(input_ids) + positions
        written, kept = [], []
        for i, layer in enumerate(d.layers):
            if write_pos is not None:
                out, k, v = self_attention_static(layer.self_attn, layer.self_attn_layer_norm(x), pasts[i], write_pos)
            else:
                out, k, v = self_attention(layer.self_attn, layer.self_attn_layer_norm(x), True,
                                           pasts[i] if pasts is not None else None)
            x = x + out
            ck, cv = crosses[i]
            x = x + cross_attention(layer.encoder_attn, layer.encoder_attn_layer_norm(x), ck, cv)
            x = x + _feed_forward(layer, x)
            written.append((k, v))
            kept.append((ck, cv))
        return self.proj_out(d.layer_norm(x)), written, kept


class Decoder(_DecoderStep):
    """The first step: input_ids, encoder_hidden_states -> logits, each layer's self key and value
    of the tokens and cross key and value of the encoder's output (Optimum's order)."""

    def forward(self, input_ids, encoder_hidden_states):
        crosses = [cross_kv(layer.encoder_attn, encoder_hidden_states) for layer in self.decoder.layers]
        logits, written, kept = self.step(input_ids, 0, None, crosses)
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class DecoderWithPast(_DecoderStep):
    """A later step: input_ids and each layer's self past and cross cache (Optimum's order) ->
    logits, each layer's self key and value with the step appended."""

    def forward(self, input_ids, *caches):
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(len(self.decoder.layers))]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(len(self.decoder.layers))]
        logits, written, _ = self.step(input_ids, caches[0].shape[2], pasts, crosses)
        return (logits, *[t for k, v in written for t in (k, v)])


class StaticDecoder(_DecoderStep):
    """The first step over a static self cache: input_ids, encoder_hidden_states, write_pos and
    each layer's self key and value buffers -> logits, each layer's buffers written and its cross
    key and value (Optimum's order)."""

    def forward(self, input_ids, encoder_hidden_states, write_pos, *buffers):
        crosses = [cross_kv(layer.encoder_attn, encoder_hidden_states) for layer in self.decoder.layers]
        pasts = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(self.decoder.layers))]
        logits, written, kept = self.step(input_ids, 0, pasts, crosses, write_pos)
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class StaticDecoderWithPast(_DecoderStep):
    """A later step over a static self cache: input_ids, write_pos and each layer's self buffers
    and cross cache -> logits, each layer's buffers written."""

    def forward(self, input_ids, write_pos, *caches):
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(len(self.decoder.layers))]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(len(self.decoder.layers))]
        logits, written, _ = self.step(input_ids, 0, pasts, crosses, write_pos)
        return (logits, *[t for k, v in written for t in (k, v)])


def modules(model, static: bool = False) -> dict[str, torch.nn.Module]:
    """The three graphs' torch modules over `model` (a WhisperForConditionalGeneration); `static`:
    the decoder's over a static self cache."""
    first, later = (StaticDecoder, StaticDecoderWithPast) if static else (Decoder, DecoderWithPast)
    return {ENCODER: Encoder(model).eval(), DECODER: first(model).eval(), DECODER_WITH_PAST: later(model).eval()}


# --- transcription ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tokens:
    """What a transcription loop needs of the tokenizer and the generation config: the start tokens,
    the end token, the tokens never picked and those not picked first."""

    start: tuple[int, ...]
    end: int
    suppress: tuple[int, ...] = ()
    suppress_first: tuple[int, ...] = ()


def transcribe(run_encoder, run_first, run_later, features: np.ndarray, tokens: Tokens, layers: int,
               max_tokens: int) -> list[list[int]]:
    """Greedy transcription of a batch of features (B, mels, 3000), the loop a client writes: the
    encoder once, the first decoder step over the start tokens (its cross cache kept), then a token
    a step with the self cache fed back, until every sequence has said the end token or
    `max_tokens`; `tokens.suppress` are never picked, `tokens.suppress_first` not as the first token
    (Whisper's generation config). Each `run_*(feed) -> {output: array}` runs one graph on any
    runtime. Returns each sequence's tokens after the start tokens, without the end token."""
    start, end, suppress, suppress_first = list(tokens.start), tokens.end, tokens.suppress, tokens.suppress_first
    batch = features.shape[0]
    states = run_encoder({"input_features": features})["last_hidden_state"]
    ids = np.tile(np.asarray(start, np.int64), (batch, 1))
    out = run_first({"input_ids": ids, "encoder_hidden_states": states})
    crosses = {n.replace("present", "past_key_values"): out[n] for n in cross_names(layers, "present")}
    said: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for step in range(max_tokens):
        logits = np.array(out["logits"][:, -1], np.float64)
        logits[:, list(suppress)] = -np.inf
        if step == 0:
            logits[:, list(suppress_first)] = -np.inf
        token = np.where(done, end, logits.argmax(-1))
        for b in range(batch):
            if not done[b] and token[b] != end:
                said[b].append(int(token[b]))
        done |= token == end
        if done.all():
            break
        caches = {**crosses, **{n.replace("present", "past_key_values"): out[n] for n in self_names(layers, "present")}}
        out = run_later({"input_ids": token[:, None].astype(np.int64),
                         **{n: caches[n] for n in both_names(layers, "past_key_values")}})
    return said


def stepped(run_first, run_later, ids: np.ndarray, states: np.ndarray, first: int, layers: int) -> np.ndarray:
    """The logits (B, T, V) of `ids` (B, T) fed as a client feeds them: the first step over
    ids[:, :first] (its cross cache kept), then a token a step through the self cache."""
    out = run_first({"input_ids": ids[:, :first], "encoder_hidden_states": states})
    crosses = {n.replace("present", "past_key_values"): out[n] for n in cross_names(layers, "present")}
    logits = [np.asarray(out["logits"])]
    for t in range(first, ids.shape[1]):
        caches = {**crosses, **{n.replace("present", "past_key_values"): out[n] for n in self_names(layers, "present")}}
        out = run_later({"input_ids": ids[:, t:t + 1], **{n: caches[n] for n in both_names(layers, "past_key_values")}})
        logits.append(np.asarray(out["logits"]))
    return np.concatenate(logits, axis=1)


# --- the merged decoder ----------------------------------------------------------------------------

MERGED = "decoder_model_merged"
# The merged decoder over a static self cache: its inputs are attnexport's own (write_pos, fixed
# buffers), which Optimum and transformers.js do not feed: the file's name says so.
MERGED_STATIC = "decoder_model_merged_static"
USE_CACHE = "use_cache_branch"


def merged_inputs(layers: int, static: bool = False) -> list[str]:
    return ["input_ids", "encoder_hidden_states", *([WRITE_POS] if static else []),
            *both_names(layers, "past_key_values"), USE_CACHE]


def merged_feed(feed: dict, config) -> dict:
    """The merged decoder's feed for a step of either graph (`feed`: a first step's, with
    encoder_hidden_states, or a later one's, with pasts), as a client fills what the step does
    not use: a first step's pasts empty (no positions), a later step's encoder_hidden_states
    empty, and use_cache_branch saying which."""
    layers, heads = config.decoder_layers, config.decoder_attention_heads
    batch = feed["input_ids"].shape[0]
    use_cache = "encoder_hidden_states" not in feed
    empty_states = np.zeros((batch, 0, config.d_model), np.float32)
    empty_cache = np.zeros((batch, heads, 0, config.d_model // heads), np.float32)
    full = {"input_ids": feed["input_ids"], "encoder_hidden_states": feed.get("encoder_hidden_states", empty_states),
            **({WRITE_POS: feed[WRITE_POS]} if WRITE_POS in feed else {}),
            **{n: feed.get(n, empty_cache) for n in both_names(layers, "past_key_values")},
            USE_CACHE: np.array([use_cache])}
    return full


def static_steps(run_first, run_later, config, max_seq: int):
    """(first step, later step) over a static self cache's graphs, each taking and returning what
    the concat form's do (`transcribe`, `stepped`): the pasts a caller holds put into buffers of
    `max_seq` positions (zeros past them) with write_pos their length, the buffers the step wrote
    cut back to the positions written. The caller's loops run unchanged; a client of the static
    form keeps the buffers and binds them (docs/whisper.md)."""
    layers, heads = config.decoder_layers, config.decoder_attention_heads
    names = self_names(layers, "past_key_values")

    def buffers(batch: int, dtype, pasts: dict) -> dict:
        out = {}
        for n in names:
            b = np.zeros((batch, heads, max_seq, config.d_model // heads), dtype)
            if n in pasts:
                b[:, :, :pasts[n].shape[2]] = pasts[n]
            out[n] = b
        return out

    def cut(out: dict, written: int) -> dict:
        return {n: (v[:, :, :written] if n in presents else v) for n, v in out.items()}
    presents = set(self_names(layers, "present"))

    def first(feed):  # the inputs in the graph's order (a torch module takes them so)
        batch, t = feed["input_ids"].shape
        dtype = feed["encoder_hidden_states"].dtype
        return cut(run_first({"input_ids": feed["input_ids"], "encoder_hidden_states": feed["encoder_hidden_states"],
                              WRITE_POS: np.zeros(batch, np.int64), **buffers(batch, dtype, {})}), t)

    def later(feed):
        batch, t = feed["input_ids"].shape
        past = feed[names[0]].shape[2]
        filled = {**feed, **buffers(batch, feed[names[0]].dtype, {n: feed[n] for n in names})}
        return cut(run_later({"input_ids": feed["input_ids"], WRITE_POS: np.full(batch, past, np.int64),
                              **{n: filled[n] for n in both_names(layers, "past_key_values")}}), past + t)
    return first, later


def typed(run, model):
    """`run(feed)` with each float input given in the type `model` declares for it (a ModelProto, or
    an ONNX Runtime session): a half graph takes float16 features, states and caches, which the
    loops here make in float32."""
    import onnx
    if isinstance(model, onnx.ModelProto):
        types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    else:
        types = {i.name: np.dtype(np.float16 if i.type == "tensor(float16)" else np.float32) for i in model.get_inputs()
                 if i.type in ("tensor(float16)", "tensor(float)")}

    def cast(feed: dict) -> dict:
        return run({k: v.astype(types[k]) if k in types and np.issubdtype(np.asarray(v).dtype, np.floating) and
                    np.asarray(v).dtype != types[k] else v for k, v in feed.items()})
    return cast


def merged_steps(run_merged, config):
    """(first step, later step) over the merged decoder `run_merged(feed) -> {output: array}`,
    each taking and returning what its own graph does (`merged_feed`; a later step's cross presents,
    empty, left out)."""
    later_outputs = outputs(DECODER_WITH_PAST, config.decoder_layers)

    def first(feed):
        return run_merged(merged_feed(feed, config))

    def later(feed):
        out = run_merged(merged_feed(feed, config))
        return {n: out[n] for n in later_outputs}
    return first, later


def merged(first, later, layers: int):
    """One decoder graph for both steps, as transformers.js loads Whisper (and Optimum can): an If
    on `use_cache_branch` (bool (1,)) runs `later` (the step with past: each layer's cross present
    empty, the clients keeping the first step's) when it is true, else `first` (the first step, which computes
    the cross cache from encoder_hidden_states); every input of both, every output of `first`.
    A weight both graphs hold (the same bytes) is kept once; names inside each branch are prefixed
    so that they cannot meet."""
    import hashlib

    import onnx
    from onnx import helper

    for g in (first, later):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.graph.node
               for a in n.attribute):
            raise ValueError("a decoder graph with subgraphs of its own cannot be merged")
    static = WRITE_POS in {i.name for i in first.graph.input}
    outer = set(merged_inputs(layers, static))
    kept: dict[str, str] = {}  # digest -> initializer name in the merged graph
    initializers = []

    def share(graph, prefix: str) -> dict[str, str]:
        names = {}
        for init in graph.initializer:
            digest = hashlib.sha1(init.SerializeToString().replace(init.name.encode(), b"")).hexdigest()
            if digest not in kept:
                kept[digest] = prefix + init.name
                copy = onnx.TensorProto()
                copy.CopyFrom(init)
                copy.name = kept[digest]
                initializers.append(copy)
            names[init.name] = kept[digest]
        return names

    def body(graph, prefix: str, outputs: list[str], extra_nodes=()):
        names = share(graph, prefix)

        def rename(name: str) -> str:
            return name if not name or name in outer else names.get(name, prefix + name)

        nodes = []
        for n in graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.name = prefix + n.name
            copy.input[:] = [rename(i) for i in n.input]
            copy.output[:] = [rename(o) for o in n.output]
            nodes.append(copy)
        nodes += list(extra_nodes)
        produced = {o.name: rename(o.name) for o in graph.output}
        produced.update({o: prefix + o for o in outputs if o not in produced})
        return helper.make_graph(nodes, prefix.rstrip("/"), [], [
            helper.make_tensor_value_info(produced[o], elem_type, None) for o in outputs])

    names = outputs(DECODER, layers)
    elem_type = first.graph.output[0].type.tensor_type.elem_type
    # A later step's cross presents: empty, (batch, heads, 0, head size). The clients keep the cross cache
    # the first step returned (Optimum binds none, transformers.js reads its own); passing the pasts
    # through would copy them every step (ONNX Runtime copies an If's outputs: 1.8 ms of a 9 ms token).
    zero, axis = "with_past/zero", "with_past/positions_axis"
    passed = [helper.make_node("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [1], [v]))
              for name, v in ((zero, 0), (axis, 2))]
    passed += [helper.make_node("Slice", [c.replace("present", "past_key_values"), zero, zero, axis],
                                ["with_past/" + c], name="with_past/empty_" + c)
               for c in cross_names(layers, "present")]
    then_branch = body(later.graph, "with_past/", names, passed)
    else_branch = body(first.graph, "first/", names)
    by_name = {i.name: i for i in list(first.graph.input) + list(later.graph.input)}
    inputs = [by_name[n] for n in merged_inputs(layers, static)[:-1]]
    inputs.append(helper.make_tensor_value_info(USE_CACHE, onnx.TensorProto.BOOL, [1]))
    by_output = {o.name: o for o in first.graph.output}
    out_infos = []
    for n in names:
        info = onnx.ValueInfoProto()
        info.CopyFrom(by_output[n])
        if n != "logits" and not static:  # the concat self cache's positions differ between the branches
            dims = info.type.tensor_type.shape.dim
            if ".decoder." in n:
                dims[2].Clear()
                dims[2].dim_param = "present_decoder_sequence_length"
        out_infos.append(info)
    node = helper.make_node("If", [USE_CACHE], names, name="use_cache_branch", then_branch=then_branch,
                            else_branch=else_branch)
    graph = helper.make_graph([node], "whisper_decoder_merged", inputs, out_infos, initializers)
    model = helper.make_model(graph, opset_imports=list(first.opset_import), ir_version=first.ir_version)
    functions = {(f.domain, f.name): f for f in list(first.functions) + list(later.functions)}
    model.functions.extend(functions.values())
    for p in first.metadata_props:
        model.metadata_props.add(key=p.key, value=p.value)
    return model
