"""A vision transformer's image form (`attnexport.pretrained.vision.form`): the graph at the processor's
size, a dynamic batch, DINOv2's position table interpolated once by the model's own code (no Resize in
the graph), the export equal to transformers' own model on ONNX Runtime. The [hf] extra."""

from collections import Counter

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

import torch  # noqa: E402

from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.runtimes import ort_session  # noqa: E402


@pytest.mark.parametrize("arch", ["vit", "dinov2"])
def test_the_export_is_transformers_model_at_the_processor_s_size_for_any_batch(arch, tiny_vision, tmp_path):
    folder = tiny_vision(arch)
    out = tmp_path / f"{arch}.onnx"
    hf_export.export_hf(hf_export.HFExport(folder, output=out))
    graph = onnx.load(out)
    ops = Counter(n.op_type for n in graph.graph.node)
    assert ops["Resize"] == 0 and ops["Attention"] == 2, ops
    (pixels,) = graph.graph.input
    dims = [d.dim_param or d.dim_value for d in pixels.type.tensor_type.shape.dim]
    assert isinstance(dims[0], str) and dims[1:] == [3, 32, 32]
    import transformers
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    session = ort_session("ort-cpu", out)[0]
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
        with torch.no_grad():
            want = model(pixel_values=torch.from_numpy(x))  # the model's own interpolation (DINOv2: bicubic)
        states, pooled = session.run(["last_hidden_state", "pooler_output"], {"pixel_values": x})
        assert states.shape == (batch, 17, 32) and pooled.shape == (batch, 32)
        assert np.abs(states - want.last_hidden_state.numpy()).max() < 1e-4
        assert np.abs(pooled - want.pooler_output.numpy()).max() < 1e-4


def test_dinov2_s_table_is_interpolated_once_to_the_size_and_held_by_the_graph(tiny_vision):
    """The table made for 56 x 56 (7 x 7 patches), interpolated by the model's code to 32 x 32 (4 x 4):
    the wrapper's buffer; the model's own table unchanged; ViT's at its own size has none."""
    import transformers
    folder = tiny_vision("dinov2")
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    layout = hf.layout_of(model, None, 0, folder)
    step = hf.step_module(model, layout)
    assert step.positions.shape == (1, 17, 32) and model.embeddings.position_embeddings.shape == (1, 50, 32)
    shaped = torch.zeros(1, 17, 32)
    assert torch.equal(step.positions, model.embeddings.interpolate_pos_encoding(shaped, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours, want = step(x), model(pixel_values=x)
    assert torch.allclose(ours[0], want.last_hidden_state, atol=1e-6)
    assert "interpolate_pos_encoding" not in vars(model.embeddings)  # the patch is gone after the call
    vit = transformers.AutoModel.from_pretrained(str(tiny_vision("vit"))).eval()
    assert hf.step_module(vit, hf.layout_of(vit, None, 0, tiny_vision("vit"))).positions is None
