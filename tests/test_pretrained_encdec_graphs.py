"""The encoder-decoder core's graphs and loops (`attnexport.pretrained.encdec.graphs`), on a stand-in
decoder written out in NumPy whose every answer is worked by hand: the names in Optimum's order, the
greedy loop a client writes (the end token, suppression, a batch whose sequences end apart), the
teacher-forced logits, the static buffers' steps giving what the concat steps give, the merged
feed, and the merged decoder run by ONNX Runtime on two small graphs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnexport.pretrained.encdec import graphs as G

VOCAB, END = 7, 0


def _logits(last: np.ndarray, positions: int) -> np.ndarray:
    """The stand-in's next-token logits (B, 1, V): the token after `last` is (last + positions) % V,
    by a lead of 2 over (last + 1) % V."""
    out = np.zeros((last.shape[0], 1, VOCAB), np.float32)
    for b, t in enumerate(last):
        out[b, 0, (t + positions) % VOCAB] = 3.0
        out[b, 0, (t + 1) % VOCAB] += 1.0
    return out


def _stand_in(layers: int = 1):
    """(encoder, first step, later step) of a decoder whose self cache holds each token as a key
    [token, 1] and whose logits read the last token and how many positions the cache holds."""

    def encoder(feed):
        return {"last_hidden_state": feed["input_features"].astype(np.float32)}

    def present(ids, past=None):
        new = np.stack([ids, np.ones_like(ids)], -1).astype(np.float32)[:, None]  # (B, 1, T, 2)
        return new if past is None else np.concatenate([past, new], axis=2)

    def first(feed):
        ids, states = feed["input_ids"], feed["encoder_hidden_states"]
        out = {"logits": np.concatenate([_logits(ids[:, t], t + 1) for t in range(ids.shape[1])], axis=1)}
        for i in range(layers):
            out[f"present.{i}.decoder.key"] = out[f"present.{i}.decoder.value"] = present(ids)
            out[f"present.{i}.encoder.key"] = out[f"present.{i}.encoder.value"] = states[:, None]
        return out

    def later(feed):
        ids = feed["input_ids"]
        assert f"past_key_values.{layers - 1}.encoder.key" in feed  # the cross cache is fed back
        out = {}
        for i in range(layers):
            out[f"present.{i}.decoder.key"] = present(ids, feed[f"past_key_values.{i}.decoder.key"])
            out[f"present.{i}.decoder.value"] = out[f"present.{i}.decoder.key"]
        out["logits"] = _logits(ids[:, -1], out["present.0.decoder.key"].shape[2])
        return out
    return encoder, first, later


def test_the_names_are_optimums_and_in_its_order():
    spec = G.Spec(layers=2, heads=1, head_dim=2, width=2)
    assert G.both_names(1, "present") == ["present.0.decoder.key", "present.0.decoder.value",
                                          "present.0.encoder.key", "present.0.encoder.value"]
    assert G.inputs(G.DECODER, spec) == ["input_ids", "encoder_hidden_states"]
    assert G.inputs(G.DECODER_WITH_PAST, spec)[:2] == ["input_ids", "past_key_values.0.decoder.key"]
    masked = G.Spec(layers=1, heads=1, head_dim=2, width=2, encoder_inputs=("input_ids", "attention_mask"),
                    encoder_mask=True)
    assert G.inputs(G.DECODER, masked, static=True) == ["input_ids", "encoder_hidden_states", G.ENCODER_MASK,
                                                         G.WRITE_POS, "past_key_values.0.decoder.key",
                                                         "past_key_values.0.decoder.value"]
    assert G.outputs(G.DECODER_WITH_PAST, 1) == ["logits", "present.0.decoder.key", "present.0.decoder.value"]
    axes = G.dynamic_axes(G.DECODER_WITH_PAST, spec)
    assert axes["past_key_values.1.decoder.key"] == {0: "batch_size", 2: "past_decoder_sequence_length"}
    assert axes["past_key_values.1.encoder.value"] == {0: "batch_size", 2: "encoder_sequence_length_out"}
    assert "past_key_values.0.decoder.key" not in G.dynamic_axes(G.DECODER_WITH_PAST, spec, static=True) or \
        G.dynamic_axes(G.DECODER_WITH_PAST, spec, static=True)["past_key_values.0.decoder.key"] == {0: "batch_size"}
    assert G.cache_pairs(1) == {"past_key_values.0.decoder.key": "present.0.decoder.key",
                                "past_key_values.0.decoder.value": "present.0.decoder.value"}
    assert G.mask_of({"input_ids": 1, "attention_mask": 2}) == {G.ENCODER_MASK: 2} and G.mask_of({"x": 1}) == {}


def test_greedy_follows_the_logits_to_the_end_token_sequence_by_sequence():
    encoder, first, later = _stand_in()
    feed = {"input_features": np.zeros((2, 3, 2), np.float32)}
    # Start [3]: one position, so 3 -> 4; then 4 + 2 = 6; 6 + 3 = 9 % 7 = 2; 2 + 4 = 6; 6 + 5 = 11 % 7 = 4; ...
    # Start [6]: 6 + 1 = 7 % 7 = 0, the end token at once.
    said = G.greedy(encoder, first, later, feed, G.Tokens((3,), END), 1, 5)
    assert said[0] == [4, 6, 2, 6, 4] and said[1] == [4, 6, 2, 6, 4]
    ended = G.greedy(encoder, first, later, feed, G.Tokens((6,), END), 1, 5)
    assert ended == [[], []]
    # Suppressed: the runner-up, (last + 1) % V, is taken instead (3 -> 4 is the runner-up's too: 3 + 1).
    assert G.greedy(encoder, first, later, feed, G.Tokens((3,), END, suppress=(6,)), 1, 2)[0] == [4, 5]
    # Not first: 4 banned only at the first step, the next best there is 0 (logits 0): the end token.
    assert G.greedy(encoder, first, later, feed, G.Tokens((3,), END, suppress_first=(4,)), 1, 3)[0] == []


def test_a_batch_whose_sequences_end_apart_keeps_each_ones_tokens():
    encoder, first, later = _stand_in()
    feed = {"input_features": np.zeros((2, 3, 2), np.float32)}

    def first_mixed(f):  # two different start tokens in one batch: [3] and [5] (5 -> 5 + 1 = 6, then 6 + 2 = 8 % 7 = 1)
        return first({**f, "input_ids": np.array([[3], [5]], np.int64)})
    said = G.greedy(encoder, first_mixed, later, feed, G.Tokens((3,), END), 1, 4)
    assert said[0] == [4, 6, 2, 6]
    assert said[1] == [6, 1, 4, 1]  # 1 + 3 = 4; 4 + 4 = 8 % 7 = 1


def test_teacher_forced_logits_predict_each_next_token():
    steps = _stand_in(layers=2)
    feed = {"input_features": np.zeros((1, 3, 2), np.float32)}
    ids = [3, 4, 6, 2]
    logits = G.teacher_forced(steps, feed, ids, first=1, layers=2)
    assert logits.shape == (3, VOCAB)
    assert list(logits.argmax(-1)) == [4, 6, 2]  # the stand-in's own greedy answers, fed back
    assert G.row_of({"a": np.arange(6).reshape(3, 2)}, 1)["a"].tolist() == [[2, 3]]


def test_static_buffers_give_what_the_concat_steps_give():
    encoder, first, later = _stand_in()
    spec = G.Spec(layers=1, heads=1, head_dim=2, width=2)
    max_seq = 8

    def write(buffer, new, pos):
        out = buffer.copy()
        for b in range(buffer.shape[0]):
            out[b, :, pos[b]:pos[b] + new.shape[2]] = new[b]
        return out

    def static_first(feed):  # a static graph: writes the step's keys into the buffers at write_pos
        out = first(feed)
        for n in G.self_names(1, "present"):
            out[n] = write(feed[n.replace("present", "past_key_values")], out[n], feed[G.WRITE_POS])
        return out

    def static_later(feed):
        pos = feed[G.WRITE_POS]
        assert feed["past_key_values.0.decoder.key"].shape[2] == max_seq
        written = {**feed, **{n: feed[n][:, :, :int(pos[0])] for n in G.self_names(1, "past_key_values")}}
        out = later(written)
        for n in G.self_names(1, "present"):
            new = out[n][:, :, -feed["input_ids"].shape[1]:]
            out[n] = write(feed[n.replace("present", "past_key_values")], new, pos)
        return out

    s_first, s_later = G.static_steps(static_first, static_later, spec, max_seq)
    feed = {"input_features": np.zeros((1, 3, 2), np.float32)}
    assert G.greedy(encoder, s_first, s_later, feed, G.Tokens((3,), END), 1, 5) == \
        G.greedy(encoder, first, later, feed, G.Tokens((3,), END), 1, 5)


def test_the_merged_feed_fills_what_a_step_does_not_use():
    spec = G.Spec(layers=1, heads=2, head_dim=3, width=4)
    ids = np.array([[1, 2]], np.int64)
    a = G.merged_feed({"input_ids": ids, "encoder_hidden_states": np.ones((1, 5, 4), np.float32)}, spec)
    assert a[G.USE_CACHE].tolist() == [False] and a["past_key_values.0.decoder.key"].shape == (1, 2, 0, 3)
    past = {n: np.ones((1, 2, 4, 3), np.float32) for n in G.both_names(1, "past_key_values")}
    b = G.merged_feed({"input_ids": ids[:, -1:], **past}, spec)
    assert b[G.USE_CACHE].tolist() == [True] and b["encoder_hidden_states"].shape == (1, 0, 4)
    assert list(b) == G.merged_inputs(spec)


def _decoder(first: bool) -> onnx.ModelProto:
    """A one-layer decoder step as ONNX: logits = input_ids as float times W (a weight both steps
    hold), the self present = the past with the token appended; the first step's cross present is
    encoder_hidden_states (B, 1, S, 1)."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])
    cast = helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT)
    logits = [helper.make_node("Unsqueeze", ["f", "ax"], ["f3"]), helper.make_node("Mul", ["f3", "w"], ["logits"])]
    ax = helper.make_tensor("ax", TensorProto.INT64, [1], [2])
    new = [helper.make_node("Unsqueeze", ["f3", "one"], ["new"])]  # (B, 1, T, 1)
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    names = G.both_names(1, "present")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "t"])
    cache = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", 1, None, 1])
             for n in G.both_names(1, "past_key_values")]
    states = helper.make_tensor_value_info("encoder_hidden_states", TensorProto.FLOAT, ["batch_size", "s", 1])
    out = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "t", 1])]
    out += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", 1, None, 1]) for n in names]
    if first:
        nodes = [cast, *logits, *new, helper.make_node("Identity", ["new"], [names[0]]),
                 helper.make_node("Identity", ["new"], [names[1]]),
                 helper.make_node("Unsqueeze", ["encoder_hidden_states", "one"], [names[2]]),
                 helper.make_node("Identity", [names[2]], [names[3]])]
        graph = helper.make_graph(nodes, "first", [ids, states], out, [w, ax, one])
    else:
        nodes = [cast, *logits, *new,
                 helper.make_node("Concat", ["past_key_values.0.decoder.key", "new"], [names[0]], axis=2),
                 helper.make_node("Concat", ["past_key_values.0.decoder.value", "new"], [names[1]], axis=2)]
        graph = helper.make_graph(nodes, "later", [ids, *cache], out[:3], [w, ax, one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_merged_decoder_runs_both_steps_in_onnx_runtime_and_keeps_a_shared_weight_once():
    spec = G.Spec(layers=1, heads=1, head_dim=1, width=1)
    merged = G.merged(_decoder(True), _decoder(False), spec, name="toy")
    onnx.checker.check_model(merged)
    assert [i.name for i in merged.graph.input] == G.merged_inputs(spec)
    assert sum(i.name.endswith("w") for i in merged.graph.initializer) == 1  # "w" held by both, kept once
    session = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    first_step, later_step = G.merged_steps(lambda f: dict(zip([o.name for o in session.get_outputs()],
                                                               session.run(None, f), strict=True)), spec)
    states = np.array([[[5.0], [6.0]]], np.float32)
    out = first_step({"input_ids": np.array([[1, 2]], np.int64), "encoder_hidden_states": states})
    assert out["logits"][0, :, 0].tolist() == [2.0, 4.0]
    assert out["present.0.decoder.key"][0, 0, :, 0].tolist() == [1.0, 2.0]
    assert out["present.0.encoder.key"][0, 0, :, 0].tolist() == [5.0, 6.0]
    past = {n.replace("present", "past_key_values"): v for n, v in out.items() if n != "logits"}
    nxt = later_step({"input_ids": np.array([[3]], np.int64), **past})
    assert set(nxt) == set(G.outputs(G.DECODER_WITH_PAST, 1))
    assert nxt["logits"][0, 0, 0] == 6.0 and nxt["present.0.decoder.key"][0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]


def test_a_decoder_with_subgraphs_of_its_own_is_refused():
    step = _decoder(True)
    inner = helper.make_graph([helper.make_node("Identity", ["logits"], ["y"])], "inner", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    cond = helper.make_node("If", ["c"], ["z"], then_branch=inner, else_branch=inner)
    step.graph.node.append(cond)
    with pytest.raises(ValueError, match="subgraphs"):
        G.merged(step, _decoder(False), G.Spec(layers=1, heads=1, head_dim=1, width=1))
