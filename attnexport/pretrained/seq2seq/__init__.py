"""Text encoder-decoders (T5 and Marian, as transformers' T5ForConditionalGeneration and MarianMTModel):
token ids in, an encoder and a decoder whose cross-attention reads the encoder's output as a cache
computed once and whose self cache grows a token a step (concat, or Marian's static buffers); its
graphs as torch modules (`graphs`) through the encoder-decoder core (`attnexport.pretrained.encdec`:
export, verify, cost), its texts and tokens (`texts`), verified with greedy generation against
transformers' `generate` (`check`), timed beside transformers (`bench`), generated with by its
clients (`clients`). The family registers itself.

The package's modules are imported when first read from it (most import torch and transformers)."""

from __future__ import annotations

import importlib
from pathlib import Path

from attnexport.pretrained import registry


class Text2Text(registry.Family):
    """Text encoder-decoders."""

    task = "text2text-generation"
    what = "text encoder-decoder (T5, Marian)"
    architectures = ("T5ForConditionalGeneration", "MarianMTModel")
    auto_class = "AutoModelForSeq2SeqLM"
    gguf_mapping = "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"
    forms = ()
    tested = ("t5", "marian")
    precisions = ("fp32", "fp16", "int8", "int4")
    needs_tokenizer = True
    clients = ("optimum", "transformers.js")
    optimum_task = "text2text-generation-with-past"

    def export(self, request, model, params_source: str):
        return self.module("texts").export_text(request, model, params_source, self.precisions)

    def exported(self, path: Path) -> bool:
        """A folder whose config.json is a T5's or a Marian's: attnexport's deployment folder, or
        another tool's export, whichever graphs it holds (its verify names those it lacks)."""
        config = registry.config_of(path) if path.is_dir() else None
        return config is not None and self.accepts(config)

    def verify(self, check):
        return self.module("check").verify(check)

    def budget(self, text):
        """The encoder-decoder core's budget (`encdec.cost.AnswerBudget`), said of generated outputs in
        verify's rows, with `--budget` applied."""
        return importlib.import_module("attnexport.pretrained.encdec.cost").AnswerBudget().with_overrides(text)

    def bench(self, source, told, said):
        return self.module("bench").from_options(source, told, said)

    def bench_lines(self, rows, info, title):
        return self.module("bench").lines(rows, info, title)


registry.register(Text2Text())
__getattr__ = registry.lazy(__name__)
