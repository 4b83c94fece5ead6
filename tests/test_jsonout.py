"""attnexport.jsonout: strict JSON (RFC 8259) of what attnexport reports."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from attnexport import jsonout


def _strict_loads(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_null_and_the_rest_is_kept():
    doc = {"inf": math.inf, "nan": float("nan"), "ninf": np.float32(-np.inf), "x": 1.5, "f16": np.float16(0.25),
           "i": np.int64(7), "b": np.bool_(True), "a": np.array([[1.0, np.nan]]), "p": Path("m/x.onnx"),
           "t": (1, 2), "s": "NaN", 3: "key"}
    back = _strict_loads(jsonout.dumps(doc))
    assert back == {"inf": None, "nan": None, "ninf": None, "x": 1.5, "f16": 0.25, "i": 7, "b": True,
                    "a": [[1.0, None]], "p": "m/x.onnx", "t": [1, 2], "s": "NaN", "3": "key"}


def test_bools_stay_bools_and_ints_stay_ints():
    back = _strict_loads(jsonout.dumps([True, False, 0, 1, np.int32(-3)]))
    assert back == [True, False, 0, 1, -3] and [type(v) for v in back] == [bool, bool, int, int, int]


def test_what_json_cannot_hold_raises():
    with pytest.raises(TypeError):
        jsonout.dumps({"x": object()})
