"""`torch` and `torch-cuda`: a target's PyTorch module itself (`attnexport.target`: a variant's), on
the CPU or a CUDA device."""

from __future__ import annotations

import contextlib
import functools

from attnexport.errors import ProviderUnavailableError
from attnexport.runtimes import base as R
from attnexport.target import Target


def status(name: str) -> R.Status:
    return cuda_status() if R.on_cuda(name) else R.Status(name, True, "PyTorch eager, CPU")


@functools.cache
def cuda_status() -> R.Status:
    import torch
    if torch.version.cuda is None:
        return R.Status("torch-cuda", False, f"this torch build has no CUDA (torch {torch.__version__})")
    if not torch.cuda.is_available():
        return R.Status("torch-cuda", False, f"torch {torch.__version__} sees no CUDA device")
    return R.Status("torch-cuda", True, torch.cuda.get_device_name(0))


@contextlib.contextmanager
def without_tf32():
    """CUDA matmuls and convolutions in full fp32 (fp32 parity: no TF32) for the duration, the
    process's settings put back after."""
    import torch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def prepare_torch(name: str, target: Target, dtype: str) -> R.Prepared:
    """The target's module on CPU or CUDA; it is fed by its inputs' names, and its outputs are
    named by the ones it declares (a module returning more than it declares gets the extras as
    `<unnamed i>`)."""
    import torch
    if not status(name).available:
        raise ProviderUnavailableError(f"runtime {name} is not available: {status(name).reason}")
    device = "cuda" if R.on_cuda(name) else "cpu"
    module = target.module(dtype, device)
    declared = list(target.outputs)

    def run(feed):
        args = target.args(feed, dtype, device)
        with torch.no_grad(), without_tf32() if device == "cuda" else contextlib.nullcontext():
            out = module(*args)
            if device == "cuda":
                torch.cuda.synchronize()
        out = out if isinstance(out, tuple) else (out,)
        arrays = [t.float().cpu().numpy() for t in out]
        names = declared + [f"<unnamed {i}>" for i in range(len(declared), len(arrays))]
        return dict(zip(names, arrays, strict=False))  # fewer outputs than declared: the missing are said

    return R.Prepared(name, run, [device])
