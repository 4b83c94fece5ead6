"""The CUDA half: verify, placement and bench on torch-cuda and ort-cuda.

Every test here needs a CUDA device and ONNX Runtime's CUDA provider; where they are absent
(CI has no GPU) each one skips with the reason the runtime gave. On the GPU machine they run
(see benchmarks/gpu-run.sh).
"""

import numpy as np
import pytest

from attnexport import bench as B
from attnexport import export as E
from attnexport import golden, seeding
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport import verify as VF


def _need(*names):
    for name in names:
        s = R.status(name)
        if not s.available:
            pytest.skip(f"{name} is not available: {s.reason}")


@pytest.fixture(scope="module")
def cuda():
    _need("torch-cuda", "ort-cuda")


def _gqa_in_fp32_on_the_cpu(row, dtype) -> bool:
    """A row that strict placement failed only because ONNX Runtime's CUDA provider has no float32
    GroupQueryAttention (the ort flavour's static step): reported, and right where it ran."""
    return (dtype == "fp32" and row.flavor == "ort" and bool(row.cpu_nodes) and bool(row.comparisons)
            and all(n.startswith("GroupQueryAttention:") for n in row.cpu_nodes)
            and all(c.passed for c in row.comparisons))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_golden_case_passes_on_cuda_with_strict_placement(cuda, dtype):
    report = VF.verify(runtimes=["torch-cuda", "ort-cuda"], dtype=dtype, strict_placement=True)
    bad = [r for r in report.rows if not r.passed and not r.skipped and not _gqa_in_fp32_on_the_cpu(r, dtype)]
    assert not bad, "\n".join(r.describe() for r in bad)
    fallback = [r for r in report.rows if _gqa_in_fp32_on_the_cpu(r, dtype)]
    assert all(not r.passed and "ran on the CPU" in r.error for r in fallback)  # strict: loud, never a pass
    if dtype == "fp16":
        assert not [r for r in report.rows if r.cpu_nodes], "fp16: every node on the device"
    ran = [r for r in report.rows if r.runtime == "ort-cuda" and not r.skipped]
    assert {r.flavor for r in ran} == set(E.FLAVORS)
    assert all(r.comparisons for r in ran)


@pytest.mark.parametrize("flavor", E.FLAVORS)
def test_fully_masked_rows_are_zero_on_cuda(cuda, flavor):
    """ONNX Runtime's CUDA kernels have given NaN for rows with no visible key."""
    case = golden.load("sdpa-fully-masked-rows")
    report = VF.verify(variants=["sdpa"], runtimes=["ort-cuda"], flavors=[flavor])
    rows = [r for r in report.rows if r.case == case.name]
    assert rows
    for r in rows:
        assert not r.skipped, r.describe()  # every flavour expresses this case
        out = r.arrays["output"]
        assert not np.isnan(out).any()
        masked = ~case.inputs["attn_mask"].any(-1)  # rows whose mask hides every key
        assert masked.any()
        # Zeros: exactly so behind the graph's guard, within fp32 rounding from a fused kernel.
        assert np.abs(out[np.broadcast_to(masked, out.shape[:-1])]).max() <= 1e-6
        assert r.passed, r.describe()


@pytest.mark.parametrize("seq,kv_seq", [(3, 7), (7, 3)])
@pytest.mark.parametrize("flavor", ["primitives", "attention"])
def test_causal_with_different_lengths_agrees_with_the_cpu(cuda, flavor, seq, kv_seq):
    """Causal masks with query and key lengths that differ: the two providers must agree."""
    variant = V.get("sdpa")
    o = variant.resolve({"batch": 2, "heads": 4, "seq": seq, "kv_seq": kv_seq, "head_dim": 16, "causal": True})
    params = seeding.init_params(variant, o, 0)
    model = E.build_model("sdpa", o, flavor, params=params)[0]
    feed = seeding.make_inputs(variant, o, 1)
    got = R.prepare_onnx("ort-cuda", model).run(feed)["output"]
    want = R.prepare_onnx("ort-cpu", model).run(feed)["output"]
    assert np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("flavor", ["attention", "ort"])
def test_every_compute_node_runs_on_cuda(cuda, flavor):
    for variant, o in (("mha", {"causal": True}), ("mha", {"mask": "padding"}), ("sdpa", {"mask": "bool"})):
        v = V.get(variant)
        opts = v.resolve(o)
        model = E.build_model(variant, opts, E.graph_flavor(v, flavor), params=seeding.init_params(v, opts, 0))[0]
        _, placement, shapes = R.ort_session("ort-cuda", model)
        assert R.cpu_nodes("ort-cuda", placement, shapes) == [], (variant, o, placement)


def test_bench_on_cuda_binds_device_memory_and_stays_under_the_peak(cuda):
    rows = B.bench("mha", {"batch": 2, "seq": [64, 128], "dim": 256, "heads": 4}, ["torch-cuda", "ort-cuda"],
                   dtype="fp16", warmup=2, iters=6, repeat=2, cuda_graph=True)
    modes = {(r.runtime, r.mode) for r in rows}
    assert {("torch-cuda", "eager"), ("torch-cuda", "cuda-graph"), ("ort-cuda", "io-binding"),
            ("ort-cuda", "io-binding cuda-graph")} <= modes
    for r in rows:
        if r.runtime == "ort-cuda" and r.flavor in ("attention", "ort"):
            assert r.cpu_nodes == []
        assert 0 < r.peak_fraction <= 1, (r.peak_fraction, r.peak_source)
        assert r.peak_source.split()[1] == "fp16"
        assert r.max_abs_err < 2e-2, (r.runtime, r.flavor, r.mode, r.max_abs_err)
        assert r.peak_mem_bytes is not None and r.peak_mem_bytes > 0


def test_static_cache_step_runs_in_place_on_cuda(cuda):
    """bench --decode --kv-cache static on CUDA: the step with its buffers bound in and out (written in
    place by TensorScatter or ScatterElements) and in a CUDA graph, each as right as torch's, with the
    step's fraction of the GPU's read bandwidth. Until the valid count came from device positions,
    ONNX Runtime ran it on the CPU and refused every capture of the static step (H100, 2026-11-24)."""
    rows = B.bench_decode("mha", {"batch": [2], "dim": 64, "heads": 4, "kv_cache": True, "max_seq": 80}, [16, 64],
                          runtimes=["torch-cuda", "ort-cuda"], dtype="fp16", warmup=2, iters=6, repeat=2,
                          cuda_graph=True)
    # The ort flavour's static step is GroupQueryAttention, whose total_sequence_length ONNX Runtime
    # reads on the host: computed from the positions, its copy to the host stopped every capture on
    # an H200 (2026-11-26); from shapes (attnexport.onnx_attention._gqa_total) it is captured too.
    refused = [(r.flavor, r.mode, r.note) for r in rows if r.median_ms != r.median_ms]
    assert not refused  # every step captured: nothing of it on the CPU, no copy between host and device
    got = {(r.runtime, r.flavor, r.mode, r.phase) for r in rows}
    for flavor in E.FLAVORS:
        for mode in ("static io-binding", "static in-place", "static in-place cuda-graph", "concat io-binding",
                     "concat io-binding cuda-graph"):
            assert ("ort-cuda", flavor, mode, "decode") in got, (flavor, mode, sorted(got))  # timed or refused
    assert ("torch-cuda", "-", "static cuda-graph", "decode") in got
    for r in rows:
        assert r.max_abs_err < 2e-2, (r.runtime, r.flavor, r.mode, r.max_abs_err)
        if r.phase == "decode":
            assert 0 < r.bandwidth_fraction <= 1 and r.bandwidth_gbs > 100, (r.mode, r.bandwidth_gbs)


@pytest.mark.parametrize("example", ["causal_self_attention", "cross_attention", "encoder_layer", "rotary_attention",
                                     "handwritten_attention", "kv_cache_module"])
def test_the_examples_verify_on_cuda_in_fp16(cuda, example, tmp_path):
    """Each example's module exported in fp16 in every flavour and verified on ort-cuda against the
    module in float32 (the kv_cache_module with its decode property)."""
    from attnexport import modules as M
    spec = f"examples/{example}.py:example"
    cache = {"past_key": "present_key", "past_value": "present_value"} if example == "kv_cache_module" else None
    module, inputs = M.load(spec)
    for flavor in E.FLAVORS:
        path = tmp_path / f"{flavor}.onnx"
        E.export_module(module, inputs, flavor=flavor, dtype="fp16", output=path, name=spec, cache=cache)
        report = VF.verify_module(path, spec, ["ort-cuda"])
        assert report.rows and all(r.passed and r.comparisons for r in report.rows), \
            "\n".join(r.describe() for r in report.rows if not r.passed)
