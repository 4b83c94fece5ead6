"""attnexport.dtypes: the float types, named in one place."""

import numpy as np
import onnx
import pytest

from attnexport import dtypes as D
from attnexport.errors import UsageError


def test_every_table_names_every_dtype():
    for table in (D.NUMPY, D.ONNX, D.ITEMSIZE):
        assert set(table) == set(D.DTYPES)
    for name in D.DTYPES:
        assert np.dtype(D.NUMPY[name]).itemsize == D.ITEMSIZE[name]
        assert onnx.helper.tensor_dtype_to_np_dtype(D.ONNX[name]) == np.dtype(D.NUMPY[name])
        assert str(D.torch_dtype(name)).endswith({"fp32": "float32", "fp16": "float16"}[name])


def test_check_refuses_an_unknown_dtype_naming_the_valid_ones():
    assert D.check("fp16") == "fp16"
    with pytest.raises(UsageError, match="unknown dtype 'int8'; valid: fp32, fp16"):
        D.check("int8")


def test_cast_floats_keeps_masks_and_lengths():
    cast = D.cast_floats({"x": np.ones(2, np.float64), "m": np.ones(2, bool), "n": np.ones(2, np.int64)}, "fp16")
    assert {k: v.dtype for k, v in cast.items()} == {"x": np.float16, "m": np.bool_, "n": np.int64}
