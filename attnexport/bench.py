"""bench: time every runtime and flavour against PyTorch eager, with FLOP/s and a roofline.

Method: one export per flavour (its symbolic axes serve every shape), seeded inputs, `warmup`
untimed runs, then `iters` timed runs; median, p10 and p90. Throughput comes from the
registry's FLOP count; `peak_fraction` divides it by the dense matrix-multiply throughput of
the same device and dtype, measured by a calibration run in this process. Every row also
reports its max error against torch eager on the same inputs, so a fast wrong result cannot hide.
On CUDA, inputs and outputs live in device memory (IO binding for ONNX Runtime) and CUDA events
time the runs.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from attnexport import decode as DC
from attnexport import dtypes as D
from attnexport import export as E
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport import schema, seeding
from attnexport import signature as S
from attnexport import target as T
from attnexport import variants as V
from attnexport.errors import UnsupportedByFlavor, UsageError, first_line

BENCH_RUNTIMES = R.TIMED_RUNTIMES
SIZE_LISTS = ("batch", "seq", "kv_seq", "past_seq", "past_kv_seq")  # options that take comma-separated lists


@dataclass
class BenchRow:
    variant: str
    runtime: str
    flavor: str  # "-" for torch
    mode: str  # eager, cuda-graph, compile, io-binding, ...
    dtype: str
    shape: dict
    median_ms: float
    p10_ms: float
    p90_ms: float
    tflops: float
    peak_fraction: float
    peak_tflops: float  # the calibrated dense matmul throughput it is a fraction of
    ratio_to_torch: float | None
    max_abs_err: float | None  # against torch eager on the same inputs
    peak_mem_bytes: int | None  # CUDA runtimes only
    threads: int
    cpu_nodes: list[str] = field(default_factory=list)
    note: str = ""
    peak_source: str = ""  # the matmul that set the calibrated peak (runtime, dtype, M x K x N)
    phase: str = ""  # with --decode: "prefill" (the prompt into an empty cache) or "decode" (one token)
    tokens_per_s: float | None = None  # with --decode: tokens the phase processes per second
    ratio_min: float | None = None  # the ratio to torch eager, per round: its lowest and highest
    ratio_max: float | None = None
    rounds: int = 0
    # with --decode, decode rows: the least bytes a step moves (the weights once, the cache's
    # valid prefix read once) per second, as a fraction of the measured memory bandwidth
    bandwidth_fraction: float | None = None
    bandwidth_gbs: float | None = None  # the bandwidth it is a fraction of (GB/s): the device's memory read
    # The same bytes per second over the read rate of a buffer as large as the step reads (what a
    # working set that stays in the last-level cache between steps can reach), and that rate.
    working_set_fraction: float | None = None
    working_set_gbs: float | None = None
    ratio_to_ort_cpu: float | None = None  # the deployment runtimes: against Python's ONNX Runtime CPU, same flavour

    @property
    def shape_label(self) -> str:
        label = "x".join(str(self.shape[k]) for k in ("batch", "seq") if k in self.shape)
        return f"{label}+{self.shape['past_seq']}" if self.shape.get("past_seq") else label


def stats_of(ms: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of timings."""
    a = np.asarray(ms)
    return float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90))


def shapes_from(options: dict) -> list[dict]:
    """Expands comma-separated size lists; lists of equal length pair up, single values repeat."""
    lists = {k: v for k, v in options.items() if k in SIZE_LISTS and isinstance(v, (list, tuple))}
    n = max((len(v) for v in lists.values()), default=1)
    for k, v in lists.items():
        if len(v) not in (1, n):
            raise UsageError(f"--{k.replace('_', '-')} has {len(v)} values; the size lists must have "
                             f"the same length ({n}) or one value")
    out = []
    for i in range(n):
        o = dict(options)
        for k, v in lists.items():
            o[k] = v[i] if len(v) > 1 else v[0]
        out.append(o)
    return out


def calibration_sizes(shapes: list[dict]) -> list[tuple[int, int, int]]:
    """Matrix sizes (M, K, N) like the block's own projections, plus square ones."""
    sizes = {(1024, 1024, 1024), (2048, 2048, 2048)}
    for o in shapes:
        d = o.get("dim") or o.get("head_dim") or 64
        sizes.add((o.get("batch", 1) * o.get("seq", 1), d, d))
    return sorted(sizes)


def calibrate_matmul(device: str, dtype: str, threads: int, sizes: list[tuple[int, int, int]] | None = None,
                     iters: int = 10) -> tuple[float, str]:
    """The machine's dense matmul peak for `dtype` (FLOP/s) and where it was measured.

    The best (fastest single run) of torch's and ONNX Runtime's matmul over `sizes`, so that no
    kernel either runtime uses for the block can beat its "peak". On the CPU an fp16 block may be
    computed through fp32 units, so the fp32 matmuls count for it too.
    """
    sizes = sizes or ([(8192, 8192, 8192)] if device == "cuda" else [(2048, 2048, 2048)])
    dtypes = [dtype] + (["fp32"] if device == "cpu" and dtype == "fp16" else [])
    if device == "cpu" and dtype == "fp16" and fp16_is_emulated(threads):
        # Emulated fp16 (no fp16 units: a 1024^3 matmul takes seconds) cannot beat the fp32 units
        # it runs on: the fp32 peak bounds it, measured at a fraction of the cost.
        dtypes = ["fp32"]
    best, where = 0.0, ""
    for dt in dtypes:
        for m, k, n in sizes:
            for runtime, ms in _matmul_ms(device, dt, m, k, n, threads, iters).items():
                flops = 2 * m * k * n / (ms / 1e3)
                if flops > best:
                    best, where = flops, f"{runtime} {dt} {m}x{k}x{n}"
    return best, where


def fp16_is_emulated(threads: int) -> bool:
    """Whether this CPU's fp16 matmul is slower than its fp32 one (no fp16 units: torch and ONNX
    Runtime convert and compute in software). Probed on small matrices, in milliseconds."""
    half = min(_matmul_ms("cpu", "fp16", 256, 256, 256, threads, 3).values())
    single = min(_matmul_ms("cpu", "fp32", 256, 256, 256, threads, 3).values())
    return half > single


@functools.cache
def _matmul_ms(device: str, dtype: str, m: int, k: int, n: int, threads: int, iters: int) -> dict[str, float]:
    """The fastest run of torch's (and on the CPU ONNX Runtime's) (m x k) @ (k x n), in ms. Measured
    once per process: later benches in it (the tests, a notebook) share the calibration."""
    import torch
    tdtype = D.torch_dtype(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=tdtype, generator=g)
    b = torch.randn(k, n, device=device, dtype=tdtype, generator=g)
    timings = {"torch": _best_of(lambda: a @ b, device, iters)}
    if device == "cpu":
        timings["onnxruntime"] = _ort_matmul_ms(a.numpy(), b.numpy(), threads, iters)
    return timings


CALIBRATION_SECONDS = 1.0  # a size's timed runs stop after about this long (at least 3 of them)


def _best_of(fn, device: str, iters: int) -> float:
    """The fastest of up to `iters` timed runs of fn, in ms, after one warm-up run; a large matmul on few
    threads (0.4 s for 2048^3 on one core) gets as many runs as fit CALIBRATION_SECONDS, at least
    3, which keeps the calibration a small part of a bench."""
    fn()
    first = R.time_call(fn, device)
    runs = max(3, min(iters, int(CALIBRATION_SECONDS * 1e3 / max(first, 1e-3))))
    return min([first] + [R.time_call(fn, device) for _ in range(runs)])


def _ort_matmul_ms(a: np.ndarray, b: np.ndarray, threads: int, iters: int) -> float:
    """The fastest of `iters` runs of ONNX Runtime's CPU MatMul on a and b, in ms."""
    from onnx import helper
    elem = helper.np_dtype_to_tensor_dtype(a.dtype)
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "calibrate",
                          [helper.make_tensor_value_info("a", elem, a.shape),
                           helper.make_tensor_value_info("b", elem, b.shape)],
                          [helper.make_tensor_value_info("c", elem, (a.shape[0], b.shape[1]))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session, _ = _ort_session("ort-cpu", model, "fp32", threads, False)
    feed = {"a": a, "b": b}
    return _best_of(lambda: session.run(None, feed), "cpu", iters)


def _ort_session(runtime: str, model, dtype: str, threads: int, cuda_graph: bool):
    """The shared session builder (runtimes.ort_session); TF32 allowed for fp16 timing only."""
    session, placement, shapes = R.ort_session(runtime, model, threads=threads, tf32=dtype != "fp32",
                                               cuda_graph=cuda_graph)
    return session, R.cpu_nodes(runtime, placement, shapes)


@dataclass(frozen=True)
class BenchRequest:
    """What to time: a variant (or a user's module as one, `module_variant`) at the shapes its
    options list (comma lists of sizes), on runtimes and flavours, and how (warm-up runs, timed
    runs, rounds, threads, CUDA graphs). `bench` takes one, or its fields."""

    variant: str | schema.Variant
    options: dict | None = None
    runtimes: list[str] | None = None  # default: every runtime of this process that can run here
    flavors: list[str] | None = None
    dtype: str = "fp32"
    warmup: int = 5
    iters: int = 30
    cuda_graph: bool = False
    threads: int | None = None  # default: every core
    seed: int = 0
    repeat: int = 5


def bench(request: BenchRequest | str | schema.Variant, options: dict | None = None,
          runtimes: list[str] | None = None, *, progress: Callable[[int, int, str], None] | None = None,
          **fields) -> list[BenchRow]:
    """Times the variant on each runtime and flavour at each shape; see the module docstring.
    Takes a BenchRequest, or its fields (`bench("mha", {"seq": [128, 512]}, ["torch", "ort-cpu"])`)."""
    import torch

    if isinstance(request, BenchRequest):
        if options is not None or runtimes is not None or fields:
            raise TypeError("give a BenchRequest or its fields, not both")
        r = request
    else:
        r = BenchRequest(request, options, runtimes, **fields)
    variant = r.variant if isinstance(r.variant, schema.Variant) else V.get(r.variant)
    dtype, warmup, iters, repeat, threads, seed = r.dtype, r.warmup, r.iters, r.repeat, r.threads, r.seed
    D.check(dtype)
    if warmup < 0 or iters < 1:
        raise UsageError("--warmup must be >= 0 and --iters >= 1")
    if repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {repeat}")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    # Default: every runtime that can run here.
    runtimes = list(r.runtimes or [rt for rt in BENCH_RUNTIMES if rt in R.DEFAULT_RUNTIMES and R.status(rt).available])
    for rt in runtimes:
        if rt not in BENCH_RUNTIMES:
            raise UsageError(f"unknown runtime {rt!r} for bench; valid: {', '.join(BENCH_RUNTIMES)}")
        R.require(rt)
    if any(rt in R.JS_RUNTIMES for rt in runtimes) and "ort-cpu" not in runtimes:
        runtimes.append("ort-cpu")  # the deployment runtimes are compared with Python's ONNX Runtime too
    flavors = FL.check_all(r.flavors)
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    shapes = [variant.resolve(s) for s in shapes_from(dict(r.options or {}))]
    for o in shapes:
        schema.check_memory(variant, o, D.ITEMSIZE[dtype])
    base = shapes[0]
    params = seeding.init_params(variant, base, seed) if variant.export is None else \
        {k: v.detach().float().numpy() for k, v in variant.build(base).state_dict().items()}
    tdtype = D.torch_dtype(dtype)

    # One export per graph flavour: the symbolic axes serve every shape.
    models, notes = {}, {}
    onnx_rts = [r for r in runtimes if not R.runs_module(r)]
    for f in flavors if onnx_rts else []:
        gf = E.graph_flavor(variant, f)
        try:
            models[f] = (E.build_model(variant.name, base, gf, dtype=dtype, params=params)[0] if variant.export is None
                         else variant.export(base, f, dtype, params))
        except UnsupportedByFlavor as e:
            notes[f] = str(e)

    devices = {"cuda" if R.on_cuda(rt) else "cpu" for rt in runtimes}
    if progress:
        progress(0, len(shapes), "calibrating the matmul peak")
    sizes = calibration_sizes(shapes)
    peak = {d: calibrate_matmul(d, dtype, threads, sizes if d == "cpu" else None) for d in devices}

    rows: list[BenchRow] = []
    run = _Run(runtimes, dtype, tdtype, devices, peak, warmup, iters, r.cuda_graph, threads, repeat)
    for i, o in enumerate(shapes):
        def said(what, i=i):
            if progress:
                progress(i, len(shapes), f"shape {i + 1} of {len(shapes)}: {what}")
        rows += _bench_shape(variant, o, params, inputs_seed=seed + 1, models=models, run=run, said=said)
    if progress:
        progress(len(shapes), len(shapes), "done")
    for f, why in notes.items():
        rows.append(_untimed_row(variant, ",".join(onnx_rts), f, "-", dtype, {}, threads, why))
    return rows


def _untimed_row(variant, runtime, flavor, mode, dtype, shape, threads, note) -> BenchRow:
    """A row that says why there is no timing (NaN times, the reason in its note)."""
    nan = float("nan")
    return BenchRow(variant.name, runtime, flavor, mode, dtype, shape, nan, nan, nan, nan, nan, nan, None, None,
                    None, threads, note=note)


@dataclass
class _Candidate:
    runtime: str
    flavor: str
    mode: str
    device: str
    fn: Callable  # one timed run
    outputs: Callable  # -> list of NumPy outputs after the runs
    cpu_nodes: list[str] = field(default_factory=list)
    memory: int | None = None  # peak device bytes, measured alone when the candidate was built
    times: list[float] = field(default_factory=list)
    rounds: list[list[float]] = field(default_factory=list)  # the timed runs of each round
    # (runs) -> ms of each, timed where the runtime runs (the deployment runtimes: the pipe to their
    # process is not timed); None: `fn` is timed here
    block: Callable[[int], list[float]] | None = None
    note: str = ""  # what the runtime says of itself (the WebGPU adapter, the WASM threads)


@dataclass(frozen=True)
class _Run:
    """How one bench times every shape: the same for all of them."""

    runtimes: list[str]
    dtype: str
    tdtype: Any  # torch's dtype for `dtype` (torch is imported when a bench runs)
    devices: set[str]
    peak: dict  # device -> (FLOP/s, where measured)
    warmup: int
    iters: int
    cuda_graph: bool
    threads: int
    repeat: int


def _bench_shape(variant, o, params, inputs_seed, models, run: _Run, said):
    """Times every candidate at one shape, in rounds: each round gives every candidate one untimed
    run and then a block of timed runs. A slow drift of the machine (clock, a noisy neighbour)
    then affects all candidates alike, while runs within a block stay back to back: interleaving
    single runs would make torch's and ONNX Runtime's spinning thread pools fight over the cores."""
    runtimes, dtype, devices, peak = run.runtimes, run.dtype, run.devices, run.peak
    warmup, iters, cuda_graph, threads, repeat = run.warmup, run.iters, run.cuda_graph, run.threads, run.repeat
    import torch
    shape = variant.sizes(o)
    inputs = seeding.make_inputs(variant, o, inputs_seed)
    cands: list[_Candidate] = []
    for dev in sorted(devices):
        rt = "torch-cuda" if dev == "cuda" else "torch"
        target = T.of_variant(variant, o, params)
        module, args = target.module(dtype, dev), target.args(inputs, dtype, dev)

        def call(module=module, args=args):
            with torch.no_grad():
                out = module(*args)
            return out if isinstance(out, tuple) else (out,)
        memory = None
        if dev == "cuda":  # weights, inputs and the activations of one run
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            call()
            torch.cuda.synchronize()
            memory = torch.cuda.max_memory_allocated()
        # torch eager is the baseline of every ratio and error, so it always runs on its device.
        cands.append(_Candidate(rt, "-", "eager", dev, call,
                                lambda call=call: [t.float().cpu().numpy() for t in call()], memory=memory))
        if dev == "cuda" and cuda_graph:
            cands.append(_torch_graph_candidate(call))
    refused = []  # (runtime, flavor, mode, why): a CUDA graph ONNX Runtime would not capture
    for f, model in models.items():
        # The static cache's buffers, {input: the output that returns it}, as the export recorded
        # them (`attnexport.signature`): bound in place, as a generation loop runs the step.
        buffers = static_buffers(model, f"the {f} export of {variant.name}")
        for rt in [r for r in runtimes if not R.runs_module(r)]:
            binds = R.REGISTRY[rt].binds
            if not (binds and R.on_cuda(rt)):  # the runtime's own run (timed where it runs), buffers bound in place
                cands.append(_prepared_candidate(rt, f, model, inputs, run))
                if buffers and binds:
                    cands.append(_ort_in_place_candidate(rt, f, model, inputs, run, buffers))
                continue
            # A CUDA session that binds: every input and output in device memory.
            cands.append(_ort_candidate(rt, f, model, inputs, run, False, cands))
            if buffers:
                cands.append(_ort_candidate(rt, f, model, inputs, run, False, cands, buffers))
            for in_place in ([False, True] if buffers else [False]) if cuda_graph else []:
                try:  # with and without CUDA graphs, side by side
                    cands.append(_ort_candidate(rt, f, model, inputs, run, True, cands,
                                                buffers if in_place else None))
                except Exception as e:  # noqa: BLE001 - e.g. a node on the CPU: no capture possible
                    mode = ("in-place" if in_place else "io-binding") + " cuda-graph"
                    refused.append((rt, f, mode, first_line(e)[:200]))
    for c in cands:
        said(f"warming up {c.runtime} {c.flavor}")
        if c.block is not None:
            c.block(warmup)
        for _ in range(0 if c.block is not None else warmup):
            c.fn()
    rounds = min(repeat, iters)
    for r in range(rounds):
        block = iters // rounds + (1 if r < iters % rounds else 0)
        for c in cands:
            said(f"round {r + 1} of {rounds}: {c.runtime} {c.flavor}")
            c.fn()  # after another candidate ran: settle the caches and thread pools, untimed
            timed = c.block(block) if c.block is not None else [R.time_call(c.fn, c.device) for _ in range(block)]
            c.rounds.append(timed)
            c.times += c.rounds[-1]
    base = {c.device: c for c in cands if R.runs_module(c.runtime) and c.mode == "eager"}
    ref_out = {d: c.outputs() for d, c in base.items()}
    flops = variant.flops(o)
    rows = []
    for c in cands:
        if R.runs_module(c.runtime) and c.runtime not in runtimes:
            continue
        out = c.outputs()
        err = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                  for a, b in zip(out, ref_out[c.device], strict=True))
        row = _row(variant, c, shape, flops, peak[c.device][0], statistics.median(base[c.device].times), err, run)
        row.cpu_nodes = c.cpu_nodes
        row.peak_source = peak[c.device][1]
        # The run-to-run spread of the ratio: one ratio per round, each of two medians.
        ratios = [statistics.median(mine) / statistics.median(theirs)
                  for mine, theirs in zip(c.rounds, base[c.device].rounds, strict=True)]
        row.ratio_min, row.ratio_max, row.rounds = min(ratios), max(ratios), len(ratios)
        notes = [c.note] if c.note else []
        if c.flavor != "-" and E.graph_flavor(variant, c.flavor) != c.flavor:
            notes.append("no dot-product core: primitives graph")
        if R.REGISTRY[c.runtime].device == "gpu":  # the CPU's matmul peak says nothing of a browser's GPU
            row.peak_fraction, row.peak_tflops, row.peak_source = float("nan"), float("nan"), ""
        if row.peak_fraction > 1:
            notes.append(f"above the calibrated peak ({row.peak_source}): a kernel beat the calibration; "
                         "this fraction is not meaningful")
        if c.runtime in R.JS_RUNTIMES:
            cpu = next((o for o in cands if o.runtime == "ort-cpu" and o.flavor == c.flavor), None)
            if cpu is not None:
                row.ratio_to_ort_cpu = row.median_ms / statistics.median(cpu.times)
        row.note = "; ".join(notes)
        rows.append(row)
    rows += [_untimed_row(variant, rt, f, mode, dtype, shape, threads, f"no CUDA graph: {why}")
             for rt, f, mode, why in refused]
    return rows


def static_buffers(model, what: str) -> dict[str, str]:
    """A static cache's buffers as the model's signature records them: {input: the output that
    returns it updated} (none for a model without a static cache or without a signature)."""
    signature = S.of(model, what)
    return {} if signature is None else {c.past: c.present for c in signature.caches if c.kind == "static"}


def _ort_candidate(rt, flavor, model, inputs, run_: _Run, cuda_graph, cands, in_place: dict | None = None):
    """ONNX Runtime's CUDA session as a candidate: inputs and outputs bound to device memory (IO
    binding) so host copies are not timed; `in_place` ({input: output}, the static cache's
    buffers): each buffer is bound both as the input and as the output that returns it updated, as a
    generation loop runs the step (the TensorScatter kernel then writes the new positions into the
    buffer instead of copying it)."""
    import torch
    dtype, threads = run_.dtype, run_.threads
    feed = D.cast_floats(inputs, dtype)
    ref = next(c for c in cands if c.runtime == "torch-cuda" and c.mode == "eager").outputs()
    np_of = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}
    ins = {k: torch.from_numpy(np.ascontiguousarray(a)).cuda() for k, a in feed.items()}
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    session, cpu_nodes = _ort_session(rt, model, dtype, threads, cuda_graph)
    names = [x.name for x in session.get_outputs()]
    returned = {present: past for past, present in (in_place or {}).items()}
    outs = [ins[returned[n]] if n in returned else torch.empty(r.shape, dtype=D.torch_dtype(dtype), device="cuda")
            for n, r in zip(names, ref, strict=True)]
    binding = session.io_binding()
    for k, t in ins.items():
        binding.bind_input(k, "cuda", 0, np_of[t.dtype], list(t.shape), t.data_ptr())
    for name, t in zip(names, outs, strict=True):
        binding.bind_output(name, "cuda", 0, np_of[t.dtype], list(t.shape), t.data_ptr())

    def run(ins=ins):  # the binding holds raw pointers: the tensors must live as long as it does
        session.run_with_iobinding(binding)
    run()  # the first run grows ONNX Runtime's arena (and captures the CUDA graph, if asked)
    torch.cuda.synchronize()
    # The session's own device memory (weights, arena, workspace) plus the inputs and outputs it
    # is bound to, which live in torch's memory: torch's peak counts its inputs and outputs too.
    bound = {t.data_ptr(): t for t in [*ins.values(), *outs]}
    io_bytes = sum(t.numel() * t.element_size() for t in bound.values())
    memory = max(0, free_before - torch.cuda.mem_get_info()[0]) + io_bytes
    mode = ("in-place" if in_place else "io-binding") + (" cuda-graph" if cuda_graph else "")
    return _Candidate(rt, flavor, mode, "cuda", run, lambda: [t.float().cpu().numpy() for t in outs], cpu_nodes,
                      memory=memory)


def _prepared_candidate(rt, flavor, model, inputs, run: _Run):
    """A runtime's own run of the model (`runtimes.prepare_onnx`: ONNX Runtime's CPU session, or
    ONNX Runtime in Node or the browser). A runtime that times its runs where they run (in
    JavaScript, performance.now around each awaited run) times each block there, so the pipe to
    its process is not in the times; the others are timed from here, a run at a time."""
    prepared = R.prepare_onnx(rt, model, threads=run.threads)
    feed = D.cast_floats(inputs, run.dtype)
    time_runs = prepared.time_runs
    block = None if time_runs is None else (lambda runs: time_runs(feed, runs) if runs else [])
    return _Candidate(rt, flavor, "eager", "cpu", lambda: prepared.run(feed), lambda: list(prepared.run(feed).values()),
                      prepared.cpu_nodes, block=block, note=prepared.note)


def _ort_in_place_candidate(rt, flavor, model, inputs, run_: _Run, pairs: dict[str, str]):
    """ONNX Runtime on the CPU (`rt`) with a static cache's buffers (`pairs`, {input: output}) as OrtValues
    bound both as the inputs and as the outputs that return them updated (IO binding), as a
    generation loop runs it: the TensorScatter kernel then writes the new positions into the
    buffer instead of copying it."""
    import onnxruntime as ort
    dtype, threads = run_.dtype, run_.threads
    feed = D.cast_floats(inputs, dtype)
    session, cpu_nodes = _ort_session(rt, model, dtype, threads, False)
    buffers = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for n, a in feed.items() if n in pairs}
    returned = {pairs[n]: n for n in buffers}
    binding = session.io_binding()
    for n, a in feed.items():
        if n in buffers:
            binding.bind_ortvalue_input(n, buffers[n])
        else:
            binding.bind_cpu_input(n, np.ascontiguousarray(a))
    names = [x.name for x in session.get_outputs()]
    for name in names:
        if name in returned:
            binding.bind_ortvalue_output(name, buffers[returned[name]])
        else:
            binding.bind_output(name, "cpu")

    def run():
        session.run_with_iobinding(binding)

    def outputs():
        run()
        got = dict(zip(names, binding.copy_outputs_to_cpu(), strict=True))
        return [got[n] for n in names]
    return _Candidate(rt, flavor, "in-place", "cpu", run, outputs, cpu_nodes)


def memory_bandwidth(threads: int | None = None, megabytes: int = 512, runs: int = 7) -> float:
    """The CPU's read bandwidth in bytes per second with `threads` threads (default: torch's),
    measured here: the fastest of `runs` sums of a `megabytes` float32 buffer (a large read-only
    reduction, each byte read once, on torch's thread pool, as a runtime's kernels read a cache).
    A one-thread copy measures about half of it (one core cannot saturate the memory), which
    would make a step look closer to the limit than it is."""
    import torch
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        ms = R.time_calls(x.sum, 1, runs)  # one untimed sum: the pages touched before timing
    finally:
        torch.set_num_threads(before)
    return x.nbytes / (min(ms) / 1e3)


def gemv_bandwidth(threads: int, megabytes: int = 512, runs: int = 7) -> float:
    """The read rate (bytes/s) of ONNX Runtime's MatMul of one row by a `megabytes` fp32 matrix on
    `threads` threads, best of `runs`: the access a decode step's projections make, which reads
    faster than a reduction on some machines."""
    from onnx import TensorProto, helper
    k = 4096
    n = megabytes * 2**20 // (4 * k)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    session = R.ort_session("ort-cpu", model, threads=threads, spinning=True)[0]
    feed = {"x": np.ones((1, k), np.float32), "w": np.random.default_rng(0).standard_normal((k, n), np.float32)}
    ms = R.time_calls(lambda: session.run(None, feed), 1, runs)
    return 4 * k * n / (min(ms) / 1e3)


def cuda_read_bandwidth(megabytes: int = 1024, runs: int = 20) -> float:
    """The GPU's read bandwidth in bytes per second, measured here: the fastest of `runs` sums of a
    `megabytes` buffer in device memory (a read-only reduction: each byte read once), timed with
    CUDA events."""
    import torch
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device="cuda")
    x.sum()
    return x.nbytes / (min(R.time_call(x.sum, "cuda") for _ in range(runs)) / 1e3)


def decode_step_bytes(variant, o, params, itemsize: int) -> int:
    """The least bytes one decoding step moves: every parameter once, and every cache's valid
    part read once (the self-attention keys and values of every sequence's positions before and
    in the step; a decoder's memory keys and values, all of them), at `itemsize` bytes a number."""
    weights = sum(np.asarray(p).size for p in params.values()) * itemsize
    if "head_dim" in o:  # sdpa: the operator's head sizes
        hd, hv, kv_heads, new = o["head_dim"], o.get("v_head_dim") or o["head_dim"], o["kv_heads"], o["kv_seq"]
    else:
        hd = hv = o["dim"] // o["heads"]
        kv_heads, new = o.get("kv_heads") or o["heads"], o["seq"]
    cached = seeding.write_positions(o).sum() if V.static_cache(o) else o["batch"] * o["past_seq"]
    positions = int(cached) + o["batch"] * new
    memory = 2 * o["heads"] * o["batch"] * o["past_kv_seq"] * hd if "past_kv_seq" in o else 0  # a decoder's
    return weights + (kv_heads * positions * (hd + hv) + memory) * itemsize


def cuda_graph_of(fn):
    """fn captured in a CUDA graph, after three warm-up calls on a side stream as torch asks:
    (the graph, fn's result as captured; replaying the graph rewrites it in place). The peak
    memory statistics start at the capture, so that they count what the graph holds."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def _torch_graph_candidate(call):
    import torch
    graph, out = cuda_graph_of(call)
    return _Candidate("torch-cuda", "-", "cuda-graph", "cuda", graph.replay,
                      lambda: [t.float().cpu().numpy() for t in out], memory=torch.cuda.max_memory_allocated())


def _row(variant, c: _Candidate, shape, flops, peak, torch_median, err, run: _Run) -> BenchRow:
    med, p10, p90 = stats_of(c.times)
    tflops = flops / (med / 1e3) / 1e12
    return BenchRow(variant.name, c.runtime, c.flavor, c.mode, run.dtype, shape, med, p10, p90, tflops,
                    tflops * 1e12 / peak, peak / 1e12, med / torch_median, err, c.memory, run.threads)


@dataclass(frozen=True)
class DecodePlan:
    """The size options a decode bench sets, as the variant's cache step declares them.

    Attributes:
        new: the sizes of what a step adds (the query's `seq`, and the keys a concat cache grows
            by): the context at the prefill, 1 at a step.
        past: the concat caches' positions: 0 at the prefill, the context at a step.
        cross: {what a cross cache grows by at the prefill (the memory's length): its positions}.
    """

    new: frozenset
    past: frozenset
    cross: dict


def decode_plan(variant, options: dict) -> DecodePlan:
    """The sizes bench --decode sets, read from the variant's concat-cache step (a static step is
    benched beside it with the same sizes): which cache grows by what (decode.growth), not option
    names."""
    scalars = {k: v for k, v in options.items() if not isinstance(v, (list, tuple))}
    static_off = {"max_seq": None} if "max_seq" in {o.name for o in variant.options} else {}
    o = variant.resolve({**scalars, "kv_cache": True, **static_off})
    signature = V.step_signature(variant, o)
    concat = DC.growth(variant, o, signature, "concat")
    cross = DC.growth(variant, o, signature, "cross")
    return DecodePlan(frozenset({"seq"} | set(concat.values())), frozenset(concat),
                      {new: past for past, new in cross.items()})


def bench_decode(request: BenchRequest | str, options: dict | None = None, contexts: list[int] | None = None, *,
                 progress: Callable[[int, int, str], None] | None = None, **fields) -> list[BenchRow]:
    """Generation with a KV cache at each context length: the prefill (the context's tokens into an
    empty cache) and one decoding step (one token over a cache of that many), on every runtime and
    flavour beside torch eager with the same cache; ms, and tokens per second, per phase.

    Takes a BenchRequest (its options without the lengths, which the contexts set), or its fields.
    """
    r = request if isinstance(request, BenchRequest) else BenchRequest(request, options, **fields)
    if isinstance(request, BenchRequest) and (options is not None or fields):
        raise TypeError("give a BenchRequest or its fields, not both")
    variant = r.variant if isinstance(r.variant, schema.Variant) else V.get(r.variant)
    options, contexts = r.options, contexts or []
    if "kv_cache" not in {o.name for o in variant.options}:
        have = [v.name for v in V.VARIANTS.values() if "kv_cache" in {o.name for o in v.options}]
        raise UsageError(f"--decode needs a variant with a KV cache ({', '.join(have)}); {variant.name} has none")
    if not contexts:
        raise UsageError("--decode needs --context, e.g. --context 128,1024")
    options = dict(options or {})
    if isinstance(options.get("batch"), (list, tuple)):
        if len(options["batch"]) != 1:
            raise UsageError("--decode takes one --batch")
        options["batch"] = options["batch"][0]
    names = {o.name for o in variant.options}
    plan = decode_plan(variant, options)
    for k in sorted(plan.new | plan.past | set(plan.cross.values())):
        if k in options:
            raise UsageError(f"--decode sets --{k.replace('_', '-')} itself (from --context): leave it out")
    sources = {}  # a cross cache's source (the decoder's memory): projected at the prefill, cached after
    for k in plan.cross:
        sources[k] = options.get(k, variant.option(k).default)
        if isinstance(sources[k], (list, tuple)):
            if len(sources[k]) != 1:
                raise UsageError(f"--decode takes one --{k.replace('_', '-')} (the length of what it attends to)")
            sources[k] = sources[k][0]
    options.update({k: [] for k in plan.new | plan.past | set(plan.cross) | set(plan.cross.values())},
                   kv_cache=True, **({"causal": True} if "causal" in names else {}))
    for c in contexts:
        for k in plan.new:  # the prefill of c tokens, then one token over a cache of c
            options[k] += [c, 1]
        for k in plan.past:
            options[k] += [0, c]
        for k, past in plan.cross.items():
            options[k] += [sources[k], 0]
            options[past] += [0, sources[k]]
    rows = bench(dataclasses.replace(r, options=options), progress=progress)
    if V.static_cache(options):  # beside today's concat cache, in the same process
        for row in rows:
            row.mode = "static" if row.mode == "eager" else f"static {row.mode}"
        concat = bench(dataclasses.replace(r, options={**options, "max_seq": None}))
        for row in concat:
            row.mode = "concat" if row.mode == "eager" else f"concat {row.mode}"
        rows += concat
    # The memory-bandwidth limit: the device's read bandwidth (a large read-only reduction; the
    # CPU's with the run's threads). A step repeated over one buffer keeps what fits in the
    # last-level cache there (32 MiB of L3 on the development machine: mha's step at context
    # 4096), which then reads faster than memory: each row also has the read rate of a buffer as
    # large as its step reads, and its fraction of that.
    scalars = {k: v for k, v in options.items() if not isinstance(v, list)}
    one_step = {**scalars, **dict.fromkeys(plan.new, 1), **dict.fromkeys(plan.past | set(plan.cross.values()), 0)}
    params = seeding.init_params(variant, variant.resolve(one_step), r.seed)
    itemsize = D.ITEMSIZE[r.dtype]
    rates: dict = {}

    def rate(device: str, megabytes: int) -> float:
        if (device, megabytes) not in rates:
            rates[device, megabytes] = cuda_read_bandwidth(max(megabytes, 64)) if device == "cuda" else \
                memory_bandwidth(r.threads, megabytes, runs=max(7, 2048 // megabytes))
        return rates[device, megabytes]
    for row in rows:
        if not row.shape:
            continue
        row.phase = "decode" if any(row.shape[k] for k in plan.past) else "prefill"
        tokens = row.shape["batch"] * row.shape["seq"]
        row.tokens_per_s = tokens / (row.median_ms / 1e3) if row.median_ms == row.median_ms else None
        if row.phase == "decode" and row.median_ms == row.median_ms:
            device = "cuda" if R.on_cuda(row.runtime) else "cpu"
            size = decode_step_bytes(variant, variant.resolve({**scalars, **row.shape}), params, itemsize)
            per_s = size / (row.median_ms / 1e3)
            memory, working = rate(device, 1024 if device == "cuda" else 512), rate(device, max(1, round(size / 2**20)))
            row.bandwidth_gbs, row.bandwidth_fraction = memory / 1e9, per_s / memory
            row.working_set_gbs, row.working_set_fraction = working / 1e9, per_s / working
            if row.bandwidth_fraction > 1:
                why = (f"above the memory's read bandwidth: its {size / 2**20:.0f} MiB stay in the cache between "
                       "steps (its working-set fraction is the meaningful one)")
                row.note = "; ".join(filter(None, [row.note, why]))
    return rows


def warnings_for(runtimes: list[str] | None, dtype: str, cuda_graph: bool) -> list[str]:
    """What the user should know before a run starts (said up front, not after minutes)."""
    runtimes = list(runtimes or [r for r in BENCH_RUNTIMES if r in R.DEFAULT_RUNTIMES and R.status(r).available])
    out = []
    if cuda_graph and not any(R.on_cuda(r) for r in runtimes):
        out.append("--cuda-graph does nothing here: no CUDA runtime (torch-cuda, ort-cuda) is in this run")
    cpu = [r for r in runtimes if not R.on_cuda(r)]
    if dtype == "fp16" and cpu:
        out.append(f"fp16 on {', '.join(cpu)}: the CPU has no fp16 matrix units, so torch and ONNX Runtime "
                   "emulate it, often 10-100x slower than fp32; a run can take minutes")
    return out


def fastest(rows: list[BenchRow]) -> list[tuple[str, str, str, float]]:
    """For each runtime and shape: the fastest flavour (runtime, shape, flavour, median ms)."""
    best: dict[tuple[str, str], tuple[str, float]] = {}
    for r in rows:
        if r.flavor == "-" or r.median_ms != r.median_ms:  # torch rows, or NaN (not applicable)
            continue
        key = (r.runtime, r.shape_label)
        if key not in best or r.median_ms < best[key][1]:
            best[key] = (r.flavor, r.median_ms)
    return [(rt, shape, f, ms) for (rt, shape), (f, ms) in best.items()]


def to_json(rows: list[BenchRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def plot(rows: list[BenchRow], path: str, title: str):
    """Latency across shapes, one line per runtime and flavour."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'attnexport[plot]'") from None
    series: dict[str, dict[str, tuple[float, float, float]]] = {}
    labels = []
    for r in rows:
        if r.median_ms != r.median_ms:
            continue
        if r.shape_label not in labels:
            labels.append(r.shape_label)
        name = r.runtime if r.flavor == "-" else f"{r.runtime} {r.flavor}"
        if r.mode not in ("eager", "io-binding"):
            name += f" ({r.mode})"
        series.setdefault(name, {})[r.shape_label] = (r.median_ms, r.p10_ms, r.p90_ms)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = np.arange(len(labels))
    for name, pts in series.items():
        xs = [i for i, lab in enumerate(labels) if lab in pts]
        med = [pts[labels[i]][0] for i in xs]
        lo = [pts[labels[i]][0] - pts[labels[i]][1] for i in xs]
        hi = [pts[labels[i]][2] - pts[labels[i]][0] for i in xs]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.set_xticks(x, labels)
    ax.set_xlabel("batch x sequence")
    ax.set_ylabel("median latency (ms), p10-p90 bars")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    F.atomic_write(path, buf.getvalue())


# --- a user's module ----------------------------------------------------------------------------

def module_variant(spec: str, module, example_inputs, input_names=None):
    """The module as a variant that `attnexport.bench.bench` times: options `batch` and `seq`
    (axis 0, and axis 1 of every input of rank 2 or more: all lengths take --seq), its own
    export, and FLOPs counted by torch's FlopCounterMode at each shape."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    example = tuple(example_inputs)
    target = T.of_module(module, example, spec, input_names)
    names = list(target.inputs)
    kinds = {}
    for n, t in zip(names, example, strict=True):
        if t.is_floating_point():
            kinds[n] = ("float", "data")
        else:
            kinds[n] = ("bool", "true" if M.common_value(t) else "false") if t.dtype == torch.bool else \
                (str(t.dtype).replace("torch.", ""), "zeros")

    def inputs(o):
        return tuple(schema.TensorSpec(n, tuple("batch" if a == 0 and t.dim() >= 2 else "seq" if a == 1 and t.dim() >= 2
                                           else s for a, s in enumerate(t.shape)), *kinds[n])
                     for n, t in zip(names, example, strict=True))

    def tensors(o, dtype="fp32"):
        arrays = seeding.make_inputs(variant, o, 0)
        return tuple(torch.from_numpy(a).to(D.torch_dtype(dtype)) if a.dtype.kind == "f" else torch.from_numpy(a)
                     for a in arrays.values())

    def flops(o):
        counter = FlopCounterMode(display=False)
        param = next(module.parameters(), None)  # inputs in the dtype the bench left the module in
        args = tuple(t.to(param.dtype) if param is not None and t.is_floating_point() else t for t in tensors(o))
        with counter, torch.no_grad():
            module(*args)
        return counter.get_total_flops()

    def export(o, flavor, dtype, params):
        return E.export_module(module, tensors(o, dtype), flavor=flavor, dtype=dtype, input_names=names,
                               name=spec).model

    def no_reference(params, inputs, o):
        raise UsageError(f"{spec} has no float64 reference: a module is compared with itself")

    b = example[0].shape[0] if example and example[0].dim() >= 2 else 1
    t = example[0].shape[1] if example and example[0].dim() >= 2 else 1
    variant = schema.Variant(name=spec, summary="your module", options=(schema.Option("batch", int, b, "batch size"),
                                                                     schema.Option("seq", int, t, "sequence length")),
                        build=lambda o: module, inputs=inputs,
                        outputs=lambda o: tuple(schema.TensorSpec(n, ("batch", "seq"), "float")
                                                for n in target.outputs or ("output",)),
                        reference=no_reference, flops=flops, dot_product_core=True, dynamic=("batch", "seq"),
                        export=export)
    return variant
