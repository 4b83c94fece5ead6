"""A text encoder-decoder's three graphs as torch modules (`attnexport.pretrained.encdec.graphs` names
them and merges the decoder's two steps), T5's and Marian's forward written out over transformers'
own parameters and submodules (embeddings, layer norms, feed-forward blocks), each attention through
attnexport's core:

- the encoder: input_ids, attention_mask (B, S) -> last_hidden_state (B, S, width); its
  self-attention over the unpadded keys;
- the first decoder step: input_ids (B, T), encoder_hidden_states, encoder_attention_mask -> logits,
  each layer's self keys and values and its cross keys and values, computed here once;
- a later step: input_ids, encoder_attention_mask and each layer's self past and cross cache ->
  logits, each layer's self keys and values with the step appended (static: buffers written at
  write_pos, Marian's only: T5's relative position bias over fixed buffers is not built).

T5: pre-norm RMS layers, scores unscaled, a relative position bias (layer 0's table, bucketed as the
model buckets it: both ways in the encoder, backwards in the decoder, the decoder's query positions
counted after its past) added to every self-attention's scores, the output scaled by d_model^-0.5
before a tied head. Marian: post-norm layers, sinusoidal positions (the model's table), embeddings
scaled by its embed_scale, the head's final_logits_bias.
"""

from __future__ import annotations

import torch

from attnexport.errors import UsageError
from attnexport.models.core import attend
from attnexport.pretrained.encdec import graphs as G
from attnexport.pretrained.encdec import layers as L
from attnexport.semantics import Core

# --- T5 --------------------------------------------------------------------------------------------

def _t5_bias(attn, queries: int, keys: int, past) -> torch.Tensor:
    """(1, H, queries, keys): the relative position bias of `attn` (the layer holding the table)
    for query positions past .. past + queries - 1 over key positions 0 .. keys - 1."""
    context = torch.arange(queries, dtype=torch.long)[:, None] + past
    memory = torch.arange(keys, dtype=torch.long)[None, :]
    buckets = attn._relative_position_bucket(memory - context, bidirectional=not attn.is_decoder,
                                             num_buckets=attn.relative_attention_num_buckets,
                                             max_distance=attn.relative_attention_max_distance)
    return attn.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)


def _padding(mask: torch.Tensor, dtype) -> torch.Tensor:
    """(B, 1, 1, S): 0 on the keys attended, the dtype's lowest where padded (as T5 adds it)."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _t5_attention(attn, x, kv, bias, causal: bool, past=None):
    """T5Attention's parameters (q, k, v, o; no scaling) through the core, `bias` added to the scores:
    returns (output, the keys, the values), the past's first where there is one."""
    h = attn.n_heads
    q = L.heads(attn.q(x), h)
    k, v = (L.heads(attn.k(kv), h), L.heads(attn.v(kv), h)) if kv is not None else (None, None)
    a = attend(q, k, v, bias, cache=past, core=Core(1.0, causal))
    if a.present_key is not None and a.present_value is not None:
        k, v = a.present_key, a.present_value
    return attn.o(L.merged(a.output)), k, v


class T5Encoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.stack = model.encoder

    def forward(self, input_ids, attention_mask):
        e = self.stack
        x = e.embed_tokens(input_ids)
        s = input_ids.shape[1]
        first = e.block[0].layer[0].SelfAttention
        bias = _t5_bias(first, s, s, 0) + _padding(attention_mask, x.dtype)
        for block in e.block:
            attention = block.layer[0]
            normed = attention.layer_norm(x)
            x = x + _t5_attention(attention.SelfAttention, normed, normed, bias, False)[0]
            ff = block.layer[-1]
            x = x + ff.DenseReluDense(ff.layer_norm(x))
        return e.final_layer_norm(x)


class _T5Step(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.stack, self.lm_head, self.config = model.decoder, model.lm_head, model.config

    def step(self, input_ids, mask, pasts, crosses):
        d, c = self.stack, self.config
        x = d.embed_tokens(input_ids)
        t = input_ids.shape[1]
        past = pasts[0][0].shape[2] if pasts is not None else 0
        first = d.block[0].layer[0].SelfAttention
        bias = _t5_bias(first, t, past + t, past)
        padding = _padding(mask, x.dtype)
        written, kept = [], []
        for i, block in enumerate(d.block):
            attention = block.layer[0]
            normed = attention.layer_norm(x)
            out, k, v = _t5_attention(attention.SelfAttention, normed, normed, bias, True,
                                      pasts[i] if pasts is not None else None)
            x = x + out
            cross = block.layer[1]
            ck, cv = crosses[i]
            q = L.heads(cross.EncDecAttention.q(cross.layer_norm(x)), cross.EncDecAttention.n_heads)
            a = attend(q, ck, cv, padding, core=Core(1.0, False))
            x = x + cross.EncDecAttention.o(L.merged(a.output))
            ff = block.layer[-1]
            x = x + ff.DenseReluDense(ff.layer_norm(x))
            written.append((k, v))
            kept.append((ck, cv))
        x = d.final_layer_norm(x)
        scaled = getattr(c, "scale_decoder_outputs", c.tie_word_embeddings)
        if scaled:
            x = x * (c.d_model ** -0.5)
        return self.lm_head(x), written, kept

    def crosses(self, states):
        out = []
        for block in self.stack.block:
            attn = block.layer[1].EncDecAttention
            out.append((L.heads(attn.k(states), attn.n_heads), L.heads(attn.v(states), attn.n_heads)))
        return out


class T5Decoder(_T5Step):
    """The first step: input_ids, encoder_hidden_states, encoder_attention_mask -> logits, each
    layer's self key and value and cross key and value (Optimum's order)."""

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask):
        logits, written, kept = self.step(input_ids, encoder_attention_mask, None, self.crosses(encoder_hidden_states))
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class T5DecoderWithPast(_T5Step):
    """A later step: input_ids, encoder_attention_mask and each layer's self past and cross cache ->
    logits, each layer's self key and value with the step appended."""

    def forward(self, input_ids, encoder_attention_mask, *caches):
        n = len(self.stack.block)
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(n)]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(n)]
        logits, written, _ = self.step(input_ids, encoder_attention_mask, pasts, crosses)
        return (logits, *[t for k, v in written for t in (k, v)])


# --- Marian ----------------------------------------------------------------------------------------

class MarianEncoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.encoder = model.model.encoder

    def forward(self, input_ids, attention_mask):
        e = self.encoder
        x = e.embed_tokens(input_ids) * e.embed_scale + e.embed_positions.weight[:input_ids.shape[1]]
        for layer in e.layers:
            x = layer.self_attn_layer_norm(x + L.self_attention(layer.self_attn, x, False, mask=attention_mask)[0])
            x = layer.final_layer_norm(x + layer.fc2(layer.activation_fn(layer.fc1(x))))
        return x


class _MarianStep(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.decoder, self.lm_head, self.bias = model.model.decoder, model.lm_head, model.final_logits_bias

    def step(self, input_ids, mask, past_len, pasts, crosses, write_pos=None):
        """logits, each layer's self keys and values, each layer's cross keys and values. With
        `write_pos` (B,), `pasts` are static buffers, written at each sequence's write_pos."""
        d = self.decoder
        table = d.embed_positions.weight
        if write_pos is None:
            positions = table[past_len:past_len + input_ids.shape[1]]
        else:  # each sequence's own positions, (B, T, width)
            positions = table[write_pos.reshape(-1, 1) + torch.arange(input_ids.shape[1])]
        x = d.embed_tokens(input_ids) * d.embed_scale + positions
        written, kept = [], []
        for i, layer in enumerate(d.layers):
            if write_pos is not None:
                out, k, v = L.self_attention_static(layer.self_attn, x, pasts[i], write_pos)
            else:
                out, k, v = L.self_attention(layer.self_attn, x, True, pasts[i] if pasts is not None else None)
            x = layer.self_attn_layer_norm(x + out)
            ck, cv = crosses[i]
            x = layer.encoder_attn_layer_norm(x + L.cross_attention(layer.encoder_attn, x, ck, cv, mask))
            x = layer.final_layer_norm(x + layer.fc2(layer.activation_fn(layer.fc1(x))))
            written.append((k, v))
            kept.append((ck, cv))
        return self.lm_head(x) + self.bias.to(x.dtype), written, kept  # the bias in the graph's type (a half one's)

    def crosses(self, states):
        return [L.cross_kv(layer.encoder_attn, states) for layer in self.decoder.layers]


class MarianDecoder(_MarianStep):
    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask):
        crosses = self.crosses(encoder_hidden_states)
        logits, written, kept = self.step(input_ids, encoder_attention_mask, 0, None, crosses)
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class MarianDecoderWithPast(_MarianStep):
    def forward(self, input_ids, encoder_attention_mask, *caches):
        n = len(self.decoder.layers)
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(n)]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(n)]
        logits, written, _ = self.step(input_ids, encoder_attention_mask, caches[0].shape[2], pasts, crosses)
        return (logits, *[t for k, v in written for t in (k, v)])


class MarianStaticDecoder(_MarianStep):
    """The first step over a static self cache: input_ids, encoder_hidden_states,
    encoder_attention_mask, write_pos and each layer's self buffers -> logits, each layer's buffers
    written and its cross key and value."""

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask, write_pos, *buffers):
        pasts = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(self.decoder.layers))]
        logits, written, kept = self.step(input_ids, encoder_attention_mask, 0, pasts,
                                          self.crosses(encoder_hidden_states), write_pos)
        return (logits, *[t for (k, v), (ck, cv) in zip(written, kept, strict=True) for t in (k, v, ck, cv)])


class MarianStaticDecoderWithPast(_MarianStep):
    def forward(self, input_ids, encoder_attention_mask, write_pos, *caches):
        n = len(self.decoder.layers)
        pasts = [(caches[4 * i], caches[4 * i + 1]) for i in range(n)]
        crosses = [(caches[4 * i + 2], caches[4 * i + 3]) for i in range(n)]
        logits, written, _ = self.step(input_ids, encoder_attention_mask, 0, pasts, crosses, write_pos)
        return (logits, *[t for k, v in written for t in (k, v)])


def modules(model, static: bool = False) -> dict[str, torch.nn.Module]:
    """The three graphs' torch modules over `model` (T5ForConditionalGeneration or MarianMTModel);
    `static`: the decoder's over a static self cache (Marian's only)."""
    if model.config.model_type == "t5":
        if static:
            raise UsageError("--kv-cache static: T5's relative position bias over fixed buffers is not built; "
                             "a T5 export's decoder takes its self cache concat (the default)")
        graphs = (T5Encoder, T5Decoder, T5DecoderWithPast)
    else:
        graphs = (MarianEncoder, *((MarianStaticDecoder, MarianStaticDecoderWithPast) if static else
                                   (MarianDecoder, MarianDecoderWithPast)))
    return {g: cls(model).eval() for g, cls in zip(G.GRAPHS, graphs, strict=True)}
