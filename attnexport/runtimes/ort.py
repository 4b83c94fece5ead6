"""`ort-cpu` and `ort-cuda`: ONNX Runtime's Python package, its CPU and CUDA providers.

Every session attnexport makes goes through `ort_session`, which records where each node ran:
ONNX Runtime falls back to the CPU silently, and `ort-cuda` must prove it did not.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile

import onnx

from attnexport import files as F
from attnexport.errors import ProviderUnavailableError, first_line
from attnexport.runtimes import base as R


@functools.cache
def _ort():
    import onnxruntime as ort
    ort.set_default_logger_severity(3)
    return ort


CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def status(name: str) -> R.Status:
    """Whether the provider of `name`'s registry line runs here: the CPU always does; another one
    must be in this build and give a session its provider (a device, a driver)."""
    provider = R.REGISTRY[name].provider
    return R.Status(name, True, CPU) if provider == CPU else provider_status(name, provider)


@functools.cache
def provider_status(name: str, provider: str) -> R.Status:
    ort = _ort()
    if provider not in ort.get_available_providers():
        return R.Status(name, False, f"onnxruntime {ort.__version__} is built without {provider}" +
                        (" (install onnxruntime-gpu)" if provider == CUDA else ""))
    if provider == CUDA:
        # A CUDA build of torch loads the CUDA libraries (cuBLAS, cuDNN) from its own packages when
        # it is imported; ONNX Runtime's CUDA provider then finds them in the process, as users'
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
                return R.Status(name, False, f"the CUDA provider library failed to load: {e}")
    # The library loads: does a session really get the provider (a device, a driver)?
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    try:
        s = ort.InferenceSession(m.SerializeToString(), providers=[provider])
    except Exception as e:  # noqa: BLE001 - any failure is the reason
        return R.Status(name, False, f"{provider} failed to start: {first_line(e)}")
    if provider not in s.get_providers():
        return R.Status(name, False, f"{provider} did not start (no device or driver?)")
    return R.Status(name, True, provider)


# ONNX Runtime's CPU provider (1.24 to 1.31.1 at least, x86-64) crashes the process while it
# creates a session for a float16 graph where a Transpose feeds a MatMul: the provider computes
# float16 MatMul in float32 behind a Cast, and its NCHWc layout pass dereferences a null schema on
# that Cast (microsoft/onnxruntime#28392; a MultiHeadAttention block's projections have that
# shape). The pass serves convolutions only, so attnexport's CPU sessions of float16 graphs run
# without it; tests/test_runtimes.py checks, in a child process, that the crash is still there.
CPU_FP16_DISABLED_OPTIMIZERS = ("NchwcTransformer",)


def ort_session(name: str, model, threads: int | None = None, optimize: bool = True,
                tf32: bool = False, cuda_graph: bool = False, spinning: bool = False, prepack: bool = True):
    """An ONNX Runtime session on `name`'s provider, and where each node was placed.

    The one place sessions are made (verify, bench, bench --hf, localization), of a ModelProto or
    a model file's path: the CPU pool does not spin between runs (its spinning took the cores
    torch needed when the two took turns, and torch's time grew 2-300x) unless `spinning` (a
    language model's decode loop timed alone, as apps run it), every node's provider is recorded,
    a float16 graph on the CPU skips the pass that crashes on it, and a CUDA session that fell
    back to the CPU is an error, never a silent success. TF32 stays off unless asked for (fp32
    parity). `prepack=False` keeps the weights as they are given, not also in the CPU kernels'
    packed layouts (a second copy of every matrix: a check that runs a few times needs none).

    Returns:
        (session, {provider: ["op_type:node name", ...]}, the shape computations among the
        nodes of the graph the session runs: see `shape_computations`).
    """
    ort = _ort()
    if isinstance(model, onnx.ModelProto):
        F.fits_one_message(model)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    threads = threads or R.cpu_threads()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    workdir = None
    disabled = []
    provider = R.REGISTRY[name].provider
    providers: list = [CPU]  # another provider first, the CPU for what it leaves
    if provider == CPU:
        if R.has_fp16(model):
            disabled = list(CPU_FP16_DISABLED_OPTIMIZERS)
    else:
        opts = {"use_tf32": "1" if tf32 else "0"} if provider == CUDA else {}
        if cuda_graph:
            opts["enable_cuda_graph"] = "1"
        providers = [(provider, opts), CPU]
        # The graph as optimized, with the node names placement reports, to tell shape
        # arithmetic from a fallback (not for a model near protobuf's 2 GB limit: ONNX Runtime
        # would fail to write it; the nodes as exported serve then).
        if R.REGISTRY[name].accelerated and model.ByteSize() < 1 << 30:
            workdir = tempfile.TemporaryDirectory(prefix="attnexport-ort-")
            so.optimized_model_filepath = os.path.join(workdir.name, "optimized.onnx")
    session = ort.InferenceSession(source, so, providers=providers,
                                   disabled_optimizers=disabled or None)
    got = session.get_providers()
    if provider not in got:
        raise ProviderUnavailableError(f"runtime {name}: the session fell back to {got}")
    placement: dict[str, list[str]] = {}
    for sub in session.get_provider_graph_assignment_info():
        placement.setdefault(sub.ep_name, []).extend(f"{n.op_type}:{n.name}" for n in sub.get_nodes())
    shapes: frozenset[str] = frozenset()
    if R.REGISTRY[name].accelerated:
        graph = model
        if workdir is not None:
            with workdir:
                try:
                    graph = onnx.load(so.optimized_model_filepath)
                except Exception:  # noqa: BLE001 - not written: the nodes as exported
                    pass
        shapes = R.shape_computations(graph)
    return session, placement, shapes


def prepare(name: str, model, optimize: bool = True, threads: int | None = None, prepack: bool = True) -> R.Prepared:
    """A session of `model` (a ModelProto or a file's path) on `name` (ort-cpu or ort-cuda), run by output name."""
    session, placement, shapes = ort_session(name, model, threads=threads, optimize=optimize, prepack=prepack)
    names = [o.name for o in session.get_outputs()]

    def run(feed: dict) -> dict:
        return dict(zip(names, session.run(names, feed), strict=True))
    return R.Prepared(name, run, session.get_providers(), placement, shapes)
