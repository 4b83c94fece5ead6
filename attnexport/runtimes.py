"""One small adapter per runtime, same interface, strict about providers.

`torch` and `torch-cuda` run the PyTorch module; `onnx-ref`, `ort-cpu` and `ort-cuda` run an
exported ONNX model. A runtime that cannot run here says why (`status()`); `ort-cuda` also
proves where every node ran, because ONNX Runtime falls back to the CPU silently.
"""

from __future__ import annotations

import ctypes
import difflib
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from attnexport import dtypes as D
from attnexport import schema, seeding
from attnexport.errors import ProviderUnavailableError, UsageError, first_line

RUNTIMES = ("torch", "torch-cuda", "onnx-ref", "ort-cpu", "ort-cuda")
ONNX_RUNTIMES = ("onnx-ref", "ort-cpu", "ort-cuda")
TIMED_RUNTIMES = ("torch", "torch-cuda", "ort-cpu", "ort-cuda")  # what bench times (not the reference evaluator)


def parse(text: str | None) -> list[str] | None:
    """`--runtimes a,b,...` -> the names, checked; None (not given) -> None: every available one."""
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
    """Returns (runtimes to use, status list). Asked-for and unavailable is an error unless skipped."""
    names = list(RUNTIMES) if requested is None else requested
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
    """Compute nodes that an accelerator runtime left on the CPU. Shape arithmetic does not count
    (`shape_nodes`, from `shape_computations`): ONNX Runtime's CUDA provider keeps it there by design."""
    if runtime != "ort-cuda":
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

    @property
    def cpu_nodes(self) -> list[str]:
        return cpu_nodes(self.runtime, self.placement, self.shape_nodes)

    def timed(self, feed: dict, warmup: int = 1, iters: int = 5) -> tuple[dict[str, np.ndarray], float]:
        """Runs `warmup` times, then `iters` times; returns the outputs and the median ms."""
        for _ in range(warmup):
            outs = self.run(feed)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            outs = self.run(feed)
            times.append((time.perf_counter() - t0) * 1e3)
        return outs, statistics.median(times)


# --- availability ----------------------------------------------------------------------------

@functools.cache
def _ort():
    import onnxruntime as ort
    ort.set_default_logger_severity(3)
    return ort


@functools.cache
def _torch_cuda_status() -> Status:
    import torch
    if torch.version.cuda is None:
        return Status("torch-cuda", False, f"this torch build has no CUDA (torch {torch.__version__})")
    if not torch.cuda.is_available():
        return Status("torch-cuda", False, f"torch {torch.__version__} sees no CUDA device")
    return Status("torch-cuda", True, torch.cuda.get_device_name(0))


@functools.cache
def _ort_cuda_status() -> Status:
    ort = _ort()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return Status("ort-cuda", False, f"onnxruntime {ort.__version__} is built without the CUDA provider "
                                         "(install onnxruntime-gpu)")
    # A CUDA build of torch loads the CUDA libraries (cuBLAS, cuDNN) from its own packages when it
    # is imported; ONNX Runtime's CUDA provider then finds them in the process, as users'
    # apps do when they import torch first.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    lib = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
    if os.path.exists(lib):
        try:
            ctypes.CDLL(lib)
        except OSError as e:
            return Status("ort-cuda", False, f"the CUDA provider library failed to load: {e}")
    # The library loads: does a session really get the CUDA provider (a device, a driver)?
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    try:
        s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - any failure is the reason
        return Status("ort-cuda", False, f"the CUDA provider failed to start: {first_line(e)}")
    if "CUDAExecutionProvider" not in s.get_providers():
        return Status("ort-cuda", False, "the CUDA provider did not start (no CUDA device or driver?)")
    return Status("ort-cuda", True, "CUDAExecutionProvider")


def status(name: str) -> Status:
    if name not in RUNTIMES:
        raise ValueError(name)
    if name == "torch-cuda":
        return _torch_cuda_status()
    if name == "ort-cuda":
        return _ort_cuda_status()
    return Status(name, True, {"torch": "PyTorch eager, CPU", "onnx-ref": "onnx.reference.ReferenceEvaluator",
                               "ort-cpu": "CPUExecutionProvider"}[name])


def require(name: str) -> None:
    s = status(name)
    if not s.available:
        raise ProviderUnavailableError(f"runtime {name} is not available: {s.reason}")


# --- torch -----------------------------------------------------------------------------------

def prepare_torch(name: str, variant: schema.Variant, options: dict, params: dict, dtype: str) -> Prepared:
    """The variant's module on CPU or CUDA; outputs are named by the variant's declared outputs
    (a module returning more than it declares gets the extras as `<unnamed i>`)."""
    import torch
    require(name)
    device = "cuda" if name == "torch-cuda" else "cpu"
    tdtype = D.torch_dtype(dtype)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: no TF32
        torch.backends.cudnn.allow_tf32 = False
    module = seeding.load_params(variant.build(options), params).to(device=device, dtype=tdtype).eval()
    declared = [s.name for s in variant.outputs(options)]

    def run(feed):
        args = [torch.from_numpy(np.ascontiguousarray(a)).to(device=device,
                                                             dtype=tdtype if a.dtype.kind == "f" else None)
                for a in feed.values()]
        with torch.no_grad():
            out = module(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        out = out if isinstance(out, tuple) else (out,)
        arrays = [t.float().cpu().numpy() for t in out]
        names = declared + [f"<unnamed {i}>" for i in range(len(declared), len(arrays))]
        return dict(zip(names, arrays, strict=False))  # fewer outputs than declared: the missing are said

    return Prepared(name, run, [device])


# --- ONNX ------------------------------------------------------------------------------------

def reference_ops() -> list:
    """The ops attnexport gives onnx's ReferenceEvaluator: com.microsoft.MultiHeadAttention, which
    it lacks, and GatherElements, which it gets wrong where the gathered axis is longer than the
    numpy.choose it relies on takes (64 choices in numpy 2; onnx 1.23's fallback then reads one
    element per row and fails to reshape: a BertModel's position ids, (1, 512) gathered to
    (1, T), broke the whole model on that runtime). The replacement is the operator's definition
    with numpy.take_along_axis."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        def _run(self, data, indices, axis=None):
            axis = 0 if axis is None else axis
            axis = axis % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices)  # negative: from the end
            # out[i][j] = data[i][indices[i][j]] (axis 1): the other axes as long as the indices'.
            data = data[tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape))]
            return (np.take_along_axis(data, indices.astype(np.int64), axis=axis),)
    return [mha_reference_op(), GatherElements]


def mha_reference_op():
    """com.microsoft.MultiHeadAttention for onnx's ReferenceEvaluator (the subset attnexport emits)."""
    from onnx.reference.op_run import OpRun

    class MultiHeadAttention(OpRun):
        op_domain = "com.microsoft"

        def _run(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                 past_key=None, past_value=None, *unused, num_heads=None, scale=None, unidirectional=None,
                 mask_filter_value=None):
            B, S, D = query.shape
            L, N = key.shape[1], num_heads
            q = query.reshape(B, S, N, D // N).transpose(0, 2, 1, 3)
            k = key.reshape(B, L, N, -1).transpose(0, 2, 1, 3)
            v = value.reshape(B, L, N, -1).transpose(0, 2, 1, 3)
            P = 0
            if past_key is not None:  # the cache: past keys/values first; causal offset by their number
                P = past_key.shape[2]
                k, v = np.concatenate([past_key, k], axis=2), np.concatenate([past_value, v], axis=2)
            s = (q @ k.transpose(0, 1, 3, 2)) * (scale if scale else 1.0 / np.sqrt(D // N))
            if attention_bias is not None:
                s = s + attention_bias
            if unidirectional:
                s = s + np.where(np.tril(np.ones((S, P + L), bool), k=P), 0, -np.inf).astype(s.dtype)
            with np.errstate(invalid="ignore"):
                e = np.exp(s - s.max(-1, keepdims=True))
                p = (e / e.sum(-1, keepdims=True)).astype(query.dtype)
            out = (p @ v).transpose(0, 2, 1, 3).reshape(B, S, -1)
            if past_key is not None:
                return out.astype(query.dtype), k.astype(query.dtype), v.astype(query.dtype)
            return (out.astype(query.dtype),)

    return MultiHeadAttention


def prepare_onnx(name: str, model: onnx.ModelProto, optimize: bool = True) -> Prepared:
    """A session of `model` on an ONNX runtime; `optimize=False` keeps every node as it is
    (ONNX Runtime's graph optimizations off), for localization."""
    require(name)
    if name == "onnx-ref":
        from onnx.reference import ReferenceEvaluator
        ev = ReferenceEvaluator(model, new_ops=reference_ops())
        ref_names = list(ev.output_names)

        def run_ref(feed):
            with np.errstate(all="ignore"):  # fully masked rows make NaN before the guard selects 0
                return {n: np.asarray(o) for n, o in zip(ref_names, ev.run(None, feed), strict=True)}
        return Prepared(name, run_ref, ["ReferenceEvaluator"])

    session, placement, shapes = ort_session(name, model, optimize=optimize)
    names = [o.name for o in session.get_outputs()]

    def run_ort(feed):
        return dict(zip(names, session.run(names, feed), strict=True))
    return Prepared(name, run_ort, session.get_providers(), placement, shapes)


# ONNX Runtime's CPU provider (1.24 to 1.31.1 at least, x86-64) crashes the process while it
# creates a session for a float16 graph where a Transpose feeds a MatMul: the provider computes
# float16 MatMul in float32 behind a Cast, and its NCHWc layout pass dereferences a null schema on
# that Cast (microsoft/onnxruntime#28392; a MultiHeadAttention block's projections have that
# shape). The pass serves convolutions only, so attnexport's CPU sessions of float16 graphs run
# without it; tests/test_runtimes.py checks, in a child process, that the crash is still there.
CPU_FP16_DISABLED_OPTIMIZERS = ("NchwcTransformer",)


def has_fp16(model: onnx.ModelProto) -> bool:
    """Whether any input, output or initializer of the graph is float16."""
    g = model.graph
    return any(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for vi in [*g.input, *g.output]) or \
        any(i.data_type == onnx.TensorProto.FLOAT16 for i in g.initializer)


# Threads of a session's CPU pool when the caller names none; None: ONNX Runtime's choice (every
# physical core). A process that shares the cores with others (a test worker) sets its share.
DEFAULT_CPU_THREADS: int | None = None


def ort_session(name: str, model: onnx.ModelProto, threads: int | None = None, optimize: bool = True,
                tf32: bool = False, cuda_graph: bool = False):
    """An ONNX Runtime session on `name`'s provider, and where each node was placed.

    The one place sessions are made (verify, bench, localization): the CPU pool does not spin
    between runs (its spinning took the cores torch needed when the two took turns, and torch's
    time grew 2-300x), every node's provider is recorded, and a CUDA session that fell back to
    the CPU is an error, never a silent success. TF32 stays off unless asked for (fp32 parity).

    Returns:
        (session, {provider: ["op_type:node name", ...]}, the shape computations among the
        nodes of the graph the session runs: see `shape_computations`).
    """
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    threads = threads or DEFAULT_CPU_THREADS
    if threads:
        so.intra_op_num_threads = threads
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    workdir = None
    disabled = []
    providers: list = ["CPUExecutionProvider"]  # ort-cuda: CUDA first, the CPU for what it leaves
    if name == "ort-cpu":
        if has_fp16(model):
            disabled = list(CPU_FP16_DISABLED_OPTIMIZERS)
    else:
        opts = {"use_tf32": "1" if tf32 else "0"}
        if cuda_graph:
            opts["enable_cuda_graph"] = "1"
        providers = [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]
        # The graph as optimized, with the node names placement reports, to tell shape
        # arithmetic from a fallback (not for a model near protobuf's 2 GB limit: ONNX Runtime
        # would fail to write it; the nodes as exported serve then).
        if model.ByteSize() < 1 << 30:
            workdir = tempfile.TemporaryDirectory(prefix="attnexport-ort-")
            so.optimized_model_filepath = os.path.join(workdir.name, "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), so, providers=providers,
                                   disabled_optimizers=disabled or None)
    got = session.get_providers()
    if name == "ort-cuda" and "CUDAExecutionProvider" not in got:
        raise ProviderUnavailableError(f"runtime ort-cuda: the session fell back to {got}")
    placement: dict[str, list[str]] = {}
    for sub in session.get_provider_graph_assignment_info():
        placement.setdefault(sub.ep_name, []).extend(f"{n.op_type}:{n.name}" for n in sub.get_nodes())
    shapes: frozenset[str] = frozenset()
    if name == "ort-cuda":
        graph = model
        if workdir is not None:
            with workdir:
                try:
                    graph = onnx.load(so.optimized_model_filepath)
                except Exception:  # noqa: BLE001 - not written: the nodes as exported
                    pass
        shapes = shape_computations(graph)
    return session, placement, shapes
