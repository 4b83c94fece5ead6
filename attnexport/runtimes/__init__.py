"""The runtimes: one adapter each, one interface, strict about where the work ran.

`torch` and `torch-cuda` run the PyTorch module (`pytorch`); `onnx-ref` runs an exported model on
onnx's reference evaluator (`reference`); `ort-cpu` and `ort-cuda` on ONNX Runtime's Python
package (`ort`); `ort-node`, `ort-wasm` and `ort-webgpu` on ONNX Runtime where apps deploy it: in
Node (onnxruntime-node) and in a browser (onnxruntime-web's WASM and WebGPU backends in headless
Chromium), through one JavaScript process (`js`). A runtime that cannot run here says why
(`status`); the accelerated ones (`ort-cuda`, `ort-webgpu`) also prove where every node ran,
because ONNX Runtime falls back to the CPU silently. Adding a runtime touches this package only:
its line in `REGISTRY` and its adapter module (`status`, and `prepare` for an ONNX runtime).
"""

from __future__ import annotations

import difflib
import importlib

import onnx

from attnexport.errors import ProviderUnavailableError, UsageError
from attnexport.runtimes import ort, pytorch, reference
from attnexport.runtimes.base import (  # noqa: F401 - the package's interface, as its users read it
    ACCELERATED,
    DEFAULT_RUNTIMES,
    JS_RUNTIMES,
    ONNX_RUNTIMES,
    REGISTRY,
    RUNTIMES,
    SHAPE_OPS,
    TIMED_RUNTIMES,
    Prepared,
    Runtime,
    Status,
    all_nodes,
    cpu_nodes,
    cpu_threads,
    has_fp16,
    on_cuda,
    runs_module,
    set_cpu_threads,
    shape_computations,
    time_call,
    time_calls,
)


def _adapter(name: str):
    if name not in REGISTRY:
        raise ValueError(name)
    return importlib.import_module(f"attnexport.runtimes.{REGISTRY[name].adapter}")


def parse(text: str | None) -> list[str] | None:
    """`--runtimes a,b,...` -> the names, checked; None (not given) -> None: the default ones."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise UsageError(f"--runtimes {text!r} names no runtime; valid: {', '.join(RUNTIMES)}")
    for n in names:
        if n not in RUNTIMES:
            close = difflib.get_close_matches(n, RUNTIMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"unknown runtime {n!r}{hint}; valid: {', '.join(RUNTIMES)}")
    return names


def select(requested: list[str] | None, skip_unavailable: bool = False):
    """Returns (runtimes to use, status list). Asked-for and unavailable is an error unless skipped;
    none asked for: every available one of DEFAULT_RUNTIMES."""
    names = list(DEFAULT_RUNTIMES) if requested is None else requested
    used, table = [], []
    for n in names:
        s = status(n)
        if not s.available and requested is not None and not skip_unavailable:
            raise ProviderUnavailableError(f"runtime {n} is not available: {s.reason} "
                                           f"(use --skip-unavailable to skip it)")
        table.append({"name": n, "available": s.available, "reason": s.reason, "used": s.available})
        if s.available:
            used.append(n)
    if not used:
        raise ProviderUnavailableError("none of the requested runtimes is available: "
                                       + "; ".join(f"{t['name']}: {t['reason']}" for t in table))
    return used, table


def status(name: str) -> Status:
    """Whether `name` can run here, and what it is (or why not): its adapter says."""
    return _adapter(name).status(name)


def described(table: list[dict]) -> list[dict]:
    """select()'s table with each used runtime's description as it is after the runs (the WebGPU
    adapter is known once the browser has run), and what it was found to compute wrong (`warning`)."""
    out = []
    for t in table:
        if t["used"]:
            s = status(t["name"])
            t = dict(t, reason=s.reason, **({"warning": s.warning} if s.warning else {}))
            if s.warning and hasattr(_adapter(t["name"]), "warning_said"):
                _adapter(t["name"]).warning_said(t["name"])  # said once, for the models this report ran
        out.append(t)
    return out


def require(name: str) -> None:
    s = status(name)
    if not s.available:
        raise ProviderUnavailableError(f"runtime {name} is not available: {s.reason}")


def prepare_onnx(name: str, model: onnx.ModelProto | str, optimize: bool = True, threads: int | None = None,
                 prepack: bool = True) -> Prepared:
    """`model` ready to run on the ONNX runtime `name`; `optimize=False` keeps every node as it is
    (the runtime's graph optimizations off), for localization; `threads`: the CPU threads of its
    pool (default `cpu_threads()`; the browser's WASM backend takes them at its first session);
    `prepack=False`: ONNX Runtime's Python sessions hold no packed copy of the weights (a check
    before writing, run a few times: see `ort.ort_session`; the other adapters hold none they
    could leave out); a ModelProto, or on ort-cpu and ort-cuda also a file's path (its external
    data read from beside it)."""
    require(name)
    if REGISTRY[name].runs != "onnx":
        raise ValueError(f"{name} runs the PyTorch module, not an ONNX model")
    return _adapter(name).prepare(name, model, optimize=optimize, threads=threads, prepack=prepack)


def prepare_torch(name: str, target, dtype: str) -> Prepared:
    """A target's module (`attnexport.target`) on `torch` or `torch-cuda` (see runtimes.pytorch)."""
    return pytorch.prepare_torch(name, target, dtype)


def ort_session(name: str, model, threads: int | None = None, optimize: bool = True,
                tf32: bool = False, cuda_graph: bool = False, spinning: bool = False):
    """The one place ONNX Runtime sessions are made in Python (see runtimes.ort.ort_session)."""
    return ort.ort_session(name, model, threads=threads, optimize=optimize, tf32=tf32, cuda_graph=cuda_graph,
                           spinning=spinning)


def reference_ops() -> list:
    """The ops attnexport gives onnx's ReferenceEvaluator (see runtimes.reference)."""
    return reference.reference_ops()


def missing_ops(name: str, model: onnx.ModelProto) -> list[str]:
    """The ops of `model` that the ONNX runtime `name` has no kernel for ("domain.op_type", with
    what of it is missing; subgraphs' too): its adapter's own list where it keeps one (onnx's reference evaluator
    knows the standard ops and the com.microsoft ones attnexport gives it, not MatMulNBits), and what
    its registry line says its kernels do not take: MatMulNBits widths (WebGPU's: 2 and 4 bits), an
    attention's padding mask (an encoder's ort flavour: `fusions.encoder`; WebGPU's take none), the
    integer int8 form's DynamicQuantizeMatMul (none on CUDA or WebGPU)."""
    adapter = _adapter(name)
    if hasattr(adapter, "missing_ops"):
        return adapter.missing_ops(model)
    runtime = REGISTRY[name]
    nodes = list(all_nodes(model.graph))
    bits = sorted({a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute
                   if a.name == "bits" and a.i not in runtime.nbits})
    missing = [f"com.microsoft.MatMulNBits of {b} bits (it takes {' and '.join(map(str, runtime.nbits))})"
               for b in bits]
    # the mask's place among each operator's inputs
    masked = {op for n in nodes if n.domain == "com.microsoft"
              for op, at in (("Attention", 3), ("MultiHeadAttention", 4))
              if n.op_type == op and len(n.input) > at and n.input[at]}
    if not runtime.padding_mask:
        missing += [f"com.microsoft.{op} with a padding mask (its kernel takes none: export the attention flavour)"
                    for op in sorted(masked)]
    integer = sorted({n.op_type for n in nodes if n.op_type in ("DynamicQuantizeMatMul", "QAttention")})
    if not runtime.integer_int8 and integer:
        # the blockwise form holds 8-bit MatMulNBits: the way out only where the runtime takes that width
        instead = ": export --int8-kernel blockwise" if 8 in runtime.nbits else \
            "; its MatMulNBits takes no 8 bits either: export int4 or fp16"
        missing.append(f"com.microsoft.{' and '.join(integer)} on its device (it would run them on the CPU{instead})")
    return missing
