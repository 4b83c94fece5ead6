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
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from attnexport.errors import ProviderUnavailableError, UsageError


@dataclass(frozen=True)
class Runtime:
    """What a runtime is, said once: what it runs, on which device, through which adapter module of
    this package, and where verify and bench use it. Everything else asks this table (`REGISTRY`,
    the tuples below, `runs_module`, `on_cuda`) rather than reading the name."""

    name: str
    runs: str  # "module": the PyTorch module itself; "onnx": an exported model
    device: str  # "cpu", "cuda", or "gpu" (the browser's WebGPU adapter)
    adapter: str  # its module in attnexport.runtimes: status(name), and prepare(name, model, ...) for "onnx"
    default: bool  # verify uses it when no runtime is named (it runs in this process)
    timed: bool  # bench times it
    accelerated: bool = False  # a compute node it leaves on the CPU is a fallback


REGISTRY = {r.name: r for r in (
    Runtime("torch", "module", "cpu", "pytorch", default=True, timed=True),
    Runtime("torch-cuda", "module", "cuda", "pytorch", default=True, timed=True),
    Runtime("onnx-ref", "onnx", "cpu", "reference", default=True, timed=False),
    Runtime("ort-cpu", "onnx", "cpu", "ort", default=True, timed=True),
    Runtime("ort-cuda", "onnx", "cuda", "ort", default=True, timed=True, accelerated=True),
    # ONNX Runtime where apps deploy it, through one JavaScript process; started when named.
    Runtime("ort-node", "onnx", "cpu", "js", default=False, timed=True),
    Runtime("ort-wasm", "onnx", "cpu", "js", default=False, timed=True),
    Runtime("ort-webgpu", "onnx", "gpu", "js", default=False, timed=True, accelerated=True),
)}
RUNTIMES = tuple(REGISTRY)
ONNX_RUNTIMES = tuple(n for n, r in REGISTRY.items() if r.runs == "onnx")
JS_RUNTIMES = tuple(n for n, r in REGISTRY.items() if r.adapter == "js")
DEFAULT_RUNTIMES = tuple(n for n, r in REGISTRY.items() if r.default)
TIMED_RUNTIMES = tuple(n for n, r in REGISTRY.items() if r.timed)  # bench's (not the reference evaluator)
ACCELERATED = tuple(n for n, r in REGISTRY.items() if r.accelerated)


def runs_module(name: str) -> bool:
    """Whether `name` runs the PyTorch module itself (torch, torch-cuda), not an exported model."""
    return REGISTRY[name].runs == "module"


def on_cuda(name: str) -> bool:
    """Whether `name` runs on a CUDA device (its inputs and timings live there)."""
    return REGISTRY[name].device == "cuda"


def _adapter(name: str):
    if name not in REGISTRY:
        raise ValueError(name)
    return importlib.import_module(f"attnexport.runtimes.{REGISTRY[name].adapter}")


# Threads of a session's CPU pool when the caller names none; None: ONNX Runtime's choice (every
# physical core). A process that shares the cores with others (a test worker) sets its share.
DEFAULT_CPU_THREADS: int | None = None


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


# Ops whose output is their input's shape, not its values.
SHAPE_OPS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class Status:
    name: str
    available: bool
    reason: str = ""  # why not, when not available; a short description otherwise


def cpu_nodes(runtime: str, placement: dict[str, list[str]], shape_nodes: frozenset[str]) -> list[str]:
    """Compute nodes that an accelerator runtime (ort-cuda, ort-webgpu) left on the CPU. Shape
    arithmetic does not count (`shape_nodes`, from `shape_computations`): ONNX Runtime's CUDA and
    WebGPU providers keep it there by design."""
    if runtime not in ACCELERATED:
        return []
    return [n for n in placement.get("CPUExecutionProvider", []) if n not in shape_nodes]


def shape_computations(model: onnx.ModelProto) -> frozenset[str]:
    """The nodes ("op_type:name") that read tensor shapes (`Shape`, `Size`) or compute scalars and
    short vectors from shapes and constants alone, such as the target shape of a Reshape.

    ONNX Runtime's CUDA provider places such nodes on the CPU on purpose (their values are read
    by the host), so they are not a fallback. A node whose value depends on an input's values,
    or that makes a tensor of rank 2 or more (a causal mask built from shapes, say), is not shape
    arithmetic: on the CPU it is a fallback and its result is copied to the device every run.
    """
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - without inferred ranks, fewer nodes qualify
        pass
    g = model.graph
    rank = {i.name: len(i.dims) for i in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            rank[vi.name] = len(t.shape.dim)
    initializers = {i.name for i in g.initializer}
    data = {i.name for i in g.input if i.name not in initializers}  # values that depend on inputs
    found = set()
    for node in g.node:
        if node.op_type in SHAPE_OPS:  # its output is a shape: independent of its input's values
            found.add(f"{node.op_type}:{node.name}")
            continue
        if any(i in data for i in node.input) or any(a.g.node for a in node.attribute):
            data.update(node.output)
            continue
        if all(o == "" or rank.get(o, 99) <= 1 for o in node.output):
            found.add(f"{node.op_type}:{node.name}")
    return frozenset(found)


@dataclass
class Prepared:
    """A runtime ready to run one model (or module)."""

    runtime: str
    run: Callable[[dict], dict]  # dict of NumPy inputs -> dict of NumPy outputs, by output name
    providers: list[str] = field(default_factory=list)
    placement: dict[str, list[str]] = field(default_factory=dict)  # provider -> "op_type:name"
    shape_nodes: frozenset = frozenset()  # nodes that compute shapes only (shape_computations)
    note: str = ""  # what the user should know of this runtime's run (the WebGPU adapter that ran)
    # (feed, runs) -> ms of each run, timed where the runtime runs (in JavaScript: the pipe's cost
    # is not timed); None: time `run` from Python
    time_runs: Callable[[dict, int], list[float]] | None = None

    @property
    def cpu_nodes(self) -> list[str]:
        return cpu_nodes(self.runtime, self.placement, self.shape_nodes)

    def timed(self, feed: dict, warmup: int = 1, iters: int = 5) -> tuple[dict[str, np.ndarray], float]:
        """Runs `warmup` times, then `iters` times; returns the outputs and the median ms."""
        outs: dict = {}

        def call():
            outs.update(self.run(feed))
        times = time_calls(call, warmup, iters)
        return outs, statistics.median(times)


def time_call(fn: Callable[[], object], device: str = "cpu") -> float:
    """The ms one call of `fn` takes: on the host clock, or on a CUDA device by events recorded
    around it on the device (the launch's host cost is not the kernel's)."""
    if device == "cuda":
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_calls(fn: Callable[[], object], warmup: int, iters: int, device: str = "cpu") -> list[float]:
    """The one timing loop: `warmup` untimed calls, then the ms of each of `iters` (`time_call`)."""
    for _ in range(warmup):
        fn()
    return [time_call(fn, device) for _ in range(iters)]


def status(name: str) -> Status:
    """Whether `name` can run here, and what it is (or why not): its adapter says."""
    return _adapter(name).status(name)


def described(table: list[dict]) -> list[dict]:
    """select()'s table with each used runtime's description as it is after the runs (the WebGPU
    adapter is known once the browser has run)."""
    return [dict(t, reason=status(t["name"]).reason) if t["used"] else t for t in table]


def require(name: str) -> None:
    s = status(name)
    if not s.available:
        raise ProviderUnavailableError(f"runtime {name} is not available: {s.reason}")


def prepare_onnx(name: str, model: onnx.ModelProto, optimize: bool = True, threads: int | None = None) -> Prepared:
    """`model` ready to run on the ONNX runtime `name`; `optimize=False` keeps every node as it is
    (the runtime's graph optimizations off), for localization; `threads`: the CPU threads of its
    pool (default DEFAULT_CPU_THREADS; the browser's WASM backend takes them at its first session)."""
    require(name)
    if REGISTRY[name].runs != "onnx":
        raise ValueError(f"{name} runs the PyTorch module, not an ONNX model")
    return _adapter(name).prepare(name, model, optimize=optimize, threads=threads)


def prepare_torch(name, variant, options, params, dtype) -> Prepared:
    """The variant's module on `torch` or `torch-cuda` (see runtimes.pytorch)."""
    from attnexport.runtimes import pytorch
    return pytorch.prepare_torch(name, variant, options, params, dtype)


def ort_session(name: str, model, threads: int | None = None, optimize: bool = True,
                tf32: bool = False, cuda_graph: bool = False, spinning: bool = False):
    """The one place ONNX Runtime sessions are made in Python (see runtimes.ort.ort_session)."""
    from attnexport.runtimes import ort
    return ort.ort_session(name, model, threads=threads, optimize=optimize, tf32=tf32, cuda_graph=cuda_graph,
                           spinning=spinning)


def reference_ops() -> list:
    """The ops attnexport gives onnx's ReferenceEvaluator (see runtimes.reference)."""
    from attnexport.runtimes import reference
    return reference.reference_ops()


# The MatMulNBits widths each ONNX runtime's kernel takes (onnxruntime-web 1.30's WebGPU kernel:
# "Only 2b and 4b quantization is supported"); a runtime not named takes 2, 4 and 8.
NBITS = {"ort-webgpu": (2, 4)}


def missing_ops(name: str, model: onnx.ModelProto) -> list[str]:
    """The ops of `model` that the ONNX runtime `name` has no kernel for ("domain.op_type", with
    what of it is missing): onnx's reference evaluator knows the standard ops and the com.microsoft
    ones attnexport gives it (`reference_ops`), not MatMulNBits; ONNX Runtime's builds have every
    contrib op attnexport writes, but WebGPU's MatMulNBits takes 2 and 4 bits only (`NBITS`)."""
    if name == "onnx-ref":
        known = {(getattr(op, "op_domain", ""), op.__name__) for op in reference_ops()}
        return sorted({f"{n.domain}.{n.op_type}" for n in model.graph.node
                       if n.domain not in ("", "ai.onnx") and (n.domain, n.op_type) not in known})
    widths = NBITS.get(name, (2, 4, 8))
    bits = sorted({a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                   if a.name == "bits" and a.i not in widths})
    return [f"com.microsoft.MatMulNBits of {b} bits (it takes {' and '.join(map(str, widths))})" for b in bits]


def has_fp16(model: onnx.ModelProto) -> bool:
    """Whether any input, output or initializer of the graph is float16."""
    g = model.graph
    return any(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for vi in [*g.input, *g.output]) or \
        any(i.data_type == onnx.TensorProto.FLOAT16 for i in g.initializer)
