"""Running one planned step on its runtime, comparing every declared output, and localizing
the first diverging node of a failing (or --localize) run."""

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
from attnexport.export import STATIC_BLOCKS, STATIC_BUFFERS
from attnexport.localize import Localization, locate
from attnexport.report import Row
from attnexport.signature import PLAIN, StepSignature
from attnexport.verify.decode_checks import decode_run
from attnexport.verify.run import Step

# --- execution ---------------------------------------------------------------------------------

def execute(step: Step, strict: bool) -> Row:
    case = step.case
    variant = V.get(case.variant)
    dtype = step.dtype
    row = Row(case.name, case.variant, step.flavor, step.runtime, dtype, step.model, tolerance=step.tol,
              expected_kind=step.expected_kind, inputs=case.inputs, expected=step.expected)
    if step.problem:
        row.error = step.problem
        return row
    try:
        if step.source is None:
            prepared = R.prepare_torch(step.runtime, T.of_variant(variant, case.options, step.params), dtype)
        else:
            prepared = R.prepare_onnx(step.runtime, step.source.get())
    except UnsupportedByFlavor as e:
        row.skipped = str(e)
        return row
    except ProviderUnavailableError:
        raise
    except AttnExportError as e:
        row.error = str(e)
        return row
    except Exception as e:  # noqa: BLE001 - a model a runtime cannot load fails verification
        row.error = reason(e)
        return row
    limits = _static_limits(step)
    signature = PLAIN
    if step.decode_chunk or limits:  # where the caches and the write position are, as the step records them
        try:
            signature = _signature(step, variant)
        except AttnExportError as e:
            row.error = str(e)
            return row
    refused = _beyond_static_blocks(step, limits.get(STATIC_BLOCKS, ""), signature)
    if refused:
        row.skipped = f"the model takes {refused}"
        return row
    feed = D.cast_floats(case.inputs, dtype)
    try:
        if step.decode_chunk:
            got, ms = decode_run(prepared, variant, case.options, feed, step.decode_chunk, signature)
        else:
            # One untimed run, then a few timed ones: verify is a check, bench is the timing tool.
            got, ms = prepared.timed(feed, warmup=0 if step.runtime == "onnx-ref" else 1,
                                     iters=1 if step.runtime == "onnx-ref" else 3)
    except Exception as e:  # noqa: BLE001 - a runtime failing on a model is a verification failure
        row.error = reason(e)
        return row
    row.median_ms, row.arrays = ms, got
    declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]
    expected = step.expected
    if not step.decode_chunk and STATIC_BUFFERS in limits:
        got, expected = _valid_prefix(got, case, signature), _valid_prefix(step.expected, case, signature)
    return row.judge(compare_outputs(declared, got, expected, step.tol), prepared.cpu_nodes, strict)




def _signature(step: Step, variant) -> StepSignature:
    """The step's signature: the one its model records; else (torch's module, which has no file, or
    a file exported before signatures) its target's, which its export records."""
    recorded = None if step.source is None else \
        S.of(step.source.get(), step.model or f"the {step.flavor} export of {variant.name}")
    return recorded or T.of_variant(variant, step.case.options, step.params).signature


def localize_row(row: Row, step: Step, fail_on_divergence: bool) -> None:
    """Attaches the first diverging node; with --localize a divergence fails the run."""
    feed = D.cast_floats(step.case.inputs, row.dtype)
    if step.source is None:  # a torch run: no graph to localize in
        return
    try:
        model, good = step.source.get(), step.source.known_good()
        if model is good and row.runtime == "onnx-ref":
            row.localization = Localization(note="this run is the reference evaluator on the export itself: "
                                                 "nothing independent to compare with")
            return
        row.localization = locate(model, good, feed, row.runtime, row.dtype)
    except UnsupportedByFlavor:
        return
    except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
        row.localization = Localization(note=f"localization failed: {reason(e)}")
        return
    if fail_on_divergence and row.localization.diverged and row.passed:
        row.passed = False
        row.error = "intermediate values diverge from the export (--localize)"


def _static_limits(step: Step) -> dict:
    """What the model's metadata says of its static step (`export.STATIC_BLOCKS`,
    `export.STATIC_BUFFERS`), if anything: {key: text}."""
    if step.source is None:
        return {}
    return {p.key: p.value for p in step.source.get().metadata_props if p.key in (STATIC_BLOCKS, STATIC_BUFFERS)}


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
