import atexit
import os
import shutil
import tempfile

import numpy as np
import torch

from attnexport import variants as V

torch.set_num_threads(2)

# One export cache for the whole session, starting empty: tests share identical exports (as
# verify and bench do for a user) and never read a cache left by an earlier run.
_CACHE = tempfile.mkdtemp(prefix="attnexport-test-cache-")
os.environ["ATTNEXPORT_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


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
