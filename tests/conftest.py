import atexit
import os
import shutil
import tempfile

import numpy as np
import torch

from attnexport import variants as V

# The suite runs on pytest-xdist workers (see pyproject's addopts): the cores are shared out
# among them instead of each worker's torch and ONNX Runtime pools fighting over all of them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_configure(config):
    """One export cache for the whole run, starting empty, made before the workers start so that
    they all share it: tests share identical exports (as verify and bench do for a user) and
    never read a cache left by an earlier run."""
    if hasattr(config, "workerinput"):
        return
    cache = tempfile.mkdtemp(prefix="attnexport-test-cache-")
    os.environ["ATTNEXPORT_CACHE"] = cache
    atexit.register(shutil.rmtree, cache, ignore_errors=True)


def shared_once(name: str, make):
    """`make()`'s result, made by the first worker of the run that asks for it and read by the
    others (pickled beside the run's export cache, under a lock)."""
    import fcntl
    import pickle
    from pathlib import Path
    root = Path(os.environ.get("ATTNEXPORT_CACHE") or tempfile.gettempdir())
    path = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        path.write_bytes(pickle.dumps(value))
        return value


def to_torch(inputs: dict, dtype=torch.float32):
    """NumPy inputs -> torch tensors; floats cast to `dtype`, bools and ints kept."""
    return [torch.from_numpy(np.ascontiguousarray(a)).to(dtype) if a.dtype.kind == "f"
            else torch.from_numpy(np.ascontiguousarray(a)) for a in inputs.values()]


def run_module(variant, o, params, inputs, dtype=torch.float32):
    """Runs the torch module; returns {output name: float64 array}."""
    module = V.load_params(variant.build(o), params).to(dtype).eval()
    with torch.no_grad():
        out = module(*to_torch(inputs, dtype))
    out = out if isinstance(out, tuple) else (out,)
    return {s.name: t.double().numpy() for s, t in zip(variant.outputs(o), out)}


def assert_fits_80(text: str):
    """Every line of a table fits 80 columns and no cell was cut short (rich's ellipsis)."""
    for line in text.splitlines():
        if line.startswith(("FAIL ", "  where: ", "note: ", "fp16 tolerances", "skipped ", "peak: ")):
            continue  # plain lines: the terminal wraps them, nothing is cut
        assert len(line) <= 80, f"{len(line)} columns: {line}"
    assert "\u2026" not in text, text


# The longest tests (each runs a variant's golden cases in every flavour), started first: at the
# end of the run they would leave one worker busy and the other idle.
_FIRST = ("test_every_golden_case_passes_everywhere", "test_fp16_verify_is_green_with_derived_tolerances")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: 0 if item.originalname in _FIRST else 1)
