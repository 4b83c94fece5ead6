"""Cross-attention from a target sequence to a memory with a key padding mask, through
nn.MultiheadAttention (weights not asked for), with a residual and a layer norm.

    attnexport export --module examples/cross_attention.py:example -o cross.onnx
"""

import torch
from torch import nn


class CrossAttentionBlock(nn.Module):
    def __init__(self, d_model=64, nhead=4, memory_dim=48):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, nhead, kdim=memory_dim, vdim=memory_dim, batch_first=True)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, target, memory, memory_padding):
        out, _ = self.attn(target, memory, memory, key_padding_mask=memory_padding, need_weights=False)
        return self.norm(target + out)


def example():
    """The block, 2 targets of 5 positions over memories of 9, the first padded after 7."""
    torch.manual_seed(0)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, 7:] = True
    return CrossAttentionBlock(), (torch.randn(2, 5, 64), torch.randn(2, 9, 48), padding)
