"""The engines bench puts beside attnexport's, as their users run them: their own pre- and
post-processing and the precision each loads. Optimum's export of a sentence encoder (plain, through
ONNX Runtime's optimizer, and that in dynamic int8) pooled as the model's files say; CTranslate2 on
a Whisper model.bin in float32 and int8, and Optimum's Whisper export, each from its users' features
and compared with transformers' transcript. On small random models (examples/tiny_encoders.py,
tiny_whisper.py); timings are printed by bench, never asserted here.

CI's real step: optimum-onnx and ctranslate2."""

import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")
pytest.importorskip("optimum.exporters.onnx", reason="optimum-onnx: pip install optimum-onnx")

from test_pretrained_whisper_audio import wav  # noqa: E402

from attnexport.pretrained.encdec import cost as COST  # noqa: E402
from attnexport.pretrained.encoders import bench as EB  # noqa: E402
from attnexport.pretrained.whisper import bench as SB  # noqa: E402
from attnexport.pretrained.whisper import export as S  # noqa: E402


@pytest.mark.parametrize("pooling,normalize", [("cls", False), ("max", True)])
def test_the_encoder_anchors_pool_as_the_model_s_files_say_and_the_int8_one_is_quantized(tiny_encoder, pooling,
                                                                                        normalize):
    """Optimum's export returns the token states only: each anchor pools them as the folder's
    sentence-transformers files say (a cls-pooled, unnormalised model is not embedded as a mean-pooled,
    normalised one), so its fp32 embeddings are the model's own; the int8 anchor is ONNX Runtime's
    dynamic int8 of the optimized graph: not the float model (its embeddings move)."""
    folder = tiny_encoder("bert", pooling=pooling, normalize=normalize)
    request = EB.EmbedBenchRequest(folder, shapes=((1, 8),), flavors=("attention",), precisions=("fp32",), threads=1,
                                   iters=1, warmup=0)
    rows, info = EB.bench_embeddings(request)
    assert "optimum" not in info["skipped"], info
    by = {row.engine: row for row in rows}
    assert set(by) == {"transformers", "attnexport", "optimum", "optimum+optimizer", "optimum+optimizer+int8"}
    for engine in ("optimum", "optimum+optimizer"):
        accuracy = by[engine].accuracy
        assert accuracy["within"] and 1 - accuracy["cosine_min"] < 1e-6, (engine, accuracy)
    int8 = by["optimum+optimizer+int8"]
    assert int8.precision == "int8" and 1 - int8.accuracy["cosine_min"] > 1e-6  # the quantized graph, not fp32's
    assert int8.accuracy["budget"] == "cosine >= 0.99, top-5 agreement >= 0.9"  # judged by int8's budget


def test_the_whisper_anchors_load_their_precision_and_transcribe_as_transformers(whisper_folder, tmp_path):
    """CTranslate2 on the folder's model.bin in float32 (compute_type float32) gives transformers'
    transcript token for token, to the last of the budget (the random model never ends: CTranslate2
    decodes at most half its max_length, which is asked for accordingly); its int8 loads int8 weights
    (compute_type int8_float32); Optimum's export transcribes as transformers does. Each row keeps its
    transcript, which its agreement is measured from against transformers' own."""
    pytest.importorskip("ctranslate2", reason="pip install ctranslate2")
    clip = wav(tmp_path / "clip.wav", S.check_audio(2.0, seed=5))
    request = SB.SpeechBenchRequest(whisper_folder(), clip, flavors=("attention",), precisions=("fp32",), threads=1,
                                    iters=1, warmup=0, new_tokens=16)
    rows, info = SB.bench_speech(request)
    assert not info["skipped"], info["skipped"]
    want = info["transcript"]
    assert len(want) == 16  # the budget's last token reached
    by = {(row.engine, row.precision): row for row in rows}
    assert set(by) == {("transformers", "fp32"), ("attnexport", "fp32"), ("optimum", "fp32"), ("ctranslate2", "fp32"),
                       ("ctranslate2", "int8")}
    for key in (("transformers", "fp32"), ("attnexport", "fp32"), ("optimum", "fp32"), ("ctranslate2", "fp32")):
        assert by[key].transcript == want and by[key].equal, key
    assert by[("ctranslate2", "fp32")].note.endswith("compute_type float32")
    assert by[("ctranslate2", "int8")].note.endswith("compute_type int8_float32")
    for row in rows:  # agreement and WER against transformers' transcript, as the row says
        agreement, wer = COST.agreement(row.transcript, want, lambda tokens: " ".join(map(str, tokens)))
        assert row.agreement == pytest.approx(agreement) and row.equal == (row.transcript == want)


@pytest.mark.parametrize("pooling,normalize,want", [("cls", False, [[1.0, 3.0]]), ("max", False, [[3.0, 5.0]]),
                                                    ("mean", True, [[2 / 20 ** 0.5, 4 / 20 ** 0.5]])])
def test_an_export_of_token_states_alone_is_pooled_as_the_model_says(tmp_path, pooling, normalize, want):
    """An anchor whose graph returns the token states only (Optimum's export of a plain transformers
    folder): pooled over the mask as the model's files say, by hand: tokens (1, 3), (3, 5) and a padded
    (100, 100)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node("Identity", ["states"], ["last_hidden_state"]),
         helper.make_node("Cast", ["attention_mask"], ["unused"], to=TensorProto.FLOAT)], "states",
        [helper.make_tensor_value_info("states", TensorProto.FLOAT, [1, 3, 2]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [1, 3, 2]),
         helper.make_tensor_value_info("unused", TensorProto.FLOAT, [1, 3])])
    path = tmp_path / "states.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    engine = EB._onnx_engine("optimum", "-", "fp32", path, 1, pooling, normalize)
    feed = {"states": np.array([[[1.0, 3.0], [3.0, 5.0], [100.0, 100.0]]], np.float32),
            "attention_mask": np.array([[1, 1, 0]], np.int64)}
    assert np.allclose(engine.run(feed), want)
