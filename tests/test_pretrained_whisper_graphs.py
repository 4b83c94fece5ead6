"""Whisper's graphs as torch modules over transformers' parameters (`attnexport.pretrained.whisper`),
on a small random model: the client's greedy loop over them gives transformers' `generate`, a step at a
time through the self cache gives the whole sequence at once, and the merged decoder of two graphs
runs each as it was.

The [hf] extra (transformers)."""

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the [hf] extra: pip install -e '.[dev,hf]'")

import onnx  # noqa: E402
import torch  # noqa: E402

from attnexport import modules as M  # noqa: E402
from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained.encdec import export as ED  # noqa: E402
from attnexport.pretrained.encdec import graphs as G  # noqa: E402
from attnexport.pretrained.whisper import audio as AU  # noqa: E402
from attnexport.pretrained.whisper import check as SC  # noqa: E402
from attnexport.pretrained.whisper import ctranslate2 as CT  # noqa: E402
from attnexport.pretrained.whisper import export as S  # noqa: E402
from attnexport.pretrained.whisper import graphs as W  # noqa: E402


def _runners(model):
    modules, layers, spec = W.modules(model), model.config.decoder_layers, W.spec(model.config)

    def runner(graph):
        def run(feed):
            with torch.no_grad(), M.export_semantics():
                out = M.outputs_of(modules[graph](*[torch.from_numpy(feed[n]) for n in G.inputs(graph, spec)]))
            return dict(zip(W.outputs(graph, layers), [t.numpy() for t in out], strict=True))
        return run
    return [runner(g) for g in W.GRAPHS]


def test_the_clients_loop_over_the_graphs_modules_is_transformers_generate(whisper_folder):
    model, _ = CT.load(whisper_folder())
    speech = S.Speech.of(model, whisper_folder())
    features = np.stack([AU.log_mel(S.check_audio(2.0, seed), speech.mels) for seed in (0, 1)])
    got = W.transcribe(*_runners(model), features, speech.tokens, speech.layers, 20)
    assert got == SC.reference_transcripts(speech, features, 20)
    assert all(len(t) > 0 for t in got)


def test_a_token_at_a_time_through_the_self_cache_is_the_whole_sequence_at_once(whisper_folder):
    model, _ = CT.load(whisper_folder())
    encoder, first, later = _runners(model)
    layers = model.config.decoder_layers
    states = encoder({"input_features": AU.log_mel(S.check_audio(1.0), 80)[None]})["last_hidden_state"]
    ids = np.array([[50257, 50362, 5, 9, 3, 7]])
    whole = first({"input_ids": ids, "encoder_hidden_states": states})["logits"]
    out = first({"input_ids": ids[:, :2], "encoder_hidden_states": states})
    crosses = {n.replace("present", "past_key_values"): out[n] for n in W.cross_names(layers, "present")}
    for t in range(2, ids.shape[1]):
        own = {n.replace("present", "past_key_values"): out[n] for n in W.self_names(layers, "present")}
        pasts = {**crosses, **own}
        out = later({"input_ids": ids[:, t:t + 1], **pasts})
        assert np.abs(out["logits"][:, 0] - whole[:, t]).max() < 1e-4
        assert out["present.0.decoder.key"].shape[2] == t + 1


def test_the_merged_decoder_runs_each_step_as_its_own_graph(whisper_deployed, whisper_folder):
    folder, _ = whisper_deployed
    model, _ = CT.load(whisper_folder())
    speech = S.Speech.of(model, whisper_folder())
    checked = ED.Checked(speech)
    merged = R.prepare_onnx("ort-cpu", onnx.load(folder / "onnx" / "decoder_model_merged.onnx"))
    first, later = G.merged_steps(merged.run, speech.spec)
    for graph, step in ((W.DECODER, first), (W.DECODER_WITH_PAST, later)):
        assert all(checked.comparisons(graph, step(checked.feeds[graph])))
    full = merged.run(G.merged_feed(checked.feeds[W.DECODER_WITH_PAST], speech.spec))
    assert full["present.0.encoder.key"].shape[2] == 0  # the later step's cross presents: empty
