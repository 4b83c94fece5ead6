"""A model of alike layers traced with three of them and stamped out (`attnexport.stamping`): the
stamped graph computes what the whole model's trace does, in the forms and flavours it applies to,
each layer on its own weights; a model whose layers differ is traced whole; traced layers that turn
out not to be alike leave the graph as traced, and the note says why. The `[hf]` extra, on small
random configs."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport import stamping as ST  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.causal import forms as causal  # noqa: E402

LAYERS = 5


def _export(folder, out, form, flavor, **fields):
    request = hf_export.request(folder, form=form, flavor=flavor, output=out,
                                max_seq=32 if form == "static" else 0, **fields)
    return hf_export.export_hf(request)


def _outputs(path, layout):
    feed = hf.example_feed(layout, batch=2, block=3, past=4, seed=1)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True))


@pytest.mark.parametrize("arch,form,flavor", [
    ("llama", "concat", "attention"),
    ("qwen2", "static", "ort"),  # ONNX Runtime's fused ops, made after the stamp by the rewrite
    ("gpt2", "none", "primitives"),  # its Split nodes, which a rewrite makes without a module, join their layer
])
def test_a_stamped_graph_computes_what_the_whole_trace_does(tiny_lm, tmp_path, monkeypatch, arch, form, flavor):
    folder = tiny_lm(arch, layers=LAYERS)
    stamped, layout = _export(folder, tmp_path / "stamped.onnx", form, flavor)
    assert f"traced with {ST.TRACED} of its {LAYERS} alike layers; the other {LAYERS - ST.TRACED} stamped from " \
           f"layer {ST.TEMPLATE}'s graph" in " ".join(stamped.notes)
    monkeypatch.setattr(causal.CausalForm, "repeat", lambda self, wrapper, layout: None)
    whole, _ = _export(folder, tmp_path / "whole.onnx", form, flavor)
    assert not any("traced with" in n for n in whole.notes)
    a, b = onnx.load(tmp_path / "stamped.onnx"), onnx.load(tmp_path / "whole.onnx")
    assert [(i.name, str(i.type)) for i in a.graph.input] == [(i.name, str(i.type)) for i in b.graph.input]
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]
    for op in ("MatMul", "Attention", "GroupQueryAttention", "Gemm"):
        assert sum(n.op_type == op for n in a.graph.node) == sum(n.op_type == op for n in b.graph.node), op
    assert len(a.graph.initializer) == len(b.graph.initializer)
    got, expected = _outputs(tmp_path / "stamped.onnx", layout), _outputs(tmp_path / "whole.onnx", layout)
    assert list(got) == list(expected)
    for name in expected:  # each layer's weights differ (drawn at random): a layer reading another's would show
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_traced_layers_that_are_not_alike_leave_the_whole_trace(tiny_lm, tmp_path, monkeypatch):
    folder = tiny_lm("llama", layers=LAYERS)
    where = ST._where

    def one_node_moved(graph, prefix):  # layer 1 one node short of layer 2
        found = where(graph, prefix)
        found[next(n for n in graph if found[n] == 1)] = None
        return found
    monkeypatch.setattr(ST, "_where", one_node_moved)
    result, _ = _export(folder, tmp_path / "m.onnx", "concat", "attention")
    note = next(n for n in result.notes if n.startswith("traced with"))
    assert note.startswith(f"traced with all {LAYERS} layers: the traced layers are not alike (layer 1 has ")
    assert sum(n.op_type == "Attention" for n in onnx.load(tmp_path / "m.onnx").graph.node) == LAYERS


def _repeat(folder, form="concat"):
    model, _ = hf.load(folder, None)
    layout = hf.layout_of(model, form, 32 if form == "static" else 0, folder)
    return layout.cache_form.repeat(hf.step_module(model, layout), layout)


def test_which_models_are_stamped(tiny_lm):
    r = _repeat(tiny_lm("llama", layers=LAYERS))
    assert (r.count, r.layers) == (LAYERS, "model.model.layers")
    assert r.names(1) == ["past_key_values.1.key", "past_key_values.1.value", "present.1.key", "present.1.value"]
    assert r.kept("past_key_values.2.value") and not r.kept("present.3.key") and r.kept("logits")
    assert _repeat(tiny_lm("llama", layers=ST.TRACED)) is None  # nothing to stamp
    assert _repeat(tiny_lm("gemma2", layers=LAYERS)) is None  # its layers alternate a window with full attention
    assert _repeat(tiny_lm("gemma3", layers=6)) is None  # five local layers to each global one
    assert _repeat(tiny_lm("llama", layers=LAYERS), "none").names(2) == []


def test_the_shallow_model_is_put_back(tiny_lm):
    model, _ = hf.load(tiny_lm("llama", layers=LAYERS), None)
    layout = hf.layout_of(model, "static", 32, None)
    wrapper = hf.step_module(model, layout)
    r = layout.cache_form.repeat(wrapper, layout)
    layers = model.model.layers
    with r.shallow(wrapper):
        assert len(model.model.layers) == ST.TRACED and model.config.num_hidden_layers == ST.TRACED
        assert wrapper.layers == ST.TRACED
    assert model.model.layers is layers and model.config.num_hidden_layers == LAYERS and wrapper.layers == LAYERS


def test_a_departing_stamped_export_names_trace_all_layers_which_traces_every_one(tiny_lm, tmp_path, monkeypatch):
    """Where a stamped graph departs from the model (here each stamped layer made to read the template's
    weights), the check refuses it and the error names --trace-all-layers; with it every layer is traced
    (no stamping) and the export passes."""
    from conftest import cli as run
    folder = tiny_lm("llama", layers=LAYERS)
    stamped = ST._stamped_param
    monkeypatch.setattr(ST, "_stamped_param", lambda value, view, layer, k: stamped(
        value, view, ST._submodule(layer_owner["module"], "model.model.layers")[ST.TEMPLATE], k))
    layer_owner = {}
    stamp = ST.stamp

    def keep_module(model, r, module):
        layer_owner["module"] = module
        return stamp(model, r, module)
    monkeypatch.setattr(ST, "stamp", keep_module)
    r = run("export", "--hf", folder, "--kv-cache", "-o", tmp_path / "a.onnx")
    assert r.exit_code == 1 and "--trace-all-layers traces every one" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "a.onnx").exists()
    r = run("export", "--hf", folder, "--kv-cache", "--trace-all-layers", "-o", tmp_path / "b.onnx")
    assert r.exit_code == 0 and "traced with" not in r.output, r.output
