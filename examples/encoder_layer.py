"""torch's own nn.TransformerEncoderLayer with a key padding mask (True = padding).

    attnexport export --module examples/encoder_layer.py:example -o encoder.onnx
"""

import torch
from torch import nn


class PaddedEncoder(nn.Module):
    def __init__(self, d_model=64, nhead=4):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=128, dropout=0.0, batch_first=True)

    def forward(self, x, padding):
        return self.layer(x, src_key_padding_mask=padding)


def example():
    """The layer, 2 sequences of 12 positions, the second padded after 9."""
    torch.manual_seed(0)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 9:] = True
    return PaddedEncoder().eval(), (torch.randn(2, 12, 64), padding)
