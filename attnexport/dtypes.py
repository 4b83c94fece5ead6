"""The dtypes attnexport runs in, and what each is called by NumPy, torch and ONNX: one place."""

from __future__ import annotations

import numpy as np
import onnx

from attnexport.errors import UsageError

DTYPES = ("fp32", "fp16")
NUMPY = {"fp32": np.float32, "fp16": np.float16}
ONNX = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16}
ITEMSIZE = {"fp32": 4, "fp16": 2}


def check(dtype: str) -> str:
    """A dtype name, checked: an unknown one is a UsageError listing the valid ones."""
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return dtype


def help_text() -> str:
    return " | ".join(DTYPES)


def torch_dtype(dtype: str):
    """torch's dtype for `dtype` (torch is imported only when asked)."""
    import torch
    return {"fp32": torch.float32, "fp16": torch.float16}[dtype]


def cast_floats(arrays: dict, dtype: str) -> dict:
    """Float arrays cast to `dtype`; bool and integer arrays (masks, lengths) kept as they are."""
    np_dtype = NUMPY[dtype]
    return {k: (a.astype(np_dtype) if a.dtype.kind == "f" else a) for k, a in arrays.items()}
