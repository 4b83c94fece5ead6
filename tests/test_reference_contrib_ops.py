"""The ONNX reference evaluator's com.microsoft ops (`attnexport.runtimes.reference`), which the
`onnx-ref` runtime runs an ort-flavour model with: each op alone in a one-node model, with each of
its optional inputs given and left out, against ONNX Runtime's own kernel on the same inputs
(the other side: what the ops mean), and the small cases against values worked by hand."""

import itertools
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attnexport import runtimes as R

B, S, L, H, D = 2, 3, 4, 2, 8  # batch, queries, keys, heads, width (head size 4)


def _model(op: str, inputs: dict, outputs: list[str], **attributes) -> onnx.ModelProto:
    """One com.microsoft node over `inputs` ({name: array}, "" for an optional input left out)."""
    given = {n: v for n, v in inputs.items() if v is not None}
    node = helper.make_node(op, [n if inputs[n] is not None else "" for n in inputs], outputs, domain="com.microsoft",
                            **attributes)
    while node.input and node.input[-1] == "":
        node.input.pop()
    kinds = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32,
             np.dtype(np.int64): TensorProto.INT64}
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(n, kinds[v.dtype], v.shape)
                                           for n, v in given.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _both(model: onnx.ModelProto, feed: dict) -> tuple[dict, dict]:
    feed = {k: v for k, v in feed.items() if v is not None}
    return R.prepare_onnx("onnx-ref", model).run(feed), R.prepare_onnx("ort-cpu", model).run(feed)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _close(ref: dict, ort: dict, names, atol=2e-5) -> None:
    for n in names:
        assert ref[n].shape == ort[n].shape, n
        np.testing.assert_allclose(ref[n], ort[n], rtol=1e-4, atol=atol, err_msg=n)


@pytest.mark.parametrize("with_beta,with_bias", itertools.product([False, True], [False, True]))
def test_skip_layer_norm_with_and_without_beta_and_bias(with_beta, with_bias):
    g = _rng(1)
    feed = {"x": g.standard_normal((B, S, D), np.float32), "skip": g.standard_normal((B, S, D), np.float32),
            "gamma": g.standard_normal(D).astype(np.float32),
            "beta": g.standard_normal(D).astype(np.float32) if with_beta else None,
            "bias": g.standard_normal(D).astype(np.float32) if with_bias else None}
    model = _model("SkipLayerNormalization", feed, ["y", "", "", "sum"], epsilon=1e-5)
    ref, ort = _both(model, feed)
    _close(ref, ort, ["y", "sum"])


def test_skip_layer_norm_by_hand():
    """x + skip + bias = (1, 3) then normalised: mean 2, variance 1, so (-1, 1); times gamma (2, 3)
    plus beta (0.5, 0): (-1.5, 3)."""
    feed = {"x": np.array([[[1.0, 2.0]]], np.float32), "skip": np.array([[[0.0, 0.5]]], np.float32),
            "gamma": np.array([2.0, 3.0], np.float32), "beta": np.array([0.5, 0.0], np.float32),
            "bias": np.array([0.0, 0.5], np.float32)}
    model = _model("SkipLayerNormalization", feed, ["y"], epsilon=0.0)
    ref, ort = _both(model, feed)
    for got in (ref, ort):
        np.testing.assert_allclose(got["y"], [[[-1.5, 3.0]]], atol=1e-6)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_norm_with_and_without_bias(with_bias):
    g = _rng(2)
    feed = {"x": g.standard_normal((B, S, D), np.float32), "skip": g.standard_normal((B, S, D), np.float32),
            "gamma": g.standard_normal(D).astype(np.float32),
            "bias": g.standard_normal(D).astype(np.float32) if with_bias else None}
    model = _model("SkipSimplifiedLayerNormalization", feed, ["y", "", "", "sum"], epsilon=1e-6)
    ref, ort = _both(model, feed)
    _close(ref, ort, ["y", "sum"])


def test_skip_simplified_layer_norm_by_hand():
    """x + skip = (3, 4): its root mean square is sqrt(12.5), so gamma (1, 2) gives (3, 8) / sqrt(12.5)."""
    feed = {"x": np.array([[[3.0, 3.0]]], np.float32), "skip": np.array([[[0.0, 1.0]]], np.float32),
            "gamma": np.array([1.0, 2.0], np.float32)}
    model = _model("SkipSimplifiedLayerNormalization", feed, ["y"], epsilon=0.0)
    ref, ort = _both(model, feed)
    for got in (ref, ort):
        np.testing.assert_allclose(got["y"], [[[3.0 / math.sqrt(12.5), 8.0 / math.sqrt(12.5)]]], rtol=1e-6)


def test_bias_gelu_is_the_exact_erf_gelu_of_input_plus_bias():
    feed = {"x": np.array([[-1.0, 0.0, 1.0, 2.0]], np.float32), "bias": np.array([0.0, 0.5, 0.0, -1.0], np.float32)}
    model = _model("BiasGelu", feed, ["y"])
    ref, ort = _both(model, feed)
    y = np.array([-1.0, 0.5, 1.0, 1.0])
    want = 0.5 * y * (1 + np.array([math.erf(v / math.sqrt(2)) for v in y]))  # GELU(-1) = -0.1587, GELU(1) = 0.8413
    for got in (ref, ort):
        np.testing.assert_allclose(got["y"][0], want, atol=1e-6)
    assert want[0] == pytest.approx(-0.158655, abs=1e-6)


def _padding(pad_last: int) -> np.ndarray:
    mask = np.ones((B, L), np.int32)
    mask[1, L - pad_last:] = 0  # the second sequence's last keys are padding
    return mask


@pytest.mark.parametrize("with_bias,with_mask,with_attention_bias",
                         itertools.product([False, True], [False, True], [False, True]))
def test_attention_with_each_optional_input(with_bias, with_mask, with_attention_bias):
    """Without a bias ONNX Runtime's CPU kernel crashes the process (a segmentation fault, onnxruntime
    1.31; attnexport's exports always give one): the reference's own no-bias case is held to ONNX
    Runtime's with a bias of zeros, the same function."""
    g = _rng(3)
    feed = {"x": g.standard_normal((B, L, D), np.float32), "weights": g.standard_normal((D, 3 * D), np.float32) * 0.3,
            "bias": g.standard_normal(3 * D).astype(np.float32) if with_bias else None,
            "mask_index": _padding(2) if with_mask else None, "past": None,
            "attention_bias": g.standard_normal((1, H, L, L)).astype(np.float32) if with_attention_bias else None}
    ref = R.prepare_onnx("onnx-ref", _model("Attention", feed, ["y"], num_heads=H)).run(
        {k: v for k, v in feed.items() if v is not None})
    zero = {**feed, "bias": feed["bias"] if with_bias else np.zeros(3 * D, np.float32)}
    ort = R.prepare_onnx("ort-cpu", _model("Attention", zero, ["y"], num_heads=H)).run(
        {k: v for k, v in zero.items() if v is not None})
    _close(ref, ort, ["y"])


def test_attention_by_hand_a_padded_key_takes_no_weight():
    """One head of width 1, weights making q = k = v = x: keys 1 and 2 with scores x_i * x_j; the second key is
    padding, so every query attends to the first alone and returns its value, 1."""
    feed = {"x": np.array([[[1.0], [2.0]]], np.float32), "weights": np.ones((1, 3), np.float32),
            "bias": np.zeros(3, np.float32), "mask_index": np.array([[1, 0]], np.int32)}
    model = _model("Attention", feed, ["y"], num_heads=1)
    ref, ort = _both(model, feed)
    for got in (ref, ort):
        np.testing.assert_allclose(got["y"], [[[1.0], [1.0]]], atol=1e-3)  # the mask adds -10000, not -inf


@pytest.mark.parametrize("with_bias,with_mask,with_attention_bias",
                         itertools.product([False, True], [False, True], [False, True]))
def test_multi_head_attention_with_each_optional_input(with_bias, with_mask, with_attention_bias):
    g = _rng(4)
    feed = {"query": g.standard_normal((B, S, D), np.float32), "key": g.standard_normal((B, L, D), np.float32),
            "value": g.standard_normal((B, L, D), np.float32),
            "bias": g.standard_normal(3 * D).astype(np.float32) if with_bias else None,
            "key_padding_mask": _padding(1) if with_mask else None,
            "attention_bias": g.standard_normal((1, H, S, L)).astype(np.float32) if with_attention_bias else None}
    model = _model("MultiHeadAttention", feed, ["y"], num_heads=H)
    if with_bias and not with_mask:  # not an input set attnexport's exports make: refused, saying so
        with pytest.raises(NotImplementedError, match="bias or key padding mask with a cache or a causal"):
            R.prepare_onnx("onnx-ref", model).run({k: v for k, v in feed.items() if v is not None})
        return
    ref, ort = _both(model, feed)
    _close(ref, ort, ["y"])


@pytest.mark.parametrize("heads_last", [False, True])
def test_rotary_embedding_rotates_half_at_the_position_ids(heads_last):
    g = _rng(5)
    d = D // H
    angles = np.arange(16)[:, None] * np.array([1.0, 0.1])  # (positions, d / 2)
    cos, sin = np.cos(angles), np.sin(angles)
    x = g.standard_normal((B, S, H * d) if heads_last else (B, H, S, d)).astype(np.float32)
    feed = {"x": x, "position_ids": np.array([[0, 1, 2], [5, 6, 7]], np.int64),
            "cos_cache": cos.astype(np.float32), "sin_cache": sin.astype(np.float32)}
    model = _model("RotaryEmbedding", feed, ["y"], **({"num_heads": H} if heads_last else {}))
    ref, ort = _both(model, feed)
    _close(ref, ort, ["y"])
