"""inspect: loading any ONNX file safely (external data included) and describing it."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from attnexport import export as E
from attnexport.errors import UsageError
from attnexport.reading import attnexport_metadata, describe, load_model


def test_describe_names_the_attention_op_and_the_metadata(tmp_path):
    path = E.export("cross", {"heads": 2}, "ort", output=tmp_path / "c.onnx").path
    d = describe(path)
    assert d["attention_op"] == "com.microsoft.MultiHeadAttention" and d["attnexport"]["variant"] == "cross"
    assert attnexport_metadata(load_model(path))["flavor"] == "ort"


def test_external_data_is_read_from_beside_the_model(tmp_path, monkeypatch):
    w = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])], [w])
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(graph), tmp_path / "m" / "x.onnx", save_as_external_data=True,
              location="x.onnx.data", size_threshold=0)
    monkeypatch.chdir(tmp_path)  # not the model's folder
    model = load_model(tmp_path / "m" / "x.onnx")
    assert numpy_helper.to_array(model.graph.initializer[0])[1, 0] == 64.0
    (tmp_path / "m" / "x.onnx.data").unlink()
    with pytest.raises(UsageError, match="external data cannot be read"):
        load_model(tmp_path / "m" / "x.onnx")


@pytest.mark.parametrize("content, message", [(b"", "is empty"), (b"not onnx at all", "is not an ONNX model")])
def test_bad_files_are_usage_errors(tmp_path, content, message):
    (tmp_path / "bad.onnx").write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load_model(tmp_path / "bad.onnx")
