"""`bench --hf SOURCE`: the source's family (`registry.of_source`) times its engines side by side
(`Family.bench`: its request made from the command line's options, those it does not take refused
in one line), and says them (`Family.bench_lines`, `bench_json`). What every family's bench shares:
which options a family's bench takes, the Optimum anchor's export of the same weights under the
family's Optimum task, and the lines of the engines a run could not time."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace

from attnexport.errors import UsageError
from attnexport.pretrained import registry

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
