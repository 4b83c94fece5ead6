"""Known-good baselines: every run's inputs and outputs, kept to catch errors that grow.

`verify --save-baseline DIR` writes one `.npz` per run (case x flavour x runtime) with the inputs,
the outputs and the error each output had against its expected values, plus a `MANIFEST.json`
of sha256s, as the golden folder has. `verify --baseline DIR` later compares a new export (after
an upgrade of torch, onnx or ONNX Runtime) with it: a run fails when an output's max abs error
grew by more than `max_growth` times, even while it is under the absolute tolerance.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport import files as F
from attnexport import golden
from attnexport.errors import GoldenIntegrityError, UsageError

MANIFEST = "MANIFEST.json"
FORMAT = 1
# Errors below this many units in the last place of the output's scale are rounding: growth is
# measured from this floor, so a baseline error of exactly 0 does not make every change infinite.
EPS = {"fp32": float(np.finfo(np.float32).eps), "fp16": float(np.finfo(np.float16).eps)}
FLOOR_ULPS = 1


def key(case: str, flavor: str, runtime: str) -> str:
    raw = f"{case}__{'torch' if flavor == '-' else flavor}__{runtime}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


def _inputs_sha(inputs: dict) -> str:
    return golden.sha256(golden.npz_bytes(sorted(inputs.items())))


@dataclass
class Entry:
    meta: dict
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


def save(rows, directory: str | Path) -> Path:
    """Writes a baseline of every run that compared something (its outputs, where it has them);
    returns the folder."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--save-baseline {directory}: not a folder")
    F.resolve_target(directory / MANIFEST, new_folder=True)  # the folder, made if its parent exists
    files = {}
    for r in rows:
        if r.skipped or not r.comparisons:
            continue
        meta = {"format": FORMAT, "case": r.case, "variant": r.variant, "flavor": r.flavor, "runtime": r.runtime,
                "dtype": r.dtype, "errors": {c.name: c.max_abs for c in r.comparisons if not c.problem},
                "scales": {n: float(np.max(np.abs(e), initial=0.0)) for n, e in r.expected.items()},
                "inputs_sha256": _inputs_sha(r.inputs)}
        entries = [("meta", np.array(json.dumps(meta, sort_keys=True)))]
        entries += [(f"inputs:{k}", v) for k, v in r.inputs.items()]
        entries += [(f"outputs:{k}", np.asarray(v)) for k, v in sorted(r.arrays.items())]
        data = golden.npz_bytes(entries)
        name = f"{key(r.case, r.flavor, r.runtime)}.npz"
        F.atomic_write(directory / name, data)
        files[name] = golden.sha256(data)
    if not files:
        raise UsageError("nothing to save: no run compared anything")
    manifest = {"format": FORMAT, "files": dict(sorted(files.items()))}
    F.atomic_write(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return directory


def load(directory: str | Path) -> dict[str, Entry]:
    """Every entry of a baseline folder, each checked against the manifest's sha256."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise UsageError(f"--baseline {directory}: no {MANIFEST} (write one with --save-baseline)")
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise GoldenIntegrityError(f"baseline manifest unreadable: {path}: {e}") from None
    out = {}
    for name, digest in files.items():
        data = (directory / name).read_bytes() if (directory / name).is_file() else None
        if data is None:
            raise GoldenIntegrityError(f"baseline file missing: {directory / name}")
        if golden.sha256(data) != digest:
            raise GoldenIntegrityError(f"baseline file damaged: {directory / name} (sha256 does not match {MANIFEST})")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"].reshape(-1)[0]))
            parts: dict[str, dict[str, np.ndarray]] = {"inputs": {}, "outputs": {}}
            for k in z.files:
                if ":" in k:
                    kind, n = k.split(":", 1)
                    parts[kind][n] = z[k]
        out[name[: -len(".npz")]] = Entry(meta, parts["inputs"], parts["outputs"])
    return out


def check(row, entry: Entry | None, max_growth: float) -> dict:
    """Compares one run with its baseline entry; returns {"passed", "problem", "outputs": [...]}."""
    if entry is None:
        return {"passed": False, "problem": "no baseline entry for this run", "outputs": []}
    if entry.meta["inputs_sha256"] != _inputs_sha(row.inputs):
        return {"passed": False, "problem": "the baseline was recorded with other inputs", "outputs": []}
    outs, passed = [], True
    for c in row.comparisons:
        base = entry.meta["errors"].get(c.name)
        if base is None or c.problem:
            continue
        floor = FLOOR_ULPS * EPS[row.dtype] * max(1.0, entry.meta["scales"].get(c.name, 1.0))
        growth = c.max_abs / max(base, floor)
        drift = None
        if c.name in entry.outputs and c.name in row.arrays:
            a = np.asarray(row.arrays[c.name], np.float64)
            b = np.asarray(entry.outputs[c.name], np.float64)
            drift = float(np.max(np.abs(a - b), initial=0.0)) if a.shape == b.shape else float("inf")
        ok = growth <= max_growth
        passed &= ok
        outs.append({"name": c.name, "baseline_max_abs": base, "max_abs": c.max_abs, "growth": growth,
                     "drift_from_baseline": drift, "passed": ok})
    if not outs:
        return {"passed": False, "problem": "no output in common with the baseline entry", "outputs": []}
    problem = "" if passed else "; ".join(
        f"{o['name']} error grew {o['growth']:.3g}x since the baseline ({o['max_abs']:.3g} vs "
        f"{o['baseline_max_abs']:.3g}; --max-growth {max_growth:g})" for o in outs if not o["passed"])
    return {"passed": passed, "problem": problem, "outputs": outs}
