"""A text encoder-decoder's clients generating with its deployment folder
(`attnexport.pretrained.seq2seq.clients`): Optimum's ORTModelForSeq2SeqLM and transformers.js'
text2text-generation pipeline, each text alone with the folder's tokenizer and generation config,
token for token with transformers' `generate` (fp32), and with the folder's own graphs (int8, near
ties apart). Where installed (CI's real step)."""

import json

import pytest
from conftest import cli

from attnexport.pretrained import clients
from attnexport.pretrained.seq2seq import Text2Text
from attnexport.pretrained.seq2seq import clients as SC


def _available(client):
    ok, why = clients.status(client)
    if not ok:
        pytest.skip(f"{client}: {why}")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, tiny_seq2seq):
    pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")
    out = {}
    for arch, precision in (("t5", "fp32"), ("marian", "fp32"), ("marian", "int8")):
        folder = tmp_path_factory.mktemp("deploy") / f"{arch}-{precision}-onnx"
        r = cli("export", "--hf", str(tiny_seq2seq(arch)), "--precision", precision, "--deploy", str(folder))
        assert r.exit_code == 0, r.output
        out[arch if precision == "fp32" else f"{arch}-{precision}"] = (tiny_seq2seq(arch), folder)
    return out


@pytest.mark.parametrize("arch", ["t5", "marian", "marian-int8"])
@pytest.mark.parametrize("client", Text2Text.clients)
def test_each_client_generates_what_transformers_generates_from_the_folder(client, arch, deployed):
    _available(client)
    source, folder = deployed[arch]
    r = cli("verify", str(folder), "--hf", str(source), "--runtimes", "ort-cpu", "--clients", client,
            "--new-tokens", "12", "--json")
    assert r.exit_code == 0, r.output
    (row,) = [x for x in json.loads(r.output)["results"] if x["case"].startswith("client")]
    assert row["passed"] and row["runtime"] == client
    detail = row["detail"]
    reference = detail.get("transformers_tokens", detail.get("ort-cpu_tokens"))
    assert len(detail["tokens"]) == 6 and any(len(t) >= 4 for t in reference)
    if arch.endswith("int8"):
        assert "ort-cpu_tokens" in detail  # a quantized folder's clients are compared with its own graphs


def test_a_generated_row_is_cut_at_its_start_and_end_tokens():
    assert SC.said([0, 5, 6, 1, 0, 0], [0], 1) == [5, 6]
    assert SC.said([5, 6, 7], [0], [1]) == [5, 6, 7]  # no start token, no end: the whole row
    assert SC.said([0, 1], [0], 1) == []
