"""`bench --hf SOURCE`: the source's family (`registry.of_source`) times its engines side by side
(`Family.bench`: its request made from the command line's options, those it does not take refused
in one line), and says them (`Family.bench_lines`, `bench_json`). What every family's bench shares:
which options a family's bench takes, the Optimum anchor's export of the same weights under the
family's Optimum task, and the lines of the engines a run could not time.

And the skeleton of a bench of one pass per input (an encoder's sentences, a vision transformer's
images): its engines (`Engine`: transformers eager, attnexport's exports per flavour and precision,
Optimum's export, it through ONNX Runtime's transformer optimizer and that one in dynamic int8), each
timed at each shape (`time_engines`: the median of `iters` calls after `warmup`, with the 10th and
90th percentiles, the engines one after another at a shape), its accuracy beside (the family's
measure of what it computes against the model in float64), its time against transformers' and
against the anchor of its precision (`ratios`), its JSON and its lines (`Row`, `lines`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from attnexport import runtimes as R
from attnexport.bench import stats_of
from attnexport.errors import UsageError, reason
from attnexport.pretrained import export as hf_export
from attnexport.pretrained import model as hf
from attnexport.pretrained import registry
from attnexport.pretrained import retrieval as RT

# Every option of bench a family's bench may take, as the command line names it, and whether it was
# given (`a`: the options read, `options`: the variant options given, `contexts`: --context's values).
_GIVEN = {
    "--batch": lambda a, options: bool(a.batch), "--seq": lambda a, options: bool(a.seq),
    "--kv-seq": lambda a, options: bool(a.kv_seq), "--decode": lambda a, options: bool(a.decode),
    "--context": lambda a, options: bool(a.contexts), "--cuda-graph": lambda a, options: bool(a.cuda_graph),
    "--plot": lambda a, options: bool(a.plot), "--dtype": lambda a, options: a.dtype != "fp32",
    "--input": lambda a, options: bool(a.input_specs), "--audio": lambda a, options: a.audio is not None,
    "--genai-python": lambda a, options: a.genai_python is not None,
    "--genai-precision": lambda a, options: a.genai_precisions_text is not None,
    "--int8-kernel": lambda a, options: a.int8_kernels_text is not None,
    "--runtimes": lambda a, options: bool(a.runtimes) and a.runtimes != ["ort-cpu"],
    "variant options": lambda a, options: any(v is not None for v in options.values()),
}
# What every family's bench takes.
ALWAYS = ("--flavor", "--precision", "--threads", "--warmup", "--iters", "--seed", "--json")


def refuse_others(a: SimpleNamespace, options: dict, takes: tuple, said: str) -> None:
    """A one-line refusal of each option given that a family's bench does not take (`takes`: its
    own, beside ALWAYS); `said`: how its refusal names what it times."""
    given = [name for name, was in _GIVEN.items() if name not in takes and was(a, options)]
    if given:
        taken = ", ".join((*takes, *ALWAYS))
        raise UsageError(f"{given[0]}: bench --hf of {said} takes {taken} (on ort-cpu)")


def precisions(text: str | None, flag: str, valid) -> tuple:
    """`--precision a,b` as a tuple, each checked; None: fp32 alone."""
    if text is None:
        return ("fp32",)
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UsageError(f"{flag} takes {', '.join(valid)} separated by commas, got {text!r}")
    return names


def request_of(cls, values: SimpleNamespace, **given):
    """A family bench's request `cls` (a dataclass) from the command line's `values`: `given`, and
    every other field of it that `values` holds under its name."""
    taken = {f.name: getattr(values, f.name) for f in dataclasses.fields(cls)
             if f.init and f.name not in given and hasattr(values, f.name)}
    return cls(**{**taken, **given})


def run(source, told: SimpleNamespace, said) -> tuple[registry.Family, list, dict]:
    """(the family, its rows, the run's info) of `bench --hf SOURCE`: `told`, the command line's
    options as read (with its variant options as `options`, and --context's, --batch's and --seq's
    values as `contexts`, `batches`, `seqs`)."""
    family = registry.of_source(source)
    with hf.gguf_parsed_once():  # a GGUF file read once for its config, tensors and tokenizer
        rows, info = family.bench(source, told, said)
    return family, rows, info


def skipped_lines(info: dict) -> list[str]:
    """The engines a whole model's bench could not time, and why."""
    return [f"note: {engine} not timed: {why}" for engine, why in info.get("skipped", {}).items()]


def optimum_export(weights: Path, out: Path, task: str) -> Path:
    """Optimum's export (optimum-cli's exporter) of the transformers folder `weights` under `task`
    into `out`, quietly (its own logging kept from the user). Returns `out`."""
    from optimum.exporters.onnx import main_export
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(weights), output=str(out), task=task)
    return out


# --- a bench of one pass per input ------------------------------------------------------------------

# The anchor each precision's times are put against: Optimum's export through the optimizer, and it in
# ONNX Runtime's dynamic int8.
ANCHORS = {"fp32": "optimum+optimizer", "int8": "optimum+optimizer+int8"}


@dataclass
class Engine:
    """One engine of a bench: `run` takes a feed (its `inputs` of the shape's) and returns what its
    accuracy is judged on."""

    engine: str  # transformers, attnexport, optimum, optimum+optimizer, optimum+optimizer+int8
    flavor: str
    precision: str
    run: Callable[[dict], np.ndarray]
    inputs: tuple[str, ...]


@dataclass
class Row:
    """An engine's time at one shape (`batch` inputs of `seq` positions; 0 where an input has one
    size), `per_s` inputs a second (`unit`: what an input is), beside its accuracy."""

    engine: str
    flavor: str
    precision: str
    batch: int
    seq: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    per_s: float
    threads: int
    ratio_to_transformers: float | None = None  # transformers' median over this one (> 1: faster)
    ratio_to_anchor: float | None = None  # the anchor of its precision's median over this one
    accuracy: dict | None = None  # the family's cost's to_dict(), with the budget and whether within it
    note: str = ""
    unit: str = "inputs"

    def to_dict(self) -> dict:
        """The row as bench --json writes it: its rate under its unit's name (`sentences_per_s`)."""
        out = {}
        for k, v in dataclasses.asdict(self).items():
            if k == "per_s":
                out[f"{self.unit}_per_s"] = v
            elif k != "unit":
                out[k] = v
        return out


def failed_row(engine: str, flavor: str, precision: str, threads: int, why: str, unit: str) -> Row:
    """The row of an engine that could not be made (an export a flavour cannot express): why, no times."""
    nan = float("nan")
    return Row(engine, flavor, precision, 0, 0, nan, nan, nan, 0.0, threads, note=why, unit=unit)


def attnexport_engines(weights: Path, tmp: Path, flavors, precisions, rows: list[Row], threads: int, unit: str,
                       engine_of: Callable[[str, str, str, Path], Engine], said) -> list[Engine]:
    """attnexport's export of the folder `weights` in each flavour and precision (into `tmp`), each
    made an engine by `engine_of(engine, flavor, precision, path)`; an export that fails is a row
    saying why (in `rows`)."""
    out = []
    for precision in precisions:
        for flavor in flavors:
            said(f"exporting attnexport {flavor} {precision}")
            path = Path(tmp) / f"{flavor}-{precision}.onnx"
            try:
                hf_export.export_hf(hf_export.HFExport(weights, flavor=flavor, precision=precision, output=path))
            except Exception as x:  # noqa: BLE001 - a flavour that cannot express the model: a row saying why
                rows.append(failed_row("attnexport", flavor, precision, threads, f"export failed: {reason(x)}", unit))
                continue
            out.append(engine_of("attnexport", flavor, precision, path))
    return out


def optimum_anchors(weights: Path, tmp: Path, task: str, model_type: str, info: dict, said,
                    engine_of: Callable[[str, str, str, Path], Engine]) -> list[Engine]:
    """Optimum's export of the same weights under `task`; it through ONNX Runtime's transformer
    optimizer (opt_level 99, its highest, as `model_type`); and that one in ONNX Runtime's dynamic
    int8, as the int8 models users download are made: each an engine by `engine_of`. Where
    optimum-onnx is not installed, or a step fails, none (the run's info says why)."""
    try:
        import optimum.exporters.onnx  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed (or broken): said in the run's info
        info["skipped"]["optimum"] = f"optimum-onnx is not installed ({type(e).__name__}): pip install optimum-onnx"
        return []
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer
    said("exporting with optimum, optimizing and quantizing it")
    out = Path(tmp) / "optimum"
    try:
        optimum_export(weights, out, task)
        with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimized = optimizer.optimize_model(str(out / "model.onnx"), model_type=model_type, opt_level=99,
                                                 use_gpu=False)
            optimized.save_model_to_file(str(out / "model-optimized.onnx"))
            # The optimizer's fused ops have no type the quantizer's shape inference knows: float, as they are.
            quantize_dynamic(str(out / "model-optimized.onnx"), str(out / "model-int8.onnx"),
                             weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    except Exception as e:  # noqa: BLE001 - Optimum's or the optimizer's own failure, said in one line
        info["skipped"]["optimum"] = f"Optimum's export, the optimizer or the quantizer failed: {reason(e)[:200]}"
        return []
    files = (("optimum", "fp32", "model.onnx"), ("optimum+optimizer", "fp32", "model-optimized.onnx"),
             ("optimum+optimizer+int8", "int8", "model-int8.onnx"))
    return [engine_of(engine, "-", precision, out / file) for engine, precision, file in files]


def accuracy_of(engine: Engine, feeds: list[dict], want: np.ndarray, measure) -> dict:
    """The engine's answers to `feeds` against the float64 model's `want`, measured by the family's
    `measure(got, want, budget)` in the budget of the engine's precision (or what kept it from
    answering)."""
    try:
        got = np.concatenate([engine.run({n: f[n] for n in engine.inputs}) for f in feeds])
    except Exception as x:  # noqa: BLE001 - an engine failing to answer: said beside its times
        return {"error": reason(x)}
    budget = RT.budget_for(engine.precision)
    cost = measure(got, want, budget).judge(budget)
    return {**cost.to_dict(), "budget": budget.text(), "within": not cost.failures}


def time_engines(engines: list[Engine], shapes, feed_of: Callable[[int, int], dict], accuracy: dict, warmup: int,
                 iters: int, threads: int, unit: str, said) -> list[Row]:
    """Each engine timed at each (batch, seq) shape of `shapes` on `feed_of(batch, seq)` (each engine
    given its own inputs of it), one after another at a shape; `accuracy`: each engine's, by
    (engine, flavor, precision)."""
    rows = []
    for batch, seq in shapes:
        said(f"batch {batch}" + (f" x {seq} positions" if seq else ""))
        full = feed_of(batch, seq)
        for e in engines:
            feed = {n: full[n] for n in e.inputs}
            median, p10, p90 = stats_of(R.time_calls(functools.partial(e.run, feed), warmup, iters))
            rows.append(Row(e.engine, e.flavor, e.precision, batch, seq, median, p10, p90, batch * 1e3 / median,
                            threads, accuracy=accuracy[(e.engine, e.flavor, e.precision)], unit=unit))
    return rows


def ratios(rows: list[Row], anchors: dict = ANCHORS) -> None:
    """Each row's time against transformers' and against the anchor of its precision at its shape."""
    by = {(r.engine, r.precision, r.batch, r.seq): r.median_ms for r in rows}
    for row in rows:
        base = by.get(("transformers", "fp32", row.batch, row.seq))
        row.ratio_to_transformers = base / row.median_ms if base and row.median_ms == row.median_ms else None
        anchor = by.get((anchors.get(row.precision, ""), row.precision, row.batch, row.seq))
        row.ratio_to_anchor = anchor / row.median_ms if anchor and row.median_ms == row.median_ms else None


def accuracy_text(a: dict | None) -> str:
    """An engine's accuracy (an embedding cost's, `retrieval.EmbeddingCost`) in a few words."""
    if not a:
        return ""
    if "error" in a:
        return f"no embeddings: {a['error']}"
    verdict = "within" if a["within"] else "OVER"
    return (f"1 - cosine max {1 - a['cosine_min']:.2g}, top-{RT.TOP_K} {a[f'top{RT.TOP_K}_agreement']:.2f} "
            f"({verdict} {a['budget']})")


def lines(head: str, rows: list[Row], info: dict) -> list[str]:
    """What bench prints of a bench of one pass per input: `head`, then each engine, precision and
    flavour at each shape, its time beside its accuracy, then the engines not timed."""
    out = [head]
    for row in rows:
        if row.median_ms != row.median_ms:  # NaN: the export failed
            out.append(f"{row.engine} {row.precision} {row.flavor}: {row.note}")
            continue
        ratios = "".join(f", {v:.2f}x {k}" for k, v in (("transformers", row.ratio_to_transformers),
                                                         ("the anchor", row.ratio_to_anchor)) if v)
        accuracy = accuracy_text(row.accuracy)
        shape = f"{row.batch:>3d} x {row.seq:<4d}" if row.seq else f"batch {row.batch:<3d}"
        out.append(f"{shape} {row.engine} {row.precision} {row.flavor}: {row.median_ms:.2f} ms "
                   f"(p10 {row.p10_ms:.2f}, p90 {row.p90_ms:.2f}), {row.per_s:,.1f} {row.unit}/s{ratios}"
                   + (f"; {accuracy}" if accuracy else ""))
    return out + skipped_lines(info)


def to_json(rows: list[Row], info: dict) -> dict:
    """bench --json of a bench of one pass per input."""
    return {"rows": [row.to_dict() for row in rows], "info": info}
