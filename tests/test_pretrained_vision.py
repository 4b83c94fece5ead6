"""The vision transformers' family (`attnexport.pretrained.vision`): ViT and DINOv2 configs taken, the
layout from the model and its image processor (the processor's crop, not the position table's size),
no cache form, a config-only folder refused without --seed, the processor's pixel values. The [hf]
extra, on small random configs."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained import registry  # noqa: E402
from attnexport.pretrained.vision import VisionTransformer  # noqa: E402
from attnexport.pretrained.vision import images as I  # noqa: E402


@pytest.mark.parametrize("arch", ["vit", "dinov2"])
def test_the_family_takes_its_architectures_and_lays_out_the_processor_s_size(arch, tiny_vision):
    folder = tiny_vision(arch)
    family = registry.of_source(folder)
    assert isinstance(family, VisionTransformer) and family.task == "image-feature-extraction"
    model, source = hf.load(folder, None)
    assert source == f"given: {folder.name}"  # the folder's own weights
    layout = hf.layout_of(model, None, 0, folder)
    assert layout.form == "image" and layout.inputs == ["pixel_values"]
    assert layout.outputs == ["last_hidden_state", "pooler_output"]
    # the images the processor makes (32 x 32), whatever the position table was made for (DINOv2's: 56)
    assert layout.extra == {"height": 32, "width": 32, "channels": 3, "patch_size": 8}
    assert json.loads(json.dumps(layout.sizes()))["extra"]["height"] == 32
    assert model.config.image_size == (56 if arch == "dinov2" else 32)


def test_a_vision_transformer_keeps_no_cache_and_needs_its_processor(tiny_vision, tmp_path):
    folder = tiny_vision("vit")
    r = cli("export", "--hf", folder, "--kv-cache", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and "a vision transformer keeps no cache" in r.output
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "preprocessor_config.json").unlink()
    r = cli("export", "--hf", bare, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0, r.output  # the export needs no processor: it takes the config's size
    r = cli("verify", tmp_path / "m.onnx", "--hf", bare, "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "needs its image processor beside it (preprocessor_config.json)" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_a_config_only_folder_is_refused_unless_a_seed_is_given(tiny_vision, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for f in ("config.json", "preprocessor_config.json"):
        shutil.copy(tiny_vision("vit") / f, config_only / f)
    r = cli("export", "--hf", config_only, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and "--seed" in r.output and not (tmp_path / "m.onnx").exists()
    r = cli("export", "--hf", config_only, "--seed", "3", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0 and "the weights are random" in r.output, r.output
    r = cli("verify", tmp_path / "m.onnx", "--hf", config_only, "--runtimes", "ort-cpu")
    assert r.exit_code == 0, r.output  # its verify draws the weights with the seed the export recorded


def test_the_processor_makes_the_model_s_pixel_values(tiny_vision):
    process = I.processor(tiny_vision("vit"))
    values = I.pixel_values(process, I.image_set())
    assert values.shape == (I.QUERIES + I.CORPUS, 3, 32, 32) and values.dtype == np.float32
    # ViT's processor: resized to 32 x 32, rescaled and normalised by 0.5, as the check's feed is
    square = I.image_set((32, 32))[0]
    by_hand = (square.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    assert np.abs(I.pixel_values(process, [square])[0] - by_hand).max() < 1e-6
