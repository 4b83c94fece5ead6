"""transformers' model computing as a quantized file does (`attnexport.pretrained.emulate`): each
Linear's weight the file's dequantized matrix while the block lasts (restored after), int8
activations where the file's MatMulNBits round them, the file's model a copy. The [hf] extra."""

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

import torch  # noqa: E402

from attnexport.pretrained import emulate  # noqa: E402
from attnexport.pretrained import export as hf_export  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import precision as P  # noqa: E402


def test_the_model_computes_with_the_file_s_weights_while_the_block_lasts_and_then_its_own(tiny_lm, tmp_path):
    path = tmp_path / "int8.onnx"
    hf_export.export_hf(hf_export.HFExport(tiny_lm("llama"), precision="int8", output=path))
    onnx_model = onnx.load(path)
    model, _ = hf.load(tiny_lm("llama"))
    q_proj = model.model.layers[0].self_attn.q_proj
    before = q_proj.weight.detach().clone()
    held = P.dequantized_params(onnx_model)
    name = next(n for n in held if n.endswith("layers.0.self_attn.q_proj.weight"))
    with emulate.as_file_holds(model, onnx_model, activations=False):
        assert np.array_equal(q_proj.weight.detach().numpy(), held[name])
        assert not torch.equal(q_proj.weight, before)  # 8 bits are not 32
    assert torch.equal(q_proj.weight, before)
    groups = list(emulate.each_group_alone(model, onnx_model))
    assert "layer:0" in groups and torch.equal(q_proj.weight, before)
    copy = emulate.file_model(model, onnx_model)
    assert np.array_equal(copy.model.layers[0].self_attn.q_proj.weight.detach().numpy(), held[name])
    assert torch.equal(q_proj.weight, before)  # the source untouched
