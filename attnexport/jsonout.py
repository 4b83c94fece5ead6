"""JSON every reader parses (RFC 8259): Python's `json` writes NaN and Infinity, which Node's
JSON.parse, jq and strict parsers refuse. Every `--json` output, and the JSON reports written for
users (the conformance run's), go through `dumps`: a number that is not finite (an infinite error, a NaN scale, the
times of a row that did not run) is written as null; a comparison's nan_diff and inf_diff, and a
row's note or error, say why."""

from __future__ import annotations

import json
import math
from pathlib import PurePath

import numpy as np


def strict(obj):
    """obj with non-finite floats as None, NumPy scalars and arrays as Python values, paths as text."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)) and not isinstance(obj, np.generic):
        return obj
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [strict(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict(obj.tolist())
    if isinstance(obj, PurePath):
        return str(obj)
    return obj


def dumps(obj, indent: int | None = None) -> str:
    """Strict JSON text of obj (see the module docstring); raises on anything else JSON cannot hold."""
    return json.dumps(strict(obj), indent=indent, allow_nan=False)
