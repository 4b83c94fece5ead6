"""A causal self-attention block written the way nanoGPT-style code writes it: one fused QKV
projection, heads split by view/transpose, torch's scaled_dot_product_attention with is_causal.

    attnexport export --module examples/causal_self_attention.py:example --flavor ort -o block.onnx
"""

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=64, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def example():
    """The block and an input: 2 sequences of 16 positions."""
    torch.manual_seed(0)
    return CausalSelfAttention(), (torch.randn(2, 16, 64),)
