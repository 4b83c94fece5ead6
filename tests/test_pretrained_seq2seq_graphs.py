"""A text encoder-decoder's graphs as torch modules (`attnexport.pretrained.seq2seq.graphs`), written
out over transformers' own parameters, against transformers' forward in float64: T5 (relative
position bias both ways in the encoder, backwards in the decoder with the past counted, scores
unscaled, the tied head scaled) and Marian (sinusoidal positions offset by the past, its padded
encoder); the first step over a padded batch, a later step through the cache, and Marian's static
buffers. The [hf] extra, on small random configs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.encdec import graphs as G  # noqa: E402
from attnexport.pretrained.seq2seq import graphs as SG  # noqa: E402
from attnexport.pretrained.seq2seq import texts as T  # noqa: E402


def _model(tiny_seq2seq, arch):
    model, _ = hf.load(tiny_seq2seq(arch), None)
    model = model.double().eval()
    m = T.TextModel.of(model, tiny_seq2seq(arch))
    return model, m


def _transformers_logits(model, feed, ids):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(feed["input_ids"]), attention_mask=torch.from_numpy(
            feed["attention_mask"]), decoder_input_ids=torch.from_numpy(ids)).logits.numpy()


def _unpadded(logits, mask):
    return [logits[i] for i in range(len(mask))]


@pytest.mark.parametrize("arch", ["t5", "marian"])
def test_the_graphs_compute_transformers_forward_on_a_padded_batch_and_through_the_cache(arch, tiny_seq2seq):
    model, m = _model(tiny_seq2seq, arch)
    feed = T.encoded(m.tok, [T.TEXTS[2], T.TEXTS[0]])
    assert feed["attention_mask"][1].sum() < feed["attention_mask"][0].sum()  # the second text padded
    ids = np.tile(np.asarray(m.start + m.check_tokens(), np.int64), (2, 1))
    want = _transformers_logits(model, feed, ids)
    modules = SG.modules(model)

    def run(graph):
        def call(f):
            with torch.no_grad():
                out = modules[graph](*[torch.from_numpy(f[n]) for n in G.inputs(graph, m.spec)])
            out = (out,) if isinstance(out, torch.Tensor) else out  # the encoder's one output
            return {n: o.numpy() for n, o in zip(G.outputs(graph, m.layers), out, strict=True)}
        return call
    states = run(G.ENCODER)(feed)["last_hidden_state"]
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=torch.from_numpy(feed["input_ids"]),
                                      attention_mask=torch.from_numpy(feed["attention_mask"])).last_hidden_state
    real = feed["attention_mask"].astype(bool)
    np.testing.assert_allclose(states[real], encoded.numpy()[real], atol=1e-10)  # padding never compared
    got = G.stepped(run(G.DECODER), run(G.DECODER_WITH_PAST), ids, states, 2, m.layers, feed["attention_mask"])
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_marian_s_static_buffers_give_the_concat_steps_logits(tiny_seq2seq):
    model, m = _model(tiny_seq2seq, "marian")
    feed = T.encoded(m.tok, [T.TEXTS[1]])
    ids = np.asarray([m.start + m.check_tokens()], np.int64)
    want = _transformers_logits(model, feed, ids)
    static = SG.modules(model, static=True)

    def run(graph):
        def call(f):
            with torch.no_grad():
                out = static[graph](*[torch.from_numpy(f[n]) for n in G.inputs(graph, m.spec, static=True)])
            return {n: o.numpy() for n, o in zip(G.outputs(graph, m.layers), out, strict=True)}
        return call
    with torch.no_grad():
        states = model.get_encoder()(input_ids=torch.from_numpy(feed["input_ids"]),
                                     attention_mask=torch.from_numpy(feed["attention_mask"])).last_hidden_state.numpy()
    first, later = G.static_steps(run(G.DECODER), run(G.DECODER_WITH_PAST), m.spec, 16)
    got = G.stepped(first, later, ids, states, 1, m.layers, feed["attention_mask"])
    np.testing.assert_allclose(got, want, atol=1e-9)
