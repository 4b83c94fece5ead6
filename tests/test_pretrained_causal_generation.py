"""A language model's generation (`attnexport.pretrained.causal.generation`): its prompts, and transformers'
steps teacher-forced in float64 lined up with its own generate. The [hf] extra."""


import numpy as np
import pytest

from attnexport.pretrained import model as hf
from attnexport.pretrained import reference as HR
from attnexport.pretrained.causal import generation as G

# --- the positions a check compares, written out -----------------------------------------------------


NEEDS = "transformers is the [hf] extra: pip install -e '.[dev,hf]'"


@pytest.fixture(scope="module")
def llama(tiny_lm):
    pytest.importorskip("transformers", reason=NEEDS)
    folder = tiny_lm("llama")
    return folder, hf.load(folder)[0]


def test_text_prompts_and_windows_come_from_the_tokenizer():
    class Words:  # a tokenizer's call: one id a word
        def __call__(self, text):
            return {"input_ids": [len(w) for w in text.split()]}
    rows = HR.token_rows(Words(), 1000, 3, 5, seed=0)
    assert rows.shape == (3, 5) and set(rows.ravel()) <= {len(w) for w in HR.PASSAGE.split()}
    layout = hf.Layout("none", 1, 1, 4, 1000)
    assert [p.tolist() for p in G.prompts(Words(), layout, (5, 9))] == [[len(w) for w in p.split()]
                                                                         for p in G.PROMPTS]
    drawn = G.prompts(None, layout, (5, 9))
    assert [len(p) for p in drawn] == [5, 9]


def test_generation_logits_in_float64_line_up_with_transformers_steps(llama):
    _, model = llama
    layout = hf.layout_of(model, "concat")
    reference = HR.Reference(model, layout)
    prompts = G.prompts_for(layout, (4, 7), seed=0)
    want = G.reference_generation(model, layout, prompts, 6)
    logits64 = G.generation_logits64(reference, prompts, want.tokens)
    assert len(logits64) == 6
    for w, e in zip(want.logits, logits64, strict=True):  # off by a position, they would differ by O(1)
        assert np.abs(w - e).max() < 1e-4
