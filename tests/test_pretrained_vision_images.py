"""What a vision transformer is judged on (`attnexport.pretrained.vision.images`): the project's drawn
images (the same on every machine: integers), the size a processor makes, the check's feeds in
float32, the embedding measure by image."""

import json

import numpy as np
import pytest

from attnexport.errors import UsageError
from attnexport.pretrained import model as hf
from attnexport.pretrained import retrieval as RT
from attnexport.pretrained.vision import images as I


class _Config:
    image_size = 56


def test_the_image_set_is_drawn_the_same_and_its_queries_are_changed_copies():
    images = I.image_set()
    assert len(images) == I.QUERIES + I.CORPUS
    assert all(i.dtype == np.uint8 and i.ndim == 3 and i.shape[2] == 3 for i in images)
    assert {i.shape[:2] for i in images} == set(I.SIZES)
    again = I.image_set()
    assert all(np.array_equal(a, b) for a, b in zip(images, again, strict=True))  # integers, drawn from seeds
    assert {i.shape[:2] for i in I.image_set((32, 24))} == {(32, 24)}
    # a query is its corpus image changed (rolled, brightened, noisy), not another image
    sized = I.image_set((40, 40))
    for q in range(I.QUERIES):
        own = np.abs(sized[q].astype(float) - sized[I.QUERIES + q]).mean()
        others = min(np.abs(sized[q].astype(float) - sized[I.QUERIES + j]).mean() for j in range(I.CORPUS) if j != q)
        assert own < others


def test_the_size_is_the_processor_s_crop_else_its_resize_else_the_config_s(tmp_path):
    assert I.input_size(None, _Config()) == (56, 56)
    assert I.input_size(tmp_path, _Config()) == (56, 56)  # no preprocessor_config.json
    said = tmp_path / "preprocessor_config.json"
    said.write_text(json.dumps({"do_center_crop": True, "crop_size": {"height": 24, "width": 32},
                                "size": {"shortest_edge": 40}}))
    assert I.input_size(tmp_path, _Config()) == (24, 32)
    said.write_text(json.dumps({"size": {"height": 48, "width": 40}}))
    assert I.input_size(tmp_path, _Config()) == (48, 40)
    said.write_text(json.dumps({"size": {"shortest_edge": 40}}))  # keeps the aspect: no one size
    assert I.input_size(tmp_path, _Config()) == (56, 56)
    said.write_text("{not json")
    with pytest.raises(UsageError, match="preprocessor_config.json is not JSON"):
        I.input_size(tmp_path, _Config())


def test_a_check_s_feed_is_the_model_s_size_in_float32():
    layout = hf.Layout("image", 2, 2, 16, 0, task="image-feature-extraction",
                       extra={"height": 24, "width": 16, "channels": 3, "patch_size": 8})
    feed = I.check_feed(layout, 3, seed=1)
    assert feed["pixel_values"].shape == (3, 3, 24, 16) and feed["pixel_values"].dtype == np.float32
    assert -1 <= feed["pixel_values"].min() and feed["pixel_values"].max() <= 1  # normalised by 0.5


def test_the_measure_names_the_image_that_departs():
    want = np.eye(I.QUERIES + I.CORPUS, 32)
    budget = RT.budget_for("fp32")
    assert not I.measure(want.copy(), want, budget).judge(budget).failures
    got = want.copy()
    got[7] = want[8]
    cost = I.measure(got, want, budget).judge(budget)
    assert cost.failures and cost.failures[0].startswith("image 7's cosine")
