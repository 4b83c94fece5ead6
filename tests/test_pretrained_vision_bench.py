"""`bench --hf VISION` (`attnexport.pretrained.vision.bench`, on `attnexport.pretrained.bench`'s skeleton):
a small random ViT's engines timed at a few batch sizes beside transformers, each with its accuracy;
Optimum's export, optimized and in dynamic int8, beside them where optimum-onnx is installed; the
refusals. Timings are printed, never asserted."""

import importlib.util
import json

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402

from attnexport.pretrained.vision import bench as VB  # noqa: E402


def test_every_engine_is_timed_beside_transformers_with_its_accuracy(tiny_vision):
    request = VB.ImageBenchRequest(tiny_vision("dinov2"), batches=(1, 3), flavors=("attention", "ort"),
                                   precisions=("fp32", "int8"), threads=1, iters=2, warmup=1, anchors=False)
    rows, info = VB.bench_images(request)
    assert {(r.engine, r.flavor, r.precision) for r in rows} == {
        ("transformers", "-", "fp32"), ("attnexport", "attention", "fp32"), ("attnexport", "ort", "fp32"),
        ("attnexport", "attention", "int8"), ("attnexport", "ort", "int8")}
    assert {(r.batch, r.seq) for r in rows} == {(1, 0), (3, 0)}
    for r in rows:
        assert r.median_ms > 0 and r.p10_ms <= r.median_ms <= r.p90_ms and r.ratio_to_transformers > 0
        assert r.per_s == pytest.approx(r.batch * 1e3 / r.median_ms) and r.unit == "images"
        assert r.accuracy["within"] and r.accuracy["images"] == 26, r.accuracy
    assert info["layers"] == 2 and (info["height"], info["width"]) == (32, 32)


def test_the_command_line_prints_each_time_beside_its_accuracy_and_the_anchors_where_installed(tiny_vision):
    folder = tiny_vision("vit")
    r = cli("bench", "--hf", folder, "--batch", "2", "--iters", "2", "--warmup", "1", "--threads", "1",
            "--precision", "fp32", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    engines = {row["engine"] for row in doc["rows"]}
    assert {"transformers", "attnexport"} <= engines
    assert all(row["images_per_s"] > 0 for row in doc["rows"])
    if importlib.util.find_spec("optimum") is not None and "optimum" not in doc["info"]["skipped"]:
        assert {"optimum", "optimum+optimizer", "optimum+optimizer+int8"} <= engines
        assert all(row["accuracy"]["images"] == 26 for row in doc["rows"])
    else:
        assert "optimum" in doc["info"]["skipped"]
    assert doc["info"]["load"]["processes"] == 0
    # the text, timed under the background load bench starts itself (`--load`), which it says
    r = cli("bench", "--hf", folder, "--batch", "2", "--iters", "2", "--warmup", "1", "--threads", "1",
            "--precision", "fp32", "--load", "1")
    assert r.exit_code == 0 and "images/s" in r.output and "1 - cosine max" in r.output and "32 x 32 images" in r.output
    assert "timed under a background load: 1 busy process (one core each), started by bench" in r.output


def test_refusals_are_one_line(tiny_vision):
    folder = tiny_vision("vit")
    for args, said in ((("--seq", "8"), "--seq: bench --hf of a vision transformer (beside transformers and Optimum) "
                                        "takes --batch"),
                       (("--decode",), "--decode: bench --hf of a vision transformer"),
                       (("--batch", "0"), "--batch takes positive integers")):
        r = cli("bench", "--hf", folder, *args)
        assert r.exit_code == 2 and said in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
