"""What one verify run is: where its model comes from (a file, or an export made here and
memoized), what it is compared against and how strictly."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from attnexport import export as E
from attnexport import golden, schema
from attnexport import reference as ref
from attnexport import variants as V
from attnexport import weights as W
from attnexport.compare import (
    TOLERANCES,
    Tolerance,
    derived_tolerance,
    tolerance,
)
from attnexport.errors import UnsupportedByFlavor
from attnexport.record import ExportRecord
from attnexport.verify.executor import Executor

# --- what one run is ---------------------------------------------------------------------------

class ModelSource:
    """Where a run's ONNX model comes from: a file's model, or an export made here (memoized).

    `known_good()` is what localization compares the model with: for a file, the torch module
    exported afresh with the same variant, options, flavour, opset, dtype and parameters (those
    the export wrote, when the file's weights changed since); for an export made here, the
    export itself, run on the reference evaluator.
    """

    def __init__(self, variant: str, options: dict, graph_flavor: str, opset: int | None, dtype: str,
                 params: dict, model: onnx.ModelProto | None = None, good_params: dict | None = None):
        self.variant, self.options, self.graph_flavor = variant, options, graph_flavor
        self.opset, self.dtype, self.params = opset, dtype, params
        self.good_params = params if good_params is None else good_params
        self.from_file = model is not None
        self._model: onnx.ModelProto | Exception | None = model
        self._good: onnx.ModelProto | Exception | None = None

    def get(self) -> onnx.ModelProto:
        if self._model is None:
            self._model = _export(self.variant, self.options, self.graph_flavor, self.opset, self.dtype, self.params)
        if isinstance(self._model, Exception):
            raise self._model
        return self._model

    def known_good(self) -> onnx.ModelProto:
        if not self.from_file:
            return self.get()
        if self._good is None:
            self._good = _export(self.variant, self.options, self.graph_flavor, self.opset, self.dtype,
                                 self.good_params)
        if isinstance(self._good, Exception):
            raise self._good
        return self._good


_GRAPHS: dict = {}  # the last exports, by what shapes the graph (at most _GRAPHS_KEPT of them)
_GRAPHS_KEPT = 64


def _export(variant, options, gf, opset, dtype, params) -> onnx.ModelProto | Exception:
    """The model of a variant with these options and parameters.

    One export per graph: variant, the options that shape the graph (sizes are symbolic), flavour,
    opset and dtype. Cases that differ only in sizes or parameters get that export with their
    parameters put into its initializers (`weights.reweight`), which is what a fresh export with
    them would hold; where that cannot be done, they are exported afresh.
    """
    key = (variant, json.dumps(V.get(variant).graph_options(options), sort_keys=True), gf, opset, dtype)
    if key not in _GRAPHS:
        while len(_GRAPHS) >= _GRAPHS_KEPT:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        try:
            _GRAPHS[key] = E.build_model(variant, options, gf, opset=opset, dtype=dtype)[0]
        except UnsupportedByFlavor as e:
            _GRAPHS[key] = e  # the same answer for every case and runtime, without exporting again
    graph = _GRAPHS[key]
    if isinstance(graph, Exception):
        return graph
    entries = ExportRecord.of(graph).parsed("params")
    model = W.reweight(graph, entries, params) if entries is not None else None
    if model is None:
        try:
            model = E.build_model(variant, options, gf, opset=opset, dtype=dtype, params=params)[0]
        except UnsupportedByFlavor as e:
            return e
    return model


@dataclass(frozen=True, eq=False)
class Step:
    """One run: a case on one runtime (and flavour), with what it is compared against."""

    case: golden.GoldenCase
    flavor: str  # "-" for the torch runtimes, which run the module itself
    runtime: str
    dtype: str
    tol: Tolerance
    expected: dict
    expected_kind: str  # "golden", or "reference (...)" when recomputed for a model's own parameters
    params: dict  # the torch module's parameters
    source: ModelSource | None = None  # None for the torch runtimes
    model: str = ""  # the model file's name in model mode
    problem: str = ""  # a failure known before running (changed weights)
    decode_chunk: int = 0  # > 0: decode the case's x in chunks from an empty cache (see attnexport.decode)


# --- arguments ---------------------------------------------------------------------------------

def case_tolerance(variant: schema.Variant, params: dict, inputs: dict, options: dict, expected: dict, dtype: str,
                   rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance of one case: the policy's (fp32), an override, or derived (fp16, see compare)."""
    if rtol is not None or atol is not None or dtype != "fp16":
        return tolerance(dtype, rtol, atol)
    with ref.rounded_to(np.float16):
        emulated = variant.reference(params, inputs, options)
    err = 0.0
    for name, e in expected.items():
        a, e = np.asarray(emulated[name], np.float64), np.asarray(e, np.float64)
        if (np.isfinite(a) != np.isfinite(e)).any():
            base = TOLERANCES[dtype]
            return Tolerance(base.rtol, base.atol, "policy (the fp16 emulation of this case overflows)")
        fin = np.isfinite(e)
        err = max(err, float(np.abs(a[fin] - e[fin]).max(initial=0.0)))
    return derived_tolerance(dtype, err)

def quiet_numerics(fn):
    """NumPy's warnings about NaN and Inf stay out of the user's terminal: a non-finite value is
    reported by the comparison (NaN never passes), not by a RuntimeWarning from the middle."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return wrapper


@dataclass(frozen=True)
class LoadedModule:
    """A user's module and its model file, loaded for the checks: what each row runs and how it
    is compared (the runtimes in use, the ONNX ones prepared)."""

    module: Any  # the torch module, in the model's dtype, in eval mode
    model: onnx.ModelProto
    spec: str
    spec_inputs: list[dict]  # the model's inputs: name, shape, dtype, symbolic axes
    used: list[str]
    prepared: dict  # runtime -> runtimes.Prepared, for the ONNX runtimes in `used`
    dtype: str
    tol: Tolerance
    flavor: str
    model_name: str
    executor: Executor  # what runs each row (verify.executor): placement, localization, baseline
