"""A decode step written the way people write one: forward takes the new tokens and the key/value
cache of the earlier ones, and returns the output with the cache updated (the past followed by the
new keys and values). Query i of the block attends to every cached position and to the new ones up
to itself: the causal mask is offset by the cache's length (bottom-right).

attnexport export --module examples/kv_cache_module.py:example \\
    --cache past_key:present_key --cache past_value:present_value -o models/step.onnx
attnexport verify models/step.onnx --module examples/kv_cache_module.py:example

`topleft_example` is the same step with the classic mistake, `is_causal=True` with a cache (torch
aligns that mask top-left: the first new token sees only the first cached ones); verify's decode
check fails it.
"""

import torch
from torch import nn
from torch.nn import functional as F


class DecodeStep(nn.Module):
    def __init__(self, dim=64, heads=4, topleft=False):
        super().__init__()
        self.heads, self.head_dim, self.topleft = heads, dim // heads, topleft
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, past_key, past_value):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        key = torch.cat([past_key, k], dim=2)  # (B, H, past + T, d)
        value = torch.cat([past_value, v], dim=2)
        if self.topleft:
            y = F.scaled_dot_product_attention(q, key, value, is_causal=True)
        else:
            past = past_key.shape[2]
            visible = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, key, value, attn_mask=visible)
        return {"output": self.out(y.transpose(1, 2).reshape(b, t, -1)), "present_key": key, "present_value": value}


def _inputs():
    return torch.randn(2, 5, 64), torch.randn(2, 4, 3, 16), torch.randn(2, 4, 3, 16)


def example():
    return DecodeStep(), _inputs()


def topleft_example():
    return DecodeStep(topleft=True), _inputs()
