"""Causal language models (decoder-only: Llama, Mistral, Qwen2, Phi-3, GPT-2, Gemma2 and their kin):
a step of tokens after a cache of earlier ones, exported in the none, concat or static form
(`forms`), generating greedily (`generation`), judged by generation parity and, lossy, by their
cost in answers (`accuracy`), timed by their decode (`bench`), generated from by their clients
(`clients`). The family registers itself and its forms.

The package's modules are imported when first read from it (most import torch and transformers)."""

from __future__ import annotations

import importlib

from attnexport.pretrained import forms as FM
from attnexport.pretrained import registry


class CausalLM(registry.Family):
    """Causal language models."""

    task = "causal-lm"
    what = "causal language model"
    architectures = ("ForCausalLM", "LMHeadModel")
    auto_class = "AutoModelForCausalLM"
    gguf_mapping = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    forms = ("none", "concat", "static")
    tested = ("llama", "mistral", "qwen2", "phi3", "gpt2", "gemma2", "gemma3_text")
    clients = ("optimum", "transformers.js")
    optimum_task = "text-generation-with-past"
    expects_first = True

    def budget(self, text):
        return self.module("accuracy").Budget().with_overrides(text)

    def verify_inputs(self, tokenizer, layout):
        return self.module("check").inputs(tokenizer, layout)

    def verify_needs(self, layout, inputs, new_tokens, tokenizer):
        return self.module("check").needs(layout, inputs, new_tokens, tokenizer)

    def float_rows(self, ctx) -> None:
        self.module("check").decode_rows(ctx)

    def answer_rows(self, ctx, lossy: bool) -> None:
        rows = self.module("check")
        (rows.accuracy_rows if lossy else rows.generation_rows)(ctx)

    def client_rows(self, ctx) -> None:
        self.module("check").client_rows(ctx)

    def bench(self, source, told, said):
        return self.module("bench").from_options(source, told, said)

    def bench_lines(self, rows, info, title):
        return self.module("bench").lines(rows, info, title)


registry.register(CausalLM())
FM.register(*importlib.import_module(f"{__name__}.forms").FORMS)

__getattr__ = registry.lazy(__name__)
