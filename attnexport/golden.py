"""Golden cases: their file format, manifest, loading with integrity, regeneration and drift
(the catalogue of cases is `attnexport.cases`).

A golden case is one `.npz` file holding the inputs, the parameters (so every runtime loads the
same weights), the expected outputs from the float64 NumPy reference, and a JSON `meta` entry
with its provenance. `MANIFEST.json` maps each file to its sha256. Files are written only by
`write()` (the `attnexport golden --write` command); `check()` regenerates every case in memory
and reports drift.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport import __version__, seeding
from attnexport import files as F
from attnexport import variants as V
from attnexport.cases import CASES, CaseDef
from attnexport.errors import GoldenIntegrityError, UsageError

MANIFEST = "MANIFEST.json"
FORMAT = 1


def default_dir() -> Path:
    """The golden folder: inside the installed package, else the source tree's `golden/`."""
    env = os.environ.get("ATTNEXPORT_GOLDEN")
    if env:
        return Path(env)
    packaged = Path(__file__).parent / "golden"
    if (packaged / MANIFEST).exists():
        return packaged
    return Path(__file__).resolve().parent.parent / "golden"


def default_dir_is_installed() -> bool:
    """True when the default golden folder is the copy inside an installed package."""
    return not os.environ.get("ATTNEXPORT_GOLDEN") and (Path(__file__).parent / "golden" / MANIFEST).exists()


# --- in-memory cases -------------------------------------------------------------------------

@dataclass
class GoldenCase:
    name: str
    variant: str
    options: dict
    inputs: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    meta: dict


def generate(case: CaseDef) -> GoldenCase:
    """Builds a case in memory: inputs and parameters, then the expected outputs from the reference."""
    variant = V.get(case.variant)
    o = variant.resolve(case.options)
    if case.make is not None:
        params, inputs = case.make(o)
    else:
        params = seeding.init_params(variant, o, case.case_seed)
        inputs = seeding.make_inputs(variant, o, case.case_seed)
    expected = {k: np.asarray(v, np.float64) for k, v in variant.reference(params, inputs, o).items()}
    meta = {"format": FORMAT, "name": case.name, "variant": case.variant, "options": o, "seed": case.case_seed,
            "source": case.source, "notes": case.notes,
            "provenance": {"generated_by": f"attnexport {__version__}", "numpy": np.__version__,
                           "reference": f"attnexport.reference.ref_{case.variant.replace('-', '_')}"}}
    return GoldenCase(case.name, case.variant, o, inputs, params, expected, meta)


# --- files ---------------------------------------------------------------------------------

def _to_bytes(case: GoldenCase) -> bytes:
    """A deterministic .npz: fixed entry order and timestamps, so equal cases give equal bytes."""
    entries = [("meta", np.array(json.dumps(case.meta, sort_keys=True)))]
    entries += [(f"inputs:{k}", v) for k, v in case.inputs.items()]
    entries += [(f"params:{k}", v) for k, v in sorted(case.params.items())]
    entries += [(f"expected:{k}", v) for k, v in case.expected.items()]
    return npz_bytes(entries)


def npz_bytes(entries: list[tuple[str, np.ndarray]]) -> bytes:
    """A deterministic .npz of (key, array) entries, in order, with fixed timestamps."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for key, arr in entries:
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            data = io.BytesIO()
            np.lib.format.write_array(data, np.ascontiguousarray(arr), allow_pickle=False)
            z.writestr(info, data.getvalue())
    return buf.getvalue()


def _from_bytes(data: bytes) -> GoldenCase:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        meta = json.loads(str(z["meta"].reshape(-1)[0]))
        parts: dict[str, dict[str, np.ndarray]] = {"inputs": {}, "params": {}, "expected": {}}
        for key in z.files:
            if ":" in key:
                kind, name = key.split(":", 1)
                parts[kind][name] = z[key]
    # Inputs keep the order of the variant's input specs (the npz keeps insertion order too).
    return GoldenCase(meta["name"], meta["variant"], meta["options"], parts["inputs"], parts["params"],
                      parts["expected"], meta)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(directory: Path | None = None) -> list[Path]:
    """Regenerates every case and writes it, then the manifest. The only writer of golden files.

    A case file the folder's earlier manifest listed that is no longer a case is removed; any
    other file is the user's and stays (`foreign_files` names them)."""
    directory = Path(directory or default_dir())
    try:
        earlier = set(read_manifest(directory))
    except GoldenIntegrityError:  # no manifest, or unreadable: nothing is known to be ours
        earlier = set()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot write golden cases to {directory}: {e.strerror or e}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write golden cases to {directory}: the folder is not writable")
    files = {}
    for case in CASES.values():
        data = _to_bytes(generate(case))
        path = directory / f"{case.name}.npz"
        F.atomic_write(path, data)
        files[path.name] = sha256(data)
    for name in sorted(earlier - set(files)):
        stale = directory / name
        if Path(name).name == name and name.endswith(".npz") and stale.is_file() and not stale.is_symlink():
            stale.unlink()
    manifest = {"format": FORMAT, "files": dict(sorted(files.items()))}
    F.atomic_write(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return [directory / n for n in files]


def foreign_files(directory: Path | None = None) -> list[str]:
    """The names in a golden folder that are neither a case file of its manifest nor the manifest."""
    directory = Path(directory or default_dir())
    try:
        ours = set(read_manifest(directory)) | {MANIFEST}
    except GoldenIntegrityError:
        ours = {MANIFEST}
    return sorted(p.name for p in directory.iterdir() if p.name not in ours)


def read_manifest(directory: Path | None = None) -> dict[str, str]:
    directory = Path(directory or default_dir())
    path = directory / MANIFEST
    if not path.exists():
        raise GoldenIntegrityError(f"golden manifest missing: {path} (run `attnexport golden --write`)")
    try:
        return json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise GoldenIntegrityError(f"golden manifest unreadable: {path}: {e}") from None


def manifest_hash(directory: Path | None = None) -> str:
    """sha256 of the manifest file: one value that pins every golden file."""
    path = Path(directory or default_dir()) / MANIFEST
    if not path.is_file():
        raise GoldenIntegrityError(f"golden manifest missing: {path} (run `attnexport golden --write`)")
    return sha256(path.read_bytes())


def load(name: str, directory: Path | None = None) -> GoldenCase:
    """Loads one case, checking its sha256 against the manifest first."""
    directory = Path(directory or default_dir())
    files = read_manifest(directory)
    fname = f"{name}.npz"
    if fname not in files:
        raise UsageError(f"no golden case {name!r} in {directory}")
    path = directory / fname
    if not path.exists():
        raise GoldenIntegrityError(f"golden file missing: {path}")
    data = path.read_bytes()
    digest = sha256(data)
    if digest != files[fname]:
        raise GoldenIntegrityError(f"golden file damaged: {path} (sha256 does not match {MANIFEST})")
    if digest not in _PARSED:  # a file's bytes, once checked, are parsed once (verify reads each case often)
        try:
            _PARSED[digest] = _from_bytes(data)
        except Exception as e:  # noqa: BLE001 - a file that hashes right but does not parse was written wrong
            raise GoldenIntegrityError(f"golden file unreadable: {path}: {e}") from None
    return copy.deepcopy(_PARSED[digest])  # the caller's own arrays


_PARSED: dict[str, GoldenCase] = {}  # by the sha256 of the file's bytes


def load_all(directory: Path | None = None, variants: list[str] | None = None) -> list[GoldenCase]:
    directory = Path(directory or default_dir())
    names = [n[: -len(".npz")] for n in read_manifest(directory)]
    cases = [load(n, directory) for n in names]
    return [c for c in cases if variants is None or c.variant in variants]


# Regenerated expected outputs are compared within this bound, relative to the array's largest
# magnitude, never bitwise. numpy's vectorised exp/sin/tanh and OpenBLAS's kernels are chosen by
# CPU, so the same float64 reference gives other last bits on another machine: measured between
# an Intel Xeon and an AMD EPYC, up to 4.4e-15 at a magnitude of 3.4 (1.3e-15 relative), over
# every case. Each expected value is a chain of at most a few thousand float64 operations, whose
# rounding (2.2e-16 each) cannot add up past about 1e-12 of its scale; a changed formula, mask or
# scale moves outputs by far more (fp32's own tolerance is 1e-5). Inputs and parameters are drawn
# from seeded generators or stored as printed, and must match to the last bit, except that a
# float input made with a vectorised function (the regression example's 2 sin(x) + x^0.8) may
# round the other way once cast to float32: one unit in the last place of its dtype, no more.
EXPECTED_BOUND = 1e-12


def differences(stored: GoldenCase, fresh: GoldenCase) -> list[str]:
    """What differs between a stored case and a regenerated one: options, names and shapes
    exactly, inputs and parameters to their last unit, expected outputs within EXPECTED_BOUND of
    their scale."""
    variant = V.get(stored.variant)
    if variant.with_defaults(stored.options) != variant.with_defaults(json.loads(json.dumps(fresh.options))):
        return [f"options differ: {stored.options} != {fresh.options}"]
    found = []
    for kind in ("inputs", "params", "expected"):
        a, b = getattr(stored, kind), getattr(fresh, kind)
        if set(a) != set(b):
            found.append(f"{kind} names differ: {sorted(a)} != {sorted(b)}")
            continue
        for key in a:
            x, y = np.asarray(a[key]), np.asarray(b[key])
            if x.shape != y.shape or x.dtype != y.dtype:
                found.append(f"{kind} {key}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}")
            elif kind != "expected":
                exact = np.array_equal(x, y)
                if not exact and not (x.dtype.kind == "f" and np.all(np.abs(x - y) <= np.spacing(np.abs(x)))):
                    found.append(f"{kind} {key} differs")
            elif x.size:
                x64, y64 = x.astype(np.float64), y.astype(np.float64)
                if np.isnan(x64).any() or np.isnan(y64).any():
                    found.append(f"expected {key}: NaN (it never passes)")
                    continue
                finite = np.isfinite(x64)
                if not np.array_equal(finite, np.isfinite(y64)) or not np.array_equal(x64[~finite], y64[~finite]):
                    found.append(f"expected {key}: infinities differ")  # a masked score is -inf in both
                    continue
                scale = max(1.0, float(np.max(np.abs(x64[finite]), initial=0.0)))
                diff = float(np.max(np.abs(x64[finite] - y64[finite]), initial=0.0))
                if diff > EXPECTED_BOUND * scale:
                    found.append(f"expected {key}: max diff {diff:.3g} (bound {EXPECTED_BOUND:g} x {scale:.3g})")
    return found


@dataclass
class Drift:
    case: str
    what: str

    def __str__(self):
        return f"{self.case}: {self.what}"


def check(directory: Path | None = None) -> list[Drift]:
    """Regenerates every case in memory and compares it with the stored one; returns the drift."""
    directory = Path(directory or default_dir())
    files = read_manifest(directory)
    drift = []
    for name in sorted(set(CASES) | {n[:-4] for n in files}):
        if name not in CASES:
            drift.append(Drift(name, "stored but no longer defined"))
            continue
        if f"{name}.npz" not in files:
            drift.append(Drift(name, "defined but not stored"))
            continue
        drift += [Drift(name, what) for what in differences(load(name, directory), generate(CASES[name]))]
    return drift

