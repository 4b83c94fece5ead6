"""transformers' model computing as a quantized file does: each Linear's weight the value the
file's matrix holds, and its input rounded to int8 where the file's MatMulNBits round it (accuracy
level 4), or to uint8 per tensor where its DynamicQuantizeMatMul does (`per_tensor_uint8`); the
model made so (`file_model`), which a quantized graph is checked against, and each of its groups of
matrices alone (`each_group_alone`), from which what each layer costs is measured."""

from __future__ import annotations

import contextlib

import numpy as np

from attnexport import usage as U
from attnexport import weights as W
from attnexport.pretrained import precision as P


def _module_name(param: str) -> str:
    """A recorded parameter's module in transformers' model: the export's wrapper adds `model.`."""
    name = param[len("model."):] if param.startswith("model.") else param
    return name.rsplit(".", 1)[0]


def _int8_blocks(block: int):
    """A forward pre-hook that rounds a Linear's input as MatMulNBits's accuracy level 4 does: each
    block of `block` values of the last axis to int8 steps of its largest magnitude over 127."""
    import torch

    def hook(module, args):
        x = args[0]
        k = x.shape[-1]
        if k % block:
            return None
        b = x.reshape(*x.shape[:-1], k // block, block)
        scale = b.abs().amax(dim=-1, keepdim=True) / 127
        q = torch.where(scale > 0, torch.round(b / torch.where(scale > 0, scale, 1)), 0) * scale
        return (q.reshape(x.shape),) + tuple(args[1:])
    return hook


def per_tensor_uint8(x):
    """`x` (a torch tensor) as com.microsoft.DynamicQuantizeMatMul reads it: ONNX's
    DynamicQuantizeLinear of the whole tensor (the range [min(x, 0), max(x, 0)] in 255 steps, the
    zero point rounded, each value rounded half to even), given back in float."""
    import torch

    lo, hi = torch.clamp(x.min(), max=0), torch.clamp(x.max(), min=0)
    scale = (hi - lo) / 255
    if float(scale) == 0:
        return torch.zeros_like(x)
    zero = torch.clamp(torch.round(-lo / scale), 0, 255)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def _uint8_smoothed(smooth):
    """A forward pre-hook that rounds a Linear's input as an integer entry's DynamicQuantizeMatMul
    does: divided by its smoothing scales (`smooth`: 1 / s per channel, or None), per tensor to
    uint8, and multiplied back (the Linear's weight is the file's matrix, the scales folded in)."""
    import torch

    inverse = torch.from_numpy(np.array(smooth, np.float32)) if smooth is not None else None

    def hook(module, args):
        x = args[0]
        if inverse is None:
            return (per_tensor_uint8(x),) + tuple(args[1:])
        inv = inverse.to(x.dtype)
        return (per_tensor_uint8(x * inv) / inv,) + tuple(args[1:])
    return hook


def _substitute(model, onnx_model, groups: set | None) -> tuple[list, list]:
    """Sets the weights of `model`'s Linear layers held in the quantized matrices of `groups` (all
    when None) to the values the file computes with. Returns (the (module, weight) pairs replaced,
    the matrices' records)."""
    import torch

    record = P.record_of(onnx_model)
    if record is None:
        return [], []
    entries = [e for e in record["matrices"] if e["bits"] and (groups is None or e["group"] in groups)]
    values = P.dequantized_params(onnx_model, {**record, "matrices": entries})
    modules = dict(model.named_modules())
    saved = []
    for name, value in values.items():
        owner = modules.get(_module_name(name))
        if owner is None or not isinstance(owner, torch.nn.Linear):
            continue  # the input embedding of a tied head: the file gathers the float table
        saved.append((owner, owner.weight))
        owner.weight = torch.nn.Parameter(torch.from_numpy(value).to(owner.weight.dtype), requires_grad=False)
    return saved, entries


@contextlib.contextmanager
def as_file_holds(model, onnx_model, groups: set | None = None, activations: bool = True):
    """Within the block `model` (transformers', fp32) computes with the weights the quantized
    `onnx_model` holds, for the matrices of `groups` (all when None), and rounds those matrices'
    inputs where the file's kernels do if `activations` (MatMulNBits at accuracy level 4: int8
    blocks; DynamicQuantizeMatMul: uint8 per tensor, after its smoothing); restored
    after. A tied head gets its own copy (the embedding keeps reading the float table, as the
    file's Gather does)."""
    import torch
    saved, entries = _substitute(model, onnx_model, groups)
    modules = dict(model.named_modules())
    hooks = []
    try:
        if activations:
            inits = {i.name: i for i in onnx_model.graph.initializer}
            for e in entries:
                if e["how"] == "integer":
                    hook = _uint8_smoothed(W.values(inits[e["smooth"]]) if e.get("smooth") else None)
                elif e["accuracy"] == 4:
                    hook = _int8_blocks(e["block"])
                else:
                    continue
                for name in dict.fromkeys(_module_name(p) for p in e["params"]):
                    owner = modules.get(name)
                    if isinstance(owner, torch.nn.Linear):
                        hooks.append(owner.register_forward_pre_hook(hook))
        yield model
    finally:
        for h in hooks:
            h.remove()
        for owner, weight in saved:
            owner.weight = weight


def each_group_alone(model, onnx_model):
    """Each group of the file's quantized matrices (`layer:I`, `head`), yielded while `model`
    computes with that group alone as the file holds it (`as_file_holds`), under no_grad."""
    import torch

    record = P.record_of(onnx_model)
    if record is None:
        return
    groups = list(dict.fromkeys(e["group"] for e in record["matrices"] if e["bits"]))
    for group in U.each(groups, "each layer quantized alone"):
        with as_file_holds(model, onnx_model, {group}), torch.no_grad():
            yield group


def file_model(model, onnx_model):
    """A copy of transformers' `model` computing with the weights the quantized `onnx_model` holds
    (float activations): the model the file's weights make, which its graph is checked against."""
    import copy
    held = copy.deepcopy(model)
    _substitute(held, onnx_model, None)
    return held


# The values `decoding_from_file` decodes at a time (float32): a block of a matrix's output columns.
# Small enough that every temporary of a block (the float32 values, their float64 cast: 4 MiB) comes
# back from the allocator's heap: a block of 1 << 22 values made fresh 16 and 32 MiB tensors, which
# the allocator maps from the kernel each time, and decoding ran at 80M values a second here against
# 310M at 1 << 19 (an 8192 x 2048 int4 matrix decoded and applied in float64).
DECODED_ELEMENTS = 1 << 19


@contextlib.contextmanager
def decoding_from_file(model, onnx_model):
    """Within the block each Linear of `model` held in one of the quantized `onnx_model`'s matrices
    computes with the values the file holds, decoded from the file's blocks each time its forward
    runs (in the input's float type: float64 within the float64 reference, exactly the file's
    values): `file_model` without its copy of the model or of the decoded weights, one matrix
    decoded at a time (a block of its columns at a time where `precision.Columns` can), so a whole
    model is checked against its file in about the memory of the model. The model's own weights
    are left as they are; the forwards are put back after."""
    import torch

    record = P.record_of(onnx_model)
    inits = {i.name: i for i in onnx_model.graph.initializer}
    modules = dict(model.named_modules())
    patched = []

    def decoding(owner, entry: dict, columns):
        first, stop = columns if columns is not None else (0, entry["n"])
        step = max(1, DECODED_ELEMENTS // entry["k"])

        def forward(x):
            held = P.Columns.of(onnx_model, entry, inits)  # its scales read now: none held between calls
            if held is None:  # the integer form: decoded whole
                w = P.matrix(onnx_model, entry, inits)  # (K, N) float32: the module's (in, out)
                out = x @ torch.from_numpy(np.ascontiguousarray(w[:, first:stop])).to(x.dtype)
            else:  # the module's own columns only, a block at a time, each decoded, cast and used
                out = x.new_empty((*x.shape[:-1], stop - first))
                for a in range(first, stop, step):
                    b = min(stop, a + step)
                    out[..., a - first:b - first] = x @ held.rows(a, b).to(x.dtype).T
            return out + owner.bias.to(x.dtype) if owner.bias is not None else out
        return forward

    try:
        for e in record["matrices"] if record else []:
            if not e["bits"]:
                continue
            for name, columns in e["params"].items():
                owner = modules.get(_module_name(name))
                if isinstance(owner, torch.nn.Linear) and "forward" not in vars(owner):
                    owner.forward = decoding(owner, e, columns)
                    patched.append(owner)
        yield model
    finally:
        for owner in patched:
            del owner.forward
