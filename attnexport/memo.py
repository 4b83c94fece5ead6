"""A content-addressed cache of exports, shared by export, verify, bench and the tests.

An export is a pure function of what it is asked (variant, options, flavour, opset, dtype, the
parameters' bytes, seed) and of the code that does it (attnexport's own source, the golden
manifest it records, the torch, onnx and onnxscript versions). The cache key hashes all of that,
so a hit is the same bytes a fresh export would write. Location: `$ATTNEXPORT_CACHE`, else
`$XDG_CACHE_HOME/attnexport`, else `~/.cache/attnexport`; `ATTNEXPORT_CACHE=off` turns it off.
A cache that cannot be read or written is skipped, never an error: it only saves time.

The cache is bounded: after each new entry, while its entries take more than the limit
(`ATTNEXPORT_CACHE_SIZE`, e.g. `500M` or `4G`; default 2 GiB), entries made by another version
of the code go first (no key of this code can reach them), then the least recently used. An
entry is a model (`<key>.onnx`) and its record (`<key>.json`, whose modification time is its
last use); nothing else in the folder is touched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from attnexport import files as F
from attnexport.errors import UsageError

DEFAULT_LIMIT = 2 * 2**30
_ENTRY = re.compile(r"^[0-9a-f]{64}\.(onnx|json)$")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def directory() -> Path | None:
    env = os.environ.get("ATTNEXPORT_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnexport"


def limit() -> int:
    """The cache's size limit in bytes: `ATTNEXPORT_CACHE_SIZE` (a number of bytes, or with a unit:
    K, M, G, T, powers of 1024), else DEFAULT_LIMIT. UsageError when it is not a size."""
    text = os.environ.get("ATTNEXPORT_CACHE_SIZE")
    if text is None or not text.strip():
        return DEFAULT_LIMIT
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"ATTNEXPORT_CACHE_SIZE={text!r} is not a size (e.g. 500M, 4G, or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
    limit()  # a limit that is not a size is the user's to fix now, before an export's work
    try:
        record = d / f"{k}.json"
        info = json.loads(record.read_text())
        data = (d / f"{k}.onnx").read_bytes()
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            return None  # a damaged entry is a miss; the next put replaces it
        with contextlib.suppress(OSError):
            os.utime(record)  # its last use, for the least-recently-used order
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
        F.atomic_write(d / f"{k}.json", json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "code": _code_hash(),
                                                    "result": result}).encode())
        prune(d, limit())


@dataclass
class Entry:
    key: str
    size: int  # the model and its record, in bytes
    last_used: float  # seconds since the epoch
    current: bool  # made by this version of the code


def entries(d: Path | None = None) -> list[Entry]:
    """The cache's entries (a model with its record; a half of one counts, to be removed)."""
    d = directory() if d is None else d
    if d is None or not d.is_dir():
        return []
    found: dict[str, Entry] = {}
    code = None
    for path in d.iterdir():
        if not _ENTRY.match(path.name):
            continue
        try:
            st = path.stat()
        except OSError:
            continue
        k = path.name[:64]
        e = found.setdefault(k, Entry(k, 0, 0.0, False))
        e.size += st.st_size
        if path.suffix == ".json":
            e.last_used = st.st_mtime
            try:
                code = code or _code_hash()
                e.current = json.loads(path.read_text()).get("code") == code
            except Exception:  # noqa: BLE001 - an unreadable record: not this code's
                e.current = False
    return list(found.values())


def prune(d: Path, max_bytes: int) -> list[str]:
    """Removes entries until they take at most `max_bytes`: other code versions' first, then the
    least recently used; temporary files of interrupted writes older than an hour too. Returns the
    removed keys."""
    now = time.time()
    for tmp in d.glob(".attnexport-*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > 3600:
                tmp.unlink()
    found = entries(d)
    total = sum(e.size for e in found)
    removed = []
    for e in sorted(found, key=lambda e: (e.current, e.last_used)):
        if total <= max_bytes:
            break
        remove(d, e.key)
        total -= e.size
        removed.append(e.key)
    return removed


def remove(d: Path, k: str) -> None:
    for suffix in (".json", ".onnx"):  # the record first: a model without one is never a hit
        with contextlib.suppress(FileNotFoundError):
            (d / f"{k}{suffix}").unlink()


def clear() -> int:
    """Removes every entry (only attnexport's files); returns how many there were."""
    d = directory()
    if d is None:
        return 0
    found = entries(d)
    for e in found:
        remove(d, e.key)
    return len(found)


def describe() -> dict:
    """What `attnexport cache` shows: the folder (None: the cache is off), its size and limit, its
    entries (of this version and of others, removed first) and when one was last used."""
    d = directory()
    found = entries(d)
    current = [e for e in found if e.current]
    return {"directory": None if d is None else str(d), "enabled": d is not None,
            "size_bytes": sum(e.size for e in found), "limit_bytes": limit(), "entries": len(found),
            "entries_of_this_version": len(current), "entries_of_other_versions": len(found) - len(current),
            "last_used": max((e.last_used for e in found), default=None)}
