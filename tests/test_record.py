"""The export record (`attnexport.record`): what an export writes is what every reader reads,
a key a file lacks is None but for what the graph says, damaged JSON is one line, and keys of
another version are kept."""

import json

import pytest
from onnx import TensorProto, helper

from attnexport import export as E
from attnexport.errors import UsageError
from attnexport.record import ExportRecord, as_json


def _bare(dtype=TensorProto.FLOAT, ops=("MatMul", "Softmax")):
    """A graph with no metadata: x -> MatMul(x, x) -> Softmax (or the ops given)."""
    nodes, last = [], "x"
    for i, op in enumerate(ops):
        args = [last, last] if op == "MatMul" else [last]
        nodes.append(helper.make_node(op, args, [f"t{i}"]))
        last = f"t{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [2, 2])],
                              [helper.make_tensor_value_info(last, dtype, [2, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_file_without_a_record_reads_as_none_but_for_what_its_graph_says():
    record = ExportRecord.of(_bare(TensorProto.FLOAT16))
    assert record.dtype == "fp16" and record.flavor == record.graph_flavor == "primitives"
    assert record.variant is record.module is record.params is record.hf is None and record.other == {}
    assert record.number("seed") is None and record.number("seed", 0) == 0 and record.parsed("params", {}) == {}
    assert ExportRecord.of(_bare()).dtype == "fp32"


def test_what_is_written_is_read_back_and_the_rest_of_the_metadata_is_kept():
    model = _bare()
    model.metadata_props.add(key="producer.note", value="kept")
    ExportRecord(variant="mha", options=as_json({"heads": 2}), flavor="ort", graph_flavor="ort", opset="23",
                 dtype="fp32", seed="3", params=as_json({"w": {"sha256": "x"}}),
                 other={"future_key": "as it was"}).write(model)
    props = {p.key: p.value for p in model.metadata_props}
    assert props["producer.note"] == "kept" and props["attnexport.future_key"] == "as it was"
    record = ExportRecord.of(model)
    assert record.variant == "mha" and record.parsed("options") == {"heads": 2}
    assert record.flavor == "ort" and record.number("opset") == 23 and record.number("seed") == 3
    assert record.parsed("params") == {"w": {"sha256": "x"}} and record.other == {"future_key": "as it was"}
    assert "attnexport.hf" not in props  # a field the record lacks is not written


def test_a_damaged_json_field_is_one_line():
    model = _bare()
    ExportRecord(params="{not json").write(model)
    with pytest.raises(UsageError, match=r"^the model's attnexport.params metadata is damaged \("):
        ExportRecord.of(model).parsed("params")


def test_an_export_records_what_verify_reads_and_older_files_keys_are_read():
    model = E.build_model("mha", {"kv_cache": True}, "primitives", use_cache=False)[0]
    record = ExportRecord.of(model)
    assert record.variant == "mha" and record.parsed("options")["kv_cache"] is True
    assert record.params_sha256 and set(record.parsed("params")) and record.version and record.torch_version
    assert json.loads(record.signature)["caches"]  # the step signature, read by attnexport.signature
    old = _bare()
    for key, value in {"attnexport.cache": json.dumps({"past_key": {"output": "present_key", "axis": 2}}),
                       "attnexport.write_pos": json.dumps({"input": "write_pos"})}.items():
        old.metadata_props.add(key=key, value=value)
    before = ExportRecord.of(old)
    assert before.parsed("cache") == {"past_key": {"output": "present_key", "axis": 2}}
    assert before.parsed("write_pos") == {"input": "write_pos"}
