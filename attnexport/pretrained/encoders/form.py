"""A sentence encoder's one form, `embed` (`attnexport.pretrained.forms`' class, registered by this
family): one pass of token ids and the padding mask to the token states and the sentence embedding,
pooled and normalised in the graph as the model's sentence-transformers files say; no cache."""

from __future__ import annotations

import numpy as np
import torch

from attnexport.errors import UsageError
from attnexport.pretrained import forms as FM


class Embedding(FM.CacheForm):
    """A sentence encoder's one pass: input_ids, attention_mask (1 on tokens, 0 on padding, which
    tokenizers put on the right), token_type_ids where the model takes them -> last_hidden_state
    (B, T, hidden) and sentence_embedding (B, hidden): the token states pooled over the mask (mean,
    cls or max) and L2-normalised where the model's sentence-transformers config says. No cache."""

    name = "embed"
    kv_cache = False
    export_checks = (("batch 2, 9 tokens", 2, 9, 0, 0), ("batch 1, 1 token", 1, 1, 0, 0),
                     ("batch 3, 12 tokens, sequence 0 right-padded by 5", 3, 12, 0, 5))
    verify_checks = (("batch 2, 7 tokens", 2, 7, 0, 0), ("batch 1, 2 tokens", 1, 2, 0, 0),
                     ("batch 4, 16 tokens, sequence 0 right-padded by 9", 4, 16, 0, 9))
    trace_shape = (7, 0)

    def inputs(self, layout):
        return ["input_ids", "attention_mask", *(["token_type_ids"] if layout.token_types else [])]

    def outputs(self, layout):
        return ["last_hidden_state", "sentence_embedding"]

    def dynamic_axes(self, layout):
        return {n: {0: "batch", 1: "sequence"} for n in self.inputs(layout)}

    def wrapper(self, model, layout):
        return EncoderStep(model, layout.pooling, layout.normalize, bool(layout.token_types))

    def rotary_positions(self, model, layout):
        return 0

    def notes(self, attention_op, dtype):
        if attention_op.startswith("com.microsoft."):  # the ort flavour's (attnexport.pretrained.fusions.encoder)
            return [f"{attention_op} takes the padding mask as it comes, which onnxruntime-web's WebGPU kernels "
                    "refuse: for WebGPU, export the attention flavour"]
        return []

    def room(self, layout):
        return layout.max_seq

    def check_room(self, layout, needs, what):
        if needs > layout.max_seq:
            raise UsageError(f"{what}: {needs} tokens, the model's positions take {layout.max_seq}")

    def example_feed(self, layout, batch, block, past, seed, padded):
        rng = np.random.default_rng(seed)
        return self.feed(layout, rng.integers(min(3, layout.vocab - 1), layout.vocab, (batch, block), dtype=np.int64),
                         padded)

    def feed(self, layout, ids: np.ndarray, padded: int = 0) -> dict:
        """The inputs for the token rows `ids` (B, T), sequence 0's last `padded` positions padding
        (the pad token, mask 0), every token of type 0."""
        ids = ids.copy()
        mask = np.ones(ids.shape, np.int64)
        if padded:
            mask[0, -padded:] = 0
            ids[0, -padded:] = layout.pad_token
        types = {"token_type_ids": np.zeros(ids.shape, np.int64)} if layout.token_types else {}
        return {"input_ids": ids, "attention_mask": mask, **types}

    def prefilled_feed(self, run, layout, ids, past, padded, dtype):
        return self.feed(layout, ids, padded)

    def valid_positions(self, layout, feed):
        """The states of tokens (not padding), and every sentence's embedding."""
        mask = np.asarray(feed["attention_mask"]).astype(bool)
        return {"last_hidden_state": mask[:, :, None], "sentence_embedding": np.ones((mask.shape[0], 1), bool)}


class EncoderStep(torch.nn.Module):
    """A sentence encoder as its export: the token states and the pooled (and normalised)
    sentence embedding, as sentence-transformers computes them (mean: the states summed over the
    mask and divided by its count, at least 1e-9; max: padding set to -1e9 first; cls: the first
    token's)."""

    def __init__(self, model, pooling: str, normalize: bool, token_types: bool):
        super().__init__()
        self.model, self.pooling, self.normalize, self.token_types = model, pooling, normalize, token_types

    def forward(self, input_ids, attention_mask, *token_type_ids):
        types = {"token_type_ids": token_type_ids[0]} if self.token_types else {}
        states = self.model(input_ids=input_ids, attention_mask=attention_mask, **types).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(states.dtype)
        if self.pooling == "cls":
            pooled = states[:, 0]
        elif self.pooling == "max":
            pooled = torch.where(weights > 0, states, torch.full_like(states, -1e9)).amax(dim=1)
        else:
            pooled = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
        return states, pooled
