"""`verify MODEL --hf SOURCE`: a whole model's export against the model it came from, on every
runtime, and its clients. The export's family (`registry.of_export`) verifies it; this module is
what every family's verify shares: the request (`HFCheck`), the context a family's rows run in
(`Context`: the rows' names, the runtimes, the executor), and the rows every family has (the
parameters against the source's, a quantized file's weights against the source's, which layers a
quantized file's cost comes from), and the verify of a family whose model is one step graph
(`verify_step`): its rows at several shapes against the model in float64, then the family's own
(`Family.float_rows`, `answer_rows`, `client_rows`).

Every number is compared with the same model run in float64, each output within a budget derived
from what fp32 torch does against that run (`attnexport.pretrained.reference`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnexport import files as F
from attnexport import runtimes as R
from attnexport import usage as U
from attnexport import weights as W
from attnexport.compare import Comparison, Tolerance, check_tolerance_values
from attnexport.errors import AttnExportError, UsageError, reason
from attnexport.localize import Localization, first_overflow, locate, locate_bounded, nonfinite
from attnexport.pretrained import clients, emulate, forms, registry
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained import reference as HR
from attnexport.pretrained import retrieval as RT
from attnexport.reading import load_model
from attnexport.record import ExportRecord
from attnexport.report import Report, Row
from attnexport.runtimes import js
from attnexport.verify.executor import Executor
from attnexport.verify.module_check import changed_params
from attnexport.verify.request import Checking

NEW_TOKENS = 48  # the default of --new-tokens: a generation's, a transcription's


@dataclass(frozen=True)
class HFCheck(Checking):
    """What `verify MODEL --hf PATH` checks: the model file (or deployment folder) against the model
    at `source`, with the Checking fields (where and how strictly)."""

    model_path: str | Path
    source: str | Path
    seed: int | None = None
    new_tokens: int = NEW_TOKENS
    clients: tuple = ()  # with a deployment folder: the clients that load it (attnexport.pretrained.clients)
    budget: Any = None  # the family's budget of a lossy export (`Family.budget`; None: its default)
    audio: tuple = ()  # a family that hears: the clips (16 kHz mono WAV files) its answers are checked on
    memory_check: bool = True  # refuse, before it loads, a model the machine has not the memory to verify


def with_fields(check: HFCheck, **fields) -> HFCheck:
    return HFCheck(**{**vars(check), **fields})


@dataclass
class Context:
    """What a family's rows run in: the request, the export's file and layout, the float64
    reference, the tokenizer, the runtimes and the executor their rows go to."""

    check: HFCheck
    onnx_model: Any
    layout: hf.Layout
    reference: HR.Reference
    tokenizer: Any
    dtype: str
    flavor: str
    used: list
    prepared: dict
    executor: Executor
    known_good: Any = None
    precision: str = "fp32"  # the file's: its dtype, or int8/int4 when quantized
    prompts: Any = None  # what the family's rows read (`Family.verify_inputs`)
    folder: Path | None = None  # the deployment folder (its clients' rows)
    extra: dict = field(default_factory=dict)  # what a family's rows share among themselves
    # A verify in two passes (`Family.expects_first`): torch's side of every row by its key, computed
    # in the first pass (`expecting`: the source model loaded, no ONNX runtime yet), read in the second.
    expectations: dict | None = None
    expecting: bool = False

    @property
    def name(self) -> str:
        return Path(self.check.model_path).name

    @property
    def family(self) -> registry.Family:
        return self.layout.family

    def row(self, case: str, runtime: str, kind: str, tol: Tolerance | None = None) -> Row:
        flavor = self.flavor if runtime in R.ONNX_RUNTIMES else "-"
        return Row(case=case, variant=f"{self.layout.form} ({self.layout.task})", flavor=flavor, runtime=runtime,
                   dtype=self.dtype, model=self.name, tolerance=tol, expected_kind=kind)

    def expect(self, key, compute: Callable[[], Any]) -> Any:
        """What `compute()` returns: torch's side of a row (the source model's answers in float64,
        the budget its fp32 run gives). In a two-pass verify the first pass computes it and keeps it
        under `key`, and the second, the source model let go, reads it back; otherwise it is computed."""
        if self.expectations is None:
            return compute()
        if self.expecting:
            if key in self.expectations:
                raise ValueError(f"verify: two rows expect under one key, {key!r}")
            self.expectations[key] = compute()
        elif key not in self.expectations:
            raise ValueError(f"verify: {key!r} was not computed before the source model was let go")
        return self.expectations[key]

    def runner(self, runtime: str):
        """The step on `runtime`: the ONNX model, or torch's `reference.run` (the model in torch,
        its attention through attnexport's core)."""
        return self.reference.run if R.runs_module(runtime) else self.prepared[runtime].run

    def run(self, row: Row, work, judge, locate=None) -> Any:
        """`work(step)` with the row's runtime's step function, run and judged by the executor;
        what it returned, or None (the row says why)."""
        rt = row.runtime
        if not R.runs_module(rt) and rt not in self.prepared:
            row.skipped = f"{rt} runs no ONNX model"
        can_locate = locate is not None and rt in self.prepared and rt != "onnx-ref"
        return self.executor.run(row, lambda: work(self.runner(rt)), judge,
                                 cpu_nodes=self.prepared[rt].cpu_nodes if rt in self.prepared else (),
                                 locate=locate if can_locate else None)

    def _graph(self):
        """The model file's graph as localization runs it: one with external data read whole, its weights in
        the message (what ONNX Runtime runs from memory)."""
        if F.data_file(self.check.model_path).is_file():
            return load_model(self.check.model_path)
        return self.onnx_model

    def overflow(self, feed: dict, runtime: str) -> Localization:
        """The first node that makes a NaN or an infinity the outputs carry (`localize.first_overflow`)."""
        try:
            return first_overflow(self._graph(), feed, runtime)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            return Localization(kind="overflow", note=f"localization failed: {reason(e)}")

    def localize(self, feed: dict, runtime: str) -> Localization:
        """The first diverging node against the model exported afresh (once) from the same source.
        Where the machine has not the memory that takes (MEMORY_FACTORS' "localize", over the graph's
        values counted as parameters; not with --no-memory-check), the graph on `runtime` against
        itself on a known-good runtime a part at a time (`localize.locate_bounded`: ONNX Runtime's
        CPU provider, or the reference evaluator where that is the runtime under test), which takes
        "localize, bounded"; skipped, saying why, where even that does not fit."""
        if self.known_good is None and self.check.memory_check:
            count = sum(int(np.prod(i.dims, dtype=np.int64)) for i in self.onnx_model.graph.initializer)
            short = hf.memory_short(count, "localize")
            if short is not None:
                return self._localize_bounded(feed, runtime, count, short)
        try:
            if self.known_good is None:
                # --max-seq is the static buffers' (an encoder's max_seq is its position table's, not asked for)
                max_seq = self.layout.max_seq if self.layout.cache_form.writes_in_place else 0
                request = hf_export.HFExport(self.check.source, self.layout.form, max_seq, self.flavor,
                                             dtype=self.dtype, seed=self.check.seed)
                self.known_good = hf_export.export_hf(request)[0].model
            return locate(self._graph(), self.known_good, feed, runtime, self.dtype)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            return Localization(note=f"localization failed: {reason(e)}")


    def _localize_bounded(self, feed: dict, runtime: str, count: int, short: str) -> Localization:
        fresh = f"against a fresh export of the model, {short} beside what verify holds"
        still = hf.memory_short(count, "localize, bounded")
        if still is not None:
            return Localization(note=f"localization skipped: {fresh}, and a part at a time {still} (the "
                                     "export's own check names a layer that departs from the model in float64)")
        known = "onnx-ref" if runtime == "ort-cpu" else "ort-cpu"
        try:
            found = locate_bounded(self._graph(), feed, runtime, known, self.dtype)
        except Exception as e:  # noqa: BLE001 - localization is a diagnosis; its failure is reported
            return Localization(note=f"localization failed ({fresh}; a part at a time): {reason(e)}")
        found.note = (f"{found.note} (not {fresh}: where the graph itself departs from the model, the export's "
                      "own check names the layer)")
        return found


def verify_hf(check: HFCheck) -> Report:
    """The rows of every check on every selected runtime: the export's family verifies it."""
    check_tolerance_values(check.rtol, check.atol)
    family = registry.of_export(check.model_path)
    if check.audio and "audio" not in family.verify_options:
        raise UsageError(f"--audio: a {family.what}'s verify takes no audio")
    if check.budget is None:  # the family's default (the command line gives one parsed by the family)
        check = with_fields(check, budget=family.budget(None))
    if check.memory_check and not family.expects_first:  # a two-pass family's verify checks once it knows which
        hf.check_fits(check.source, "verify in one pass")
    with U.metered() as meter:
        report = family.verify(check)
    report.resources, report.resources_line = meter.to_dict(), meter.line()
    return report


def model_file(path: str | Path) -> tuple[Path, Path | None]:
    """(the model file, the deployment folder it is in or None) of verify's MODEL: a .onnx file, or a
    folder written by `export --hf --deploy` (the step graph at one of its forms' deployment files)."""
    path = Path(path)
    registry.families()
    files = list(dict.fromkeys(f.deploy_file for f in forms.FORMS.values()))
    if path.is_dir():
        found = [path / f for f in files if (path / f).is_file()]
        if len(found) != 1:
            raise UsageError(f"{path}: a folder MODEL is a deployment folder (export --hf --deploy) holding one of "
                             f"{', '.join(files)}; it holds {len(found)}")
        return found[0], path
    folder = path.parent.parent
    in_folder = path.parent.name == "onnx" and (folder / "config.json").is_file()
    return path, folder if in_folder else None


def family_of_file(path: Path) -> registry.Family:
    """The family of a step graph's export (a .onnx file, or a deployment folder holding one): the
    task its step signature records."""
    if not path.exists():
        raise UsageError(f"{path}: no such file or folder")
    return hf.Layout.of(load_model(model_file(path)[0], external_data=False)).family


def verify_step(check: HFCheck) -> Report:
    """The verify of a family whose export is one step graph (see the module docstring)."""
    path, folder = model_file(check.model_path)
    if check.clients and folder is None:
        raise UsageError(f"--clients load a deployment folder (export --hf --deploy FOLDER); {check.model_path} "
                         "is not in one")
    check = with_fields(check, model_path=path)
    # A model with external data is read without it first: ONNX Runtime's Python sessions map the
    # weights from the file and the fingerprints read them one at a time, so a model of any size
    # is not held twice (a quantized one, whose matrices are all read, or a runtime given the model
    # in memory, loads it whole below).
    model = load_model(check.model_path, external_data=False)
    layout = hf.Layout.of(model)
    family = layout.family
    if check.clients:
        check = with_fields(check, clients=tuple(clients.of_family(check.clients, family)))
    client_table = clients.select(check.clients, check.skip_unavailable)
    meta = ExportRecord.of(model)
    dtype, flavor = meta.dtype, meta.flavor
    seed = check.seed if check.seed is not None else meta.number("seed")  # a config-only source's weights
    check = with_fields(check, seed=seed)
    quantized = P.record_of(model)
    two_passes = family.expects_first and quantized is None  # the source model let go before the file is mapped
    external = F.data_file(path).is_file()
    mapped = _maps_source(check.source, path) if external else None
    with hf.gguf_parsed_once():  # a GGUF file read once for its count, config, tensors and tokenizer
        if check.memory_check and family.expects_first:
            hf.check_fits(check.source, ("verify" if two_passes else "verify in one pass") +
                          (", mapped" if mapped is not None else ""))
        with U.phase("load"):
            hf_model, _ = hf.load(check.source, seed, mapped_in=mapped)
        source_family = registry.of_model(hf_model)
        if source_family is not family:
            raise UsageError(f"{path.name} is a {family.what}'s export; --hf {check.source} is a "
                             f"{source_family.what}: give the model it was exported from")
        tokenizer = hf.tokenizer_of(check.source)
    hf.check_tokenizer(layout, tokenizer, check.source)
    inputs = family.verify_inputs(tokenizer, layout)
    for needs, what in family.verify_needs(layout, inputs, check.new_tokens, tokenizer):
        layout.cache_form.check_room(layout, needs, what)
    reference = HR.Reference(hf_model, layout, dtype, check.rtol, check.atol)
    del hf_model  # the reference holds it, and lets it go (`release`) where the rows allow
    used, table = R.select(check.runtimes, check.skip_unavailable)
    if external and (quantized is not None or any(R.REGISTRY[rt].adapter != "ort" for rt in used
                                                  if rt in R.ONNX_RUNTIMES)):
        model = load_model(check.model_path)
    used, table = P.able_runtimes(model, used, table, check.runtimes, quantized)
    executor = Executor(check.checking)
    record = meta.parsed("params", {})
    with U.phase("fingerprints"):
        changed = changed_params(reference.step, record, dtype)
        # The file's own initializers against the record:
        damaged = W.read(model, record, str(Path(path).resolve().parent), keep=False)[1] if record else []
        damaged += P.damaged(model, quantized)
    ctx = Context(check, model, layout, reference, tokenizer, dtype, flavor, used, {}, executor,
                  precision=P.precision_name(model, quantized), prompts=inputs, folder=folder)
    if changed or damaged:
        parameters_row(ctx, changed, damaged)
    elif two_passes:
        # Two passes: torch's rows and every row's expectations with the source model, then the
        # model let go and the ONNX runtimes' rows against what was kept. A runtime that cannot hold
        # the model says so before the first.
        for rt in used:
            if rt in R.JS_RUNTIMES:
                js.refuse_too_large(rt, model)
        ctx.expectations, ctx.expecting = {}, True
        ctx.used = [rt for rt in used if R.runs_module(rt)]
        with np.errstate(all="ignore"), U.phase("expectations"):
            _float_rows(ctx, family)
        reference.release()
        ctx.expecting, ctx.used = False, [rt for rt in used if not R.runs_module(rt)]
        first = len(executor.rows)
        with U.phase("sessions"):
            ctx.prepared = {rt: _prepared(rt, model, path) for rt in used if rt in R.ONNX_RUNTIMES}
        with np.errstate(all="ignore"), U.phase("rows"):
            _float_rows(ctx, family)
        executor.rows = _in_order(executor.rows[first:] + executor.rows[:first], used)
    else:
        with U.phase("sessions"):
            ctx.prepared = {rt: _prepared(rt, model, path) for rt in used if rt in R.ONNX_RUNTIMES}
        with np.errstate(all="ignore"), U.phase("rows"):
            if quantized is not None:  # its answers are judged by the accuracy budget, its weights by their source
                weights_row(ctx, quantized)
                family.answer_rows(ctx, lossy=True)
                if check.clients:
                    family.client_rows(ctx)
            else:
                _float_rows(ctx, family)
    return executor.report(R.described(table) + client_table, dtype, [flavor], [str(check.model_path)])


def _maps_source(source, path: Path) -> Path | None:
    """Where verify of a model with its weights beside the graph maps the source model's float32
    weights from a file rather than holding them (`model.map_float32`, as its export did): the
    model's own folder, whose disk holds its weights already; None for a source that is not a
    folder transformers reads (a GGUF file, a family's own folder)."""
    folder = Path(str(source))
    if not folder.is_dir() or registry.reading(folder) is not None:
        return None
    return path.resolve().parent


def _float_rows(ctx: Context, family: registry.Family) -> None:
    """The rows of a float export (fp32, fp16): each step within its budget, its answers by the
    family's rows (fp16's by the accuracy budget), its clients."""
    with U.phase("steps"):
        shape_rows(ctx)
    with U.phase("float rows"):
        family.float_rows(ctx)
    with U.phase("answers"):
        family.answer_rows(ctx, lossy=ctx.dtype != "fp32")
    if ctx.check.clients:
        family.client_rows(ctx)


def _in_order(rows: list[Row], used: list[str]) -> list[Row]:
    """Rows of two passes as one pass would give them: by case, in the order the cases first come
    in `rows`, and within a case by runtime, in the order of `used` (anything else after, as it came)."""
    cases: dict[str, int] = {}
    for row in rows:
        cases.setdefault(row.case, len(cases))
    rank = {rt: i for i, rt in enumerate(used)}
    return sorted(rows, key=lambda row: (cases[row.case], rank.get(row.runtime, len(rank))))


def _prepared(runtime: str, model, path: Path | None = None) -> R.Prepared:
    """The model ready on `runtime`; a runtime that cannot even load it is a UsageError in one line."""
    if path is not None and F.data_file(path).is_file() and R.REGISTRY[runtime].adapter == "ort":
        model = str(path)  # its weights mapped from beside it, not copied from the model in memory
    try:
        return R.prepare_onnx(runtime, model)
    except AttnExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the runtime's own reason, in one line
        raise UsageError(f"{runtime} cannot load the model: {reason(e)[:300]}") from None


def parameters_row(ctx: Context, changed: list[str], damaged: list[str]) -> None:
    """One failing row: the file's parameters are not its source's (`changed`), or not those its
    record says it was written with (`damaged`)."""
    row = ctx.row("parameters", "-", "the model's record")
    row.error = (f"the model's parameters differ from {ctx.check.source}'s: {', '.join(changed[:3])} "
                 "(sha256 in the metadata; --seed for a folder with a config only)") if changed else \
        (f"the model file's parameters differ from the sha256 recorded at its export: "
         f"{', '.join(damaged[:3])} (the file was changed after the export)")
    ctx.executor.record(row)


def weights_row(ctx: Context, quantized: dict) -> None:
    """One row: every quantized matrix against the source model's float matrix it stands for (a
    carried grid bit for bit, ONNX Runtime's rounding within a step of its block's scale)."""
    # The source's float32 weights (float64 holds them exactly), also for a graph in half: a grid is
    # carried from these, not from their fp16 rounding.
    state = {k: v.detach().float().numpy() for k, v in ctx.reference.step64.state_dict().items()}
    before = {}
    for e in quantized["matrices"]:
        if not e["bits"]:
            continue
        w = np.zeros((e["k"], e["n"]), np.float32)
        for name, columns in e["params"].items():
            if name in state and state[name].ndim == 2:
                block = state[name].T
                if columns is None:
                    w = block
                else:
                    w[:, columns[0]:columns[1]] = block
        before[e["weight"]] = w
    row = ctx.row("weights: each quantized matrix against the source's", "-",
                  "the source model's weights; exact for a carried grid, a step for ONNX Runtime's rounding")
    bad = P.unfaithful(before, ctx.onnx_model, quantized)
    counts: dict[str, int] = {}
    for e in quantized["matrices"]:
        key = "kept" if not e["bits"] else f"{e['how']} {e['bits']}-bit"
        counts[key] = counts.get(key, 0) + 1
    row.detail = {"matrices": counts, "unfaithful": bad}
    if bad:
        row.error = f"{len(bad)} quantized matrix(es) are not a quantization of the source's: {bad[0]}"
    else:
        moved = _largest_move(before, ctx.onnx_model, quantized)
        for how in ("folded", "float"):  # how far a grid's minimums held this way moved its weights
            folds = [e["fold"] for e in quantized["matrices"] if e.get("how") == how]
            if folds:
                row.detail[how] = {"max_steps": max(f["max_steps"] for f in folds),
                                   "rms_steps": float(np.sqrt(np.mean([f["rms_steps"] ** 2 for f in folds])))}
        row.comparisons = [Comparison("quantized matrices faithful to the source", True, moved, 0.0, 0, 0, 0.0, 0.0,
                                      0.0, 0.0, compared=sum(1 for e in quantized["matrices"] if e["bits"]),
                                      basis="exact grids bit for bit; folded ones within half a residual step; "
                                            "float zero points within their rounding; ORT's rounding within one step")]
        row.passed = True
    ctx.executor.record(row)


def _largest_move(before: dict, model, record: dict) -> float:
    """The largest difference between a weight the file computes with and the source's."""
    inits = {i.name: i for i in model.graph.initializer}
    largest = 0.0
    for e in record["matrices"]:
        got = P.matrix(model, e, inits) if e["bits"] else None
        if got is not None and e["weight"] in before:
            largest = max(largest, float(np.abs(got.astype(np.float64) - before[e["weight"]]).max()))
    return largest


def layer_cost_row(ctx: Context, what: str, costs: list[dict], key: str, measure: str, compared: int,
                   against: str) -> None:
    """One informational row (runtime "-"): which of a quantized file's layers cost most, each alone
    (`costs`, most costly first, `key` its value), the three costliest as its comparisons."""
    row = ctx.row(f"{what}: the cost of each layer quantized alone (weights as the file holds them, "
                  "activations rounded as its kernels do, emulated in torch)", "-", against)
    row.flavor = "-"
    row.detail = {"layer_costs": costs}
    row.comparisons = [Comparison(f"{measure}, {c['group']} alone", True, c[key], math.nan, 0, 0, 0.0, math.inf,
                                  c[key], math.inf, compared=compared, basis="informational: which layers cost most")
                       for c in costs[:3]]
    row.passed = bool(costs)
    ctx.executor.record(row)


def embedding_judge(row: Row, cost, budget, precision: str, output: str) -> list[Comparison]:
    """An embedding family's row judged (`cost`: `retrieval.EmbeddingCost`, judged by `budget`): its
    detail, its error where over the budget, and its one comparison (1 - the lowest cosine of the
    embeddings, its graph's `output`)."""
    cost.judge(budget)
    row.detail = {"embeddings": cost.to_dict(), "budget": {**vars(budget), "text": budget.text()},
                  "summary": cost.text(), "measure": "embeddings"}
    if cost.failures:
        row.error = f"over the embedding budget: {'; '.join(cost.failures)} ({cost.text()})"
    distance = float(1 - cost.cosines.min()) if np.isfinite(cost.cosines).all() else math.inf
    return [Comparison(f"{output}: 1 - cosine", not cost.failures, distance, math.nan, 0, 0, 0.0,
                       1 - budget.cosine, distance, math.inf, compared=int(cost.cosines.size),
                       basis=f"the {precision} embedding budget: {budget.text()}")]


def embedding_layer_costs(ctx: Context, feeds: list[dict], output: str, want: np.ndarray, budget, measure) -> None:
    """An embedding family's informational row of a quantized file: each group of its matrices made
    as the file holds it, alone, in the fp32 model (`emulate.each_group_alone`), and what that alone
    costs the embeddings (`output` of `feeds`) against the float64 model's `want` (`measure`): 1 -
    the lowest cosine, and top-k agreement; most costly first."""
    out = []
    for group in emulate.each_group_alone(ctx.reference.model, ctx.onnx_model):
        got = np.concatenate([np.asarray(ctx.reference.run(f)[output]) for f in feeds])
        cost = measure(got, want, budget)
        out.append({"group": group, "cost": float(1 - cost.cosines.min()), "cosine_min": float(cost.cosines.min()),
                    f"top{RT.TOP_K}_agreement": cost.agreement})
    out.sort(key=lambda d: -d["cost"])
    layer_cost_row(ctx, "embeddings", out, "cost", "1 - lowest cosine", len(want), "the model's embeddings in float64")


def shape_rows(ctx: Context) -> None:
    """The step at each of its form's verify shapes, its caches written by the model from a prefix
    of the family's inputs (`Family.check_feed`), against the float64 model on the same feed."""
    for label, batch, block, past, padded in ctx.layout.cache_form.verify_checks:
        def expect(batch=batch, block=block, past=past, padded=padded):
            feed = ctx.family.check_feed(ctx.reference, ctx.tokenizer, batch, block, past, padded, seed=2)
            return feed, ctx.reference.expect(feed)
        feed, expected = ctx.expect(("shape", label), expect)
        for rt in ctx.used:
            if R.runs_module(rt):  # the budget is torch's own error on this feed: torch's rows are the answers'
                continue
            row = ctx.row(label, rt, "the model in float64" + (", caches written by it in fp32" if past else ""),
                          expected.tolerances[ctx.layout.outputs[0]])
            row.inputs, row.expected = feed, expected.outputs
            ctx.run(row, functools.partial(_called, feed=feed),
                    functools.partial(expected.compare, names=ctx.layout.outputs),
                    locate=functools.partial(_located, ctx, feed, rt))


def _called(run, feed: dict):
    return run(feed)


def _located(ctx: Context, feed: dict, runtime: str, result=None) -> Localization:
    """Where a failing row departs: the first node that makes a non-finite value where the run's
    outputs hold one (an overflow), else the first node that diverges from a fresh export."""
    if result is not None and nonfinite(result):
        return ctx.overflow(feed, runtime)
    return ctx.localize(feed, runtime)


def deployment(ctx: Context) -> Path:
    """The deployment folder a family's client rows load (verify_step refuses --clients without one)."""
    assert ctx.folder is not None
    return ctx.folder


def unavailable_client(row: Row, client: str) -> None:
    """A client's row skipped with the reason where the client cannot run here (reached only under
    --skip-unavailable: `clients.select` refuses it otherwise)."""
    row.flavor = "-"
    row.skipped = clients.skipped(client)
