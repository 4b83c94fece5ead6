"""`bench --hf` of a text encoder-decoder (`attnexport.pretrained.seq2seq.bench`): attnexport's folder
in fp32 and int8 beside transformers' generate in the same run, each time beside its outputs'
agreement with transformers' fp32 greedy ones, printed and as JSON; options it does not take refused.
The [hf] extra, on a small random Marian."""

import json

import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from conftest import cli  # noqa: E402


def test_bench_times_each_engine_beside_its_outputs(tiny_seq2seq):
    r = cli("bench", "--hf", tiny_seq2seq("marian"), "--precision", "fp32,int8", "--iters", "2", "--warmup", "0",
            "--threads", "1", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rows = {(x["engine"], x["precision"]): x for x in doc["rows"]}
    assert set(rows) >= {("transformers", "fp32"), ("attnexport", "fp32"), ("attnexport", "int8")}
    fp32 = rows[("attnexport", "fp32")]
    assert fp32["median_ms"] > 0 and fp32["ratio_to_transformers"] > 0
    assert fp32["accuracy"]["equal"] == 6 and fp32["accuracy"]["agreement"] == 1.0  # fp32: transformers' outputs
    assert rows[("transformers", "fp32")]["accuracy"]["wer"] == 0.0
    assert 0 <= rows[("attnexport", "int8")]["accuracy"]["agreement"] <= 1
    assert doc["info"]["texts"] == 6 and len(doc["info"]["transformers_tokens"]) == 6


def test_bench_refuses_what_it_does_not_take(tiny_seq2seq):
    r = cli("bench", "--hf", tiny_seq2seq("t5"), "--batch", "4")
    assert r.exit_code == 2 and "--batch: bench --hf of a text encoder-decoder" in r.output
