"""GGML's block formats read exactly: a GGUF tensor's bytes as groups of integer levels, each group
with its float32 scale and offset, so that `scale * level - offset` in float32 is the value the file
holds, bit for bit as NumPy's float32 arithmetic computes it (llama.cpp's C computes the same
products and differences unless its build fuses them into one multiply-add).

The formats, by the layout of one block (little-endian; `d`, `dmin` and `m` are fp16):

| kind | values | bytes | layout | value |
| --- | --- | --- | --- | --- |
| Q4_0 | 32 | 18 | d, 16 bytes of 4-bit q (value j low nibble, j + 16 high) | d * (q - 8) |
| Q4_1 | 32 | 20 | d, m, 16 bytes of 4-bit q | d * q + m |
| Q5_0 | 32 | 22 | d, 32 high bits (uint32: bit j is value j's fifth), 16 bytes of low nibbles | d * (q - 16) |
| Q8_0 | 32 | 34 | d, 32 int8 | d * q |
| Q4_K | 256 | 144 | d, dmin, 12 bytes of eight 6-bit scales and minimums, 128 of 4-bit q | d * sc * q - dmin * m |
| Q6_K | 256 | 210 | 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d | d * sc * (q - 32) |

A K-quant's super-block holds sub-blocks with scales of their own: Q4_K eight of 32 values (64 values
a chunk: the low nibbles of 32 bytes, then their high nibbles), Q6_K sixteen of 16. Each group here is
such a sub-block: the unit a block-wise int4/int8 MatMulNBits carries with a scale and a zero point or
minimum of its own.

`Tensors` finds a file's tensor by its values: a weight matrix of the model transformers loaded from
the file (each block format dequantized to float32, bit for bit as here) is the tensor whose groups
give the same bytes, whatever the two call it; a tensor transformers changed as it read it (a row
order it permutes back) matches none, and is not carried."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# kind: (values a block, bytes a block, values a group)
FORMATS = {"Q4_0": (32, 18, 32), "Q4_1": (32, 20, 32), "Q5_0": (32, 22, 32), "Q8_0": (32, 34, 32),
           "Q4_K": (256, 144, 32), "Q6_K": (256, 210, 16)}


@dataclass(frozen=True)
class Groups:
    """A tensor's values as groups: value = scale * level - offset, in float32.

    Args:
        levels: (G, group) integers, signed where the format centres them (Q4_0, Q5_0, Q8_0, Q6_K).
        scale: (G,) float32, each group's step.
        offset: (G,) float32 subtracted after the product, or None (a symmetric grid).
        bits: how many bits a level takes in the file.
    """

    levels: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    bits: int

    @property
    def group(self) -> int:
        return self.levels.shape[1]

    def values(self) -> np.ndarray:
        """The values in file order, flat, float32."""
        v = self.scale[:, None] * self.levels.astype(np.float32)
        if self.offset is not None:
            v = v - self.offset[:, None]
        return v.reshape(-1).astype(np.float32)


def read(data: np.ndarray | bytes, kind: str) -> Groups:
    """The groups of `data`, a tensor's bytes in GGML's `kind` (whole blocks)."""
    if kind not in FORMATS:
        raise ValueError(f"{kind} is not a block format read here: one of {', '.join(FORMATS)}")
    per_block, size, _ = FORMATS[kind]
    raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes | bytearray | memoryview) else \
        np.asarray(data, np.uint8).reshape(-1)
    if raw.size % size:
        raise ValueError(f"{raw.size} bytes are not whole {kind} blocks of {size} bytes")
    blocks = raw.reshape(-1, size)
    return _READERS[kind](blocks)


def _fp16(b: np.ndarray) -> np.ndarray:
    """(N, 2) bytes as the fp16 they hold, in float32."""
    return np.ascontiguousarray(b).view("<f2")[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(N, 16) bytes as 32 4-bit values: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(b: np.ndarray) -> Groups:
    return Groups(_nibbles(b[:, 2:]).astype(np.int8) - 8, _fp16(b[:, 0:2]), None, 4)


def _q4_1(b: np.ndarray) -> Groups:
    # d * q + m as d * q - (-m): negating an fp16 value is exact.
    return Groups(_nibbles(b[:, 4:]), _fp16(b[:, 0:2]), -_fp16(b[:, 2:4]), 4)


def _q5_0(b: np.ndarray) -> Groups:
    high = np.ascontiguousarray(b[:, 2:6]).view("<u4")[:, 0]
    fifth = ((high[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return Groups((_nibbles(b[:, 6:]) | fifth).astype(np.int8) - 16, _fp16(b[:, 0:2]), None, 5)


def _q8_0(b: np.ndarray) -> Groups:
    return Groups(np.ascontiguousarray(b[:, 2:]).view(np.int8), _fp16(b[:, 0:2]), None, 8)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes as eight 6-bit scales and eight 6-bit minimums: the first four of each in
    the low 6 bits of bytes 0-3 and 4-7, the last four in the nibbles of bytes 8-11 with their two
    high bits in the top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _q4_k(b: np.ndarray) -> Groups:
    n = b.shape[0]
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    sc, mn = _k4_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)  # four chunks of 64 values
    levels = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n * 8, 32)  # chunk c: groups 2c, 2c + 1
    scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
    offset = (dmin[:, None] * mn.astype(np.float32)).reshape(-1)
    return Groups(levels, scale, offset, 4)


def _q6_k(b: np.ndarray) -> Groups:
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    d = _fp16(b[:, 208:210])
    # Each half of 128 values: quarter k takes the low (k = 0, 1) or high (k = 2, 3) nibbles of
    # ql's first (k even) or second 32 bytes, and bits 2k, 2k + 1 of qh.
    quarters = [(ql[:, :, (k % 2) * 32:(k % 2) * 32 + 32] >> (4 * (k // 2))) & 0x0F for k in range(4)]
    highs = [(qh >> (2 * k)) & 3 for k in range(4)]
    q = np.stack([lo | (hi << 4) for lo, hi in zip(quarters, highs, strict=True)], axis=2)  # (n, 2, 4, 32)
    levels = q.reshape(n * 16, 16).astype(np.int8) - 32  # group g of a block: its half, quarter and 16
    scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
    return Groups(levels, scale, None, 6)


_READERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


# The rows of a tensor dequantized at once while its values are hashed.
HASH_ROWS = 4096


@dataclass(frozen=True)
class Found:
    """A file's tensor: its name, kind, and groups, in row order (each row's groups in turn)."""

    name: str
    kind: str
    groups: Groups


class Tensors:
    """The 2-D tensors of a GGUF file in the block formats read here (FORMATS), found by their values
    (`find`). The file is memory-mapped (gguf's reader); a tensor is dequantized only where a matrix
    of its shape is looked for, a block of rows at a time, to hash it."""

    def __init__(self, path: str | Path):
        import gguf
        self.path = Path(path)
        self._by_shape: dict[tuple[int, int], list] = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            if t.tensor_type.name in FORMATS and len(t.shape) == 2:
                rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF gives the fastest axis first
                self._by_shape.setdefault((rows, cols), []).append(t)
        self._digests: dict[str, bytes] = {}

    def kinds(self) -> dict[str, int]:
        """How many tensors of each block format the file has."""
        out: dict[str, int] = {}
        for ts in self._by_shape.values():
            for t in ts:
                out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return dict(sorted(out.items()))

    def find(self, matrix: np.ndarray) -> Found | None:
        """The tensor whose values are `matrix` (rows, columns) float32, bit for bit, or None."""
        candidates = self._by_shape.get(tuple(matrix.shape), [])
        if not candidates:
            return None
        want = _digest(np.ascontiguousarray(matrix, np.float32))
        for t in candidates:
            if t.name not in self._digests:
                self._digests[t.name] = _tensor_digest(t)
            if self._digests[t.name] == want:
                return Found(t.name, t.tensor_type.name, read(t.data, t.tensor_type.name))
        return None


def _digest(matrix: np.ndarray) -> bytes:
    h = hashlib.sha256()
    for a in range(0, matrix.shape[0], HASH_ROWS):
        h.update(np.ascontiguousarray(matrix[a:a + HASH_ROWS]).data)
    return h.digest()


def _tensor_digest(t) -> bytes:
    h = hashlib.sha256()
    for a in range(0, t.data.shape[0], HASH_ROWS):
        h.update(read(t.data[a:a + HASH_ROWS], t.tensor_type.name).values().data)
    return h.digest()
