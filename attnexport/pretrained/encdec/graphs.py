"""An encoder-decoder as its deployments load it: three graphs with Optimum's names, the decoder's
two merged after.

- `encoder_model.onnx`: the encoder's inputs (a family's: Whisper's input_features, a text model's
  input_ids and attention_mask) -> last_hidden_state (B, S, width);
- `decoder_model.onnx`, the first step: input_ids (B, T), encoder_hidden_states (and, where the
  encoder's input is padded, encoder_attention_mask (B, S)) -> logits and, a layer each,
  present.i.decoder.key/value (the self cache of the T tokens) and present.i.encoder.key/value (the
  cross keys and values, computed here once from the encoder's output);
- `decoder_with_past_model.onnx`, every later step: input_ids (encoder_attention_mask) and, a layer
  each, past_key_values.i.decoder.key/value (the self cache so far) and
  past_key_values.i.encoder.key/value (the cross cache as the first step returned it, reused) ->
  logits and present.i.decoder.key/value (the self cache with the step's positions appended);
- `decoder_model_merged.onnx`: both steps in one graph, an If on `use_cache_branch` (`merged`).

A static self cache (`static`) is fixed buffers written at `write_pos`, which the first step takes
too. The loops a client writes over the graphs (`greedy`, `stepped`) run on any runtime: each graph
is a function `feed -> {output: array}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ENCODER, DECODER, DECODER_WITH_PAST = "encoder_model", "decoder_model", "decoder_with_past_model"
GRAPHS = (ENCODER, DECODER, DECODER_WITH_PAST)
# The static self cache's write position: (batch,) int64, each sequence's first new position.
WRITE_POS = "write_pos"
# The decoder's input of the encoder's padding, where the encoder takes a mask.
ENCODER_MASK = "encoder_attention_mask"


@dataclass(frozen=True)
class Spec:
    """What the graphs' names and axes depend on: the decoder's layers, heads and head size (its
    caches'), the encoder's output width, the encoder's inputs with their symbolic axes, and whether
    the decoder takes the encoder's padding mask (a text encoder's inputs are padded; Whisper's
    30 s of features are not)."""

    layers: int
    heads: int
    head_dim: int
    width: int
    encoder_inputs: tuple[str, ...] = ("input_features",)
    encoder_axes: dict = field(default_factory=lambda: {"input_features": {0: "batch_size"}})
    encoder_mask: bool = False


def self_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.decoder.{kv}" for i in range(layers) for kv in ("key", "value")]


def cross_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.encoder.{kv}" for i in range(layers) for kv in ("key", "value")]


def both_names(layers: int, prefix: str) -> list[str]:
    """Optimum's order: each layer's self key and value, then its cross key and value."""
    return [f"{prefix}.{i}.{side}.{kv}" for i in range(layers) for side in ("decoder", "encoder")
            for kv in ("key", "value")]


def inputs(graph: str, spec: Spec, static: bool = False) -> list[str]:
    """A graph's inputs; `static`: the self cache as fixed buffers written at write_pos, which the
    first step takes too (a client allocates them once)."""
    written = [WRITE_POS] if static else []
    mask = [ENCODER_MASK] if spec.encoder_mask else []
    return {ENCODER: list(spec.encoder_inputs),
            DECODER: ["input_ids", "encoder_hidden_states", *mask, *written,
                      *(self_names(spec.layers, "past_key_values") if static else [])],
            DECODER_WITH_PAST: ["input_ids", *mask, *written, *both_names(spec.layers, "past_key_values")]}[graph]


def outputs(graph: str, layers: int) -> list[str]:
    return {ENCODER: ["last_hidden_state"], DECODER: ["logits", *both_names(layers, "present")],
            DECODER_WITH_PAST: ["logits", *self_names(layers, "present")]}[graph]


def dynamic_axes(graph: str, spec: Spec, static: bool = False) -> dict:
    """Each input's symbolic axes, Optimum's names (a static self cache's positions are its buffers')."""
    if graph == ENCODER:
        return {n: dict(a) for n, a in spec.encoder_axes.items()}
    axes = {"input_ids": {0: "batch_size", 1: "decoder_sequence_length"}}
    if spec.encoder_mask:
        axes[ENCODER_MASK] = {0: "batch_size", 1: "encoder_sequence_length"}
    if static:
        axes[WRITE_POS] = {0: "batch_size"}
        axes.update({n: {0: "batch_size"} for n in self_names(spec.layers, "past_key_values")})
    if graph == DECODER:
        return {**axes, "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"}}
    for name in both_names(spec.layers, "past_key_values"):
        if ".decoder." in name:
            if not static:
                axes[name] = {0: "batch_size", 2: "past_decoder_sequence_length"}
        else:
            axes[name] = {0: "batch_size", 2: "encoder_sequence_length_out"}
    return axes


def cache_pairs(layers: int) -> dict[str, str]:
    """{self past: the present that returns it with the step appended (static: written in)}."""
    return dict(zip(self_names(layers, "past_key_values"), self_names(layers, "present"), strict=True))


# --- the loops a client writes -----------------------------------------------------------------------

@dataclass(frozen=True)
class Tokens:
    """What a greedy loop needs of the tokenizer and the generation config: the start tokens, the
    end token, the tokens never picked and those not picked first, and whether the end token is
    forced at the budget's last position (a generation config's `forced_eos_token_id`)."""

    start: tuple[int, ...]
    end: int
    suppress: tuple[int, ...] = ()
    suppress_first: tuple[int, ...] = ()
    forced_end: bool = False


def mask_of(encoder_feed: dict) -> dict:
    """The decoder's encoder_attention_mask of an encoder feed that holds a padding mask, else none."""
    return {ENCODER_MASK: encoder_feed["attention_mask"]} if "attention_mask" in encoder_feed else {}


def greedy(run_encoder, run_first, run_later, encoder_feed: dict, tokens: Tokens, layers: int,
           max_tokens: int) -> list[list[int]]:
    """Greedy decoding of a batch (`encoder_feed`: the encoder's inputs), the loop a client writes:
    the encoder once, the first decoder step over the start tokens (its cross cache kept), then a
    token a step with the self cache fed back, until every sequence has said the end token or
    `max_tokens`; `tokens.suppress` are never picked, `tokens.suppress_first` not as the first token,
    and with `tokens.forced_end` the last token of the budget is the end token (as transformers'
    generate forces it). Each `run_*(feed) -> {output: array}` runs one graph on any runtime. Returns
    each sequence's tokens after the start tokens, without the end token."""
    start, end, suppress, suppress_first = list(tokens.start), tokens.end, tokens.suppress, tokens.suppress_first
    batch = next(iter(encoder_feed.values())).shape[0]
    mask = mask_of(encoder_feed)
    states = run_encoder(encoder_feed)["last_hidden_state"]
    ids = np.tile(np.asarray(start, np.int64), (batch, 1))
    out = run_first({"input_ids": ids, "encoder_hidden_states": states, **mask})
    crosses = {n.replace("present", "past_key_values"): out[n] for n in cross_names(layers, "present")}
    said: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for step in range(max_tokens):
        logits = np.array(out["logits"][:, -1], np.float64)
        logits[:, list(suppress)] = -np.inf
        if step == 0:
            logits[:, list(suppress_first)] = -np.inf
        token = np.where(done | (tokens.forced_end and step == max_tokens - 1), end, logits.argmax(-1))
        for b in range(batch):
            if not done[b] and token[b] != end:
                said[b].append(int(token[b]))
        done |= token == end
        if done.all():
            break
        caches = {**crosses, **{n.replace("present", "past_key_values"): out[n] for n in self_names(layers, "present")}}
        out = run_later({"input_ids": token[:, None].astype(np.int64), **mask,
                         **{n: caches[n] for n in both_names(layers, "past_key_values")}})
    return said


def stepped(run_first, run_later, ids: np.ndarray, states: np.ndarray, first: int, layers: int,
            mask: np.ndarray | None = None) -> np.ndarray:
    """The logits (B, T, V) of `ids` (B, T) fed as a client feeds them: the first step over
    ids[:, :first] (its cross cache kept), then a token a step through the self cache; `mask`: the
    encoder's padding (B, S), where the decoder takes it."""
    masked = {ENCODER_MASK: mask} if mask is not None else {}
    out = run_first({"input_ids": ids[:, :first], "encoder_hidden_states": states, **masked})
    crosses = {n.replace("present", "past_key_values"): out[n] for n in cross_names(layers, "present")}
    logits = [np.asarray(out["logits"])]
    for t in range(first, ids.shape[1]):
        caches = {**crosses, **{n.replace("present", "past_key_values"): out[n] for n in self_names(layers, "present")}}
        out = run_later({"input_ids": ids[:, t:t + 1], **masked,
                         **{n: caches[n] for n in both_names(layers, "past_key_values")}})
        logits.append(np.asarray(out["logits"]))
    return np.concatenate(logits, axis=1)


def teacher_forced(steps, encoder_feed: dict, ids: list[int], first: int, layers: int) -> np.ndarray:
    """The logits (T - first + 1, V) a client's loop over `steps` ((encoder, first step, later step))
    gives for one input (`encoder_feed` of batch 1) fed `ids` teacher-forced: the first step over
    ids[:first], then ids[first:-1] a token a step; row i predicts ids[first + i]."""
    run_encoder, run_first, run_later = steps
    states = run_encoder(encoder_feed)["last_hidden_state"]
    return stepped(run_first, run_later, np.asarray(ids, np.int64)[None, :-1], states, first, layers,
                   encoder_feed.get("attention_mask"))[0, first - 1:]


def row_of(encoder_feed: dict, i: int) -> dict:
    """Input `i` of a batch's encoder feed, as a batch of one."""
    return {k: v[i:i + 1] for k, v in encoder_feed.items()}


# --- the merged decoder ----------------------------------------------------------------------------

MERGED = "decoder_model_merged"
# The merged decoder over a static self cache: its inputs are attnexport's own (write_pos, fixed
# buffers), which Optimum and transformers.js do not feed: the file's name says so.
MERGED_STATIC = "decoder_model_merged_static"
USE_CACHE = "use_cache_branch"


def merged_inputs(spec: Spec, static: bool = False) -> list[str]:
    return ["input_ids", "encoder_hidden_states", *([ENCODER_MASK] if spec.encoder_mask else []),
            *([WRITE_POS] if static else []), *both_names(spec.layers, "past_key_values"), USE_CACHE]


def merged_feed(feed: dict, spec: Spec) -> dict:
    """The merged decoder's feed for a step of either graph (`feed`: a first step's, with
    encoder_hidden_states, or a later one's, with pasts), as a client fills what the step does
    not use: a first step's pasts empty (no positions), a later step's encoder_hidden_states
    empty, and use_cache_branch saying which."""
    batch = feed["input_ids"].shape[0]
    use_cache = "encoder_hidden_states" not in feed
    empty_states = np.zeros((batch, 0, spec.width), np.float32)
    empty_cache = np.zeros((batch, spec.heads, 0, spec.head_dim), np.float32)
    return {"input_ids": feed["input_ids"], "encoder_hidden_states": feed.get("encoder_hidden_states", empty_states),
            **({ENCODER_MASK: feed[ENCODER_MASK]} if ENCODER_MASK in feed else {}),
            **({WRITE_POS: feed[WRITE_POS]} if WRITE_POS in feed else {}),
            **{n: feed.get(n, empty_cache) for n in both_names(spec.layers, "past_key_values")},
            USE_CACHE: np.array([use_cache])}


def static_steps(run_first, run_later, spec: Spec, max_seq: int):
    """(first step, later step) over a static self cache's graphs, each taking and returning what
    the concat form's do (`greedy`, `stepped`): the pasts a caller holds put into buffers of
    `max_seq` positions (zeros past them) with write_pos their length, the buffers the step wrote
    cut back to the positions written. The caller's loops run unchanged; a client of the static
    form keeps the buffers and binds them."""
    layers = spec.layers
    names = self_names(layers, "past_key_values")
    presents = set(self_names(layers, "present"))

    def buffers(batch: int, dtype, pasts: dict) -> dict:
        out = {}
        for n in names:
            b = np.zeros((batch, spec.heads, max_seq, spec.head_dim), dtype)
            if n in pasts:
                b[:, :, :pasts[n].shape[2]] = pasts[n]
            out[n] = b
        return out

    def cut(out: dict, written: int) -> dict:
        return {n: (v[:, :, :written] if n in presents else v) for n, v in out.items()}

    def first(feed):  # the inputs in the graph's order (a torch module takes them so)
        batch, t = feed["input_ids"].shape
        dtype = feed["encoder_hidden_states"].dtype
        mask = {ENCODER_MASK: feed[ENCODER_MASK]} if ENCODER_MASK in feed else {}
        return cut(run_first({"input_ids": feed["input_ids"], "encoder_hidden_states": feed["encoder_hidden_states"],
                              **mask, WRITE_POS: np.zeros(batch, np.int64), **buffers(batch, dtype, {})}), t)

    def later(feed):
        batch, t = feed["input_ids"].shape
        past = feed[names[0]].shape[2]
        filled = {**feed, **buffers(batch, feed[names[0]].dtype, {n: feed[n] for n in names})}
        mask = {ENCODER_MASK: feed[ENCODER_MASK]} if ENCODER_MASK in feed else {}
        return cut(run_later({"input_ids": feed["input_ids"], **mask, WRITE_POS: np.full(batch, past, np.int64),
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


def merged_steps(run_merged, spec: Spec):
    """(first step, later step) over the merged decoder `run_merged(feed) -> {output: array}`,
    each taking and returning what its own graph does (`merged_feed`; a later step's cross presents,
    empty, left out)."""
    later_outputs = outputs(DECODER_WITH_PAST, spec.layers)

    def first(feed):
        return run_merged(merged_feed(feed, spec))

    def later(feed):
        out = run_merged(merged_feed(feed, spec))
        return {n: out[n] for n in later_outputs}
    return first, later


def merged(first, later, spec: Spec, name: str = "whisper_decoder_merged"):
    """One decoder graph for both steps, as transformers.js loads an encoder-decoder (and Optimum
    can): an If on `use_cache_branch` (bool (1,)) runs `later` (the step with past: each layer's
    cross present empty, the clients keeping the first step's) when it is true, else `first` (the
    first step, which computes the cross cache from encoder_hidden_states); every input of both,
    every output of `first`. A weight both graphs hold (the same bytes) is kept once; names inside
    each branch are prefixed so that they cannot meet. `name`: the merged graph's."""
    import hashlib

    import onnx
    from onnx import helper

    layers = spec.layers
    for g in (first, later):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.graph.node
               for a in n.attribute):
            raise ValueError("a decoder graph with subgraphs of its own cannot be merged")
    static = WRITE_POS in {i.name for i in first.graph.input}
    outer = set(merged_inputs(spec, static))
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
        for k, n in enumerate(graph.node):
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.name = prefix + (n.name or f"{n.op_type}_{k}")  # an unnamed node named, so that none meet
            copy.input[:] = [rename(i) for i in n.input]
            copy.output[:] = [rename(o) for o in n.output]
            nodes.append(copy)
        nodes += list(extra_nodes)
        produced = {o.name: rename(o.name) for o in graph.output}
        produced.update({o: prefix + o for o in outputs if o not in produced})
        return helper.make_graph(nodes, prefix.rstrip("/"), [], [
            helper.make_tensor_value_info(produced[o], types[o], None) for o in outputs])

    names = outputs(DECODER, layers)
    types = {o.name: o.type.tensor_type.elem_type for o in first.graph.output}  # each output's own element type
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
    graph_inputs = [by_name[n] for n in merged_inputs(spec, static)[:-1]]
    graph_inputs.append(helper.make_tensor_value_info(USE_CACHE, onnx.TensorProto.BOOL, [1]))
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
    graph = helper.make_graph([node], name, graph_inputs, out_infos, initializers)
    model = helper.make_model(graph, opset_imports=list(first.opset_import), ir_version=first.ir_version)
    functions = {(f.domain, f.name): f for f in list(first.functions) + list(later.functions)}
    model.functions.extend(functions.values())
    for p in first.metadata_props:
        model.metadata_props.add(key=p.key, value=p.value)
    return model
