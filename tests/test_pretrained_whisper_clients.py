"""Whisper's clients transcribing with its deployment folder (`attnexport.pretrained.whisper.clients`): Optimum and
transcribers.js give transformers' transcript to the budget's last token, reading the folder's generation config.
Where installed (CI's real step)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")
pytest.importorskip("optimum.exporters.onnx", reason="optimum-onnx: pip install optimum-onnx")

from conftest import cli  # noqa: E402

from attnexport.pretrained.whisper import Whisper  # noqa: E402
from attnexport.pretrained.whisper import ctranslate2 as CT  # noqa: E402


def test_each_client_s_transcript_reaches_the_last_position_of_the_budget(whisper_deployed, whisper_folder):
    """The small random Whisper never says its end token within 6 tokens, so each transcript runs to the
    budget's last position, where a client that generates otherwise than transformers (without the
    folder's generation config: no <|notimestamps|> start token, which a trained model then says
    itself at the cost of a token, and none of the suppression) is one short or departs. The folder is
    named as a user types it, relative ("whisper-onnx", which transformers' loaders take for a model id
    first): Optimum read the generation config of such a folder from nowhere (the graphs' subfolder
    had none), transcribing tiny.en's 25 s clip a token short."""
    from optimum.onnxruntime import ORTModelForSpeechSeq2Seq

    from attnexport.pretrained import clients
    deployed, _ = whisper_deployed
    Path("whisper-onnx").symlink_to(deployed)  # in the test's own working folder
    loaded = ORTModelForSpeechSeq2Seq.from_pretrained("whisper-onnx", subfolder="onnx", use_cache=True,
                                                      use_merged=True, provider="CPUExecutionProvider")
    model = CT.load(whisper_folder())[0].generation_config
    assert loaded.generation_config.no_timestamps_token_id == model.no_timestamps_token_id
    assert list(loaded.generation_config.suppress_tokens) == list(model.suppress_tokens) and model.suppress_tokens
    assert list(loaded.generation_config.begin_suppress_tokens) == list(model.begin_suppress_tokens)
    wanted = [c for c in Whisper.clients if clients.status(c)[0]]
    r = cli("verify", "whisper-onnx", "--hf", whisper_folder(), "--runtimes", "ort-cpu", "--new-tokens", "6",
            "--clients", ",".join(wanted), "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.output)["results"] if row["runtime"] in wanted]
    assert [row["runtime"] for row in rows] == wanted
    for row in rows:
        assert [len(t) for t in row["detail"]["transformers_tokens"]] == [6]  # the budget's last position reached
        assert row["detail"]["tokens"] == row["detail"]["transformers_tokens"]
