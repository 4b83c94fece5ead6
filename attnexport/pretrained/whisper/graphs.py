"""Whisper's three graphs as torch modules (`attnexport.pretrained.encdec.graphs` names them and
merges the decoder's two steps):

- the encoder: input_features (B, mels, 3000) -> last_hidden_state (B, 1500, width);
- the first decoder step: input_ids (B, T), encoder_hidden_states -> logits, each layer's self keys
  and values and its cross keys and values, computed here once from the encoder's output;
- a later step: input_ids and each layer's self past and cross cache -> logits, each layer's self
  keys and values with the step appended (static: buffers written at write_pos).

The graphs are Whisper's forward written out over transformers' own parameters (its modules:
convolutions, layer norms, projections, embeddings), each attention through attnexport's core:
the encoder's and the cross-attention unmasked, the decoder's self-attention causal over its cache.
The log-mel features stay in the client (`attnexport.pretrained.whisper.audio`), as in Whisper's clients.
"""

from __future__ import annotations

import numpy as np
import torch

from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.encdec.graphs import (
    DECODER,
    DECODER_WITH_PAST,
    ENCODER,
    GRAPHS,
    MERGED,
    MERGED_STATIC,
    USE_CACHE,
    WRITE_POS,
    Tokens,
    both_names,
    cross_names,
    outputs,
    self_names,
    typed,
)
from attnexport.pretrained.encdec.layers import cross_attention, cross_kv, self_attention, self_attention_static

__all__ = ["DECODER", "DECODER_WITH_PAST", "ENCODER", "GRAPHS", "MERGED", "MERGED_STATIC", "USE_CACHE", "WRITE_POS",
           "Tokens", "both_names", "cross_names", "outputs", "self_names", "typed", "spec", "modules", "transcribe"]


def spec(config) -> G.Spec:
    """Whisper's graphs' sizes: the decoder's layers, heads and head size, the encoder's width; its
    encoder takes 30 s of features, unpadded (no mask for the decoder)."""
    heads = config.decoder_attention_heads
    return G.Spec(config.decoder_layers, heads, config.d_model // heads, config.d_model)


# --- the torch graphs ----------------------------------------------------------------------------

def _feed_forward(layer, x):
    return layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))


class Encoder(torch.nn.Module):
    """input_features (B, mels, 3000) -> last_hidden_state (B, 1500, width)."""

    def __init__(self, model):
        super().__init__()
        self.encoder = model.model.encoder

    def forward(self, input_features):
        e = self.encoder
        x = torch.nn.functional.gelu(e.conv1(input_features))
        x = torch.nn.functional.gelu(e.conv2(x)).transpose(1, 2)
        x = x + e.embed_positions.weight[:x.shape[1]]
        for layer in e.layers:
            x = x + self_attention(layer.self_attn, layer.self_attn_layer_norm(x), False)[0]
            x = x + _feed_forward(layer, x)
        return e.layer_norm(x)


class _DecoderStep(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.decoder, self.proj_out = model.model.decoder, model.proj_out

    def step(self, input_ids, past_len, pasts, crosses, write_pos=None):
        """logits, each layer's self keys and values, each layer's cross keys and values. With
        `write_pos` (B,), `pasts` are static buffers, written at each sequence's write_pos."""
        d = self.decoder
        if write_pos is None:
            positions = d.embed_positions.weight[past_len:past_len + input_ids.shape[1]]
        else:  # each sequence's own positions, (B, T, width)
            positions = d.embed_positions.weight[write_pos.reshape(-1, 1) + torch.arange(input_ids.shape[1])]
        x = d.embed_tokens(input_ids) + positions
        written, kept = [], []
        for i, layer in enumerate(d.layers):
            if write_pos is not None:
                out, k, v = self_attention_static(layer.self_attn, layer.self_attn_layer_norm(x), pasts[i], write_pos)
            else:
                out, k, v = self_attention(layer.self_attn, layer.self_attn_layer_norm(x), True,
                                           pasts[i] if pasts is not None else None)
            x = x + out
            ck, cv = crosses[i]
            x = x + cross_attention(layer.encoder_attn, layer.encoder_attn_layer_norm(x), ck, cv)
            x = x + _feed_forward(layer, x)
            written.append((k, v))
            kept.append((ck, cv))
        return self.proj_out(d.layer_norm(x)), written, kept


class Decoder(_DecoderStep):
    """The first step: input_ids, encoder_hidden_states -> logits, each layer's self key and value
    of the tokens and cross key and value of the encoder's output (Optimum's order)."""

    def forward(self, input_ids, encoder_hidden_states):
        crosses = [cross_kv(layer.encoder_attn, encoder_hidden_states) for layer in self.decoder.layers]
        logits, written, kept = self.step(input_ids, 0, None, crosses)
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class DecoderWithPast(_DecoderStep):
    """A later step: input_ids and each layer's self past and cross cache (Optimum's order) ->
    logits, each layer's self key and value with the step appended."""

    def forward(self, input_ids, *caches):
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(len(self.decoder.layers))]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(len(self.decoder.layers))]
        logits, written, _ = self.step(input_ids, caches[0].shape[2], pasts, crosses)
        return (logits, *[t for k, v in written for t in (k, v)])


class StaticDecoder(_DecoderStep):
    """The first step over a static self cache: input_ids, encoder_hidden_states, write_pos and
    each layer's self key and value buffers -> logits, each layer's buffers written and its cross
    key and value (Optimum's order)."""

    def forward(self, input_ids, encoder_hidden_states, write_pos, *buffers):
        crosses = [cross_kv(layer.encoder_attn, encoder_hidden_states) for layer in self.decoder.layers]
        pasts = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(self.decoder.layers))]
        logits, written, kept = self.step(input_ids, 0, pasts, crosses, write_pos)
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class StaticDecoderWithPast(_DecoderStep):
    """A later step over a static self cache: input_ids, write_pos and each layer's self buffers
    and cross cache -> logits, each layer's buffers written."""

    def forward(self, input_ids, write_pos, *caches):
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(len(self.decoder.layers))]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(len(self.decoder.layers))]
        logits, written, _ = self.step(input_ids, 0, pasts, crosses, write_pos)
        return (logits, *[t for k, v in written for t in (k, v)])


def modules(model, static: bool = False) -> dict[str, torch.nn.Module]:
    """The three graphs' torch modules over `model` (a WhisperForConditionalGeneration); `static`:
    the decoder's over a static self cache."""
    first, later = (StaticDecoder, StaticDecoderWithPast) if static else (Decoder, DecoderWithPast)
    return {ENCODER: Encoder(model).eval(), DECODER: first(model).eval(), DECODER_WITH_PAST: later(model).eval()}


# --- transcription ---------------------------------------------------------------------------------

def transcribe(run_encoder, run_first, run_later, features: np.ndarray, tokens: Tokens, layers: int,
               max_tokens: int) -> list[list[int]]:
    """Greedy transcription of a batch of features (B, mels, 3000), the loop a client writes
    (`encdec.graphs.greedy` over the encoder's input_features)."""
    return G.greedy(run_encoder, run_first, run_later, {"input_features": features}, tokens, layers, max_tokens)
