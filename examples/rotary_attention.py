import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryBlock(nn.Module):
    """Causal attention with rotary position embeddings written as transformers writes them
    (Llama, Mistral, Qwen2): cos and sin from position ids of batch 1, broadcast against the
    batch. torch.onnx fuses this into the RotaryEmbedding op at opset 23 (the attention flavor)."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T, device=x.device).unsqueeze(0).float()  # (1, T)
        freqs = (self.inv_freq.float()[None, :, None] @ pos[:, None, :]).transpose(1, 2)  # (1, T, hd/2), in fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)  # (1, 1, T, hd), as transformers
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


def example():
    torch.manual_seed(0)
    return RotaryBlock(), (torch.randn(2, 6, 32),)
