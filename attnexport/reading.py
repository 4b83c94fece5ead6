"""Reads an ONNX file safely and describes it: opsets, IR, inputs/outputs, ops, attnexport metadata."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from attnexport.errors import UsageError, first_line
from attnexport.export import attention_op_of

_ELEM = {v: k for k, v in onnx.TensorProto.DataType.items()}


def load_model(path: str | Path, external_data: bool = True) -> onnx.ModelProto:
    """Loads an ONNX model; a missing, empty, truncated or non-ONNX file is a UsageError.
    `external_data=False` leaves weights held beside the model there (the graph names them; a
    reader loads them one at a time, `numpy_helper.to_array(tensor, folder)`)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    if path.is_dir():
        raise UsageError(f"{path} is a folder, not an ONNX file")
    data = path.read_bytes()
    if not data:
        raise UsageError(f"{path} is empty")
    try:
        model = onnx.load_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise UsageError(f"{path} is not an ONNX model ({type(e).__name__})") from None
    if not model.graph.node or not model.opset_import:
        raise UsageError(f"{path} is not an ONNX model (no graph)")
    beside = any(external_data_helper.uses_external_data(t) for t in model.graph.initializer)
    if external_data and beside:
        # Weights beside the model (`model.onnx.data`, torch.onnx's default for large ones) are
        # found next to the model file, from any working directory.
        try:
            external_data_helper.load_external_data_for_model(model, str(path.resolve().parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as e:
            raise UsageError(f"{path}: its external data cannot be read: {getattr(e, 'strerror', None) or e}") \
                from None
    try:
        # Beside it, its external data is found from the file's folder, not the working one (and a
        # model above protobuf's 2 GB, which cannot be checked as one message, is checked so).
        onnx.checker.check_model(str(path) if beside else model, full_check=False)
    except onnx.checker.ValidationError as e:
        raise UsageError(f"{path} is not a valid ONNX model: {first_line(e)}") from None
    return model


def _dims(vi) -> list:
    t = vi.type.tensor_type
    return [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else "?")
            for d in t.shape.dim]


def _io(vi) -> dict:
    return {"name": vi.name, "dtype": _ELEM.get(vi.type.tensor_type.elem_type, "?").lower(), "dims": _dims(vi)}


def attnexport_metadata(model: onnx.ModelProto) -> dict:
    meta = {p.key[len("attnexport."):]: p.value for p in model.metadata_props if p.key.startswith("attnexport.")}
    if "options" in meta:
        meta["options"] = json.loads(meta["options"])
    return meta


def describe(path: str | Path) -> dict:
    """A JSON-ready description of an ONNX file."""
    model = load_model(path)
    ops = Counter((f"{n.domain}." if n.domain else "") + n.op_type for n in model.graph.node)
    inits = {i.name for i in model.graph.initializer}
    return {
        "path": str(path),
        "ir_version": model.ir_version,
        "opsets": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "inputs": [_io(i) for i in model.graph.input if i.name not in inits],
        "outputs": [_io(o) for o in model.graph.output],
        "attention_op": attention_op_of(model),
        "op_counts": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "nodes": len(model.graph.node),
        "parameters": int(sum(_numel(i) for i in model.graph.initializer)),
        "size": Path(path).stat().st_size,
        "attnexport": attnexport_metadata(model),
    }


def _numel(t) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n
