"""The check of each layer alone before a whole model's export is written (`attnexport.pretrained.layers`):
each decoder layer's output found in the graph by value, the graph cut there and fed the float64 model's
output of the layer before, each layer within a budget of its own, and the first that departs named. The
`[hf]` extra, on small random configs."""

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli as run  # noqa: E402

from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import layers as LC  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import reference as HR  # noqa: E402


def _down(model: onnx.ModelProto, layer: int):
    """The initializer of layer `layer`'s MLP down projection (the layers' MatMul weights of shape
    (intermediate, hidden), in node order)."""
    inits = {i.name: i for i in model.graph.initializer}
    shapes = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            dims = tuple(inits[node.input[1]].dims)
            shapes.setdefault(dims, []).append(inits[node.input[1]])
    down = max((dims for dims in shapes if len(dims) == 2 and dims[0] > dims[1]), key=lambda dims: dims[0])
    return shapes[down][layer]


def _damage(model: onnx.ModelProto, layer: int, by: float = 1.5) -> None:
    w = _down(model, layer)
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(by), w.name))


@pytest.mark.parametrize("flavor", ["attention", "ort"])
def test_each_layer_is_checked_alone_and_the_export_says_so(tiny_lm, tmp_path, flavor):
    r = run("export", "--hf", tiny_lm("llama", layers=3), "--kv-cache", "--flavor", flavor, "-o", tmp_path / "m.onnx",
            "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    for entry in doc["checked"]:
        layers = entry["layers"]
        assert layers["layers"] == 3 and layers["compared"] == 3 and layers["not_found"] == [], layers
        assert layers["departing"] is None and 0 <= layers["worst"]["of_budget"] <= 1
        assert "torch's fp32 error" in layers["worst"]["basis"] or "policy" in layers["worst"]["basis"]
    assert any("each of its 3 layers alone (its input the float64 model's), 3 of them found" in n
               for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize("flavor", ["attention", "ort"])
def test_a_layer_is_checked_from_the_float64_models_input_so_only_the_damaged_one_departs(tiny_lm, tmp_path,
                                                                                          flavor):
    """Layer 0's down projection off by half: layer 0 departs, and layer 1, fed the float64 model's output
    of layer 0 rather than the graph's own, is within its budget (in the ort flavour the residual sum is
    a fused SkipSimplifiedLayerNormalization's, which the cut computes twice)."""
    folder = tiny_lm("llama", layers=3)
    path = tmp_path / "m.onnx"
    assert run("export", "--hf", folder, "--kv-cache", "--flavor", flavor, "-o", path).exit_code == 0
    graph = onnx.load(str(path))
    assert (flavor == "ort") == any(n.op_type == "SkipSimplifiedLayerNormalization" for n in graph.graph.node)
    model, _ = hf.load(folder, 0)
    layout = hf.layout_of(model, "concat", None, folder)
    reference = HR.Reference(model, layout)
    tokenizer = hf.tokenizer_of(folder)
    sides = []
    for label, batch, block, past, padded in layout.cache_form.export_checks:
        feed = layout.family.check_feed(reference, tokenizer, batch, block, past, padded, seed=1)
        sides.append((label, feed, reference.expect(feed, layers=True).layers))
    assert all(s is not None for _, _, s in sides)
    checks = LC.check_layers(graph, sides)
    assert all(c.departing is None for c in checks)
    _damage(graph, 0)
    checks = LC.check_layers(graph, sides)
    for check in checks:
        assert check.departing == 0, check.to_dict()
        assert check.comparisons[1] and check.comparisons[2], [str(c) for c in check.comparisons]


def test_the_export_names_the_first_layer_that_departs_and_writes_nothing(tiny_lm, tmp_path, monkeypatch):
    rewritten = hf_export._rewritten

    def damaged(onnx_model, *args, **kwargs):
        onnx_model = rewritten(onnx_model, *args, **kwargs)
        _damage(onnx_model, 1)
        return onnx_model
    monkeypatch.setattr(hf_export, "_rewritten", damaged)
    path = tmp_path / "m.onnx"
    r = run("export", "--hf", tiny_lm("llama", layers=3), "--kv-cache", "-o", path)
    assert r.exit_code == 1 and "layer 1 of 3 departs at" in r.output and "its input the float64 model's" in r.output
    assert r.output.count("\n") <= 2 and not list(tmp_path.iterdir()), r.output


def test_a_value_near_no_layers_output_is_not_taken_for_it():
    want = np.ones((1, 2, 4))
    side = LC.LayerSide([want], None, [None])
    assert LC.boundaries({"far": want * 1.5, "int": want.astype(np.int64)}, side).names == ["far"]  # the only one
    two = LC.LayerSide([want, want * 2], None, [None, None])
    assert LC.boundaries({"far": want * 1.7}, two).names == [None, "far"]  # nearer the second layer's output
    found = LC.boundaries({"far": want * 1.5, "near": (want + 1e-6).astype(np.float32)}, side)
    assert found.names == ["near"] and found.nearness[0] < 1e-5


@pytest.mark.parametrize("flavor", ["attention", "ort"])
def test_a_post_norm_encoders_layers_are_found_where_a_norm_ends_them(tiny_encoder, tmp_path, flavor):
    """BERT's layer ends with its norm (a fused SkipLayerNormalization's first output in the ort flavour)."""
    r = run("export", "--hf", tiny_encoder("bert"), "--flavor", flavor, "-o", tmp_path / "e.onnx", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert all(e["layers"]["compared"] == e["layers"]["layers"] == 2 for e in doc["checked"]), doc["checked"]


@pytest.mark.parametrize("form", ["concat", "static"])
def test_torchs_run_and_each_layer_alone_in_one_run_give_what_two_runs_give(tiny_lm, form):
    """`Reference._low`: torch's run of the step and each layer's run alone (its input replaced) made
    in one run of the feed given twice over, the second copy reading the replacements: each half is
    what its own run gives, to fp32's rounding (a batch of another size may sum in another order).
    The replacements here are far from the layers' own inputs, so halves taken the wrong way round
    would not pass."""
    model, _ = hf.load(tiny_lm("llama", layers=3), 0)
    layout = hf.layout_of(model, form, 32 if form == "static" else None)
    reference = HR.Reference(model, layout)
    feed = layout.family.check_feed(reference, None, 3, 4, 2, 0, seed=1)
    window, _ = reference._written_window(feed, HR.valid_positions(layout, feed))
    assert HR._twice(window, layout.cache_form.dynamic_axes(layout)) is not None  # the one-run way is taken
    ins: dict = {}
    with LC.layer_io(LC.decoder_layers(model, 3), ins, {}):
        reference.run(window)
    far = {i: ins[i].double() * 1.5 + 0.25 for i in range(3)}
    one, sides = reference._low(window, far)
    alone = reference.run(window)
    outs: dict = {}
    with LC.layer_io(LC.decoder_layers(reference.low, 3), {}, outs, replace={i: far[i] for i in (1, 2)}):
        reference.run(window)
    assert sorted(one) == sorted(alone) and sorted(sides) == [0, 1, 2]
    for name, got in one.items():
        np.testing.assert_allclose(got, alone[name], rtol=1e-4, atol=1e-5, err_msg=name)
    for i in range(3):
        np.testing.assert_allclose(sides[i].numpy(), outs[i].numpy(), rtol=1e-4, atol=1e-5, err_msg=f"layer {i}")
    assert not np.allclose(sides[2].numpy(), alone_layer(reference, window, 2), atol=1e-3)


def alone_layer(reference, window, i: int) -> np.ndarray:
    """Layer i's output in torch's run of `window` as it flows (no input replaced)."""
    outs: dict = {}
    with LC.layer_io(LC.decoder_layers(reference.low, reference.layout.layers), {}, outs):
        reference.run(window)
    return outs[i].numpy()
