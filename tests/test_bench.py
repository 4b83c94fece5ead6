"""bench: a quick smoke test of the method and the command (timings are not asserted)."""

import json

import numpy as np
import pytest
from conftest import assert_fits_80, cli, shared_once

from attnexport import bench as B
from attnexport import runtimes as R
from attnexport import seeding
from attnexport import variants as V
from attnexport.errors import ProviderUnavailableError, UsageError

SMALL = {"batch": 2, "seq": [8, 16], "dim": 32, "heads": 4}


@pytest.fixture(scope="session")
def rows():
    """One bench run for the whole test run: the first worker to need it measures it, the others
    read it (pytest-xdist 3.8 under pytest 9 does not keep an xdist_group on one worker)."""
    return shared_once("bench-rows", lambda: B.bench("mha", SMALL, ["torch", "ort-cpu"], warmup=1, iters=3,
                                                      threads=1))


def test_rows_cover_every_runtime_flavor_and_shape(rows):
    got = {(r.runtime, r.flavor, r.shape["seq"]) for r in rows}
    want = {("torch", "-", s) for s in (8, 16)} | {("ort-cpu", f, s) for f in ("primitives", "attention", "ort")
                                                  for s in (8, 16)}
    assert got == want


def test_row_fields(rows):
    for r in rows:
        assert 0 < r.p10_ms <= r.median_ms <= r.p90_ms
        # The calibration is the best matmul of torch and ONNX Runtime: nothing may beat it.
        assert r.tflops > 0 and 0 < r.peak_fraction <= 1, (r.peak_fraction, r.peak_source)
        assert r.peak_source.split()[0] in ("torch", "onnxruntime")
        assert r.rounds == 3
        assert 0 < r.ratio_min <= r.ratio_max
        assert r.threads == 1
        assert r.max_abs_err < 1e-4, "ONNX Runtime must agree with torch on the same inputs"
        if r.runtime == "torch":
            assert r.ratio_to_torch == 1.0 and r.max_abs_err == 0.0
        else:
            assert r.ratio_to_torch > 0
        # The block's FLOPs written out from the row's shape, not taken from the registry: four
        # D x D projections, 2 B T D^2 each, and Q K^T and the weights times V, 2 B T^2 D each.
        b, t, d = r.shape["batch"], r.shape["seq"], SMALL["dim"]
        flops = 4 * 2 * b * t * d**2 + 2 * 2 * b * t**2 * d
        assert r.tflops == pytest.approx(flops / (r.median_ms / 1e3) / 1e12)


def test_fastest_picks_the_minimum(rows):
    best = B.fastest(rows)
    # One pick for every runtime and shape that ran a flavour, each the least of its rows.
    assert {(rt, shape) for rt, shape, _f, _ms in best} == {(r.runtime, r.shape_label) for r in rows if r.flavor != "-"}
    for rt, shape, flavor, ms in best:
        same = [r for r in rows if r.runtime == rt and r.shape_label == shape and r.flavor != "-"]
        assert len(same) > 1 and ms == min(r.median_ms for r in same)
        assert any(r.flavor == flavor and r.median_ms == ms for r in same)


def test_shapes_from_pairs_lists():
    shapes = B.shapes_from({"batch": [8, 4, 1], "seq": [512, 2048, 8192], "dim": 64})
    assert [(s["batch"], s["seq"]) for s in shapes] == [(8, 512), (4, 2048), (1, 8192)]
    assert [s["batch"] for s in B.shapes_from({"batch": [2], "seq": [1, 2]})] == [2, 2]
    with pytest.raises(UsageError, match="same length"):
        B.shapes_from({"batch": [1, 2], "seq": [1, 2, 3]})


def test_unsupported_flavor_is_a_note():
    rows = B.bench("sdpa", {"softcap": 2.0, "seq": 8, "kv_seq": 8}, ["ort-cpu"], flavors=["ort", "attention"],
                   warmup=0, iters=1, threads=1)
    note = [r for r in rows if r.flavor == "ort"]
    assert len(note) == 1 and "softcap" in note[0].note and note[0].median_ms != note[0].median_ms


def test_calibration_is_plausible_and_names_its_source():
    flops, where = B.calibrate_matmul("cpu", "fp32", 1, [(256, 256, 256), (64, 32, 32)], iters=3)
    assert 1e8 < flops < 1e13 and where.split()[0] in ("torch", "onnxruntime") and "x" in where
    # fp16 on the CPU: the fp32 units count too, so the fp16 peak is never below the fp32 one.
    f16, _ = B.calibrate_matmul("cpu", "fp16", 1, [(256, 256, 256)], iters=3)
    assert f16 >= 0.5 * flops


def test_fp16_and_cuda_graph_warnings_come_first():
    notes = B.warnings_for(["torch", "ort-cpu"], "fp16", cuda_graph=True)
    assert any("--cuda-graph does nothing" in n for n in notes) and any("emulate" in n for n in notes)
    assert B.warnings_for(["torch"], "fp32", cuda_graph=False) == []


def test_cli_json_and_plot(tmp_path):
    png = tmp_path / "lat.png"
    r = cli("bench", "--variant", "mha", "--runtimes", "torch,ort-cpu", "--batch", "2",
            "--seq", "8,16", "--dim", "32", "--heads", "4", "--warmup", "1", "--iters", "2",
            "--threads", "1", "--json", "--plot", str(png))
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    for row in rows:
        assert {"runtime", "flavor", "dtype", "shape", "median_ms", "p90_ms", "tflops", "peak_fraction",
                "ratio_to_torch", "max_abs_err"} <= set(row)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_is_readable_at_80_columns(tmp_path):
    r = cli("bench", "--variant", "mha", "--seq", "8", "--dim", "16",
            "--warmup", "0", "--iters", "2", "--flavor", "attention",
            "--flavor", "ort", env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    for head in ("run", "shape", "median ms", "p10-p90", "TFLOP/s", "peak", "x torch", "max err"):
        assert head in r.output
    assert "fastest on ort-cpu" in r.output
    r = cli("bench", "--variant", "posenc", "--seq", "8", "--warmup", "0",
            "--iters", "1", "--flavor", "attention", env={"COLUMNS": "80"})
    assert r.exit_code == 0 and "note: ort-cpu attention 1x8: no dot-product core" in r.output
    assert_fits_80(r.output)


@pytest.mark.parametrize("args, message", [
    (["--runtimes", "tpu"], "unknown runtime"),
    (["--seq", "8,x"], "integers separated by commas"),
    (["--batch", "1,2", "--seq", "1,2,3"], "same length"),
    (["--iters", "0"], "--iters"),
    (["--repeat", "0"], "'--repeat': 0 is not in the range x>=1"),
])
def test_cli_errors(args, message):
    r = cli("bench", "--variant", "mha", *args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_cuda_runtime_without_cuda():
    if R.status("ort-cuda").available:
        pytest.skip("this machine has a working CUDA provider")
    with pytest.raises(ProviderUnavailableError, match="ort-cuda is not available"):
        B.bench("mha", {}, ["ort-cuda"])


def test_decode_bench_times_prefill_and_one_step_per_context():
    rows = B.bench_decode("mha", {"batch": [1], "dim": 32, "heads": 4}, [8, 16], runtimes=["torch", "ort-cpu"],
                          flavors=["attention", "ort"], warmup=1, iters=2, threads=1, repeat=2)
    got = {(r.runtime, r.flavor, r.phase, r.shape["seq"], r.shape["past_seq"]) for r in rows}
    for rt, fl in (("torch", "-"), ("ort-cpu", "attention"), ("ort-cpu", "ort")):
        for c in (8, 16):
            assert (rt, fl, "prefill", c, 0) in got and (rt, fl, "decode", 1, c) in got
    for r in rows:
        assert r.tokens_per_s == pytest.approx(r.shape["batch"] * r.shape["seq"] / (r.median_ms / 1e3))
        assert r.max_abs_err < 1e-4 and 0 < r.peak_fraction <= 1
    with pytest.raises(UsageError, match="needs a variant with a KV cache"):
        B.bench_decode("encoder", {}, [8])
    r = cli("bench", "--variant", "mha", "--context", "8")
    assert r.exit_code == 2 and "--context goes with --decode" in r.output


def test_decode_bench_sets_the_sizes_each_cache_declares_it_grows_by():
    """bench --decode plans its prefill and step rows from what each cache pair declares it grows
    by (decode.growth), not from option names: sdpa's keys grow by its new keys, the decoder's
    cross cache by its memory; a static buffer's fixed positions (mha's max_seq) are no cache
    length; and a size the plan sets is refused when given, --past-kv-seq too (it was overwritten)."""
    from attnexport import decode as DC
    plan = B.decode_plan(V.get("sdpa"), {"kv_cache": True, "max_seq": 20})
    assert (plan.new, plan.past, plan.cross) == ({"seq", "kv_seq"}, {"past_seq"}, {})
    plan = B.decode_plan(V.get("decoder"), {"kv_cache": True})
    assert (plan.new, plan.past, plan.cross) == ({"seq"}, {"past_seq"}, {"kv_seq": "past_kv_seq"})
    mha = V.get("mha")
    o = mha.resolve({"kv_cache": True, "max_seq": 20})
    assert DC.cache_lengths(mha, o, V.step_signature(mha, o)) == set()
    empty = DC.empty_cache(mha, o, np.float32, V.step_signature(mha, o))  # a static buffer keeps its size
    assert {n: a.shape[2] for n, a in empty.items()} == {"key_cache": 20, "value_cache": 20}
    for variant, given in (("decoder", "past_kv_seq"), ("sdpa", "kv_seq"), ("mha", "seq")):
        with pytest.raises(UsageError, match=f"sets --{given.replace('_', '-')} itself"):
            B.bench_decode(variant, {given: [3]}, [8], runtimes=["torch"])


def test_decode_bench_of_the_static_cache_runs_in_place_beside_the_concat_cache():
    """bench --decode --kv-cache static: the static step (ONNX Runtime unbound and in place) beside
    today's concat step and torch eager of each, with the memory-bandwidth fraction of a step."""
    rows = B.bench_decode("mha", {"batch": [1], "dim": 32, "heads": 4, "kv_cache": True, "max_seq": 20}, [8, 16],
                          runtimes=["torch", "ort-cpu"], flavors=["attention"], warmup=1, iters=2, threads=1,
                          repeat=2)
    got = {(r.runtime, r.mode, r.phase, r.shape["past_seq"]) for r in rows}
    for c in (8, 16):
        for rt, mode in (("torch", "static"), ("ort-cpu", "static"), ("ort-cpu", "static in-place"),
                         ("torch", "concat"), ("ort-cpu", "concat")):
            assert (rt, mode, "decode", c) in got, got
    for r in rows:
        assert r.max_abs_err < 1e-4
        if r.phase == "decode":
            assert r.bandwidth_fraction > 0 and r.bandwidth_gbs > 0
    r = cli("bench", "--variant", "mha", "--decode", "--context", "8", "--kv-cache", "static")
    assert r.exit_code == 2 and "--kv-cache static needs --max-seq" in r.output


def test_emulated_fp16_is_calibrated_on_the_fp32_units_only(monkeypatch):
    """Where fp16 is emulated (a 1024^3 fp16 matmul takes seconds on such a CPU), the calibration
    times no fp16 matmul beyond the 256^3 probe: the fp32 peak bounds an emulated fp16 block."""
    timed = []

    def fake(device, dtype, m, k, n, threads, iters):
        timed.append((dtype, m))
        return {"torch": (50.0 if dtype == "fp16" else 1.0) * m * k * n / 1e9}
    monkeypatch.setattr(B, "_matmul_ms", fake)
    peak, where = B.calibrate_matmul("cpu", "fp16", 1, [(1024, 1024, 1024), (64, 32, 32)])
    assert [t for t in timed if t[0] == "fp16"] == [("fp16", 256)]
    assert "fp32" in where and peak == pytest.approx(2e12)
    timed.clear()  # a CPU with fp16 units (faster than fp32 on the probe) times fp16 too
    monkeypatch.setattr(B, "_matmul_ms", lambda d, dt, m, k, n, t, i: timed.append((dt, m)) or {"torch": 1.0})
    B.calibrate_matmul("cpu", "fp16", 1, [(1024, 1024, 1024)])
    assert ("fp16", 1024) in timed


@pytest.mark.parametrize("variant, options", [
    ("mha", {"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 1, "past_seq": 6}),
    ("mha", {"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 1, "past_seq": 6, "max_seq": 12, "batch": 3}),
    ("decoder", {"kv_cache": True, "seq": 1, "past_seq": 4, "kv_seq": 0, "past_kv_seq": 5}),
    ("decoder", {"kv_cache": True, "seq": 2, "past_seq": 4, "kv_seq": 0, "past_kv_seq": 5, "max_seq": 10}),
    ("sdpa", {"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 1, "kv_seq": 1, "past_seq": 5,
              "v_head_dim": 24}),
    ("sdpa", {"kv_cache": True, "causal": True, "kv_heads": 2, "seq": 2, "kv_seq": 2, "past_seq": 5, "max_seq": 12,
              "batch": 3}),
])
def test_the_least_bytes_of_a_decoding_step_are_counted_from_the_tensors(variant, options):
    """bandwidth_fraction stands on decode_step_bytes: pinned against a count made here from the
    step's own tensors (every parameter, and each cache's valid positions: a static buffer's up to
    each sequence's write_pos plus the block, a concat cache's past plus the block, a decoder's
    memory cache whole)."""
    v = V.get(variant)
    o = v.resolve(options)
    params = seeding.init_params(v, o, 0)
    inputs = seeding.make_inputs(v, o, 0)
    new = (inputs["key"].shape[2] if "key" in inputs else inputs["x"].shape[1])
    count = sum(p.size for p in params.values())
    for name in ("key_cache", "value_cache"):
        if name in inputs:
            b, h, _, d = inputs[name].shape
            count += sum(h * d * (int(w) + new) for w in inputs["write_pos"])
    for name in ("past_key", "past_value"):
        if name in inputs:
            b, h, p, d = inputs[name].shape
            count += b * h * (p + new) * d
    for name in ("past_cross_key", "past_cross_value"):
        if name in inputs:
            count += inputs[name].size
    assert B.decode_step_bytes(v, o, params, 4) == 4 * count
    assert B.decode_step_bytes(v, o, params, 2) == 2 * count


def test_the_buffers_bound_in_place_are_the_ones_the_export_recorded():
    """bench binds a static cache's buffers in place by the model's signature (`attnexport.signature`),
    not by their names: renamed in the record, the binding follows; a concat step and a file without
    a signature have none; a damaged record is a one-line error."""
    from attnexport import export as E
    from attnexport import signature as S
    static, _ = E.build_model("mha", {"batch": 1, "seq": 1, "dim": 32, "heads": 4, "kv_cache": True, "max_seq": 8},
                              "attention")
    assert B.static_buffers(static, "mha") == {"key_cache": "key_cache_out", "value_cache": "value_cache_out"}
    recorded = S.of(static)
    # The same graph, its inputs renamed: the binding is read from the record, whatever the names.
    renamed = {"key_cache": "k_buf", "value_cache": "v_buf", "key_cache_out": "k_buf_next",
               "value_cache_out": "v_buf_next"}
    for vi in [*static.graph.input, *static.graph.output]:
        vi.name = renamed.get(vi.name, vi.name)
    for node in static.graph.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) for n in node.output]
    record = S.StepSignature(tuple(renamed.get(n, n) for n in recorded.inputs),
                             tuple(renamed.get(n, n) for n in recorded.outputs), {},
                             tuple(S.CachePair(renamed[c.past], renamed[c.present], c.axis, c.kind)
                                   for c in recorded.caches), recorded.write_pos)
    props = {p.key: p for p in static.metadata_props}
    props[S.META].value = record.to_json()
    assert B.static_buffers(static, "mha") == {"k_buf": "k_buf_next", "v_buf": "v_buf_next"}
    concat, _ = E.build_model("mha", {"batch": 1, "seq": 1, "dim": 32, "heads": 4, "kv_cache": True}, "attention")
    assert B.static_buffers(concat, "mha") == {}
    del concat.metadata_props[:]
    assert B.static_buffers(concat, "a plain file") == {}
    props[S.META].value = "{not json"
    with pytest.raises(UsageError, match="metadata is damaged"):
        B.static_buffers(static, "mha")


def test_a_runtime_is_timed_as_the_registry_says_not_by_its_name(monkeypatch):
    """Two lines added to the registry, ONNX Runtime's CPU provider under other names: bench times
    both through their prepared runs, and binds a static cache's buffers in place only on the one
    whose line says its session binds buffers (`Runtime.binds`)."""
    for name, binds in (("ort-plain", False), ("ort-bound", True)):
        monkeypatch.setitem(R.REGISTRY, name, R.Runtime(name, "onnx", "cpu", "ort", default=False, timed=True,
                                                        provider="CPUExecutionProvider", binds=binds))
    monkeypatch.setattr(B, "BENCH_RUNTIMES", (*B.BENCH_RUNTIMES, "ort-plain", "ort-bound"))
    rows = B.bench_decode("mha", {"batch": [1], "dim": 32, "heads": 4, "kv_cache": True, "max_seq": 12}, [8],
                          runtimes=["torch", "ort-plain", "ort-bound"], flavors=["attention"], warmup=1, iters=2,
                          threads=1, repeat=1)
    got = {(r.runtime, r.mode) for r in rows if r.phase == "decode"}
    assert {("ort-plain", "static"), ("ort-bound", "static"), ("ort-bound", "static in-place")} <= got, got
    assert ("ort-plain", "static in-place") not in got
    for r in rows:
        assert r.max_abs_err < 1e-4, (r.runtime, r.mode, r.max_abs_err)
