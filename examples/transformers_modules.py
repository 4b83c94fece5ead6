"""Attention blocks of transformers, timm and torch, built from small configs with random weights
(nothing is downloaded), each wrapped the way a user exporting one block would: forward takes
tensors and returns one. `attnexport export --module examples/transformers_modules.py:llama`.

transformers and timm are the `[hf]` extra: `pip install -e ".[hf]"`.
"""

import torch
from torch import nn


def _sdpa(config):
    config._attn_implementation = "sdpa"  # the attention transformers routes to torch's SDPA
    return config


def _eager(config):
    config._attn_implementation = "eager"  # attention written out: matmul, softmax, matmul
    return config


class _First(nn.Module):
    """Calls the wrapped block with the given keyword arguments and returns its first output."""

    def __init__(self, block, **kwargs):
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, hidden_states):
        out = self.block(hidden_states, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


class RotaryDecoderLayer(nn.Module):
    """A decoder layer with its rotary embedding (position ids 0..T-1 of batch 1, as the models
    compute them): hidden states (B, T, 64) -> hidden states."""

    def __init__(self, family):
        super().__init__()
        import transformers as T
        models = T.models
        config_class, layer_class, rope_class = {
            "llama": (T.LlamaConfig, models.llama.modeling_llama.LlamaDecoderLayer,
                      models.llama.modeling_llama.LlamaRotaryEmbedding),
            "mistral": (T.MistralConfig, models.mistral.modeling_mistral.MistralDecoderLayer,
                        models.mistral.modeling_mistral.MistralRotaryEmbedding),
            "qwen2": (T.Qwen2Config, models.qwen2.modeling_qwen2.Qwen2DecoderLayer,
                      models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding),
        }[family]
        config = _sdpa(config_class(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=1, vocab_size=100,
                                    max_position_embeddings=128))
        self.layer = layer_class(config, layer_idx=0)
        self.rope = rope_class(config=config)

    def forward(self, hidden_states):
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        out = self.layer(hidden_states, attention_mask=None, position_ids=positions,
                         position_embeddings=self.rope(hidden_states, positions))
        return out[0] if isinstance(out, tuple) else out


class IdsAndMask(nn.Module):
    """A whole model taking token ids and a padding mask (1 = token): its last hidden state."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _hidden():
    return (torch.randn(2, 8, 64),)


def _ids_and_mask():
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 6:] = 0  # the second sequence is 6 tokens long
    return ids, mask


def llama():
    return RotaryDecoderLayer("llama"), _hidden()


def mistral():
    return RotaryDecoderLayer("mistral"), _hidden()


def qwen2():
    return RotaryDecoderLayer("qwen2"), _hidden()


def gpt2_block():
    import transformers as T
    config = _sdpa(T.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=64, vocab_size=100))
    return _First(T.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0)), _hidden()


def gpt2_eager_block():
    import transformers as T
    config = _eager(T.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=64, vocab_size=100))
    return _First(T.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0)), _hidden()


def gpt2_model():
    import transformers as T
    config = _sdpa(T.GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=64, vocab_size=100, use_cache=False))
    return IdsAndMask(T.GPT2Model(config)), _ids_and_mask()


def bert_model():
    import transformers as T
    config = _sdpa(T.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                                vocab_size=100, max_position_embeddings=64))
    return IdsAndMask(T.BertModel(config, add_pooling_layer=False)), _ids_and_mask()


def bert_layer():
    import transformers as T
    config = _sdpa(T.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1,
                                vocab_size=100))
    return _First(T.models.bert.modeling_bert.BertLayer(config)), _hidden()


def t5_attention():
    """T5's self-attention with its relative position bias: attention written out, no scale."""
    import transformers as T
    config = _eager(T.T5Config(d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=1, vocab_size=100))
    return _Positions(T.models.t5.modeling_t5.T5Attention(config, has_relative_attention_bias=True, layer_idx=0)), \
        _hidden()


class _Positions(_First):
    """A block that reads its query length from `cache_position` (T5Attention before transformers
    5 requires it without a cache): given the positions 0..T-1."""

    def forward(self, hidden_states):
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        out = self.block(hidden_states, cache_position=positions)
        return out[0] if isinstance(out, tuple) else out


def bert_model_eager():
    """BertModel with transformers' eager attention: its padding mask is added as the float32's
    lowest number, which ONNX Runtime's Attention kernel once took for -inf."""
    import transformers as T
    config = _eager(T.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                                 vocab_size=100, max_position_embeddings=64))
    return IdsAndMask(T.BertModel(config, add_pooling_layer=False)), _ids_and_mask()


def whisper_attention():
    import transformers as T
    config = _sdpa(T.WhisperConfig(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4,
                                   encoder_layers=1, decoder_layers=1))
    return _First(T.models.whisper.modeling_whisper.WhisperAttention(64, 4, config=config)), _hidden()


def vit_block():
    from timm.models.vision_transformer import Block
    return Block(dim=64, num_heads=4), _hidden()


def torch_decoder_layer():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

        def forward(self, x, memory):
            return self.layer(x, memory)
    return Layer(), (torch.randn(2, 8, 64), torch.randn(2, 6, 64))
