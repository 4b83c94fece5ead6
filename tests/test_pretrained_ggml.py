"""GGML's block formats (attnexport.pretrained.ggml): one hand-worked block of each format, its
values written out here from the format's layout, and random blocks against the gguf package's own
dequantization where it is installed (the [real] extra)."""

import numpy as np
import pytest

from attnexport.pretrained import ggml


def _half(x: float) -> list[int]:
    return list(np.float16(x).tobytes())


def _block(size: int, at: dict[int, list[int] | int]) -> np.ndarray:
    b = np.zeros(size, np.uint8)
    for offset, value in at.items():
        value = [value] if isinstance(value, int) else value
        b[offset:offset + len(value)] = value
    return b


def test_q4_0_and_q4_1():
    b = _block(18, {0: _half(0.5), 2: 0x9F, 3: 0x08})
    v = ggml.read(b, "Q4_0").values()
    assert (v[0], v[16], v[1], v[17], v[2]) == (3.5, 0.5, 0.0, -4.0, -4.0)  # (15-8)/2, (9-8)/2, 0, -8/2
    b = _block(20, {0: _half(0.25), 2: _half(-1.0), 4: 0x3A})
    g = ggml.read(b, "Q4_1")
    assert (g.values()[0], g.values()[16], g.values()[1]) == (1.5, -0.25, -1.0)  # 10/4 - 1, 3/4 - 1, -1
    assert g.group == 32 and g.bits == 4


def test_q5_0_takes_the_fifth_bit_of_value_j_from_bit_j():
    # bits 0 and 17 set: values 0 and 17 get their fifth bit.
    b = _block(22, {0: _half(1.0), 2: [0x01, 0x00, 0x02, 0x00], 6: 0x21, 7: 0x3F})
    v = ggml.read(b, "Q5_0").values()
    assert (v[0], v[16], v[1], v[17], v[2]) == (1.0, -14.0, -1.0, 3.0, -16.0)  # 17-16, 2-16, 15-16, 19-16


def test_q8_0():
    b = _block(34, {0: _half(2.0), 2: 0xFD, 33: 127})
    v = ggml.read(b, "Q8_0").values()
    assert (v[0], v[1], v[31]) == (-6.0, 0.0, 254.0)


def test_q4_k_packs_its_six_bit_scales_and_minimums():
    """Sub-block 0: scale 3, minimum 2; 1: scale 1, minimum 7; 5: scale 5 + 16 (the two high bits
    from byte 1's top), minimum 2 + 32 (byte 5's top), all times d = 1 and dmin = 0.5."""
    scales = {4 + 0: 3, 4 + 1: 0x40 | 1, 4 + 4: 2, 4 + 5: 0x80 | 7, 4 + 9: 0x25}
    b = _block(144, {0: _half(1.0), 2: _half(0.5), **scales, 16: 0x4A, 16 + 64: 0x70})
    g = ggml.read(b, "Q4_K")
    assert g.levels.shape == (8, 32) and list(g.scale[[0, 1, 5]]) == [3.0, 1.0, 21.0]
    assert list(g.offset[[0, 1, 5]]) == [1.0, 3.5, 17.0]
    v = g.values()
    assert v[0] == 3 * 10 - 0.5 * 2       # chunk 0's low nibbles: sub-block 0
    assert v[32] == 1 * 4 - 0.5 * 7       # chunk 0's high nibbles: sub-block 1
    assert v[160] == 21 * 7 - 0.5 * 34    # chunk 2's high nibbles: sub-block 5
    assert v[1] == -1.0                   # a zero level: minus the minimum


def test_q6_k_groups_sixteen_values_a_scale():
    """Position 0: ql[0]'s low nibble 5 and qh[0]'s bits 0-1 (1): level 21 - 32, scale 2; position
    84 (the half's third quarter, its second 16): ql[20]'s high nibble 11 and qh[20]'s bits 4-5 (2):
    level 43 - 32, scale -3; d = 0.5."""
    b = _block(210, {0: 0x05, 20: 0xB0, 128: 0x01, 128 + 20: 0x20, 192: 2, 192 + 5: 0xFD, 208: _half(0.5)})
    g = ggml.read(b, "Q6_K")
    assert g.levels.shape == (16, 16) and g.offset is None
    v = g.values()
    assert v[0] == 0.5 * 2 * -11 and v[84] == 0.5 * -3 * 11
    assert v[1] == 0.5 * 2 * -32 and v[16] == 0.0  # sub-block 1's scale is 0


def test_a_partial_block_or_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="whole Q8_0 blocks"):
        ggml.read(np.zeros(35, np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="Q3_K is not a block format read here"):
        ggml.read(np.zeros(110, np.uint8), "Q3_K")


@pytest.mark.parametrize("kind", list(ggml.FORMATS))
def test_random_blocks_equal_the_gguf_package_s_dequantization(kind):
    quants = pytest.importorskip("gguf.quants", reason="the gguf package is the [real] extra")
    import gguf
    per_block, size, _ = ggml.FORMATS[kind]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (64, size), dtype=np.uint8)
    # The fp16 fields finite and of either sign, as a quantizer writes them.
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[kind]
    for at in halves:
        blocks[:, at:at + 2] = rng.normal(0, 0.02, (64, 1)).astype(np.float16).view(np.uint8)
    want = quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(-1)
    got = ggml.read(blocks, kind).values()
    assert got.shape == (64 * per_block,) and got.dtype == np.float32
    # Bit for bit: each value is one float32 product and at most one difference, each correctly
    # rounded by IEEE 754 on any CPU (no transcendental function, no sum whose order may vary).
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """`rows` rows of `cols` values of random `kind` blocks, their fp16 fields finite."""
    per_block, size, _ = ggml.FORMATS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // per_block, size), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[kind]
    for at in halves:
        blocks[:, at:at + 2] = np.abs(rng.normal(0, 0.02, (len(blocks), 1))).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file of four weight matrices (out, in) in Q4_K, Q5_0, Q6_K and Q8_0, and each as the
    gguf package dequantizes it (what transformers loads)."""
    pytest.importorskip("gguf.quants", reason="the gguf package is the [real] extra")
    import gguf
    from gguf.quants import dequantize
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    matrices = {}
    for i, (kind, rows) in enumerate((("Q4_K", 24), ("Q5_0", 16), ("Q6_K", 8), ("Q8_0", 40))):
        raw = _random_blocks(kind, rows, 256, seed=i)
        writer.add_tensor(f"blk.0.{kind}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        matrices[kind] = dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32).reshape(rows, 256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, matrices


def _matmuls(matrices: dict):
    """y_KIND = x @ W_KIND.T for each matrix: a graph whose MatMuls hold the matrices as a Linear's
    export does (transposed)."""
    from onnx import TensorProto, helper, numpy_helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 256])
    nodes, inits, outs = [], [], []
    for kind, m in matrices.items():
        inits.append(numpy_helper.from_array(np.ascontiguousarray(m.T), f"w_{kind}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w_{kind}"], [f"y_{kind}"], name=f"mm_{kind}"))
        outs.append(helper.make_tensor_value_info(f"y_{kind}", TensorProto.FLOAT, [3, m.shape[0]]))
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_gguf_file_s_tensors_are_found_by_their_values(gguf_file):
    path, matrices = gguf_file
    tensors = ggml.Tensors(path)
    assert tensors.kinds() == {"Q4_K": 1, "Q5_0": 1, "Q6_K": 1, "Q8_0": 1}
    for kind, m in matrices.items():
        found = tensors.find(m)
        assert found.kind == kind and found.name == f"blk.0.{kind}.weight"
        assert np.array_equal(found.groups.values().reshape(m.shape), m)
    moved = matrices["Q5_0"].copy()
    moved[3, 7] = np.nextafter(moved[3, 7], np.float32(1))  # one value one ulp away: not the file's
    assert tensors.find(moved) is None and tensors.find(matrices["Q5_0"][::-1]) is None


@pytest.mark.parametrize(("bits", "widen"), [(8, True), (4, True), (4, False)])
def test_int4_and_int8_carry_the_file_s_own_blocks_where_a_width_holds_them(gguf_file, bits, widen):
    """At int8 every format is carried (Q6_K's sub-blocks of 16 as blocks of 16); at int4 the Q4_K
    blocks are, and the 5-, 6- and 8-bit ones carried at 8 bits (the file's own widths) or, asked,
    re-quantized to 4, each said in the record; ONNX Runtime's products of the carried matrices
    equal x @ W in float64 within fp32's budget."""
    ort = pytest.importorskip("onnxruntime")
    from attnexport.compare import Tolerance, compare
    from attnexport.pretrained import precision as P
    path, matrices = gguf_file
    model = _matmuls(matrices)
    done = P.quantize(model, P.Plan(bits=bits, accuracy=0, minimums="exact", widen=widen), layers=1,
                      tensors=ggml.Tensors(path))
    how = {e["file"]: (e["how"], e["bits"], e["block"]) for e in done.entries}
    wide = {"Q5_0": ("exact", 8, 32), "Q6_K": ("exact", 8, 16), "Q8_0": ("exact", 8, 32)}
    if widen:
        assert how == {"Q4_K": ("exact", bits, 32), **wide}
    else:
        assert how == {"Q4_K": ("exact", 4, 32), "Q5_0": ("ort", 4, 32), "Q6_K": ("ort", 4, 32),
                       "Q8_0": ("ort", 4, 32)}
        assert "of the file's tensors Q4_K 1 carried, Q5_0 1 re-quantized" in done.summary()
    x = np.random.default_rng(0).normal(size=(3, 256)).astype(np.float32)
    got = dict(zip([o.name for o in model.graph.output],
                   ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                   .run(None, {"x": x}), strict=True))
    for kind, m in matrices.items():
        if how[kind][0] == "exact":
            want = x.astype(np.float64) @ m.T.astype(np.float64)
            # fp32 sums of 256 products: a few ulps of the largest partial sum.
            tol = Tolerance(1e-5, 1e-5 * float(np.abs(x).max() * np.abs(m).max() * 256), "fp32 products of 256")
            assert compare(f"y_{kind}", got[f"y_{kind}"], want, tol).passed, kind


def test_a_gguf_file_is_parsed_once_within_a_block(gguf_file, monkeypatch):
    """Within `model.gguf_parsed_once` every reader of a file is the first one made (transformers makes
    one for the config, one for the tensors and one for the tokenizer: 9 s each for Gemma-3-270M's
    vocabulary), its tokenizer is made once, and a file changed is read again; once the readers are
    let go, or outside the block, a reader parses the file anew."""
    import os

    import gguf
    transformers = pytest.importorskip("transformers")
    from attnexport.pretrained import model as hf
    path, matrices = gguf_file
    made = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            made.append(path)
            super().__init__(path, mode)

    tokenizers = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: tokenizers.append(a) or real(*a, **k))
    count = sum(m.size for m in matrices.values())
    with hf.gguf_parsed_once() as parsed:
        assert hf.parameter_count(path) == count and hf.parameter_count(str(path)) == count
        first = gguf.GGUFReader(str(path))
        assert len(made) == 1 and isinstance(first, Counting)
        with hf.gguf_parsed_once() as inner:  # a block within: the outer one's readers
            assert inner is parsed and gguf.GGUFReader(str(path)) is first
        hf.loaded_readers_dropped(path)  # its tokenizer made (this file has no vocabulary: none), readers let go
        assert hf.tokenizer_of(path) is None and len(tokenizers) == 1
        again = gguf.GGUFReader(str(path))
        assert again is not first and len(made) == 2
        os.utime(path, ns=(10**9, 10**9))  # the file changed: read again
        assert gguf.GGUFReader(str(path)) is not again and len(made) == 3
    assert gguf.GGUFReader is Counting  # put back as it was
    hf.parameter_count(path)
    hf.parameter_count(path)
    assert len(made) == 5


def test_a_half_graph_carries_a_k_quants_grid_with_its_scales_rounded_to_fp16(gguf_file):
    """q4f16: a half graph's MatMulNBits holds its scales in fp16. Q4_K's (an fp16 super-block scale
    times a 6-bit one) and Q6_K's (times an 8-bit one) are finer: they are carried rounded, said in
    the record and the summary, and each weight is checked within that rounding (not bit for bit,
    nor a whole step); Q5_0's and Q8_0's are fp16 values, carried exactly. ONNX Runtime's fp16
    products equal x @ W in float64 within fp16's budget."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto

    from attnexport.pretrained import precision as P
    path, matrices = gguf_file
    half = _matmuls({k: m.astype(np.float16) for k, m in matrices.items()})
    for v in list(half.graph.input) + list(half.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    weights = {f"w_{k}": np.ascontiguousarray(m.T) for k, m in matrices.items()}
    done = P.quantize(half, P.Plan(bits=4, accuracy=0), layers=1, weights=weights, tensors=ggml.Tensors(path))
    by_file = {e["file"]: e for e in done.entries}
    assert {k: e["how"] for k, e in by_file.items()} == {"Q4_K": "folded", "Q5_0": "exact", "Q6_K": "exact",
                                                         "Q8_0": "exact"}
    assert 0 < by_file["Q4_K"]["scales_rounded"] <= 2 ** -11 and 0 < by_file["Q6_K"]["scales_rounded"] <= 2 ** -11
    assert "scales_rounded" not in by_file["Q5_0"] and "scales_rounded" not in by_file["Q8_0"]
    assert "2 carried with their scales rounded to fp16" in done.summary()
    assert P.unfaithful(weights, half) == []
    for kind in ("Q6_K", "Q4_K"):  # a weight off by a twentieth of its block's step: more than fp16's rounding
        e = by_file[kind]
        held = P.matrix(half, e).astype(np.float64)
        codes = np.unique(np.round(held[:e["block"], 3], 6))
        step = np.diff(codes).min()
        moved = {**weights, e["weight"]: weights[e["weight"]].copy()}
        moved[e["weight"]][5, 3] += 0.05 * step
        assert [p.split(":")[0] for p in P.unfaithful(moved, half)] == [f"mm_{kind}"], kind
    floats = _matmuls({"Q4_K": matrices["Q4_K"].astype(np.float16)})  # the float zero points' form too
    for v in list(floats.graph.input) + list(floats.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    done = P.quantize(floats, P.Plan(bits=4, accuracy=0, minimums="float"), layers=1,
                      weights={"w_Q4_K": weights["w_Q4_K"]}, tensors=ggml.Tensors(path))
    assert [(e["how"], bool(e.get("scales_rounded"))) for e in done.entries] == [("float", True)]
    assert P.unfaithful({"w_Q4_K": weights["w_Q4_K"]}, floats) == []
    x = np.random.default_rng(0).normal(size=(3, 256)).astype(np.float16)
    got = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for (kind, m), y in zip(matrices.items(), got, strict=True):
        want = x.astype(np.float64) @ m.T.astype(np.float64)
        assert np.abs(y - want).max() < 4e-3 * np.abs(want).max(), kind  # fp16 activations and sums
