"""What an export records in the model's metadata, as one dataclass written and read here only.

Each field is the metadata key `attnexport.<field>`, its value as the file holds it: text (the
JSON fields, options, inputs, routed, params, signature, hf, precision, cache and write_pos, as
JSON text that `parsed` reads). The one fallback rule: a key the file
lacks (an earlier export, or another exporter's file) is None, except what the graph itself says
(the float type of its inputs, the flavour of its attention op: `dtype`, `flavor` and
`graph_flavor`), which is read from the graph.
Keys of an attnexport version this one does not know are kept as they are (`other`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any, overload

import onnx

from attnexport import flavors as FL
from attnexport.errors import UsageError

PREFIX = "attnexport."


@dataclass(frozen=True)
class ExportRecord:
    """An export's record. What made it: a variant (`variant`, `options`), a user's module
    (`module`, `inputs`, `routed`) or a whole model (its sizes in `signature`); how (`flavor`
    asked, `graph_flavor` made, `opset`, `dtype`, `seed`); its parameters (`params`: each one's
    initializer and fingerprint, `params_sha256`, `params_source`); its step (`signature`, and
    ONNX Runtime's limits of a static step: `static_blocks`, `static_buffers`); a quantization
    (`precision`); the golden manifest it was checked against; attnexport's and torch's versions.
    `cache` and `write_pos` are what files from before signatures recorded, `hf` a whole model's
    sizes in files from before they were in the signature."""

    variant: str | None = None
    options: str | None = None
    module: str | None = None
    inputs: str | None = None
    routed: str | None = None
    hf: str | None = None
    flavor: str = ""  # "" in a record being made only: `of` fills in the graph's
    graph_flavor: str = ""
    opset: str | None = None
    dtype: str = ""
    seed: str | None = None
    params_source: str | None = None
    golden_manifest_sha256: str | None = None
    signature: str | None = None
    static_blocks: str | None = None
    static_buffers: str | None = None
    params: str | None = None
    params_sha256: str | None = None
    precision: str | None = None
    cache: str | None = None
    write_pos: str | None = None
    version: str | None = None
    torch_version: str | None = None
    other: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ExportRecord:
        """The record `model` holds, the graph's float type and flavour where it holds none."""
        props = {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}
        known = {f.name for f in fields(cls)} - {"other"}
        record = cls(**{k: v for k, v in props.items() if k in known},
                     other={k: v for k, v in props.items() if k not in known})
        if record.dtype and record.flavor and record.graph_flavor:  # an attnexport export: the graph not read
            return record
        graph = FL.of_op(attention_op_of(model))
        return replace(record, dtype=record.dtype or dtype_of(model), flavor=record.flavor or graph,
                       graph_flavor=record.graph_flavor or graph)

    def parsed(self, name: str, default: Any = None) -> Any:
        """A JSON field read (`default` where the file has none); a one-line UsageError if damaged."""
        text = getattr(self, name)
        if text is None:
            return default
        try:
            return json.loads(text)
        except ValueError as e:
            raise UsageError(f"the model's {PREFIX}{name} metadata is damaged ({e})") from None

    @overload
    def number(self, name: str) -> int | None: ...

    @overload
    def number(self, name: str, default: int) -> int: ...

    def number(self, name, default=None):
        """An integer field (opset, seed), or `default` where the file has none."""
        text = getattr(self, name)
        return default if text is None else int(text)

    def props(self) -> dict[str, str]:
        """{metadata key: value} of every field the record has, in the fields' order."""
        out = {f"{PREFIX}{f.name}": getattr(self, f.name) for f in fields(self) if f.name != "other"}
        kept = {k: v for k, v in out.items() if v not in (None, "")}
        return {**kept, **{PREFIX + k: v for k, v in self.other.items()}}

    def write(self, model: onnx.ModelProto) -> None:
        """`model`'s metadata made this record (what is not attnexport's kept as it is)."""
        kept = [(p.key, p.value) for p in model.metadata_props if not p.key.startswith(PREFIX)]
        del model.metadata_props[:]
        for key, value in [*kept, *self.props().items()]:
            model.metadata_props.add(key=key, value=value)


def as_json(value: Any, sort_keys: bool = True) -> str:
    """A JSON field's text as the record writes it."""
    return json.dumps(value, sort_keys=sort_keys)


def attention_op_of(model: onnx.ModelProto) -> str:
    """Names the attention op in a graph: a fused op, MatMul+Softmax, or none."""
    ops = Counter((n.domain, n.op_type) for n in model.graph.node)
    fused = [name for key, name in FL.FUSED_OPS.items() if ops.get(key)]
    if fused:
        return ", ".join(fused)
    if ops.get(("", "Softmax")) and ops.get(("", "MatMul")):
        return "MatMul+Softmax"
    return "none"


def dtype_of(model: onnx.ModelProto) -> str:
    """fp16 when the model's float inputs are float16, else fp32."""
    inits = {i.name for i in model.graph.initializer}
    for i in model.graph.input:
        if i.name not in inits and i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16:
            return "fp16"
    return "fp32"
