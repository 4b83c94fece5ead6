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

    def layout_fields(self, model, source) -> dict:
        """Each layer's sliding window (0: it sees every position), where any layer has one: the
        static form keeps a ring of it (`forms.StaticCache.rings`)."""
        windows = sliding_windows(model.config)
        return {"extra": {"windows": windows}} if any(windows) else {}

    def bench(self, source, told, said):
        return self.module("bench").from_options(source, told, said)

    def bench_lines(self, rows, info, title):
        return self.module("bench").lines(rows, info, title)


def sliding_windows(config) -> list[int]:
    """Each layer's sliding window as the config gives it (`sliding_window`, and `layer_types`
    where it names the sliding layers; without it every layer's), 0 for a layer without one."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(config.num_hidden_layers)
    window = int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None)
    if not window:
        return [0] * layers
    if types:
        return [window if t == "sliding_attention" else 0 for t in types]
    return [window] * layers


registry.register(CausalLM())
FM.register(*importlib.import_module(f"{__name__}.forms").FORMS)

__getattr__ = registry.lazy(__name__)

