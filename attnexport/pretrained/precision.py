"""Quantized weights of an exported language model: each weight matrix of a MatMul as ONNX Runtime's
`com.microsoft.MatMulNBits` (4 or 8 bits in blocks along the input axis), chosen per layer, recorded
in the model's metadata, and read back as the float matrices the file computes with.

attnexport never rounds a weight itself. A matrix goes through ONNX Runtime's own blockwise
quantizer (the kernel `onnxruntime.quantization.matmul_nbits_quantizer` calls, round to nearest,
run here a matrix at a time), unless it already
holds a block grid of the bits asked for (a GGUF file's Q4_0, Q4_1 and Q8_0 blocks, which
transformers dequantizes to float32 when it reads the file): then the grid is carried into
MatMulNBits as it is (a Q4_1 block's float minimum folded, below, or bit for bit). Quantizing a
weight that is already quantized rounds it a second time, onto a grid shifted from its own: on
SmolLM2-135M (Q4_1) that took the mean KL against the model from 0.014 to 0.30 and its held-out
perplexity up by a third (docs/quantization.md).

MatMulNBits's grid is `scale * (q - zero)` with an integer zero point. A Q4_1 block is
`d * q + m` with a float minimum `m`, which no integer zero point holds (m / d is no integer). Two
forms carry it (`Plan.minimums`):

- `folded` (the default): the zero point nearest `-m / d`, and what that leaves of `m` (at most half
  a step) as one more row per block, rounded by ONNX Runtime's quantizer to 4-bit codes of their
  own block's scale, multiplied by the sum of the block's inputs. The input gets its block sums
  appended, padded to whole blocks (`{x}_folded`: a MatMul by a 0/1 matrix and a Concat,
  shared by the matrices that read `x`), and the MatMulNBits reads K + 32 values (K + 64 past K =
  1024). No other op per matrix. Each weight is within half a residual step of the model's (on
  SmolLM2-135M at most 0.32 of its block's step, 0.02 rms), recorded and checked (`unfaithful`).
  The codes are centred on zero, so int8 activations (accuracy level 4) cost less than on the
  exact form's all-positive ones: SmolLM2's mean KL 0.0038 against 0.014 (docs/quantization.md).
- `exact`: the integer grid `d * q` (zero point 0) plus, per block, `m` times the sum of the block's
  inputs as a MatMul of the block sums by the minimums and an Add (`MINIMUMS`): bit for bit (at
  accuracy level 0 the model's own answers), and on SmolLM2-135M about 2 ms a token slower on 2 cores.
- `float`: MatMulNBits's float zero points (in the scales' type), `-m / d` a block: one op a
  matrix and no extra input, each weight within the zero point's rounding of the model's (fp16:
  |m| / 2048). ONNX Runtime's CPU kernel for float zero points is 17 to 40 times slower than its
  integer one (docs/quantization.md), so this form is for the CUDA provider, where the folded
  form's block sums cost two launches an input.

int8 has a second form (`Plan.kernel`): `integer`, each matrix as com.microsoft.DynamicQuantizeMatMul,
its weights int8 per output column (ONNX Runtime's `quantize_data`, symmetric, round to nearest) and
its input quantized to uint8 per tensor when it runs: ONNX Runtime's integer GEMM, which is for many
rows (an encoder's batch of sentences) what MatMulNBits's blockwise kernel is for a language
model's few rows a step. A per-tensor activation grid loses the answers where a few channels of
the input are far wider than the rest; a matrix may therefore carry a smoothing vector
(`{weight}_smooth`, a Mul before it, shared by the matrices that read the same input: the input's
channel j divided by s_j, the weight's row j multiplied by it, the product unchanged) and a
matrix may be kept in float, each as calibration chose it (`attnexport.pretrained.calibrate`).
The blockwise form is `blockwise`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport import runtimes as R
from attnexport import usage as U
from attnexport import weights as W
from attnexport.errors import UsageError
from attnexport.record import ExportRecord, as_json
from attnexport.runtimes.base import all_graphs, all_nodes

BLOCKS = (16, 32, 64, 128)
# MatMulNBits's accuracy_level: 0 computes with float activations; 4 quantizes each block of the
# activations to int8 first (ONNX Runtime's fastest CPU kernels), 1 to 3 ask for fp32/fp16/bf16
# compute, which ONNX Runtime's x86 CPU kernels treat as 0.
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
# What the minimums of an exact float-minimum grid add: the suffix of its nodes and initializers.
MINIMUMS = "_minimums"
# How a float-minimum grid's minimums are carried (the module's docstring).
MINIMUM_FORMS = ("folded", "exact", "float")
# The suffix of an input with its block sums appended, which folded grids read.
FOLDED = "_folded"
# How an int8 matrix runs (the module's docstring): MatMulNBits, or DynamicQuantizeMatMul.
KERNELS = ("blockwise", "integer")
# The integer form's ops: a MatMul's, and a packed Attention's; and where each holds its weight's
# codes and per-column scales among its inputs.
INTEGER_OPS = ("DynamicQuantizeMatMul", "QAttention")
_CODES_AND_SCALES = {"DynamicQuantizeMatMul": (1, 2), "QAttention": (1, 4)}
# The suffix of an integer matrix's smoothing vector (1 / s per input channel) and of its Mul.
SMOOTH = "_smooth"
# Groups a --keep names: the vocabulary head, the first and last decoder layer, a layer by index.
GROUP_WORDS = ("head", "first", "last")


@dataclass(frozen=True)
class Rule:
    """How one group of matrices is held: `bits` 0 keeps it in the model's float type; `accuracy`
    is MatMulNBits's accuracy_level for it."""

    bits: int
    accuracy: int


@dataclass(frozen=True)
class Plan:
    """How a model's weight matrices are quantized.

    Attributes:
        bits: the default width, 4 or 8.
        block: the block size along the input axis (16, 32, 64 or 128).
        accuracy: MatMulNBits's accuracy_level for every quantized matrix (0: float activations;
            4: int8 activations, ONNX Runtime's fastest CPU path).
        symmetric: ORT's quantizer without zero points (it is faster); a carried grid keeps its own.
        keep: {group: Rule} overrides: a group is `head`, `layer:I` (negative counts from the last).
        carry: a matrix that already holds a grid of the bits asked for is carried exactly; False
            rounds it with ONNX Runtime's quantizer like any other (no minimums to add: faster, and
            on a Q4_1 model far less accurate; verify says how much).
        minimums: how a carried grid's float minimums (Q4_1) are held, `folded`, `exact` or
            `float` (the module's docstring).
        widen: a GGUF file's tensor in a format wider than `bits` (Q5_0, Q6_K, Q8_0 at int4) is
            carried at the 8 bits that hold it, as the file mixes its widths; False rounds it to
            `bits` with ONNX Runtime's quantizer.
        kernel: int8's `blockwise` (MatMulNBits) or `integer` (DynamicQuantizeMatMul, the module's
            docstring) form; None: the family's (`registry.Family.int8_kernel`).
        calibrate: the integer form's smoothing and float matrices chosen on the family's
            calibration text (`calibrate.choose`); False quantizes every matrix as it is.
    """

    bits: int = 4
    block: int = 32
    accuracy: int = 4
    symmetric: bool = True
    keep: tuple = ()
    carry: bool = True
    minimums: str = "folded"
    widen: bool = True
    kernel: str | None = None
    calibrate: bool = True

    def rule_for(self, group: str, layers: int) -> Rule:
        rule = Rule(self.bits, self.accuracy)
        for name, r in self.keep:
            if _same_group(name, group, layers):
                rule = r
        return rule


def _same_group(name: str, group: str, layers: int) -> bool:
    if name == group:
        return True
    if name.startswith("layer:") and group.startswith("layer:"):
        i = int(name.split(":")[1])
        return (i % layers if layers else i) == int(group.split(":")[1])
    return False


def parse_keep(text: str | None, layers: int | None = None) -> tuple:
    """`--keep` as ((group, Rule), ...): comma-separated GROUP or GROUP=HOW, GROUP one of `head`,
    `first`, `last`, `layer:I` (I from 0, negative from the last), `layers:I-J`; HOW `fp32`
    (the default: not quantized), `int8`, `int4`, or either with `@0`/`@4` for the accuracy level
    (`head=int8@4`). A UsageError names what is wrong."""
    if not text:
        return ()
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, how = part.partition("=")
        bits, accuracy = _how(how or "fp32", part)
        for group in _groups(name.strip(), part):
            out.append((group, Rule(bits, accuracy if accuracy is not None else -1)))
    return tuple(out)


def _how(how: str, part: str) -> tuple[int, int | None]:
    width, _, level = how.partition("@")
    widths = {"fp32": 0, "float": 0, "int8": 8, "int4": 4}
    if width not in widths:
        raise UsageError(f"--keep {part}: after '=' comes fp32, int8 or int4 (optionally @LEVEL), got {width!r}")
    if level and (not level.isdigit() or int(level) not in ACCURACY_LEVELS):
        raise UsageError(f"--keep {part}: the accuracy level after '@' is one of "
                         f"{', '.join(map(str, ACCURACY_LEVELS))}, got {level!r}")
    return widths[width], int(level) if level else None


def _groups(name: str, part: str) -> list[str]:
    if name == "head":
        return ["head"]
    if name == "first":
        return ["layer:0"]
    if name == "last":
        return ["layer:-1"]
    m = re.fullmatch(r"layers?:(-?\d+)(?:-(-?\d+))?", name)
    if m is None:
        raise UsageError(f"--keep {part}: a group is head, first, last, layer:I or layers:I-J, got {name!r}")
    first, last = int(m.group(1)), int(m.group(2)) if m.group(2) else int(m.group(1))
    if m.group(2) and last < first:
        raise UsageError(f"--keep {part}: layers:I-J needs I <= J")
    return [f"layer:{i}" for i in range(first, last + 1)]


# --- where the weight matrices are ------------------------------------------------------------------

@dataclass
class Site:
    """One MatMul whose second input is a constant (K, N) float matrix: its node, weight, the
    parameters it holds (from the export's record: name -> the columns of the matrix it fills)
    and the group it belongs to (`layer:I`, `head`, or `other`)."""

    node: str
    weight: str
    input: str
    k: int
    n: int
    params: dict
    group: str


def sites(model: onnx.ModelProto, vocab: int | None = None, attention: bool = False) -> list[Site]:
    """Every MatMul with a constant 2-D float weight, in graph order, with the parameters the
    export's record (`attnexport.params`) places in it and its group; with `attention`, each
    com.microsoft.Attention's packed projections too (an encoder's ort flavour in fp32, which the
    integer form makes a QAttention)."""
    inits = {i.name: i for i in model.graph.initializer}
    record = ExportRecord.of(model).parsed("params", {})
    held: dict[str, dict] = {}
    for name, e in record.items():
        if e.get("initializer"):
            held.setdefault(e["initializer"], {})[name] = e.get("columns")
    out = []
    for node in model.graph.node:
        matmul = node.op_type == "MatMul" and node.domain in ("", "ai.onnx")
        packed = attention and node.op_type == "Attention" and node.domain == "com.microsoft"
        if not (matmul or packed) or len(node.input) < 2 or node.input[1] not in inits:
            continue
        w = inits[node.input[1]]
        if len(w.dims) != 2 or w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        params = held.get(node.input[1], {})
        out.append(Site(node.name, node.input[1], node.input[0], int(w.dims[0]), int(w.dims[1]), params,
                        _group(params, int(w.dims[1]), vocab)))
    return out


def _group(params: dict, n: int, vocab: int | None) -> str:
    for name in params:
        m = re.search(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.", name)  # BERT's: encoder.layer.I
        if m:
            return f"layer:{m.group(1)}"
    if vocab and n == vocab or any(re.search(r"(lm_head|embed_tokens|wte)\.weight$", p) for p in params):
        return "head"
    return "other"


# --- grids a matrix already holds -------------------------------------------------------------------

@dataclass
class Grid:
    """A (K, N) matrix as `scale * (q - zero) + minimum` per block of `block` rows and column:
    q (K, N) integers, scale and minimum (K/block, N) float32, `zero` one integer for all."""

    bits: int
    block: int
    q: np.ndarray
    scale: np.ndarray
    zero: int
    minimum: np.ndarray | None  # None: no float minimum (a symmetric grid)

    def values(self) -> np.ndarray:
        """The matrix the grid holds, in float32 as MatMulNBits computes it (the minimum added
        after)."""
        rep = np.repeat(self.scale, self.block, axis=0)
        w = rep * (self.q.astype(np.float32) - np.float32(self.zero))
        if self.minimum is not None:
            w = w + np.repeat(self.minimum, self.block, axis=0)
        return w.astype(np.float32)


def grid_of(w: np.ndarray, bits: int, block: int) -> Grid | None:
    """The block grid `w` (K, N) float32 already holds, exactly, or None: a symmetric one
    (`d * (q - 2**(bits-1))`, GGUF's Q4_0 and Q8_0) or one with a float minimum (`d * q + m`,
    Q4_1). Scales and minimums must be fp16 values, as a GGUF block stores them, and the grid must
    give back every weight bit for bit."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if k % block:
        return None
    blocks = w.reshape(k // block, block, n)
    for make in (_symmetric_grid, _minimum_grid):
        # Each block's grid is its own: where the first row of blocks is on none, the matrix is not
        # (a float matrix is turned away for a 1/(K/block) of the work).
        first = make(blocks[:1], bits)
        if first is None or not np.array_equal(first.values(), w[:block]):
            continue
        grid = make(blocks, bits)
        if grid is not None and np.array_equal(grid.values(), w):
            return grid
    return None


# The width of MatMulNBits a GGUF block format's groups take (`file_grid`): 4-bit codes for Q4's, 8
# for the 5-, 6- and 8-bit ones.
FILE_WIDTHS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q6_K": 8, "Q8_0": 8}


def file_grid(w: np.ndarray, s: Site, bits: int, tensors, widen: bool = False) -> tuple[Grid | None, str | None]:
    """(the grid of the source file's own blocks that `w` (K, N) is, or None; the file's format of
    the matrix, or None where the file has no tensor of these values). `tensors` is the GGUF file's
    (`ggml.Tensors`); each parameter the site holds (a column block of `w`, transposed: a Linear's
    weight) is looked for there by its values. A format narrower than `bits` is held in `bits` as it
    is (Q4_K at int8); one wider (Q5_0 at int4) in the 8 bits that hold it where `widen`, else it
    gives no grid."""
    parts = sorted((c for c in s.params.values() if c is not None), key=lambda c: c[0]) or [[0, s.n]]
    if parts[0][0] != 0 or parts[-1][1] != s.n or any(a[1] != b[0] for a, b in zip(parts, parts[1:], strict=False)):
        parts = [[0, s.n]]  # the columns not given whole by the record: the matrix as one
    found = []
    for a, b in parts:
        f = tensors.find(np.ascontiguousarray(w[:, a:b].T))
        if f is None:
            return None, None
        found.append(f)
    kinds = sorted({f.kind for f in found})
    kind = "+".join(kinds)
    groups = [f.groups for f in found]
    width = max(FILE_WIDTHS[k] for k in kinds)
    if width > bits and widen:
        bits = width
    if width > bits or len({g.group for g in groups}) > 1 or len({g.offset is None for g in groups}) > 1 or \
            s.k % groups[0].group:
        return None, kind
    block, zero = groups[0].group, 0 if groups[0].offset is not None else 2 ** (bits - 1)
    q = np.concatenate([(g.levels.reshape(-1, s.k).astype(np.int16) + zero).T for g in groups], axis=1)
    scale = np.concatenate([g.scale.reshape(-1, s.k // block).T for g in groups], axis=1)
    minimum = None if groups[0].offset is None else \
        np.concatenate([-g.offset.reshape(-1, s.k // block).T for g in groups], axis=1)
    grid = Grid(bits, block, np.ascontiguousarray(q.astype(np.uint8)), np.ascontiguousarray(scale, np.float32), zero,
                None if minimum is None else np.ascontiguousarray(minimum, np.float32))
    return (grid if _holds(grid, w) else None), kind


def half_rounding(grid: Grid) -> float:
    """The largest relative change of `grid`'s scales and minimums held in fp16, as a half graph's
    MatMulNBits holds them (0.0: every one is an fp16 value, a Q4_0, Q4_1 or Q8_0 block's). A
    K-quant's are not: Q4_K's scale is its super-block's fp16 scale times a 6-bit one, Q6_K's times
    an 8-bit one, so in fp16 each weight moves by at most 2**-11 of itself, the rounding an fp16 graph
    gives every float weight."""
    worst = 0.0
    for t in (grid.scale, grid.minimum):
        if t is None:
            continue
        t = np.asarray(t, np.float64)
        moved = np.abs(t.astype(np.float16).astype(np.float64) - t)
        with np.errstate(divide="ignore", invalid="ignore"):
            worst = max(worst, float(np.where(t != 0, moved / np.abs(t), moved).max(initial=0.0)))
    return worst


def _holds(grid: Grid, w: np.ndarray, columns: int = 4096) -> bool:
    """Whether `grid` gives back `w` bit for bit (compared a block of columns at a time)."""
    for a in range(0, w.shape[1], columns):
        part = Grid(grid.bits, grid.block, grid.q[:, a:a + columns], grid.scale[:, a:a + columns], grid.zero,
                    None if grid.minimum is None else grid.minimum[:, a:a + columns])
        if not np.array_equal(part.values(), w[:, a:a + columns]):
            return False
    return True


def _fp16_exact(x: np.ndarray) -> np.ndarray:
    return np.float32(x).astype(np.float16).astype(np.float32)


def _symmetric_grid(blocks: np.ndarray, bits: int) -> Grid | None:
    """q - zero in [-2**(bits-1), 2**(bits-1) - 1]: GGUF's Q4_0 takes the block's extreme as -8 steps
    (its sign gives the scale's), Q8_0 the largest magnitude as 127 steps."""
    zero = 2 ** (bits - 1)
    with np.errstate(all="ignore"):
        extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None, :], axis=1)[:, 0, :]
        scale = _fp16_exact(-extreme / zero) if bits == 4 else _fp16_exact(np.abs(extreme) / (zero - 1))
        q = np.where(scale[:, None, :] != 0, np.rint(blocks / scale[:, None, :]), 0) + zero
    if not np.isfinite(q).all() or q.min() < 0 or q.max() > 2 ** bits - 1:
        return None
    k = blocks.shape[0] * blocks.shape[1]
    return Grid(bits, blocks.shape[1], q.reshape(k, -1).astype(np.uint8), scale, zero, None)


def _minimum_grid(blocks: np.ndarray, bits: int) -> Grid | None:
    """d * q + m, q in [0, 2**bits - 1]: GGUF's Q4_1 takes the block's least value as m, and d as
    its range over 2**bits - 1 steps; both stored in fp16."""
    low = blocks.min(axis=1)
    if not np.array_equal(_fp16_exact(low), low):
        return None
    with np.errstate(all="ignore"):
        scale = _fp16_exact((blocks.max(axis=1).astype(np.float64) - low) / (2 ** bits - 1))
        q = np.where(scale[:, None, :] != 0, np.rint((blocks - low[:, None, :]) / scale[:, None, :]), 0)
    if not np.isfinite(q).all() or q.min() < 0 or q.max() > 2 ** bits - 1:
        return None
    k = blocks.shape[0] * blocks.shape[1]
    return Grid(bits, blocks.shape[1], q.reshape(k, -1).astype(np.uint8), scale, 0, low.astype(np.float32))


# --- MatMulNBits's layout ---------------------------------------------------------------------------

def pack(q: np.ndarray, bits: int, block: int) -> np.ndarray:
    """(K, N) integers in [0, 2**bits) as MatMulNBits's B: (N, K/block, block*bits/8) bytes, each
    column's blocks in order, two 4-bit values a byte with the first in the low half."""
    k, n = q.shape
    cols = np.ascontiguousarray(q.T.reshape(n, k // block, block)).astype(np.uint8)
    if bits == 8:
        return cols
    return (cols[..., 0::2] | (cols[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, bits: int, k: int, n: int, block: int) -> np.ndarray:
    """MatMulNBits's B back to (K, N) integers."""
    packed = packed.reshape(n, -1)
    if bits == 4:
        low, high = packed & 0x0F, packed >> 4
        packed = np.stack([low, high], axis=-1).reshape(n, -1)
    return np.ascontiguousarray(packed[:, :k].T)


def pack_zeros(zero: np.ndarray, bits: int) -> np.ndarray:
    """(N, K/block) integer zero points as MatMulNBits's: 4-bit ones two a byte, low half first."""
    if bits == 8:
        return zero.astype(np.uint8)
    n, blocks = zero.shape
    if blocks % 2:
        zero = np.concatenate([zero, np.zeros((n, 1), zero.dtype)], axis=1)
    return (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8)


def unpack_zeros(packed: np.ndarray, bits: int, n: int, blocks: int) -> np.ndarray:
    packed = packed.reshape(n, -1)
    if bits == 8:
        return packed[:, :blocks]
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks]


# --- quantizing a model ------------------------------------------------------------------------------

@dataclass
class Quantized:
    """What `quantize` did to each matrix (a Site's node, its group, bits, accuracy level, and how:
    `exact` (a grid it held, carried), `folded` (a float-minimum grid carried with its minimums
    folded; `fold`: the most and the rms a weight moved, in steps of its block's scale), `float` (one
    carried with float zero points; `fold` likewise), `ort` (ONNX
    Runtime's quantizer), `integer` (the integer form's DynamicQuantizeMatMul or QAttention, `op`;
    `alpha`: its smoothing's, 0 for none) or `kept` (`why`: calibration's reason, where it chose)), for the
    metadata and the report."""

    plan: Plan
    entries: list = field(default_factory=list)
    calibration: dict | None = None  # the integer form's: what calibration measured (`Calibration.table`)

    def meta(self) -> str:
        return json.dumps({"plan": {**asdict(self.plan), "keep": [[g, asdict(r)] for g, r in self.plan.keep]},
                           "matrices": self.entries,
                           **({"calibration": self.calibration} if self.calibration else {})}, sort_keys=True)

    def counts(self) -> dict:
        out: dict = {}
        for e in self.entries:
            key = "kept" if e["how"] == "kept" else f"{e['how']} {e['bits']}-bit"
            out[key] = out.get(key, 0) + 1
        return out

    def files(self) -> dict:
        """{the source file's format: {how: matrices}} of the matrices that are its tensors."""
        out: dict = {}
        for e in self.entries:
            if "file" in e:
                how = "re-quantized" if e["how"] == "ort" else "carried"
                out.setdefault(e["file"], {}).setdefault(how, 0)
                out[e["file"]][how] += 1
        return out

    def summary(self) -> str:
        total = len(self.entries)
        parts = [f"{v} {k}" for k, v in sorted(self.counts().items())]
        files = self.files()
        if files:
            said = [f"{kind} {n} {how}" for kind, hows in sorted(files.items()) for how, n in sorted(hows.items())]
            parts.append("of the file's tensors " + ", ".join(said))
        folds = [e["fold"] for e in self.entries if e["how"] == "folded"]
        if folds:
            worst = max(f["max_steps"] for f in folds)
            rms = float(np.sqrt(np.mean([f["rms_steps"] ** 2 for f in folds])))
            parts.append(f"folded weights within {worst:.2g} of a step of the model's ({rms:.2g} rms)")
        floats = [e["fold"] for e in self.entries if e["how"] == "float"]
        if floats:
            worst = max(f["max_steps"] for f in floats)
            parts.append(f"float-zero-point weights within {worst:.2g} of a step of the model's")
        smoothed = sum(1 for e in self.entries if e.get("alpha"))
        if smoothed:
            parts.append(f"{smoothed} of them smoothed")
        chosen = sum(1 for e in self.entries if e["how"] == "kept" and e.get("why"))
        if chosen:
            parts.append(f"{chosen} of the kept chosen by calibration")
        rounded = [e["scales_rounded"] for e in self.entries if e.get("scales_rounded")]
        if rounded:
            parts.append(f"{len(rounded)} carried with their scales rounded to fp16 (a K-quant's are finer; "
                         f"each at most {max(rounded):.2g} of itself)")
        return f"{total} weight matrices: " + ", ".join(parts)


@dataclass
class Calibration:
    """What calibration chose for the integer form (`calibrate.choose`): each matrix's smoothing
    (node -> (alpha, s: (K,) float64 scales, the input's channel j divided by s_j; the matrices
    that read one input hold the same array, and share its Mul)), the matrices
    kept in float (node -> why), and the measurements behind the choice (`table`, for the record)."""

    smoothing: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)
    table: dict = field(default_factory=dict)


def quantize(model: onnx.ModelProto, plan: Plan, layers: int, vocab: int | None = None,
             weights: dict | None = None, tensors=None, calibration: Calibration | None = None) -> Quantized:
    """Replaces, in place, each constant weight matrix of a MatMul by MatMulNBits as `plan` says
    for its group: carried exactly where it holds a grid of the bits asked for, else through ONNX
    Runtime's quantizer. `weights` ({initializer: (K, N) float32}) are the matrices a graph exported
    in half stands for: a grid is looked for there (an fp16 initializer is its rounding), and the
    scales are written in the graph's float type. `tensors` (a GGUF source's `ggml.Tensors`): a
    matrix that is one of the file's tensors is carried from the file's own blocks where `bits`
    hold them (`file_grid`), and its entry names the file's format. The integer form
    (`plan.kernel`) quantizes each matrix to DynamicQuantizeMatMul instead, smoothed and kept as
    `calibration` says (`_integer`). Returns what was done; `model` gets the record (the export
    record's `precision`)."""
    found = sites(model, vocab, attention=plan.kernel == "integer")
    if not found:
        raise UsageError("the model has no MatMul with a constant weight matrix: there is nothing to quantize")
    if plan.kernel == "integer":
        return _integer(model, plan, layers, found, calibration or Calibration())
    inits = {i.name: i for i in model.graph.initializer}
    done = Quantized(plan)
    by_bits: dict[int, list[Site]] = {4: [], 8: []}
    exact: list[tuple[Site, Grid]] = []
    for s in U.each(found, "quantize: reading, matrix"):
        rule = plan.rule_for(s.group, layers)
        if rule.accuracy < 0:
            rule = Rule(rule.bits, plan.accuracy)
        if rule.bits == 0:
            done.entries.append(_entry(s, 0, -1, "kept", plan.block))
            continue
        w = weights[s.weight] if weights and s.weight in weights else \
            W.values(inits[s.weight]).astype(np.float32)
        grid, kind = file_grid(w, s, rule.bits, tensors, plan.widen) if plan.carry and tensors is not None \
            else (None, None)
        if grid is not None:  # in the file's own width where that is wider than asked (`widen`)
            rule = Rule(grid.bits, rule.accuracy)
        if grid is None and plan.carry:
            grid = grid_of(w, rule.bits, plan.block)
        if grid is not None:
            exact.append((s, grid))
        else:
            by_bits[rule.bits].append(s)
        entry = _entry(s, rule.bits, rule.accuracy, "exact" if grid is not None else "ort",
                       grid.block if grid is not None else plan.block)
        if kind is not None:
            entry["file"] = kind
        if grid is not None and inits[s.weight].data_type == onnx.TensorProto.FLOAT16 and (r := half_rounding(grid)):
            entry["scales_rounded"] = r  # a half graph's scales are fp16: the file's finer ones rounded
        done.entries.append(entry)
    entries = {e["node"]: e for e in done.entries}
    with U.counted("quantize: writing, matrix", len(exact) + sum(map(len, by_bits.values()))) as advance:
        for s, grid in exact:
            if grid.minimum is not None and plan.minimums == "folded":
                entries[s.node].update(how="folded", fold=_carry_folded(model, s, grid))
            elif grid.minimum is not None and plan.minimums == "float":
                entries[s.node].update(how="float", fold=_carry_float_zeros(model, s, grid))
            else:
                _carry(model, s, grid)
            advance()
        for bits, group in by_bits.items():
            if group:
                _ort_quantize(model, group, bits, plan, advance)
    # Each matrix's MatMulNBits is named for its MatMul (`{node}_Q{bits}`, as ONNX Runtime's quantizer names it).
    levels = {f"{e['node']}_Q{e['bits']}": e["accuracy"] for e in done.entries if e["bits"]}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.name in levels:
            _set_attr(node, "accuracy_level", levels[node.name])
    _flatten(model)
    for e in done.entries:
        if e["group"] == "head" and e["how"] == "exact" and e["bits"] == 8 and _embedding_from_head(model, e):
            e["embedding"] = "gathered from this matrix's blocks"
    return _recorded(model, done)


def _recorded(model: onnx.ModelProto, done: Quantized) -> Quantized:
    """`done` written into `model`'s record once its unused float matrices are dropped and each
    quantized matrix's tensors fingerprinted."""
    _drop_unused(model)
    _fingerprint(model, done)
    record = ExportRecord.of(model)
    params = record.parsed("params")
    replace(record, precision=done.meta(),
            params=as_json(_params_record(params, done, model)) if params is not None else None).write(model)
    return done


def _integer(model: onnx.ModelProto, plan: Plan, layers: int, found: list[Site], calibration: Calibration) -> Quantized:
    """The integer form: each matrix not kept (by `plan`'s groups or by `calibration`) replaced in
    place by com.microsoft.DynamicQuantizeMatMul `{node}_Q8` (`int8_columns`: int8 per output
    column, no zero point), after a Mul by its smoothing vector where calibration chose one (its
    weight's rows multiplied by the scales before they are rounded; the matrices that read one input
    share its vector and its Mul, the entry's `smooth`)."""
    done = Quantized(plan, calibration=calibration.table or None)
    inits = {i.name: i for i in model.graph.initializer}
    chosen: dict[str, Site] = {}
    for s in found:
        if plan.rule_for(s.group, layers).bits == 0:
            done.entries.append(_entry(s, 0, -1, "kept", 0))
        elif s.node in calibration.kept:
            done.entries.append({**_entry(s, 0, -1, "kept", 0), "why": calibration.kept[s.node]})
        else:
            chosen[s.node] = s
    entries = {}
    nodes, added = [], []
    mul_of: dict[int, str] = {}  # one Mul a smoothing vector: the matrices that read one input share it
    for node in model.graph.node:
        site = chosen.get(node.name)
        if site is None:
            nodes.append(node)
            continue
        s = site
        w = W.values(inits[s.weight]).astype(np.float32)
        x = node.input[0]
        entry = {**_entry(s, 8, 0, "integer", 0), "alpha": 0.0,
                 "op": "QAttention" if node.op_type == "Attention" else "DynamicQuantizeMatMul"}
        smooth = calibration.smoothing.get(s.node)
        if smooth is not None:
            alpha, scales = smooth
            w = (w.astype(np.float64) * scales[:, None]).astype(np.float32)
            if id(scales) not in mul_of:
                inverse = numpy_helper.from_array((1 / scales).astype(np.float32), f"{s.weight}{SMOOTH}")
                added.append(inverse)
                nodes.append(helper.make_node("Mul", [x, inverse.name], [f"{node.name}{SMOOTH}"],
                                              name=f"{node.name}{SMOOTH}"))
                mul_of[id(scales)] = node.name
            first = chosen[mul_of[id(scales)]]
            x = f"{first.node}{SMOOTH}"
            entry.update(alpha=float(alpha), smooth=f"{first.weight}{SMOOTH}")
        q, scale = int8_columns(w)
        added += [numpy_helper.from_array(q, f"{s.weight}_Q8"), numpy_helper.from_array(scale, f"{s.weight}_scales")]
        if node.op_type == "Attention":  # its input quantized once, the projections and attention one kernel
            xq = f"{node.name}_Q8_input"
            nodes.append(helper.make_node("DynamicQuantizeLinear", [x], [xq, f"{xq}_scale", f"{xq}_zero_point"],
                                          name=xq))
            rest = list(node.input[2:]) + [""] * (4 - len(node.input))
            nodes.append(helper.make_node(
                "QAttention", [xq, f"{s.weight}_Q8", rest[0], f"{xq}_scale", f"{s.weight}_scales", rest[1],
                               f"{xq}_zero_point"], list(node.output), name=f"{node.name}_Q8", domain="com.microsoft",
                **{a.name: helper.get_attribute_value(a) for a in node.attribute
                   if a.name in ("num_heads", "unidirectional")}))
        else:
            nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, f"{s.weight}_Q8", f"{s.weight}_scales"],
                                          [node.output[0]], name=f"{node.name}_Q8", domain="com.microsoft"))
        entries[s.node] = entry
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(added)
    _ensure_domain(model)
    done.entries += entries.values()
    order = {s.node: i for i, s in enumerate(found)}
    done.entries.sort(key=lambda e: order[e["node"]])
    return _recorded(model, done)


def int8_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float32 -> ((K, N) int8 codes, (N,) float32 scales): each column rounded by ONNX
    Runtime's quantizer (`quant_utils.quantize_data`, symmetric int8: its largest magnitude is 127
    steps, zero point 0), as its dynamic quantizer rounds a MatMul's weight per channel."""
    from onnxruntime.quantization.quant_utils import quantize_data

    q = np.empty(w.shape, np.int8)
    scales = np.empty(w.shape[1], np.float32)
    for j in range(w.shape[1]):
        _, scale, q[:, j] = quantize_data(np.ascontiguousarray(w[:, j]), onnx.TensorProto.INT8, True)
        scales[j] = scale
    return q, scales


def _params_record(record: dict, done: Quantized, model) -> dict:
    """The export's parameter record with each parameter now held in a quantized matrix marked so
    (`quantized`: its MatMulNBits node): its sha256 stays that of its float value as exported, which
    verify compares with the source model's; the file's own tensors are checked against the
    precision record (`damaged`). A parameter the graph still reads as a float initializer elsewhere
    (the embedding of a tied head) keeps its entry."""
    still = {i for n in model.graph.node for i in n.input}
    out = dict(record)
    for e in done.entries:
        if not e["bits"]:
            continue
        for name in e["params"]:
            entry = out.get(name)
            if entry is not None and entry.get("initializer") not in still:
                out[name] = {**entry, "quantized": f"{e['node']}_Q{e['bits']}"}
    return out


def _flatten(model: onnx.ModelProto) -> None:
    """Every MatMulNBits's scales and zero points as the operator's contract has them, 1-D (N x
    blocks, and its packed bytes): ONNX Runtime's quantizer writes them (N, blocks), which its CPU
    kernel takes but onnxruntime-web 1.30's WebGPU kernel fails on ("cannot convert shape")."""
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        for name in node.input[2:4]:
            init = inits.get(name)
            if init is not None and len(init.dims) > 1:
                init.CopyFrom(numpy_helper.from_array(W.values(init).reshape(-1), init.name))


def _entry(s: Site, bits: int, accuracy: int, how: str, block: int) -> dict:
    return {"node": s.node, "weight": s.weight, "group": s.group, "k": s.k, "n": s.n, "bits": bits,
            "accuracy": accuracy, "how": how, "block": block, "params": s.params}


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _set_attr(node, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    if value:  # 0 is the attribute's default; left out as ONNX Runtime's quantizer leaves it out
        node.attribute.append(helper.make_attribute(name, value))


def _float_of(model: onnx.ModelProto, s: Site):
    """The numpy float type of the site's weight initializer: what its scales are written in."""
    w = next(i for i in model.graph.initializer if i.name == s.weight)
    return np.float16 if w.data_type == onnx.TensorProto.FLOAT16 else np.float32


def _carry(model: onnx.ModelProto, s: Site, grid: Grid) -> None:
    """The MatMul at `s` replaced by MatMulNBits holding `grid` exactly (plus the minimums' MatMul
    for a float-minimum grid)."""
    base, real = s.weight, _float_of(model, s)
    blocks = s.k // grid.block
    inits = [numpy_helper.from_array(pack(grid.q, grid.bits, grid.block), f"{base}_Q{grid.bits}"),
             numpy_helper.from_array(np.ascontiguousarray(grid.scale.T).astype(real), f"{base}_scales")]
    inputs = [s.input, inits[0].name, inits[1].name]
    if grid.minimum is not None or grid.zero != 2 ** (grid.bits - 1):
        zeros = np.full((s.n, blocks), grid.zero, np.uint8)
        inits.append(numpy_helper.from_array(pack_zeros(zeros, grid.bits), f"{base}_zero_points"))
        inputs.append(inits[-1].name)

    def build(nodes: list, out: str) -> list:
        product = f"{out}_grid" if grid.minimum is not None else out
        made = [helper.make_node("MatMulNBits", inputs, [product], name=f"{s.node}_Q{grid.bits}",
                                 domain="com.microsoft", K=s.k, N=s.n, bits=grid.bits, block_size=grid.block)]
        if grid.minimum is not None:
            minimums = numpy_helper.from_array(grid.minimum.astype(real), f"{base}{MINIMUMS}")
            inits.append(minimums)
            sums = _block_sums(model, nodes, inits, s.input, s.k, grid.block, real)
            made += [helper.make_node("MatMul", [sums, minimums.name], [f"{out}{MINIMUMS}"],
                                      name=f"{s.node}{MINIMUMS}"),
                     helper.make_node("Add", [product, f"{out}{MINIMUMS}"], [out], name=f"{s.node}{MINIMUMS}_add")]
        return made

    _replace_site(model, s, inits, build)


def _replace_site(model: onnx.ModelProto, s: Site, inits: list, build) -> None:
    """The MatMul at `s` replaced by the nodes `build(nodes before it, its output's name)` returns
    (it may add nodes shared by several sites to the ones before it), `inits` added."""
    nodes: list = []
    for i, node in enumerate(model.graph.node):
        if node.name == s.node:
            nodes += build(nodes, node.output[0])
            nodes += list(model.graph.node)[i + 1:]
            break
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(inits)
    _ensure_domain(model)


def _block_sums(model, nodes: list, inits: list, x: str, k: int, block: int, real=np.float32) -> str:
    """The name of `x`'s sums over each block of `block` values of its last axis (..., K/block), a
    MatMul by a (K, K/block) 0/1 matrix (`_summing`, one per K in the model), made once per input:
    the inputs several matrices share (a layer's gate and up projections) are summed once."""
    name = f"{x}_block_sums" if block == 32 else f"{x}_block{block}_sums"
    if not any(name in n.output for n in nodes):
        ones = _summing(model, inits, k, block, real, k // block)
        nodes.append(helper.make_node("MatMul", [x, ones], [name], name=name))
    return name


def fold_grid(grid: Grid) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A float-minimum grid's minimums folded: (zero points (K/block, N), the residual rows' codes
    (K/block, N), their scales and zero points (one per block of `block` residual rows and column),
    the part of each minimum they miss (K/block, N, float64)). The residual rows are rounded by ONNX
    Runtime's own blockwise quantizer (asymmetric, round to nearest), as any matrix attnexport does
    not carry is."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
    assert grid.minimum is not None, "only a float-minimum grid has minimums to fold"
    top = 2 ** grid.bits - 1
    d = grid.scale.astype(np.float64)
    m = grid.minimum.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(d > 0, np.clip(np.rint(-m / d), 0, top), 0)
    residual = (m + d * zero).astype(np.float32)  # within half a step of d where -m/d lies in the grid's range
    rows, n = residual.shape
    r_blocks = -(-rows // grid.block)
    padded = np.zeros((r_blocks * grid.block, n), np.float32)
    padded[:rows] = residual
    packed = np.zeros((n, r_blocks, grid.block * grid.bits // 8), np.uint8)
    r_scale = np.zeros((n, r_blocks), np.float32)
    r_zero = np.zeros((n, -(-r_blocks * grid.bits // 8)), np.uint8)
    quantize = quantize_matmul_4bits if grid.bits == 4 else quantize_matmul_8bits
    quantize(packed, padded, r_scale, r_zero, grid.block, n, r_blocks * grid.block, False)
    codes = unpack(packed, grid.bits, r_blocks * grid.block, n, grid.block)[:rows]
    r_zero = unpack_zeros(r_zero, grid.bits, n, r_blocks).T
    held = np.repeat(r_scale.T.astype(np.float64), grid.block, axis=0)[:rows] * (
        codes.astype(np.float64) - np.repeat(r_zero, grid.block, axis=0)[:rows])
    return zero.astype(np.uint8), codes, r_scale.T, r_zero, residual.astype(np.float64) - held


def _carry_folded(model: onnx.ModelProto, s: Site, grid: Grid) -> dict:
    """The MatMul at `s` replaced by MatMulNBits holding a float-minimum `grid` with its minimums
    folded (the module's docstring): it reads `x` with its block sums appended, padded to whole
    blocks (`_folded_input`).
    Returns how far the folded weights are from the grid's, in steps of each block's scale."""
    base, real = s.weight, _float_of(model, s)
    blocks = s.k // grid.block
    zero, codes, r_scale, r_zero, missed = fold_grid(grid)
    if real is np.float16:  # the residual rows' scales as the file holds them: what they miss grows by that rounding
        rounded = r_scale.astype(np.float16).astype(np.float64)
        held = np.repeat(rounded - r_scale.astype(np.float64), grid.block, axis=0)[:blocks] * (
            codes.astype(np.float64) - np.repeat(r_zero, grid.block, axis=0)[:blocks])
        missed = missed - held
    k_folded = s.k + folded_width(s.k, grid.block)
    q = np.zeros((k_folded, s.n), np.uint8)
    q[:s.k], q[s.k:s.k + blocks] = grid.q, codes  # the padding rows past them read zeros
    scales = np.concatenate([grid.scale.astype(np.float32), r_scale]).astype(real)
    zeros = np.concatenate([zero, r_zero])
    inits = [numpy_helper.from_array(pack(q, grid.bits, grid.block), f"{base}_Q{grid.bits}"),
             numpy_helper.from_array(np.ascontiguousarray(scales.T), f"{base}_scales"),
             numpy_helper.from_array(pack_zeros(np.ascontiguousarray(zeros.T), grid.bits), f"{base}_zero_points")]

    def build(nodes: list, out: str) -> list:
        folded = _folded_input(model, nodes, inits, s.input, s.k, grid.block, real)
        return [helper.make_node("MatMulNBits", [folded] + [t.name for t in inits[:3]], [out],
                                 name=f"{s.node}_Q{grid.bits}", domain="com.microsoft", K=k_folded, N=s.n,
                                 bits=grid.bits, block_size=grid.block)]

    _replace_site(model, s, inits, build)
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.abs(np.where(grid.scale > 0, missed / grid.scale.astype(np.float64), 0))
    return {"max_steps": float(steps.max()), "rms_steps": float(np.sqrt(np.mean(steps ** 2)))}


def _carry_float_zeros(model: onnx.ModelProto, s: Site, grid: Grid) -> dict:
    """The MatMul at `s` replaced by one MatMulNBits holding a float-minimum `grid` with float zero
    points, `-m / d` a block in the scales' type (the module's docstring). A block of one value
    (d = 0) is held as codes 0, scale m and zero point -1. Returns how far the held weights are from
    the grid's, in steps of each block's scale (|m| where d = 0)."""
    assert grid.minimum is not None, "only a float-minimum grid has minimums to hold"
    base, real = s.weight, _float_of(model, s)
    d = grid.scale.astype(np.float64)
    m = grid.minimum.astype(np.float64)
    flat = d == 0
    q = grid.q.copy()
    q[np.repeat(flat, grid.block, axis=0)[:s.k]] = 0
    scale = np.where(flat, m, d).astype(real)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, -1.0, grid.zero - m / np.where(flat, 1, d)).astype(real)
    inits = [numpy_helper.from_array(pack(q, grid.bits, grid.block), f"{base}_Q{grid.bits}"),
             numpy_helper.from_array(np.ascontiguousarray(scale.T), f"{base}_scales"),
             numpy_helper.from_array(np.ascontiguousarray(zero.T), f"{base}_zero_points")]

    def build(nodes: list, out: str) -> list:
        return [helper.make_node("MatMulNBits", [s.input] + [t.name for t in inits], [out],
                                 name=f"{s.node}_Q{grid.bits}", domain="com.microsoft", K=s.k, N=s.n,
                                 bits=grid.bits, block_size=grid.block)]

    _replace_site(model, s, inits, build)
    held = np.repeat(scale.astype(np.float64), grid.block, axis=0)[:s.k] * (
        q.astype(np.float64) - np.repeat(zero.astype(np.float64), grid.block, axis=0)[:s.k])
    unit = np.repeat(np.where(flat, np.abs(m), d), grid.block, axis=0)[:s.k]
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.abs(np.where(unit > 0, (held - grid.values().astype(np.float64)) / unit, 0))
    return {"max_steps": float(steps.max()), "rms_steps": float(np.sqrt(np.mean(steps ** 2)))}


def _embedding_from_head(model: onnx.ModelProto, entry: dict) -> bool:
    """A tied embedding's rows gathered from its head's 8-bit blocks instead of the float table: the
    Gather of the (D, V) table's columns and the Transpose after it become GatherBlockQuantized over
    the head's MatMulNBits data and scales, and a Reshape, where the table is exactly the head's
    grid (a GGUF's Q8_0 head carried), or in a half graph its fp16 rounding. The file loses the table
    (SmolLM2-135M's int4: 229 to 101 MiB); every row is the same float. False, and nothing changed,
    where that does not hold."""
    inits = {i.name: i for i in model.graph.initializer}
    head = _nbits_node(model, entry)
    if head is None or len(head.input) > 3 and head.input[3]:
        return False
    gather = next((n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == entry["weight"]
                   and _attr(n, "axis", 0) == 1 and entry["weight"] in inits), None)
    readers = [n for n in model.graph.node if gather is not None and gather.output[0] in n.input]
    if gather is None or len(readers) != 1 or readers[0].op_type != "Transpose" or \
            list(_attr(readers[0], "perm", [])) != [1, 2, 0] or \
            sum(entry["weight"] in n.input for n in model.graph.node) != 1:
        return False
    d, v, block = entry["k"], entry["n"], int(_attr(head, "block_size"))
    table = W.values(inits[entry["weight"]])
    held = matrix(model, entry, inits)
    # A half graph's table is the fp16 rounding of the grid, which is what the gather gives in fp16.
    if held is None or table.shape != (d, v) or not np.array_equal(held.astype(table.dtype), table):
        return False
    base = entry["weight"]
    shapes = [numpy_helper.from_array(np.array([v, d // block, 1], np.int64), f"{base}_embedding_scales_shape"),
              numpy_helper.from_array(np.array([0, 0, d], np.int64), f"{base}_embedding_shape")]
    rows = [helper.make_node("Reshape", [head.input[2], shapes[0].name], [f"{base}_embedding_scales"],
                             name=f"{base}_embedding_scales"),
            helper.make_node("GatherBlockQuantized", [head.input[1], gather.input[1], f"{base}_embedding_scales"],
                             [f"{base}_embedding_blocks"], name=f"{base}_embedding_blocks", domain="com.microsoft",
                             gather_axis=0, quantize_axis=2, block_size=block, bits=8),
            helper.make_node("Reshape", [f"{base}_embedding_blocks", shapes[1].name], [readers[0].output[0]],
                             name=f"{base}_embedding")]
    nodes = []
    for n in model.graph.node:
        if n is gather:
            nodes += rows
        elif n is not readers[0]:
            nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(shapes)
    return True


def _folded_input(model, nodes: list, inits: list, x: str, k: int, block: int, real=np.float32) -> str:
    """The name of `x` (..., K) with its sums over each block of `block` values appended, padded
    with zeros to whole blocks (..., K + `folded_width`): a MatMul by a 0/1 matrix (`_summing`,
    one per K in the whole model, so every layer's inputs of that width read the same small
    matrix from the cache) and a Concat, made once per input (the matrices that share it read
    one). Whole blocks, because onnxruntime-web 1.30's WebGPU MatMulNBits answers wrong when K is
    not a multiple of the block (the deployment-runtime test in tests/test_pretrained_accuracy.py fails on
    WebGPU without the padding)."""
    name = f"{x}{FOLDED}" if block == 32 else f"{x}_block{block}{FOLDED}"
    if any(name in n.output for n in nodes):
        return name
    ones = _summing(model, inits, k, block, real, folded_width(k, block))
    nodes += [helper.make_node("MatMul", [x, ones], [f"{name}_sums"], name=f"{name}_sums"),
              helper.make_node("Concat", [x, f"{name}_sums"], [name], name=name, axis=-1)]
    return name


def _summing(model, inits: list, k: int, block: int, real, width: int) -> str:
    """The name of the (K, `width`) float matrix whose column b is 1 on block b's rows (any
    columns past K/block 0), added to `inits` unless the model or `inits` has it already."""
    name = f"block_sums_{k}x{width}_{block}_{np.dtype(real).name}"
    if not any(i.name == name for i in [*model.graph.initializer, *inits]):
        ones = np.zeros((k, width), real)
        for b in range(k // block):
            ones[b * block:(b + 1) * block, b] = 1
        inits.append(numpy_helper.from_array(ones, name))
    return name


def folded_width(k: int, block: int) -> int:
    """How many values a folded input appends: one sum a block, padded to whole blocks."""
    return -(-(k // block) // block) * block


def _ensure_domain(model) -> None:
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _ort_quantize(model: onnx.ModelProto, group: list[Site], bits: int, plan: Plan,
                  advance=U.counted_nothing) -> None:
    """ONNX Runtime's blockwise quantization (round to nearest) of each matrix of `group`: the
    kernel its MatMulNBitsQuantizer calls (`quantize_matmul_4bits`, `_8bits`), with the same
    layout and names, run a matrix at a time on the matrix read from wherever the graph holds it
    (`weights.values`: its external data too), never on a copy of the whole model. Each MatMul is
    replaced in place by MatMulNBits `{node}_Q{bits}`; the float matrices are dropped later.
    `advance()` is called as each matrix is done (`usage.counted`)."""
    from onnxruntime.capi import _pybind_state as ort_c

    kernel = {4: ort_c.quantize_matmul_4bits, 8: ort_c.quantize_matmul_8bits}[bits]
    inits = {i.name: i for i in model.graph.initializer}
    chosen = {s.node: s for s in group}
    per_byte = 8 // bits
    nodes, added = [], []
    for node in model.graph.node:
        s = chosen.get(node.name)
        if s is None:
            nodes.append(node)
            continue
        held = W.values(inits[s.weight])
        real = np.float16 if held.dtype == np.float16 else np.float32
        k, n = held.shape
        blocks = -(-k // plan.block)
        w = np.ascontiguousarray(held, dtype=real)
        if blocks * plan.block != k:  # the last block padded with zeros, as the quantizer pads it
            w = np.pad(w, ((0, blocks * plan.block - k), (0, 0)))
        packed = np.zeros((n, blocks, -(-plan.block // per_byte)), np.uint8)
        zeros = np.zeros((n, -(-blocks // per_byte)), np.uint8)
        scales = np.zeros((n, blocks), real)
        kernel(packed, w, scales, zeros, plan.block, n, k, plan.symmetric)
        del held, w
        made = [numpy_helper.from_array(packed, f"{s.weight}_Q{bits}"),
                numpy_helper.from_array(scales, f"{s.weight}_scales")]
        if not plan.symmetric:
            made.append(numpy_helper.from_array(zeros, f"{s.weight}_zero_points"))
        added += made
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], *(t.name for t in made)], [node.output[0]],
                                      name=f"{node.name}_Q{bits}", domain="com.microsoft", K=k, N=n, bits=bits,
                                      block_size=plan.block))
        advance()
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(added)
    _ensure_domain(model)


def _drop_unused(model: onnx.ModelProto) -> None:
    used = {i for n in model.graph.node for i in n.input}
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


# --- reading a quantized model back ---------------------------------------------------------------------

def record_of(model: onnx.ModelProto) -> dict | None:
    """The record `quantize` left (the export record's `precision`), or None for a model that is not
    quantized."""
    return ExportRecord.of(model).parsed("precision")


def _nbits_node(model, entry: dict):
    """The quantized entry's node: its MatMulNBits, or the integer form's DynamicQuantizeMatMul."""
    name = f"{entry['node']}_Q{entry['bits']}"
    ops = INTEGER_OPS if entry["how"] == "integer" else ("MatMulNBits",)
    return next((n for n in model.graph.node if n.op_type in ops and n.name == name), None)


def _codes_times_scales(node, inits: dict) -> np.ndarray:
    """(K, N) float32: an integer node's weight codes, less their zero point where it has one, times
    their column's scale: the matrix its smoothed input is multiplied by."""
    codes, scales = (node.input[i] for i in _CODES_AND_SCALES[node.op_type])
    zero_at = {"DynamicQuantizeMatMul": 3, "QAttention": 7}[node.op_type]
    q = W.values(inits[codes]).astype(np.float32)
    if len(node.input) > zero_at and node.input[zero_at]:
        q = q - W.values(inits[node.input[zero_at]]).astype(np.float32).reshape(1, -1)
    return (q * W.values(inits[scales]).astype(np.float32).reshape(1, -1)).astype(np.float32)


def _integer_matrix(node, entry: dict, inits: dict) -> np.ndarray:
    """The (K, N) float32 matrix an integer entry computes with: its codes times their column's
    scale (`_codes_times_scales`), each row divided by its smoothing scale."""
    w = _codes_times_scales(node, inits)
    if entry.get("smooth"):
        w = w * W.values(inits[entry["smooth"]]).astype(np.float32)[:, None]
    return w.astype(np.float32)


def matrix(model: onnx.ModelProto, entry: dict, inits: dict | None = None) -> np.ndarray | None:
    """The (K, N) float32 matrix a quantized entry computes with, decoded from the file (its
    minimums added, or its folded residual rows spread over their blocks: `Columns`, all of its
    columns at once); None when its tensors are not in the file."""
    inits = inits if inits is not None else {i.name: i for i in model.graph.initializer}
    if entry["how"] == "integer":
        node = _nbits_node(model, entry)
        try:
            return _integer_matrix(node, entry, inits) if node is not None else None
        except KeyError:
            return None
    held = Columns.of(model, entry, inits)
    return None if held is None else np.ascontiguousarray(held.rows(0, entry["n"]).numpy().T)


class Columns:
    """A blockwise entry's matrix decoded a block of its output columns at a time, in torch:
    `rows(first, stop)` is its columns [first, stop) as (stop - first, K) float32 rows (`matrix`
    is all of them, turned), 10x faster here than NumPy's decoding of the whole matrix was; only
    the rows asked for are read and decoded. A folded grid's residual rows (past K) are spread over
    their blocks. `of` gives None for the integer form (`matrix` decodes it) and where the entry's
    tensors are not in the file."""

    def __init__(self, codes: np.ndarray, scale, zero, minimums, bits: int, block: int, k: int, stored: int):
        self.codes, self.scale, self.zero, self.minimums = codes, scale, zero, minimums
        self.bits, self.block, self.k, self.stored = bits, block, k, stored

    @classmethod
    def of(cls, model, entry: dict, inits: dict) -> Columns | None:
        import torch
        node = _nbits_node(model, entry)
        if node is None or entry["how"] == "integer" or entry["bits"] not in (4, 8):
            return None
        bits, block, k, n = entry["bits"], int(_attr(node, "block_size")), entry["k"], entry["n"]
        stored = int(_attr(node, "K", k))  # K, or K + K/block for a folded grid
        blocks = -(-stored // block)
        try:
            codes = W.values(inits[node.input[1]]).reshape(n, -1)
            scale = torch.from_numpy(W.values(inits[node.input[2]]).astype(np.float32).reshape(n, blocks))
            if len(node.input) > 3 and node.input[3] and inits[node.input[3]].data_type != onnx.TensorProto.UINT8:
                zero = torch.from_numpy(W.values(inits[node.input[3]]).astype(np.float32).reshape(n, blocks))
            elif len(node.input) > 3 and node.input[3]:
                zero = torch.from_numpy(unpack_zeros(W.values(inits[node.input[3]]), bits, n, blocks)
                                        .astype(np.float32))
            else:
                zero = torch.full((n, blocks), 2.0 ** (bits - 1))
            held = inits.get(f"{entry['weight']}{MINIMUMS}")
            minimums = torch.from_numpy(W.values(held).astype(np.float32).T.copy()) if held is not None else None
        except KeyError:
            return None
        return cls(codes, scale, zero, minimums, bits, block, k, stored)

    def _from_zero(self, first: int, stop: int):
        """q - zero of columns [first, stop), (stop - first, blocks, block) float32."""
        import torch
        packed = torch.from_numpy(np.array(self.codes[first:stop]))  # read from the mapped file
        if self.bits == 4:
            packed = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(stop - first, -1)
        blocks = self.scale.shape[1]
        q = packed[:, :blocks * self.block].reshape(stop - first, blocks, self.block).float()
        return q - self.zero[first:stop, :, None]

    def rows(self, first: int, stop: int):
        w = self._from_zero(first, stop).mul_(self.scale[first:stop, :, None])
        w = w.reshape(stop - first, -1)[:, :self.stored]
        if self.stored > self.k:  # each row past K is a block's residual, multiplied by the sum of its inputs
            w = w[:, :self.k] + w[:, self.k:self.k + self.k // self.block].repeat_interleave(self.block, dim=1)
        if self.minimums is not None:  # (N, blocks): each block's minimum over its K rows
            w = w + self.minimums[first:stop].repeat_interleave(self.block, dim=1)[:, :self.k]
        return w

    def fp16_allowance(self, first: int, stop: int):
        """How far each weight of columns [first, stop) may be from the grid it was carried from where
        that grid's scales and minimums were rounded to fp16 (a K-quant's in a half graph:
        `half_rounding`), (stop - first, K) float64: a scale moves by at most 2**-11 of the fp16 value
        it became (2**-25 below fp16's normal range), times the weight's own distance from its zero
        point in codes; a minimum by as much of itself. A folded grid's residual rows are not counted
        here (their own allowance is `unfaithful`'s)."""
        def moved(t):
            return t.double().abs_().mul_(2.0 ** -11).add_(2.0 ** -25)
        reach = self._from_zero(first, stop).abs_().double()
        blocks = self.k // self.block if self.stored > self.k else self.scale.shape[1]
        allow = reach[:, :blocks].mul_(moved(self.scale[first:stop, :blocks])[:, :, None])
        allow = allow.reshape(stop - first, -1)[:, :self.k]
        if self.minimums is not None:
            allow = allow + moved(self.minimums[first:stop]).repeat_interleave(self.block, dim=1)[:, :self.k]
        return allow


def _residual_steps(model, entry: dict, inits: dict) -> np.ndarray:
    """(K, N): the scale of the residual block a folded entry's weight takes its residual from."""
    node = _nbits_node(model, entry)
    block, k, n = entry["block"], entry["k"], entry["n"]
    blocks = int(_attr(node, "K")) // block
    scale = W.values(inits[node.input[2]]).astype(np.float64).reshape(n, blocks).T
    per_row = np.repeat(scale[k // block:], block, axis=0)[:k // block]  # residual row b -> its block's scale
    return np.repeat(per_row, block, axis=0)


def _rounding_of(model, entry: dict, inits: dict) -> np.ndarray:
    """(K, N): how far each weight of an entry carried with its scales rounded to fp16 may be from
    the file's (`Columns.fp16_allowance`; bounded by fp16's own rounding, not by the record's figure)."""
    held = Columns.of(model, entry, inits)
    if held is None:
        return np.zeros((entry["k"], entry["n"]))
    return held.fp16_allowance(0, entry["n"]).numpy().T


def _tensors_of(model, entry: dict) -> list[str]:
    node = _nbits_node(model, entry)
    if node is not None and entry["how"] == "integer":  # its codes, scales and smoothing vector
        return [node.input[i] for i in _CODES_AND_SCALES[node.op_type]] + \
            ([entry["smooth"]] if entry.get("smooth") else [])
    names = [i for i in node.input[1:] if i] if node is not None else []
    if node is not None and entry["how"] == "folded":  # the 0/1 matrix that sums its input's blocks
        names += [n.input[1] for n in model.graph.node if n.output and n.output[0] == f"{node.input[0]}_sums"]
    return names + ([f"{entry['weight']}{MINIMUMS}"] if entry["how"] == "exact" and
                    any(i.name == f"{entry['weight']}{MINIMUMS}" for i in model.graph.initializer) else [])


def _digest(model, names: list[str], inits: dict) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode())
        h.update(W.values(inits[name]).tobytes())
    return h.hexdigest()


def _fingerprint(model, done: Quantized) -> None:
    inits = {i.name: i for i in model.graph.initializer}
    for e in done.entries:
        if e["bits"]:
            e["tensors"] = _tensors_of(model, e)
            e["sha256"] = _digest(model, e["tensors"], inits)


def fingerprint(model: onnx.ModelProto) -> None:
    """The record's sha256 of every quantized matrix computed again from the file's tensors, for a
    tool that edits a quantized model on purpose (verify then judges the edit by its weights and
    its accuracy, not as damage)."""
    record = record_of(model)
    if record is None:
        raise UsageError("the model is not quantized by attnexport (no attnexport.precision record)")
    inits = {i.name: i for i in model.graph.initializer}
    for e in record["matrices"]:
        if e["bits"]:
            e["sha256"] = _digest(model, e["tensors"], inits)
    replace(ExportRecord.of(model), precision=as_json(record)).write(model)


def damaged(model: onnx.ModelProto, record: dict | None = None) -> list[str]:
    """The quantized matrices whose tensors differ from the sha256 recorded when they were made
    (or are gone), by node."""
    record = record if record is not None else record_of(model)
    if not record:
        return []
    inits = {i.name: i for i in model.graph.initializer}
    bad = []
    for e in record["matrices"]:
        if not e["bits"]:
            continue
        if any(t not in inits for t in e.get("tensors", [])) or _digest(model, e["tensors"], inits) != e["sha256"]:
            bad.append(e["node"])
    return bad


def dequantized_params(model: onnx.ModelProto, record: dict | None = None) -> dict[str, np.ndarray]:
    """{parameter name: the float32 value the file computes with} for every parameter held in a
    quantized matrix, in the module's layout ((out, in), as torch's Linear holds it)."""
    record = record if record is not None else record_of(model)
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for e in record["matrices"] if record else []:
        if not e["bits"]:
            continue
        w = matrix(model, e, inits)
        if w is None:
            continue
        for name, columns in e["params"].items():
            block = w if columns is None else w[:, columns[0]:columns[1]]
            out[name] = np.ascontiguousarray(block.T)
    return out


# --- what a precision means by default, and the checks of a quantized export -------------------------

@dataclass(frozen=True)
class Precision:
    """One `--precision`: the bits of its quantized weight matrices (0: float weights as exported),
    the float type of its graph (its activations and caches), and the plan its quantization starts
    from. Which runtimes run it follows from its ops (`runtimes.missing_ops`: MatMulNBits' widths
    are each runtime's line in the registry)."""

    name: str
    bits: int
    activations: str
    plan: Plan | None = None


# The plans `--precision int8|int4` start from (docs/quantization.md has the measurements behind
# them): blocks of 32 along the input axis, int8 activations (accuracy level 4, ONNX Runtime's
# fastest CPU kernels), zero points (ORT's asymmetric quantizer is the more accurate), and for int4
# the vocabulary head at 8 bits: on SmolLM2-135M it is, with the last layer, the group that costs
# most when quantized alone. q4f16 is int4's weights in a graph exported in half (what GPUs run:
# ONNX Runtime's CUDA provider has no fp32 GroupQueryAttention).
_INT4 = Plan(bits=4, block=32, accuracy=4, symmetric=False, keep=(("head", Rule(8, -1)),))
TABLE = {p.name: p for p in (
    Precision("fp32", 0, "fp32"),
    Precision("fp16", 0, "fp16"),
    Precision("int8", 8, "fp32", Plan(bits=8, block=32, accuracy=4, symmetric=False)),
    Precision("int4", 4, "fp32", _INT4),
    Precision("q4f16", 4, "fp16", _INT4),
)}
PRECISIONS = tuple(TABLE)
QUANTIZED = tuple(name for name, p in TABLE.items() if p.bits)


def plan_for(precision: str, block: int | None = None, accuracy: int | None = None, keep: str | None = None,
             symmetric: bool | None = None, carry: bool | None = None, minimums: str | None = None,
             widen: bool | None = None, kernel: str | None = None) -> Plan:
    """The plan of `--precision` with `--block-size`, `--accuracy-level`, `--keep`, `--symmetric`,
    `--requantize`, `--minimums`, `--file-widths/--asked-width` and `--int8-kernel` applied; a
    UsageError names a bad value. The options of MatMulNBits's blocks (`--block-size`,
    `--accuracy-level`, `--symmetric`, `--minimums`) choose the blockwise form where `--int8-kernel`
    is not given, and are refused beside `--int8-kernel integer`."""
    blockwise = {"--block-size": block, "--accuracy-level": accuracy, "--symmetric/--asymmetric": symmetric,
                 "--minimums": minimums}
    given = [k for k, v in blockwise.items() if v is not None]
    if kernel is not None and kernel not in KERNELS:
        raise UsageError(f"--int8-kernel is one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "integer" and precision != "int8":
        raise UsageError(f"--int8-kernel integer goes with --precision int8 (DynamicQuantizeMatMul holds 8 bits), "
                         f"not {precision}")
    if kernel == "integer" and given:
        raise UsageError(f"{', '.join(given)} set MatMulNBits's blocks: they go with --int8-kernel blockwise, "
                         "not integer (one int8 scale per output column)")
    if kernel is None and given:
        kernel = "blockwise"
    if precision not in QUANTIZED:
        raise UsageError(f"--precision {precision} quantizes nothing: --block-size, --accuracy-level, --keep, "
                         f"--symmetric and --requantize go with {' or '.join(QUANTIZED)}")
    base = TABLE[precision].plan
    assert base is not None  # a quantized precision's
    if block is not None and block not in BLOCKS:
        raise UsageError(f"--block-size is one of {', '.join(map(str, BLOCKS))}, got {block}")
    if accuracy is not None and accuracy not in ACCURACY_LEVELS:
        raise UsageError(f"--accuracy-level is one of {', '.join(map(str, ACCURACY_LEVELS))}, got {accuracy}")
    if minimums is not None and minimums not in MINIMUM_FORMS:
        raise UsageError(f"--minimums is one of {', '.join(MINIMUM_FORMS)}, got {minimums!r}")
    return Plan(bits=base.bits, block=block or base.block, accuracy=base.accuracy if accuracy is None else accuracy,
                symmetric=base.symmetric if symmetric is None else symmetric,
                keep=base.keep if keep is None else parse_keep(keep), carry=base.carry if carry is None else carry,
                minimums=minimums or base.minimums, widen=base.widen if widen is None else widen,
                kernel=kernel if kernel is not None else base.kernel)


def unfaithful(before: dict, model: onnx.ModelProto, record: dict | None = None) -> list[str]:
    """The quantized matrices that are not a quantization of the float matrices they replaced
    (`before`: {weight initializer: (K, N) array}): a carried grid must give back every weight bit
    for bit, a folded one every weight within half a step of its residual block's scale, ONNX
    Runtime's rounding every weight within one step of its block's scale, an integer entry's
    within half a step of its column's (over its row's smoothing scale). Scales held in fp16 (a
    q4f16 graph) add their own rounding: a folded residual's, and that of the fp16 matrix ONNX
    Runtime rounded. Each problem in a few words, by node."""
    record = record if record is not None else record_of(model)
    inits = {i.name: i for i in model.graph.initializer}
    bad = []
    for e in record["matrices"] if record else []:
        if not e["bits"]:
            continue
        if e["how"] in ("ort", "exact"):  # a block of columns at a time, never the whole matrix decoded
            held = Columns.of(model, e, inits) if e["weight"] in before else None
            problem = _unfaithful_by_columns(e, before, held, inits[_nbits_node(model, e).input[2]]) \
                if held is not None else f"{e['node']}: its tensors are missing"
            if problem:
                bad.append(problem)
            continue
        w, got = before.get(e["weight"]), matrix(model, e, inits)
        if w is None or got is None:
            bad.append(f"{e['node']}: its tensors are missing")
            continue
        err = np.abs(got.astype(np.float64) - w)
        node = _nbits_node(model, e)
        half = inits[node.input[2]].data_type == onnx.TensorProto.FLOAT16
        if e["how"] == "folded":
            # half a residual step (and fp16's rounding of its scale, times at most 16 codes), and
            # float32's rounding of the two terms the file adds
            residual = (0.5 + (16 * np.finfo(np.float16).eps if half else 0)) * _residual_steps(model, e, inits)
            if half and e.get("scales_rounded"):  # and the grid's own scales' rounding to fp16, times its codes
                residual = residual + _rounding_of(model, e, inits)
            over = _outside(err, residual, w, got)
            if over is not None:
                bad.append(f"{e['node']}: folded, but {over} weight(s) more than half a residual step "
                           f"from the float weight (max error {err.max():.3g})")
            continue
        if e["how"] == "float":
            # the zero point's rounding to the scales' type, times the scale, and float32's rounding
            # of the product the file computes
            scale = W.values(inits[node.input[2]]).astype(np.float64).reshape(e["n"], -1).T
            zero = W.values(inits[node.input[3]]).astype(np.float64).reshape(e["n"], -1).T
            eps = np.finfo(np.float16 if half else np.float32).eps
            spread = np.repeat(np.abs(scale) * (np.abs(zero) + 1) * eps, e["block"], axis=0)[:e["k"]]
            if half and e.get("scales_rounded"):  # and the grid's own scales' rounding to fp16, times its codes
                spread = spread + _rounding_of(model, e, inits)
            over = _outside(err, spread, w, got)
            if over is not None:
                bad.append(f"{e['node']}: float zero points, but {over} weight(s) further from the "
                           f"float weight than the zero point's rounding (max error {err.max():.3g})")
            continue
        if e["how"] == "integer":
            # half a step of its column's scale, divided by the row's smoothing scale (ONNX Runtime's
            # rounding to nearest of the smoothed weight), and float32's rounding
            scale = np.abs(W.values(inits[node.input[_CODES_AND_SCALES[node.op_type][1]]]).astype(np.float64))
            scale = scale.reshape(1, -1)
            rows = np.abs(W.values(inits[e["smooth"]]).astype(np.float64))[:, None] if e.get("smooth") else 1.0
            over = _outside(err, 0.5 * scale * rows * (1 + 1e-6), w, got)
            if over is not None:
                bad.append(f"{e['node']}: {over} weight(s) more than half a step of their column's scale from "
                           f"the float weight (max error {err.max():.3g})")
            continue
        bad.append(f"{e['node']}: recorded as quantized in a way attnexport does not write ({e['how']!r})")
    return bad


def _unfaithful_by_columns(e: dict, before: Mapping, held: Columns, scales) -> str | None:
    """`unfaithful`'s finding for an entry carried exactly or rounded by ONNX Runtime, its matrix
    decoded and compared a block of output columns at a time (`Columns`; the float matrix's columns
    read as rows of its parameters where `before` can give them: `rows(weight, first, stop)`), in
    torch, in float64, each block's largest error against its step first (the weights counted only
    in a block over it). A block's temporaries are 4 MB: at 8 MB the allocator took them from the
    kernel each time, and every float64 forward of the check after it ran at half speed (1.07B int4:
    the faithfulness check 2.4 s where NumPy's took 5.6, the forwards after it 8.7 s, 17.1 at 8 MB)."""
    import torch
    half = scales.data_type == onnx.TensorProto.FLOAT16
    blocks = -(-e["k"] // e["block"])
    rounded = half and e["how"] == "exact" and bool(e.get("scales_rounded"))  # a K-quant's scales in fp16
    scale = torch.from_numpy(np.abs(W.values(scales).reshape(e["n"], blocks)).astype(np.float64)) \
        if e["how"] == "ort" else None
    rows_of = getattr(before, "rows", None)
    step = max(1, (1 << 19) // e["k"])
    over = 0
    worst = 0.0
    finite = True
    for a in range(0, e["n"], step):
        b = min(e["n"], a + step)
        w = torch.from_numpy(np.asarray(rows_of(e["weight"], a, b) if rows_of is not None
                                        else np.asarray(before[e["weight"]])[:, a:b].T))
        got = held.rows(a, b)
        err = got.double().sub_(w).abs_()
        # each block's largest error (a padded last block's missing rows count as none): a NaN or an
        # infinity in a block shows there
        peak = torch.nn.functional.pad(err, (0, blocks * e["block"] - e["k"])).view(b - a, blocks, -1).amax(-1)
        top = float(peak.max()) if peak.numel() else 0.0
        worst = top if np.isnan(top) or top > worst else worst  # a NaN is said, not lost in max()
        finite = finite and bool(torch.isfinite(peak).all())
        if rounded:  # within the scales' rounding (and float32's of the product) or not carried
            limit = held.fp16_allowance(a, b).add_(w.double().abs().mul_(float(8 * np.finfo(np.float32).eps)))
            over += int((err > limit).sum())
            continue
        if scale is None:
            over += int((err > 0).sum()) if bool((peak > 0).any()) else 0
            continue
        steps = scale[a:b] * (1 + 1e-6) + 1e-12
        if not half and not bool((peak > steps).any()):  # every block within its step: no weight is over
            continue
        limit = steps.repeat_interleave(e["block"], dim=1)[:, :e["k"]]
        if half:  # the fp16 matrix it was given
            limit.add_(w.double().abs_().mul_(float(np.finfo(np.float16).eps)))
        over += int((err > limit).sum())
    if scale is None:
        said = " beyond their scales' rounding to fp16" if rounded else ""
        return (f"{e['node']}: carried as exact but {over} weight(s) differ{said} (max {worst:.3g})"
                if over or not finite else None)
    if over or not finite:
        return (f"{e['node']}: {over} weight(s) more than one step of their block's scale from the float weight "
                f"(max error {worst:.3g})")
    return None


def _outside(err: np.ndarray, margin: np.ndarray, w: np.ndarray, got: np.ndarray) -> int | None:
    """How many weights are further from the float ones than `margin` plus float32's rounding of the
    two terms the file adds, or None when none is and every weight is finite."""
    over = err > margin + 8 * np.finfo(np.float32).eps * (np.abs(w) + np.abs(got))
    return int(over.sum()) if over.any() or not np.isfinite(got).all() else None


def float_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a quantized model with every MatMulNBits at accuracy level 0 (float activations) and
    every DynamicQuantizeMatMul a MatMul by its decoded weights (in an If's branches too): it
    computes with exactly the weights the file holds, so it is checked against them in float64 with
    fp32's budget."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)

    for node in all_nodes(twin.graph):
        if node.op_type == "MatMulNBits":
            _set_attr(node, "accuracy_level", 0)
    graphs = list(all_graphs(twin.graph))
    inits = {i.name: i for g in graphs for i in g.initializer}
    for graph in reversed(graphs):  # a branch before the graph that holds it (rewriting a graph copies its nodes)
        _float_integer(graph, inits, twin.graph)
    return twin


def _float_integer(graph, inits: dict, top) -> None:
    """Each DynamicQuantizeMatMul of `graph` as a MatMul by its weights decoded (its codes times
    their column's scale, in float32, as a float initializer of `top`, the model's graph: a
    DequantizeLinear before a MatMul is what ONNX Runtime's optimizer fuses into integer kernels),
    each QAttention as the Attention it was, reading the float input its DynamicQuantizeLinear read:
    the same weights, float activations."""
    quantizing = {n.output[0]: n for n in graph.node if n.op_type == "DynamicQuantizeLinear"}
    read = {n.input[0] for n in graph.node if n.op_type == "QAttention"}
    names = {i.name for i in top.initializer}
    made: dict[tuple, str] = {}  # (codes, scales, zero point) -> the float initializer decoded from them

    def decoded(node) -> str:
        key = tuple(node.input[1:])
        if key not in made:
            name = f"{node.input[1]}_decoded"
            while name in names:
                name += "_"
            top.initializer.append(numpy_helper.from_array(_codes_times_scales(node, inits), name))
            names.add(name)
            made[key] = name
        return made[key]

    nodes = []
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear" and node.output[0] in read:
            continue  # its QAttention reads the float input instead
        if node.op_type == "QAttention":
            x = quantizing[node.input[0]].input[0]
            mask = node.input[5] if len(node.input) > 5 else ""
            nodes.append(helper.make_node("Attention", [x, decoded(node), node.input[2]] + ([mask] if mask else []),
                                          list(node.output), name=f"{node.name}_float", domain="com.microsoft",
                                          **{a.name: helper.get_attribute_value(a) for a in node.attribute}))
            continue
        if node.op_type != "DynamicQuantizeMatMul":
            nodes.append(node)
            continue
        out = node.output[0] if len(node.input) < 5 or not node.input[4] else f"{node.name}_unbiased"
        nodes.append(helper.make_node("MatMul", [node.input[0], decoded(node)], [out], name=f"{node.name}_float"))
        if out != node.output[0]:
            nodes.append(helper.make_node("Add", [out, node.input[4]], [node.output[0]], name=f"{node.name}_bias"))
    del graph.node[:]
    graph.node.extend(nodes)


# --- which runtimes run a model of a precision ---------------------------------------------------

def precision_name(model, quantized) -> str:
    """A model's precision as reports name it: int4/int8 (`quantized`: its record), else its dtype."""
    if quantized is not None:
        return f"int{quantized['plan']['bits']}"
    return ExportRecord.of(model).dtype


def able_runtimes(model, used: list, table: list, requested: list | None, quantized) -> tuple[list, list]:
    """The runtimes that can run `model`'s ops (`used`, `table`: `runtimes.select`'s; `requested`: the
    runtimes named with --runtimes, or None): one named that cannot is a
    UsageError naming the ops it lacks; one taken by default is left out, the table saying why.
    torch runs the source model, which a quantized model's cost is measured against: not a runtime of it
    (an fp16 model's torch row is the model in torch's fp16)."""
    kind = precision_name(model, quantized)
    keep, out = [], []
    for row in table:
        name = row["name"]
        missing = R.missing_ops(name, model) if name in used else []
        why = None
        if missing:
            why = f"{name} cannot run this {kind} model: it has no {', '.join(missing)}"
            if requested is not None:
                can = [r for r in R.ONNX_RUNTIMES if not R.missing_ops(r, model)]
                raise UsageError(f"{why} (runtimes that can: {', '.join(can)})")
        elif R.runs_module(name) and R.REGISTRY[name].device != "cpu" and name in used:
            why = (f"{name}: the model in torch is this check's reference, run on the CPU beside its float64 "
                   "copy; the export's own rows on the GPU are ort-cuda's")
            if requested is not None and name in requested:
                raise UsageError(why)
        elif R.runs_module(name) and quantized is not None and name in used:
            why = "torch runs the source model, which this quantized model's cost is measured against"
        if why is not None:
            out.append({**row, "used": False, "reason": why})
            continue
        out.append(row)
        if name in used:
            keep.append(name)
    if not keep:
        raise UsageError(f"no runtime selected can run this {kind} model")
    return keep, out
