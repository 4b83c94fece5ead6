"""What a text encoder-decoder reads and answers: the project's source texts (short sentences of
everyday English, numbers and a question among them), tokenized by the model's own tokenizer into a
right-padded batch with its attention mask (the encoder's feed), and the model as the
encoder-decoder core sees it (`TextModel`: the decoder's start token, the end token, the tokens
never generated, its graphs as torch modules)."""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport.errors import UsageError
from attnexport.pretrained import model as hf
from attnexport.pretrained.encdec import export as ED
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.seq2seq import graphs

# The texts verify answers (and bench and the export's checks read), a T5 task prefix on none of them:
# a Marian model translates them, a T5 model continues them as it was trained.
TEXTS = (
    "The weather is cold today.",
    "She reads a book in the garden.",
    "Where is the nearest train station?",
    "We will meet again next week.",
    "The cat sleeps on the warm roof.",
    "Numbers like 42 and 7 are easy to write.",
)
# The tokenizer's files a deployment folder keeps (those the source folder has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "spiece.model",
                   "source.spm", "target.spm", "vocab.json")


def tokenizer(source):
    """The model's tokenizer (from its folder), as its users load it; a one-line refusal where there is none."""
    from transformers import AutoTokenizer

    folder = Path(str(source))
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(f"--hf {source}: a text encoder-decoder needs its tokenizer beside it (tokenizer.json, or "
                         "spiece.model / source.spm with tokenizer_config.json): it is checked on real text")
    with hf.quiet_transformers():
        return AutoTokenizer.from_pretrained(str(folder))


def encoded(tok, texts) -> dict:
    """`texts` as the encoder takes them: input_ids and attention_mask (int64), right-padded."""
    batch = tok(list(texts), padding=True, return_tensors="np")
    return {"input_ids": np.asarray(batch["input_ids"], np.int64),
            "attention_mask": np.asarray(batch["attention_mask"], np.int64)}


@dataclass
class TextModel(ED.Model):
    """A text encoder-decoder (`encdec.export.Model`): its decoder starts from the config's
    decoder_start_token_id, ends with its eos token; the tokens generation never picks are the
    generation config's single-token bad words (Marian's padding), and where the config forces the
    end token at the last position of the budget (`forced_eos_token_id`), the loops force it too."""

    name = "seq2seq"
    title = "a text encoder-decoder"
    item = "text"
    answers = "outputs"
    verb = "generate for"
    budget_name = "the generation accuracy budget"

    @property
    def spec(self) -> G.Spec:
        return spec(self.model)

    @classmethod
    def of(cls, model, source) -> TextModel:
        config, g = model.config, model.generation_config
        start = g.decoder_start_token_id if g.decoder_start_token_id is not None else config.decoder_start_token_id
        end = g.eos_token_id if g.eos_token_id is not None else config.eos_token_id
        end = end[0] if isinstance(end, list) else end
        banned = [int(w[0]) for w in (g.bad_words_ids or []) if len(w) == 1]
        return cls(model, Path(str(source)), [int(start)], int(end), banned, [])

    @property
    def tokens(self) -> G.Tokens:
        forced = self.model.generation_config.forced_eos_token_id is not None
        return G.Tokens(tuple(self.start), self.end, tuple(self.suppress), tuple(self.suppress_first), forced)

    def positions(self) -> int | None:
        """Marian's learned-free sinusoidal table holds max_position_embeddings; T5's positions are relative."""
        return getattr(self.model.config, "max_position_embeddings", None) if self.model.config.model_type != "t5" \
            else None

    def modules(self, model, static: bool = False):
        return graphs.modules(model, static)

    @functools.cached_property
    def tok(self):
        return tokenizer(self.source)

    def check_inputs(self) -> dict:
        """Two texts of unequal lengths (the shorter one padded)."""
        return encoded(self.tok, [TEXTS[2], TEXTS[0]])

    def check_tokens(self) -> list[int]:
        ids = self.tok(TEXTS[1], add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids if t != self.end][:8]

    def decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    def write_files(self, staging: Path) -> None:
        """The tokenizer's files, as the source folder holds them."""
        for f in TOKENIZER_FILES:
            if (self.source / f).is_file():
                shutil.copyfile(self.source / f, staging / f)
        config = staging / "tokenizer_config.json"
        if not config.is_file():
            config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")

    def notes(self, static: bool, max_seq: int) -> list[str]:
        if not static:
            return [f"the decoder's two steps are one graph ({G.MERGED}.onnx: an If on {G.USE_CACHE}, their weights "
                    "kept once), as transformers.js and Optimum load a text encoder-decoder; the tokenizer is the "
                    "client's"]
        return [f"the decoder's two steps are one graph ({G.MERGED_STATIC}.onnx), its self cache buffers of "
                f"{max_seq} positions written at {G.WRITE_POS} (attnexport's own inputs: Optimum and "
                "transformers.js load the concat form, the default)"]


def spec(model) -> G.Spec:
    """A text encoder-decoder's graphs' sizes: its decoder's layers, heads and head size, its width;
    its encoder takes token ids with their padding mask, which the decoder's cross-attention takes too."""
    c = model.config
    if c.model_type == "t5":
        layers, heads, head_dim, width = c.num_decoder_layers, c.num_heads, c.d_kv, c.d_model
    else:
        layers, heads, width = c.decoder_layers, c.decoder_attention_heads, c.d_model
        head_dim = width // heads
    axes = {"input_ids": {0: "batch_size", 1: "encoder_sequence_length"},
            "attention_mask": {0: "batch_size", 1: "encoder_sequence_length"}}
    return G.Spec(layers, heads, head_dim, width, ("input_ids", "attention_mask"), axes, True)


def export_text(request, model, params_source: str, precisions: tuple) -> ED.GraphsExport:
    """`export --hf` of a text encoder-decoder: its three graphs through the encoder-decoder core,
    written as a deployment folder (--deploy) only."""
    return ED.export_graphs(request, TextModel.of(model, request.source), params_source, precisions)
