"""A decode step over a static cache, written the way people write one: the key and value buffers
keep their size (max_seq positions), each step writes its block of new keys and values into them
at each sequence's write position, and attention reads the buffers through a mask that shows
sequence b's query i the positions up to write_pos[b] + i (the rest of the buffer is never read).
One graph serves the prompt and every later token, and its inputs never change shape.

attnexport export --module examples/static_cache_module.py:example \\
    --cache key_cache:key_cache_out --cache value_cache:value_cache_out --write-pos write_pos \\
    -o models/static_step.onnx
attnexport verify models/static_step.onnx --module examples/static_cache_module.py:example

`positions_example` takes the positions written instead (one per new token, shared by the batch,
as transformers' StaticCache takes `cache_position`); its position axis is the block's, so the
export names it: --dynamic cache_position:0=x_len.

`unmasked_example` is the same step with the classic mistake: attention over the whole buffer, no
mask, so it reads positions nothing has written yet (zeros in the example, which still weigh in the
softmax); verify's decode check, which starts from buffers full of noise, fails it.
"""

import torch
from torch import nn
from torch.nn import functional as F


class StaticStep(nn.Module):
    def __init__(self, dim=64, heads=4, mistake=False):
        super().__init__()
        self.heads, self.head_dim, self.mistake = heads, dim // heads, mistake
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, key_cache, value_cache, write_pos):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # The block's positions in the buffer, (B, T): sequence b writes at write_pos[b], write_pos[b] + 1, ...
        pos = write_pos[:, None] + torch.arange(t, device=x.device)
        index = pos[:, None, :, None].expand(b, self.heads, t, self.head_dim)
        key_cache = key_cache.scatter(2, index, k)
        value_cache = value_cache.scatter(2, index, v)
        slots = torch.arange(key_cache.shape[2], device=x.device)
        visible = (slots[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, T, S)
        y = F.scaled_dot_product_attention(q, key_cache, value_cache, attn_mask=None if self.mistake else visible)
        return {"output": self.out(y.transpose(1, 2).reshape(b, t, -1)), "key_cache_out": key_cache,
                "value_cache_out": value_cache}


class PositionsStep(StaticStep):
    """The same step, told the positions its block fills (T,), the same for every sequence."""

    def forward(self, x, key_cache, value_cache, cache_position):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        key_cache = key_cache.index_copy(2, cache_position, k)
        value_cache = value_cache.index_copy(2, cache_position, v)
        slots = torch.arange(key_cache.shape[2], device=x.device)
        visible = slots[None, :] <= cache_position[:, None]  # (T, S)
        y = F.scaled_dot_product_attention(q, key_cache, value_cache, attn_mask=visible)
        return {"output": self.out(y.transpose(1, 2).reshape(b, t, -1)), "key_cache_out": key_cache,
                "value_cache_out": value_cache}


MAX_SEQ = 16


def _buffers(batch=2):
    return torch.zeros(batch, 4, MAX_SEQ, 16), torch.zeros(batch, 4, MAX_SEQ, 16)


def example():
    """Two sequences, 5 new tokens each, written at positions 0 and 3."""
    return StaticStep(), (torch.randn(2, 5, 64), *_buffers(), torch.tensor([0, 3]))


def positions_example():
    return PositionsStep(), (torch.randn(2, 5, 64), *_buffers(), torch.arange(2, 7))


def unmasked_example():
    return StaticStep(mistake=True), (torch.randn(2, 5, 64), *_buffers(), torch.tensor([0, 3]))
