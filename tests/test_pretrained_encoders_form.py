"""A sentence encoder's embed form (`attnexport.pretrained.encoders.form`): its feeds, the positions it compares
(tokens, never padding), a form of its family's own. The [hf] extra."""

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is the [hf] extra: pip install -e '.[dev,hf]'")

from attnexport.errors import UsageError  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.causal import generation as G  # noqa: E402


def test_the_embed_form_feeds_its_inputs_and_compares_tokens_not_padding():
    layout = hf.Layout("embed", layers=2, kv_heads=4, head_dim=4, vocab=50, max_seq=16, task="feature-extraction",
                       token_types=2, pooling="mean", normalize=True)
    form = layout.cache_form
    feed = hf.example_feed(layout, batch=3, block=6, padded=2)
    assert list(feed) == layout.inputs == ["input_ids", "attention_mask", "token_type_ids"]
    assert set(form.dynamic_axes(layout)) == set(layout.inputs) and layout.signature.caches == ()
    assert feed["attention_mask"][0].tolist() == [1, 1, 1, 1, 0, 0]  # right padding, as tokenizers pad
    assert (feed["input_ids"][0, -2:] == layout.pad_token).all()
    valid = form.valid_positions(layout, feed)
    assert valid["last_hidden_state"][0, :, 0].tolist() == [True] * 4 + [False] * 2
    assert valid["sentence_embedding"].all()
    assert hf.Layout("embed", 2, 4, 4, 50, 16, task="feature-extraction").inputs == ["input_ids", "attention_mask"]
    with pytest.raises(UsageError, match="positions take 16"):
        form.check_room(layout, 17, "embedding")
    assert not hasattr(form, "decoding")  # a form of its family's own: no language model's steps
    with pytest.raises(UsageError, match="a sentence encoder generates no tokens"):
        G.generate(lambda feed: feed, layout, [np.array([3])], 1)
