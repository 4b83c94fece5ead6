"""Quantized weight matrices (`attnexport.pretrained.precision`): grids a matrix already holds found and carried
bit for bit, ONNX Runtime's quantizer for the rest, MatMulNBits's layout read back, the record and
its fingerprints, the per-layer plan and its refusals. On handmade one-MatMul graphs run by ONNX
Runtime; whole models are in test_pretrained_causal_accuracy.py and test_real_models.py."""

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnexport.errors import UsageError
from attnexport.pretrained import precision as P

K, N, B = 96, 40, 32


def _blocks(w, block=B):
    return w.reshape(w.shape[0] // block, block, w.shape[1])


def q4_1(w, block=B):
    """A GGUF Q4_1 matrix as transformers reads it: d * q + m per block, d and m in fp16."""
    b = _blocks(w, block)
    low, d = b.min(1), (b.max(1) - b.min(1)) / 15
    q = np.clip(np.floor((b - low[:, None]) / d[:, None] + 0.5), 0, 15)
    return (d.astype(np.float16).astype(np.float32)[:, None] * q
            + low.astype(np.float16).astype(np.float32)[:, None]).reshape(w.shape).astype(np.float32)


def q4_0(w):
    """GGUF's Q4_0: d * (q - 8), the block's extreme as -8 steps."""
    b = _blocks(w)
    extreme = np.take_along_axis(b, np.abs(b).argmax(1)[:, None], 1)[:, 0]
    d = extreme / -8
    q = np.clip(np.floor(b / d[:, None] + 8.5), 0, 15)
    return (d.astype(np.float16).astype(np.float32)[:, None] * (q - 8)).reshape(K, N).astype(np.float32)


def q8_0(w):
    """GGUF's Q8_0: d * q, q in [-127, 127]."""
    b = _blocks(w)
    d = np.abs(b).max(1) / 127
    return (d.astype(np.float16).astype(np.float32)[:, None] * np.rint(b / d[:, None])).reshape(K, N).astype(
        np.float32)


def raw(seed=0):
    return np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32)


def one_matmul(w, param="model.model.layers.3.mlp.down_proj.weight"):
    """x (1, 3, K) @ w, with the record an export leaves (the parameter held transposed)."""
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, w.shape[1]])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    model.metadata_props.add(key="attnexport.params", value=json.dumps(
        {param: {"initializer": "w", "layout": "transposed", "sha256": "0"}}))
    return model


def run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def by_columns(model, entry, step=7):
    """`Columns` (the check's decoder) a block of output columns at a time gives the whole matrix's
    values exactly (`matrix`: all the columns at once), or declines the integer form."""
    inits = {i.name: i for i in model.graph.initializer}
    held = P.Columns.of(model, entry, inits)
    if entry["how"] == "integer":
        assert held is None
        return
    assert held is not None
    want = P.matrix(model, entry)
    got = np.concatenate([held.rows(a, min(entry["n"], a + step)).numpy()
                          for a in range(0, entry["n"], step)]).T
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("make, bits", [(q4_1, 4), (q4_0, 4), (q8_0, 8)])
def test_a_gguf_grid_is_found_and_carried_bit_for_bit(make, bits):
    w = make(raw())
    grid = P.grid_of(w, bits, B)
    assert grid is not None and np.array_equal(grid.values(), w)
    model = one_matmul(w)
    done = P.quantize(model, P.Plan(bits=bits, block=B, accuracy=0, minimums="exact"), layers=4)
    (entry,) = done.entries
    assert entry["how"] == "exact" and entry["group"] == "layer:3" and entry["bits"] == bits
    assert np.array_equal(P.matrix(model, entry), w)  # the file holds the very weights
    by_columns(model, entry)
    x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float32)
    want = x.astype(np.float64) @ w
    assert np.abs(run(model, x) - want).max() < 1e-4 * np.abs(want).max()
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 1 and ("Add" in ops) == (make is q4_1)  # only Q4_1 has float minimums


def graph_of(nodes, out: int, **weights):
    """A model of `nodes` from x (1, 3, K) to y (1, 3, `out`), `weights` its initializers by name."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, out])],
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def two_matmuls(w1, w2):
    """x (1, 3, K) @ w1 and x @ w2, summed: two matrices reading one input."""
    return graph_of([helper.make_node("MatMul", ["x", "w1"], ["y1"], name="mm1"),
                     helper.make_node("MatMul", ["x", "w2"], ["y2"], name="mm2"),
                     helper.make_node("Add", ["y1", "y2"], ["y"], name="add")], N, w1=w1, w2=w2)


def test_a_q4_1_grid_is_folded_within_half_a_residual_step_with_no_op_per_matrix():
    w1, w2 = q4_1(raw()), q4_1(raw(7))
    model = two_matmuls(w1, w2)
    done = P.quantize(model, P.Plan(bits=4, block=B, accuracy=0), layers=4)
    assert [e["how"] for e in done.entries] == ["folded", "folded"]
    assert P.unfaithful({"w1": w1, "w2": w2}, model) == []
    for entry, w in zip(done.entries, (w1, w2), strict=True):
        held = P.matrix(model, entry)
        d = np.repeat(P.grid_of(w, 4, B).scale, B, axis=0)
        moved = np.abs(held.astype(np.float64) - w) / d
        assert 0 < moved.max() < 0.5 and np.isclose(moved.max(), entry["fold"]["max_steps"], rtol=1e-3)
        assert entry["fold"]["rms_steps"] < 0.05  # 4-bit residual codes: a thirtieth of a step or so
    # One sum of the shared input's blocks (a MatMul by a 0/1 matrix) and one Concat; no op beside
    # each matrix, and whole blocks only (K + 32 here: 3 sums and 29 zeros).
    ops = [n.op_type for n in model.graph.node]
    assert sorted(ops) == ["Add", "Concat", "MatMul", "MatMulNBits", "MatMulNBits"]
    summing = [i for i in model.graph.initializer if i.name.startswith("block_sums_")]
    assert len(summing) == 1 and numpy_helper.to_array(summing[0]).shape == (K, B)
    folded = [n for n in model.graph.node if n.op_type == "MatMulNBits" and P.FOLDED in n.input[0]]
    assert len(folded) == 2 and all(P._attr(n, "K") == K + B for n in folded)
    x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float32)
    held = P.matrix(model, done.entries[0]) + P.matrix(model, done.entries[1])
    want = x.astype(np.float64) @ held
    assert np.abs(run(model, x) - want).max() < 1e-4 * np.abs(want).max()  # it computes what matrix() says
    model4 = two_matmuls(w1, w2)
    P.quantize(model4, P.Plan(bits=4, block=B, accuracy=4), layers=4)
    exact4 = two_matmuls(w1, w2)
    P.quantize(exact4, P.Plan(bits=4, block=B, accuracy=4, minimums="exact"), layers=4)
    truth = x.astype(np.float64) @ (w1.astype(np.float64) + w2)
    # With int8 activations the folded grid is no further from the model than the exact one's
    # product by the grid's all-positive codes.
    assert np.abs(run(model4, x) - truth).max() <= np.abs(run(exact4, x) - truth).max()


@pytest.mark.parametrize("real", [np.float32, np.float16])
def test_a_q4_1_grid_with_float_zero_points_is_one_op_a_matrix_within_the_zero_points_rounding(real):
    """--minimums float: -m / d as MatMulNBits's float zero point (the scales' type), no input
    rewritten, no op beside each matrix; a block of one value (d = 0) held too."""
    w1, w2 = q4_1(raw()), q4_1(raw(7))
    w1[:B, 0] = 0.375  # one block of one value: its scale is 0
    grid = P.grid_of(w1, 4, B)
    assert grid is not None and grid.scale[0, 0] == 0
    model = two_matmuls(w1, w2)
    weights = None
    if real is np.float16:  # a graph in half: fp16 initializers, the grid found in the float32 matrices
        for init in model.graph.initializer:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
        weights = {"w1": w1, "w2": w2}
    done = P.quantize(model, P.Plan(bits=4, block=B, accuracy=0, minimums="float"), layers=4, weights=weights)
    assert [e["how"] for e in done.entries] == ["float", "float"]
    assert sorted(n.op_type for n in model.graph.node) == ["Add", "MatMulNBits", "MatMulNBits"]
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            zeros = next(i for i in model.graph.initializer if i.name == n.input[3])
            assert n.input[0] == "x" and P._attr(n, "K") == K
            assert zeros.data_type == (TensorProto.FLOAT16 if real is np.float16 else TensorProto.FLOAT)
    assert P.unfaithful({"w1": w1, "w2": w2}, model) == []
    worst = 0.0
    for entry, w in zip(done.entries, (w1, w2), strict=True):
        held = P.matrix(model, entry).astype(np.float64)
        by_columns(model, entry)
        err = np.abs(held - w)
        assert err.max() <= np.abs(w).max() * (np.finfo(real).eps * 2 + 1e-6)
        worst = max(worst, entry["fold"]["max_steps"])
    assert np.abs(P.matrix(model, done.entries[0])[:B, 0] - 0.375).max() < 1e-6  # the one-value block
    # far tighter than the folded form's fraction of a step; float32 zero points nearly exact
    assert worst < (0.02 if real is np.float16 else 1e-4)
    assert "float-zero-point weights within" in done.summary()
    if real is np.float32:  # ONNX Runtime's CPU kernel computes what matrix() says
        x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float32)
        want = x.astype(np.float64) @ (P.matrix(model, done.entries[0]) + P.matrix(model, done.entries[1]))
        assert np.abs(run(model, x) - want).max() < 1e-4 * np.abs(want).max()


def test_a_half_graph_carries_the_grid_its_float_matrices_hold():
    """q4f16: the graph is in fp16, whose initializers only round a Q4_1 matrix; the float32 matrices
    given beside it are where the grid is found, and the scales are written in fp16."""
    w1, w2 = q4_1(raw()), q4_1(raw(7))
    half = two_matmuls(w1.astype(np.float16), w2.astype(np.float16))
    for v in list(half.graph.input) + list(half.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    alone = two_matmuls(w1.astype(np.float16), w2.astype(np.float16))
    assert [e["how"] for e in P.quantize(alone, P.Plan(bits=4, block=B, accuracy=0), layers=4).entries] == \
        ["ort", "ort"]  # the fp16 rounding of a grid is no grid
    done = P.quantize(half, P.Plan(bits=4, block=B, accuracy=0), layers=4, weights={"w1": w1, "w2": w2})
    assert [e["how"] for e in done.entries] == ["folded", "folded"]
    assert P.unfaithful({"w1": w1, "w2": w2}, half) == []
    by_columns(half, done.entries[0])
    scales = [i for i in half.graph.initializer if i.name.endswith("_scales")]
    assert scales and all(i.data_type == TensorProto.FLOAT16 for i in scales)
    x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float16)
    held = P.matrix(half, done.entries[0]).astype(np.float64) + P.matrix(half, done.entries[1])
    want = x.astype(np.float64) @ held
    assert np.abs(run(half, x) - want).max() < 4e-3 * np.abs(want).max()  # fp16 activations


def test_a_folded_matrix_is_read_back_row_by_row_from_its_residual_blocks():
    """matrix() and the residual steps of a folded grid, worked out one weight at a time from the
    node's own tensors: weight row r is code row r (block r // b) plus residual row K + r // b, which
    takes the scale and zero point of block (K + r // b) // b. With K = 512 in blocks of 16 the 32
    residual rows fill two blocks of their own, so a row read from the wrong one shows."""
    k, n, b = 512, 6, 16
    model = one_matmul(q4_1(np.random.default_rng(3).standard_normal((k, n)).astype(np.float32), b))
    (entry,) = P.quantize(model, P.Plan(bits=4, block=b, accuracy=0), layers=4).entries
    assert entry["how"] == "folded"
    node = next(n_ for n_ in model.graph.node if n_.op_type == "MatMulNBits")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rows = P._attr(node, "K")
    assert rows == k + 2 * b  # 32 residual rows: two whole blocks
    blocks = rows // b
    q = P.unpack(inits[node.input[1]], 4, rows, n, b).astype(np.float64)
    scale = inits[node.input[2]].astype(np.float64).reshape(n, blocks)
    zero = P.unpack_zeros(inits[node.input[3]], 4, n, blocks).astype(np.float64)
    want, steps = np.zeros((k, n)), np.zeros((k, n))
    for r in range(k):
        res = k + r // b
        for c in range(n):
            want[r, c] = (scale[c, r // b] * (q[r, c] - zero[c, r // b])
                          + scale[c, res // b] * (q[res, c] - zero[c, res // b]))
            steps[r, c] = scale[c, res // b]
    assert len({steps[0, 0], steps[k - 1, 0]}) == 2  # the two residual blocks' scales differ
    got = P.matrix(model, entry)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    held = {i.name: i for i in model.graph.initializer}
    assert np.abs(P._residual_steps(model, entry, held) - steps).max() <= 1e-9 * steps.max()


def test_a_folded_residual_off_by_a_step_is_not_a_quantization():
    w = q4_1(raw())
    model = one_matmul(w)
    P.quantize(model, P.Plan(bits=4, block=B), layers=4)
    assert P.unfaithful({"w": w}, model) == []
    init = _scales(model)
    scales = numpy_helper.to_array(init).reshape(N, -1).copy()
    scales[:, K // B:] *= 3  # the residual rows' scales, three times too large
    init.CopyFrom(numpy_helper.from_array(scales.reshape(-1), init.name))
    (bad,) = P.unfaithful({"w": w}, model)
    assert "folded, but" in bad and "half a residual step" in bad


def test_a_matrix_off_every_grid_is_not_taken_for_one():
    assert P.grid_of(raw(), 4, B) is None
    nudged = q4_1(raw())
    nudged[5, 7] = np.nextafter(nudged[5, 7], np.float32(np.inf))  # one weight one ulp off its grid
    assert P.grid_of(nudged, 4, B) is None
    assert P.grid_of(q4_1(raw())[:K - 1], 4, B) is None  # rows that fill no whole block
    for make, bits in ((q4_1, 4), (q4_0, 4), (q8_0, 8)):  # the first row of blocks on the grid, a later one off it
        late = make(raw())
        assert P.grid_of(late, bits, B) is not None
        late[K - 1, N - 1] = np.nextafter(late[K - 1, N - 1], np.float32(np.inf))
        assert P.grid_of(late, bits, B) is None


def test_a_terminal_is_told_each_matrix_as_it_is_read_and_as_it_is_written():
    """`usage.counted` a matrix at a time (a terminal's bar while a large model is quantized): one
    matrix carried from its grid, one through ONNX Runtime's quantizer."""
    from attnexport import usage as U
    carried, rounded = one_matmul(q4_1(raw(0))), one_matmul(raw(1))
    said: list[tuple] = []
    U.tell_counts(lambda c: said.append((c.what, c.done, c.total, c.ended)))
    try:
        for model in (carried, rounded):
            P.quantize(model, P.Plan(bits=4, block=B, accuracy=0, minimums="exact"), layers=4)
    finally:
        U.tell_counts(None)
    steps = [("quantize: reading, matrix", 0, 1, False), ("quantize: reading, matrix", 1, 1, False),
             ("quantize: reading, matrix", 1, 1, True), ("quantize: writing, matrix", 0, 1, False),
             ("quantize: writing, matrix", 1, 1, False), ("quantize: writing, matrix", 1, 1, True)]
    assert said == steps + steps


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, False)])
def test_ort_quantizer_rounds_within_a_step_and_its_output_matches_its_weights(bits, symmetric):
    w = raw()
    model = one_matmul(w)
    done = P.quantize(model, P.Plan(bits=bits, block=B, accuracy=0, symmetric=symmetric), layers=4)
    (entry,) = done.entries
    assert entry["how"] == "ort"
    held = P.matrix(model, entry)
    assert not np.array_equal(held, w) and P.unfaithful({"w": w}, model) == []
    by_columns(model, entry)
    x = np.random.default_rng(2).standard_normal((1, 3, K)).astype(np.float32)
    want = x.astype(np.float64) @ held
    assert np.abs(run(model, x) - want).max() < 1e-4 * np.abs(want).max()
    # What ONNX Runtime's MatMulNBitsQuantizer writes for the same matrix, tensor for tensor: the
    # kernel is its, run here a matrix at a time.
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    theirs = MatMulNBitsQuantizer(one_matmul(w), bits=bits, block_size=B, is_symmetric=symmetric,
                                  op_types_to_quantize=("MatMul",))
    theirs.process()
    ours = {i.name: numpy_helper.to_array(i).reshape(-1) for i in model.graph.initializer}
    compared = [init.name for init in theirs.model.model.graph.initializer if init.name in ours]
    assert {f"w_Q{bits}", "w_scales"} <= set(compared) and ("w_zero_points" in compared) == (not symmetric)
    for init in theirs.model.model.graph.initializer:
        if init.name in ours:
            assert np.array_equal(numpy_helper.to_array(init).reshape(-1), ours[init.name]), init.name
    assert {n.name for n in theirs.model.model.graph.node if n.op_type == "MatMulNBits"} == \
        {n.name for n in model.graph.node if n.op_type == "MatMulNBits"}


@pytest.mark.parametrize("bits", [4, 8])
def test_columns_decode_a_matrix_whose_rows_fill_no_whole_block(bits):
    """K = 100 rows in blocks of 32: the last block is padded in the file, and `Columns` cuts it."""
    w = np.random.default_rng(5).standard_normal((100, N)).astype(np.float32)
    model = one_matmul(w)
    done = P.quantize(model, P.Plan(bits=bits, block=B, accuracy=0, symmetric=False), layers=4)
    (entry,) = done.entries
    assert entry["how"] == "ort" and entry["k"] == 100
    by_columns(model, entry, step=16)
    # the faithfulness check reads the padded block as the decoder does: a weight of it moved is found
    assert P.unfaithful({"w": w}, model) == []
    moved = w.copy()
    moved[99, N - 1] += 10 * np.abs(w[96:, N - 1]).max()
    (bad,) = P.unfaithful({"w": moved}, model)
    assert "1 weight(s) more than one step of their block's scale" in bad


class _ByRows(dict):
    """A `before` that gives a matrix's columns as rows, as the export's does (`rows`)."""

    def rows(self, weight, first, stop):
        return np.ascontiguousarray(self[weight][:, first:stop].T)


@pytest.mark.parametrize("given", [dict, _ByRows])
def test_a_weight_off_its_grid_is_found_a_block_of_columns_at_a_time(given):
    """The carried and rounded entries are compared a block of columns at a time: one weight moved
    is counted, in the last column as in the first."""
    w = q8_0(raw())
    model = one_matmul(w)
    (entry,) = P.quantize(model, P.Plan(bits=8, block=B, accuracy=0, minimums="exact"), layers=4).entries
    assert entry["how"] == "exact" and P.unfaithful(given(w=w), model) == []
    moved = w.copy()
    moved[K - 1, N - 1] += 1e-3
    (bad,) = P.unfaithful(given(w=moved), model)
    assert bad.startswith("mm: carried as exact but 1 weight(s) differ (max 0.001")
    w = raw()
    model = one_matmul(w)
    (entry,) = P.quantize(model, P.Plan(bits=4, block=B, accuracy=0), layers=4).entries
    assert entry["how"] == "ort" and P.unfaithful(given(w=w), model) == []
    moved = w.copy()
    moved[0, N - 1] += 10 * np.abs(w[:B, N - 1]).max()
    (bad,) = P.unfaithful(given(w=moved), model)
    assert "mm: 1 weight(s) more than one step of their block's scale" in bad
    # a matrix the caller has not got, and a record of a kind attnexport does not write: each named
    record = P.record_of(model)
    assert P.unfaithful(given(), model) == ["mm: its tensors are missing"]
    odd = {**record, "matrices": [{**record["matrices"][0], "how": "mystery"}]}
    assert P.unfaithful(given(w=w), model, odd) == ["mm: recorded as quantized in a way attnexport does not write "
                                                    "('mystery')"]


def test_pack_and_unpack_are_inverse():
    rng = np.random.default_rng(3)
    for bits in (4, 8):
        q = rng.integers(0, 2 ** bits, (K, N)).astype(np.uint8)
        assert np.array_equal(P.unpack(P.pack(q, bits, B), bits, K, N, B), q)
        zeros = rng.integers(0, 2 ** bits, (N, 3)).astype(np.uint8)
        assert np.array_equal(P.unpack_zeros(P.pack_zeros(zeros, bits), bits, N, 3), zeros)


def _scales(model):
    return next(i for i in model.graph.initializer if i.name.endswith("_scales"))


def test_an_edited_quantized_tensor_is_named_and_a_wrong_scale_is_not_a_quantization():
    w = q4_1(raw())
    model = one_matmul(w)
    P.quantize(model, P.Plan(bits=4, block=B), layers=4)
    assert P.damaged(model) == []
    init = _scales(model)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
    assert P.damaged(model) == ["mm"]  # the record's sha256 no longer matches
    P.fingerprint(model)  # a quantizer that got its scales wrong records them as they are
    assert P.damaged(model) == []
    assert P.unfaithful({"w": w}, model) and "folded, but" in P.unfaithful({"w": w}, model)[0]


def test_the_plan_per_group():
    plan = P.plan_for("int4", keep="head=int8,first,layers:2-3=int4@0")
    assert plan.rule_for("head", 4) == P.Rule(8, -1)
    assert plan.rule_for("layer:0", 4).bits == 0
    assert plan.rule_for("layer:3", 4) == P.Rule(4, 0)
    assert plan.rule_for("layer:1", 4) == P.Rule(4, 4)
    assert P.plan_for("int4", keep="last").rule_for("layer:3", 4).bits == 0  # the last of 4 layers
    assert P.TABLE["int4"].plan.rule_for("head", 30) == P.Rule(8, -1)
    assert P.plan_for("int8").keep == () and P.plan_for("int8").bits == 8


@pytest.mark.parametrize("args, message", [
    (("int4", 48), "--block-size is one of 16, 32, 64, 128"),
    (("int4", None, 5), "--accuracy-level is one of"),
    (("int4", None, None, "tail"), "a group is head, first, last"),
    (("int4", None, None, "head=int2"), "after '=' comes fp32, int8 or int4"),
    (("int4", None, None, "head=int8@7"), "the accuracy level after '@'"),
    (("int4", None, None, "layers:5-2"), "I <= J"),
    (("fp16", 32), "quantizes nothing"),
    (("int4", None, None, None, None, None, "rounded"), "--minimums is one of folded, exact, float"),
])
def test_a_bad_plan_is_one_line(args, message):
    with pytest.raises(UsageError, match=message):
        P.plan_for(*args)


def test_a_model_with_no_matrix_to_quantize_is_refused():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(UsageError, match="no MatMul with a constant weight matrix"):
        P.quantize(helper.make_model(graph), P.Plan(), layers=1)


def test_the_params_record_marks_what_moved_into_a_quantized_matrix():
    model = one_matmul(q8_0(raw()))
    P.quantize(model, P.Plan(bits=8, block=B), layers=4)
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    assert record["model.model.layers.3.mlp.down_proj.weight"]["quantized"] == "mm_Q8"
    assert "w" not in {i.name for i in model.graph.initializer}  # the float matrix is gone
    assert P.dequantized_params(model)["model.model.layers.3.mlp.down_proj.weight"].shape == (N, K)


def test_quantizing_leaves_the_logging_as_it_was():
    # ONNX Runtime's quantizer module calls logging.basicConfig(level=INFO) when first imported: in a
    # fresh process, the root logger must have no handler and its level after a quantization.
    import logging
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import logging, test_pretrained_precision as t; from attnexport.pretrained import precision as P; "
            "P.quantize(t.one_matmul(t.raw()), P.Plan(bits=4, block=t.B), layers=4); "
            "r = logging.getLogger(); print(len(r.handlers), r.level)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.stdout.split() == ["0", str(logging.WARNING)]


def test_requantize_rounds_a_grid_again():
    w = q4_1(raw())
    done = P.quantize(one_matmul(w), P.plan_for("int4", carry=False), layers=4)
    assert [e["how"] for e in done.entries] == ["ort"]


def tied(w):
    """ids (1, 3) -> the (K, N) table's columns as rows (a tied embedding, as the export gathers it),
    then those rows @ the same table (the head): logits (1, 3, N)."""
    nodes = [helper.make_node("Gather", ["w", "ids"], ["columns"], name="embedding", axis=1),
             helper.make_node("Transpose", ["columns"], ["rows"], name="embedding_model_axis_last", perm=[1, 2, 0]),
             helper.make_node("MatMul", ["rows", "w"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3, N])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    model.metadata_props.add(key="attnexport.params", value=json.dumps(
        {name: {"initializer": "w", "layout": "transposed", "sha256": "0"}
         for name in ("model.lm_head.weight", "model.model.embed_tokens.weight")}))
    return model


def test_a_tied_embedding_is_gathered_from_its_heads_8_bit_blocks():
    w = q8_0(raw())
    model = tied(w)
    ids = np.array([[3, 0, N - 1]], np.int64)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})[0]
    done = P.quantize(model, P.Plan(bits=8, block=B, accuracy=0), layers=4)
    (entry,) = done.entries
    assert entry["how"] == "exact" and entry["group"] == "head" and entry["embedding"]
    assert "w" not in {i.name for i in model.graph.initializer}  # the float table is gone
    assert [n.op_type for n in model.graph.node].count("GatherBlockQuantized") == 1
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})[0]
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()  # the same rows, the same head
    record = json.loads({p.key: p.value for p in model.metadata_props}["attnexport.params"])
    assert record["model.model.embed_tokens.weight"]["quantized"] == "head_Q8"
    assert np.array_equal(P.dequantized_params(model)["model.model.embed_tokens.weight"], w.T)
    assert P.damaged(model) == [] and P.unfaithful({"w": w}, model) == []


def test_a_tied_embedding_off_the_heads_grid_stays_a_float_table():
    w = raw()  # ONNX Runtime's quantizer rounds the head: its rows are not the table's
    model = tied(w)
    done = P.quantize(model, P.Plan(bits=8, block=B, accuracy=0), layers=4)
    assert done.entries[0]["how"] == "ort" and "embedding" not in done.entries[0]
    assert "w" in {i.name for i in model.graph.initializer}
    assert "GatherBlockQuantized" not in [n.op_type for n in model.graph.node]


def test_every_input_of_one_width_reads_one_summing_matrix():
    """A chain x @ w1 @ w2 of square Q4_1 matrices: each folded input gets its own block sums, by
    the one 0/1 matrix of its width (the model's layers all read it from the cache)."""
    w1, w2 = (q4_1(np.random.default_rng(seed).standard_normal((K, K)).astype(np.float32)) for seed in (1, 2))
    model = graph_of([helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
                      helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")], K, w1=w1, w2=w2)
    model.metadata_props.add(key="attnexport.params", value=json.dumps(
        {f"model.model.layers.{i}.mlp.up_proj.weight": {"initializer": f"w{i}", "layout": "transposed",
                                                        "sha256": "0"} for i in (1, 2)}))
    done = P.quantize(model, P.Plan(bits=4, block=B, accuracy=0), layers=4)
    assert [e["how"] for e in done.entries] == ["folded", "folded"]
    summing = [i for i in model.graph.initializer if i.name.startswith("block_sums_")]
    sums = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert len(summing) == 1 and len(sums) == 2 and {n.input[1] for n in sums} == {summing[0].name}
    x = np.random.default_rng(3).standard_normal((1, 3, K)).astype(np.float32)
    want = x.astype(np.float64) @ P.matrix(model, done.entries[0]) @ P.matrix(model, done.entries[1])
    assert np.abs(run(model, x) - want).max() < 1e-4 * np.abs(want).max()


def test_the_timing_only_edits_of_a_folded_graph_keep_its_codes_and_drop_what_they_say():
    """benchmarks/probes/int4_step.py's `:no-zero-points` and `:bare` (what the zero points and the block
    sums cost, docs/quantization.md): the codes and scales of the model's own blocks stay, the zero
    points go, and `bare` reads the plain input with K values, so with the zero points at the
    kernel's implied 8 it computes the grid's `d * (q - 8)` exactly."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "int4_step.py"
    spec = importlib.util.spec_from_file_location("int4_step", path)
    int4_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(int4_step)
    w1, w2 = q4_1(raw()), q4_1(raw(7))
    model = two_matmuls(w1, w2)
    P.quantize(model, P.Plan(bits=4, block=B, accuracy=0), layers=4)
    no_zeros = int4_step.without_zero_points(model)
    assert all(len(n.input) == 3 for n in no_zeros.graph.node if n.op_type == "MatMulNBits")
    assert not any(i.name.endswith("_zero_points") for i in no_zeros.graph.initializer)
    bare = int4_step.bare(model)
    assert sorted(n.op_type for n in bare.graph.node) == ["Add", "MatMulNBits", "MatMulNBits"]
    assert {n.input[0] for n in bare.graph.node if n.op_type == "MatMulNBits"} == {"x"}
    assert all(P._attr(n, "K") == K for n in bare.graph.node if n.op_type == "MatMulNBits")
    assert not any(i.name.startswith("block_sums_") for i in bare.graph.initializer)
    assert P.FOLDED in next(n for n in model.graph.node if n.op_type == "MatMulNBits").input[0]  # the original kept
    x = np.random.default_rng(1).standard_normal((1, 3, K)).astype(np.float32)
    grids = [P.grid_of(w, 4, B) for w in (w1, w2)]
    held = sum(np.repeat(g.scale, B, axis=0).astype(np.float64) * (g.q.astype(np.float64) - 8) for g in grids)
    want = x.astype(np.float64) @ held
    assert np.abs(run(bare, x) - want).max() < 1e-4 * np.abs(want).max()
