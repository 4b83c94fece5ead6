"""A golden or model-file step: prepared on its runtime, run by verify's executor
(`verify.executor`), every declared output compared, its model localized against the
known-good export."""

from __future__ import annotations

import numpy as np

from attnexport import dtypes as D
from attnexport import runtimes as R
from attnexport import signature as S
from attnexport import target as T
from attnexport import variants as V
from attnexport.compare import (
    compare_outputs,
    past_ends_zeroed,
)
from attnexport.errors import AttnExportError, ProviderUnavailableError, UnsupportedByFlavor, reason
from attnexport.localize import Localization, locate
from attnexport.record import ExportRecord
from attnexport.report import Row
from attnexport.signature import PLAIN, StepSignature
from attnexport.verify.decode_checks import decode_run
from attnexport.verify.executor import Executor
from attnexport.verify.run import Step

# --- execution ---------------------------------------------------------------------------------

def execute(step: Step, executor: Executor) -> Row:
    """One planned step, prepared on its runtime and run by `executor`; its row."""
    case = step.case
    variant = V.get(case.variant)
    dtype = step.dtype
    row = Row(case.name, case.variant, step.flavor, step.runtime, dtype, step.model, tolerance=step.tol,
              expected_kind=step.expected_kind, inputs=case.inputs, expected=step.expected)
    row.error = step.problem
    prepared, signature, limits = None, PLAIN, ExportRecord()
    if not row.error:
        try:
            prepared, signature, limits = _prepared(step, variant)
        except UnsupportedByFlavor as e:
            row.skipped = str(e)
        except ProviderUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 - a model a runtime cannot load fails verification
            row.error = str(e) if isinstance(e, AttnExportError) else reason(e)
    if prepared is not None:
        refused = _beyond_static_blocks(step, limits.static_blocks or "", signature)
        if refused:
            row.skipped = f"the model takes {refused}"
    feed = D.cast_floats(case.inputs, dtype)
    declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]

    def work():
        if step.decode_chunk:
            return decode_run(prepared, variant, case.options, feed, step.decode_chunk, signature)
        return prepared.run(feed)

    def judge(got):
        expected = step.expected
        if not step.decode_chunk and limits.static_buffers is not None:
            got, expected = _valid_prefix(got, case, signature), _valid_prefix(expected, case, signature)
        return compare_outputs(declared, got, expected, step.tol)
    # Verify is a check, bench the timing tool: one untimed run, then a few timed ones (the
    # reference evaluator and a decode loop once). Localization needs one ONNX model run on one
    # feed, not a decode loop.
    once = step.decode_chunk or step.runtime == "onnx-ref"
    executor.run(row, work, judge, cpu_nodes=prepared.cpu_nodes if prepared is not None else (),
                 warmup=0 if once else 1, iters=1 if once else 3,
                 locate=None if step.source is None or step.decode_chunk else lambda _: localize(step, dtype))
    return row


def _prepared(step: Step, variant):
    """(the step's runtime ready to run it, its signature, what its model says of its static step)."""
    if step.source is None:
        prepared = R.prepare_torch(step.runtime, T.of_variant(variant, step.case.options, step.params), step.dtype)
    else:
        prepared = R.prepare_onnx(step.runtime, step.source.get())
    limits = _static_limits(step)
    # Where the caches and the write position are, as the step records them.
    static = limits.static_blocks is not None or limits.static_buffers is not None
    signature = _signature(step, variant) if step.decode_chunk or static else PLAIN
    return prepared, signature, limits


def _signature(step: Step, variant) -> StepSignature:
    """The step's signature: the one its model records; else (torch's module, which has no file, or
    a file exported before signatures) its target's, which its export records."""
    recorded = None if step.source is None else \
        S.of(step.source.get(), step.model or f"the {step.flavor} export of {variant.name}")
    return recorded or T.of_variant(variant, step.case.options, step.params).signature


def localize(step: Step, dtype: str) -> Localization | None:
    """The first diverging node of an ONNX step's model against its known-good export."""
    if step.source is None:  # the torch module: no graph to look inside
        return None
    try:
        model, good = step.source.get(), step.source.known_good()
        if model is good and step.runtime == "onnx-ref":
            return Localization(note="this run is the reference evaluator on the export itself: nothing "
                                     "independent to compare with")
        return locate(model, good, D.cast_floats(step.case.inputs, dtype), step.runtime, dtype)
    except UnsupportedByFlavor:  # the flavour cannot export the known-good model: nothing to look inside
        return None


def _static_limits(step: Step) -> ExportRecord:
    """The model's record (`static_blocks`, `static_buffers`: what it says of its static step);
    an empty one for a run without a model file."""
    return ExportRecord() if step.source is None else ExportRecord.of(step.source.get())


def _block(case) -> int:
    """The positions a static-cache case writes: its new keys (sdpa's kv_seq) or its new positions."""
    return case.options["kv_seq"] if "key" in case.inputs else case.options["seq"]


def _beyond_static_blocks(step: Step, limit: str, signature: StepSignature) -> str:
    """`limit` (what the model says its static step takes) when this run asks for more: a block of
    several positions over written positions at batch > 1 (the golden step itself, or the decode
    check's chunks after the prefill). "" when the run fits."""
    if not limit or step.case.options.get("batch", 1) == 1 or signature.write_pos is None:
        return ""
    if step.decode_chunk:
        return limit if step.decode_chunk > 1 else ""
    written = int(np.asarray(step.case.inputs[signature.write_pos.name]).max())
    return limit if _block(step.case) > 1 and written > 0 else ""


def _valid_prefix(arrays: dict, case, signature: StepSignature) -> dict:
    """The static buffers' outputs, as the step's signature names them, with every position past
    each sequence's end (its write position, in the signature's form, + the block) set to 0 (what
    the model leaves undefined there), the other outputs as they are."""
    if signature.write_pos is None:
        return arrays
    ends = signature.write_pos.ends(case.inputs[signature.write_pos.name], _block(case), case.options["batch"])
    return past_ends_zeroed(arrays, [c.present for c in signature.caches if c.kind == "static" and c.present in arrays],
                            ends)
