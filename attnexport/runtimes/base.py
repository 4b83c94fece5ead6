"""What every runtime adapter shares, said once: the table of runtimes (`REGISTRY`, one line each:
what it runs, on which device, its adapter module, where verify and bench use it, the
MatMulNBits widths its kernel takes), a runtime's status, a model prepared to run on it, the
one timing loop, and the CPU threads a session takes when the caller names none. The adapters
import this module, never the package, whose dispatch imports them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx


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
    # The MatMulNBits widths its kernel takes (onnxruntime-web 1.30's WebGPU kernel: "Only 2b and 4b
    # quantization is supported"); the standard ops' coverage is the adapter's (`missing_ops`).
    nbits: tuple[int, ...] = (2, 4, 8)
    # Its com.microsoft.Attention and MultiHeadAttention kernels take a padding mask (mask_index,
    # key_padding_mask); onnxruntime-web 1.30's WebGPU ones refuse it ("Mask not supported").
    padding_mask: bool = True
    # It has a kernel of its own for com.microsoft.DynamicQuantizeMatMul (the integer int8 form):
    # ONNX Runtime's CPU build and onnxruntime-web's WASM one do; its CUDA and WebGPU providers
    # have none, and would run each on the CPU.
    integer_int8: bool = True
    provider: str = ""  # the ONNX Runtime execution provider the `ort` adapter gives its sessions
    # Its session binds inputs and outputs to buffers of its own (ONNX Runtime's IO binding): bench
    # binds a static cache's buffers in place, and on CUDA every input and output on the device.
    binds: bool = False


REGISTRY = {r.name: r for r in (
    Runtime("torch", "module", "cpu", "pytorch", default=True, timed=True),
    Runtime("torch-cuda", "module", "cuda", "pytorch", default=True, timed=True),
    Runtime("onnx-ref", "onnx", "cpu", "reference", default=True, timed=False),
    Runtime("ort-cpu", "onnx", "cpu", "ort", default=True, timed=True, provider="CPUExecutionProvider", binds=True),
    Runtime("ort-cuda", "onnx", "cuda", "ort", default=True, timed=True, accelerated=True,
            provider="CUDAExecutionProvider", binds=True, integer_int8=False),
    # ONNX Runtime where apps deploy it, through one JavaScript process; started when named.
    Runtime("ort-node", "onnx", "cpu", "js", default=False, timed=True),
    Runtime("ort-wasm", "onnx", "cpu", "js", default=False, timed=True),
    Runtime("ort-webgpu", "onnx", "gpu", "js", default=False, timed=True, accelerated=True, nbits=(2, 4),
            padding_mask=False, integer_int8=False),
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


# Threads of a session's CPU pool when the caller names none; None: ONNX Runtime's choice (every
# physical core). A process that shares the cores with others (a test worker) sets its share once.
_CPU_THREADS: int | None = None


def set_cpu_threads(threads: int | None) -> None:
    """Sets the CPU threads of every session made after it that names none (None: the runtime's choice)."""
    global _CPU_THREADS
    _CPU_THREADS = threads


def cpu_threads() -> int | None:
    """The CPU threads a session takes when the caller names none (see `set_cpu_threads`)."""
    return _CPU_THREADS


# Ops whose output is their input's shape, not its values.
SHAPE_OPS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class Status:
    name: str
    available: bool
    reason: str = ""  # why not, when not available; a short description otherwise
    warning: str = ""  # what it was found to compute wrong, where a probe found it (WebGPU's float16)


def cpu_nodes(runtime: str, placement: dict[str, list[str]], shape_nodes: frozenset[str]) -> list[str]:
    """Compute nodes that an accelerator runtime (ort-cuda, ort-webgpu) left on the CPU. Shape
    arithmetic does not count (`shape_nodes`, from `shape_computations`): ONNX Runtime's CUDA and
    WebGPU providers keep it there by design."""
    if not REGISTRY[runtime].accelerated:
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


def has_fp16(model: onnx.ModelProto) -> bool:
    """Whether any input, output or initializer of the graph is float16."""
    g = model.graph
    return any(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for vi in [*g.input, *g.output]) or \
        any(i.data_type == onnx.TensorProto.FLOAT16 for i in g.initializer)


def all_graphs(graph):
    """`graph` and every subgraph its nodes hold (an If's branches), each before those it holds."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield from all_graphs(g)


def all_nodes(graph):
    """Every node of `graph` and of the subgraphs its nodes hold (an If's branches), in order."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield from all_nodes(g)
