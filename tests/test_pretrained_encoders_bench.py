"""`bench --hf ENCODER` (`attnexport.pretrained.encoders.bench`, on `attnexport.pretrained.bench`'s
skeleton): a small random BERT encoder's engines timed at batch x sequence shapes beside transformers,
each with its embeddings' accuracy; Optimum's export, optimized and in dynamic int8, beside them where
optimum-onnx is installed; the refusals. Timings are printed, never asserted."""

import importlib.util
import json

import pytest

from attnexport.errors import UsageError
from attnexport.pretrained.encoders import bench as EB

transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402


@pytest.fixture
def bert(tiny_encoder):
    return tiny_encoder("bert")


def test_shapes_pair_up_as_bench_pairs_them():
    assert EB.shapes([], []) == EB.SHAPES == ((1, 16), (32, 128), (8, 512))
    assert EB.shapes([1, 4], [16, 32]) == ((1, 16), (4, 32))
    assert EB.shapes([2], [16, 32]) == ((2, 16), (2, 32))
    with pytest.raises(UsageError, match="pair up"):
        EB.shapes([1, 2], [16, 32, 64])


def test_every_engine_is_timed_beside_transformers_with_its_accuracy(bert):
    request = EB.EmbedBenchRequest(bert, shapes=((1, 8), (3, 16)), flavors=("attention", "ort"),
                                   precisions=("fp32", "int8"), threads=1, iters=2, warmup=1, anchors=False)
    rows, info = EB.bench_embeddings(request)
    assert {(r.engine, r.flavor, r.precision) for r in rows} == {
        ("transformers", "-", "fp32"), ("attnexport", "attention", "fp32"), ("attnexport", "ort", "fp32"),
        ("attnexport", "attention", "int8"), ("attnexport", "ort", "int8")}
    assert {(r.batch, r.seq) for r in rows} == {(1, 8), (3, 16)}
    for r in rows:
        assert r.median_ms > 0 and r.p10_ms <= r.median_ms <= r.p90_ms and r.ratio_to_transformers > 0
        assert r.per_s == pytest.approx(r.batch * 1e3 / r.median_ms)
        assert r.accuracy["within"] and r.accuracy["sentences"] == 40, r.accuracy
    assert info["layers"] == 2 and info["pooling"] == "mean" and info["normalize"]


def test_the_command_line_prints_each_time_beside_its_accuracy_and_the_anchors_where_installed(bert):
    r = cli("bench", "--hf", bert, "--batch", "2", "--seq", "8", "--iters", "2", "--warmup", "1", "--threads", "1",
            "--flavor", "attention", "--precision", "fp32", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    engines = {row["engine"] for row in doc["rows"]}
    assert {"transformers", "attnexport"} <= engines
    assert all(row["sentences_per_s"] > 0 and "per_s" not in row and "unit" not in row for row in doc["rows"])
    if importlib.util.find_spec("optimum") is not None and "optimum" not in doc["info"]["skipped"]:
        assert {"optimum", "optimum+optimizer", "optimum+optimizer+int8"} <= engines
        anchor = next(row for row in doc["rows"] if row["engine"] == "attnexport")
        assert anchor["ratio_to_anchor"] > 0
    else:
        assert "optimum" in doc["info"]["skipped"]
    r = cli("bench", "--hf", bert, "--batch", "2", "--seq", "8", "--iters", "2", "--warmup", "1", "--threads", "1",
            "--flavor", "attention", "--precision", "fp32")
    assert r.exit_code == 0 and "sentences/s" in r.output and "1 - cosine max" in r.output


def test_refusals_are_one_line(bert, tiny_lm):
    r = cli("bench", "--hf", bert, "--seq", "4096")
    assert r.exit_code == 2 and "positions take 128" in r.output
    r = cli("bench", "--hf", bert, "--context", "128")
    assert r.exit_code == 2 and "sentence encoder" in r.output
    r = cli("bench", "--hf", tiny_lm("llama"), "--seq", "8")
    assert r.exit_code == 2 and "give --decode" in r.output
