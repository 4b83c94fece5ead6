"""A content-addressed cache of exports, shared by export, verify, bench and the tests.

An export is a pure function of what it is asked (variant, options, flavour, opset, dtype, the
parameters' bytes, seed) and of the code that does it (attnexport's own source, the golden
manifest it records, the torch, onnx and onnxscript versions). The cache key hashes all of that,
so a hit is the same bytes a fresh export would write. Location: `$ATTNEXPORT_CACHE`, else
`$XDG_CACHE_HOME/attnexport`, else `~/.cache/attnexport`; `ATTNEXPORT_CACHE=off` turns it off.
A cache that cannot be read or written is skipped, never an error: it only saves time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

import onnx

from attnexport import files as F


def directory() -> Path | None:
    env = os.environ.get("ATTNEXPORT_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnexport"


@functools.cache
def _code_hash() -> str:
    """attnexport's own source and the versions of what it exports with."""
    import onnxscript
    import torch
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    h.update(f"torch {torch.__version__} onnx {onnx.__version__} onnxscript {onnxscript.__version__}".encode())
    return h.hexdigest()


def key(request: dict) -> str:
    """The cache key of an export request (a JSON-ready dict) under this code."""
    blob = json.dumps(request, sort_keys=True, default=str).encode()
    return hashlib.sha256(_code_hash().encode() + blob).hexdigest()


def get(k: str) -> tuple[onnx.ModelProto, dict] | None:
    d = directory()
    if d is None:
        return None
    try:
        info = json.loads((d / f"{k}.json").read_text())
        data = (d / f"{k}.onnx").read_bytes()
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            return None  # a damaged entry is a miss; the next put replaces it
        return onnx.load_from_string(data), info["result"]
    except Exception:  # noqa: BLE001 - unreadable, damaged or unparsable: a miss, never an error
        return None


def put(k: str, model: onnx.ModelProto, result: dict) -> None:
    d = directory()
    if d is None:
        return
    data = model.SerializeToString(deterministic=True)
    with contextlib.suppress(Exception):
        d.mkdir(parents=True, exist_ok=True)
        F.atomic_write(d / f"{k}.onnx", data)
        F.atomic_write(d / f"{k}.json", json.dumps({"sha256": hashlib.sha256(data).hexdigest(),
                                                    "result": result}).encode())
