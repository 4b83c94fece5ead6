"""Sentence encoders (BERT and its RoBERTa kin, as sentence-transformers ships them): a sequence in,
each token's state and the sentence's embedding out, pooled and normalised as the folder's
sentence-transformers files say (`form`, the `embed` form), no cache; judged as their users judge
them (`measures`: each sentence's cosine to the float64 embedding, top-k retrieval), timed beside
Optimum's export (`bench`), embedded with by their clients (`clients`). The family registers itself
and its form.

The package's modules are imported when first read from it (most import torch and transformers)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from attnexport.errors import UsageError
from attnexport.pretrained import forms as FM
from attnexport.pretrained import registry
from attnexport.pretrained import retrieval as RT
from attnexport.pretrained.encoders import measures as E


class SentenceEncoder(registry.Family):
    """Sentence encoders."""

    task = "feature-extraction"
    what = "sentence encoder"
    architectures = ("BertModel", "RobertaModel", "XLMRobertaModel")
    auto_class = "AutoModel"
    gguf_mapping = "MODEL_MAPPING_NAMES"
    forms = ("embed",)
    tested = ("bert", "roberta")
    needs_tokenizer = True
    clients = ("sentence-transformers", "optimum", "transformers.js")
    fuses_encoder_layers = True
    optimum_task = "feature-extraction"
    # DynamicQuantizeMatMul: ONNX Runtime's integer GEMM, for many rows (docs/encoders.md measures both).
    int8_kernel = "integer"

    def form(self, name: str) -> FM.CacheForm:
        if name not in self.forms:
            raise UsageError(f"a {self.what} keeps no cache: --kv-cache and --max-seq do not apply")
        return FM.FORMS[name]

    def layout_fields(self, model, source) -> dict:
        """The position table's length (the longest sequence), whether it takes token_type_ids,
        and its pooling and normalisation (`measures.pooling_of`)."""
        config, embeddings = model.config, getattr(model, "embeddings", None)
        # RoBERTa's kin count positions from after the padding index (its `padding_idx`), BERT's from 0.
        first = getattr(embeddings, "padding_idx", -1) + 1 if embeddings is not None else 0
        pooling, normalize = E.pooling_of(source)
        return {"max_seq": int(config.max_position_embeddings) - first,
                "token_types": int(getattr(config, "type_vocab_size", 0) or 0), "pooling": pooling,
                "normalize": normalize}

    def deploy_files(self, source) -> list[str]:
        """sentence-transformers' files (modules.json, its configs, each module's folder), which its
        loader and transformers.js' pipeline read for the pooling and normalisation."""
        folder = Path(source)
        if not folder.is_dir():
            return []
        found = [f for f in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
                 if (folder / f).is_file()]
        if "modules.json" in found:
            for module in json.loads((folder / "modules.json").read_text()):
                where = folder / module.get("path", "")
                if module.get("path") and where.is_dir():
                    found += sorted(str(p.relative_to(folder)) for p in where.rglob("*") if p.is_file())
        return found

    def finish_folder(self, folder: Path, source, layout) -> None:
        """One longest input in every file a client reads (`measures.max_length`: the model's own),
        and no fixed padding: tokenizer.json's truncation (a plain tokenizers loop, transformers.js'
        tokenizer), tokenizer_config.json's model_max_length (transformers' and Optimum's tokenizer,
        transformers.js' pipeline) and sentence_bert_config.json's max_seq_length (sentence-transformers)."""
        E.state_max_length(folder, E.max_length(source, layout.max_seq))

    def calibration(self, layout, tokenizer):
        """`measures.calibration`: the calibration passage's sentences, their embeddings' lowest cosine."""
        return E.calibration(layout, tokenizer)

    def budget(self, text):
        """An encoder's budget is its file's precision's (`measures.budget_for`), with `--budget
        cosine=...,retrieval=...` applied to it."""
        return RT.Overrides(text)

    def verify_needs(self, layout, inputs, new_tokens, tokenizer):
        return self.module("check").needs(layout, inputs, new_tokens, tokenizer)

    def answer_rows(self, ctx, lossy: bool) -> None:
        self.module("check").embedding_rows(ctx)

    def client_rows(self, ctx) -> None:
        self.module("check").client_rows(ctx)

    def bench(self, source, told, said):
        return self.module("bench").from_options(source, told, said)

    def bench_lines(self, rows, info, title):
        return self.module("bench").lines(rows, info, title)


registry.register(SentenceEncoder())
FM.register(importlib.import_module(f"{__name__}.form").Embedding())

__getattr__ = registry.lazy(__name__)
