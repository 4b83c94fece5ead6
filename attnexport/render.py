"""What the commands print: attnexport's results as text (rich tables that fit 80 columns, and
plain lines). The command line (`attnexport.cli`) calls these on what `attnexport.commands` and
the rest of the library return; a Python caller may too."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnexport import bench as bench_mod
from attnexport import files as F
from attnexport import signature as SG
from attnexport import usage
from attnexport.compare import FP32_FACTOR


def variants(rows: list[dict], options: list) -> None:
    """`attnexport list`: each variant (`variants.catalogue()` rows), its inputs and outputs (the
    optional ones in brackets) and its options (`options`, a list of each variant's schema.Option)."""
    t = Table(title=f"{len(rows)} attention variants", show_lines=True)
    for col in ("variant", "inputs -> outputs", "options"):
        t.add_column(col, overflow="fold")  # fold long choices, never cut them
    for r, opts in zip(rows, options, strict=True):
        ins = ", ".join(("[" + i["name"] + "]") if i["optional"] else i["name"] for i in r["inputs"])
        outs = ", ".join(("[" + i["name"] + "]") if i["optional"] else i["name"] for i in r["outputs"])
        t.add_row(f"[bold]{r['name']}[/bold]\n{escape(r['summary'])}", escape(f"{ins} -> {outs}"),
                  escape(" ".join(option_text(opt) for opt in opts)))
    Console().print(t)


def option_text(opt) -> str:
    """A variant option as `list` shows it: `--heads=4`, `--mask {none|causal}=none`, a flag alone."""
    if opt.type is bool:
        return opt.flag
    default = "auto" if opt.default is None else opt.default  # None: derived (e.g. --kv-heads = --heads)
    if opt.choices:
        return f"{opt.flag} {{{'|'.join(opt.choices)}}}={default}"
    return f"{opt.flag}={default}"


def inspection(d: dict) -> None:
    """`attnexport inspect`: `inspect.describe`'s description of a model file."""
    console = Console()
    opsets = ", ".join(f"{k} {v}" for k, v in d["opsets"].items())
    console.print(f"[bold]{escape(d['path'])}[/bold]: IR {d['ir_version']}, opsets {escape(opsets)}, "
                  f"{d['nodes']} nodes, {d['parameters']} parameters, {F.human_size(d['size'])}")
    console.print(f"attention op: [bold]{escape(d['attention_op'])}[/bold]")
    t = Table(show_header=True)
    for col in ("", "name", "dtype", "dims"):
        t.add_column(col)
    for kind in ("inputs", "outputs"):
        for x in d[kind]:
            t.add_row(kind[:-1], x["name"], x["dtype"], escape(str(x["dims"])))
    console.print(t)
    console.print("ops: " + escape(", ".join(f"{k} x{v}" for k, v in d["op_counts"].items())))
    if not d["attnexport"]:
        console.print("no attnexport metadata")
        return
    for k, v in d["attnexport"].items():
        if k == "params":  # one line: how many are fingerprinted (the hashes are in --json)
            entries = json.loads(v) if isinstance(v, str) else v
            v = f"{len(entries)} parameters fingerprinted (sha256 each; see --json)"
        elif k == "routed":  # a module's attention calls: how each was found, and where
            calls = json.loads(v)
            v = f"{len(calls)} attention call(s)" + "".join(f"; {c['kind']} at {c['where']}" for c in calls)
        elif k == "signature":  # the step's cache pairs and write position (the whole record in --json)
            v = SG.describe(SG.StepSignature.from_json(v))
        elif k == "inputs":  # a module's inputs: shape, dtype and the name of each symbolic axis
            v = "; ".join(f"{i['name']} {'x'.join(map(str, i['shape']))} {i['dtype']}" + "".join(
                f", axis {a} {dim}" for a, dim in i["dynamic"].items()) for i in json.loads(v))
        console.print(f"  {k}: {escape(json.dumps(v) if isinstance(v, dict) else str(v))}")


def sci(x) -> str:
    return "-" if x is None or x != x or x == float("inf") else f"{x:.2e}"


def new_table(title, columns, numeric, min_widths=None):
    """A table that fits 80 columns: no vertical rules, text columns fold, numbers never cut."""
    from rich import box
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in columns:
        if col in numeric:
            t.add_column(col, justify="right", no_wrap=True)
        else:
            t.add_column(col, overflow="fold", min_width=(min_widths or {}).get(col))
    return t


def run_cell(r) -> str:
    """A run's table cell: the model file, the case and where it ran on lines of their own, so a
    narrow terminal wraps between them, not inside a name (a case's steps break after the /)."""
    case = r.case.replace("/", "/ ")
    return "\n".join(([f"{r.model}:"] if r.model else []) + [case, f"{r.flavor} {r.runtime}"])


def result(r) -> str:
    return "n/a" if r.skipped else ("[green]pass[/green]" if r.passed else "[red]FAIL[/red]")


def verify(report, details: bool = False, out: Console | None = None) -> None:
    """`verify`'s report as text: the runtimes skipped, the failures (or, with `details`, every
    run with its error statistics), a summary per runtime and flavour, the bases of the
    tolerances, a lossy model's accuracy, and the verdict."""
    out = out or Console()
    for r in report.runtimes:
        if not r["available"]:
            click.echo(f"skipped {r['name']}: {r['reason']}", err=True)
        elif r.get("warning"):
            click.echo(f"warning {r['name']}: {r['warning']}", err=True)
    if details:
        table = new_table(f"verify {report.dtype}: every run",
                          ("run", "ok", "output", "max abs\n@ index", "mean\nmedian\np99", "atol\nneeds", "ms"),
                          ("max abs\n@ index", "mean\nmedian\np99", "atol\nneeds", "ms"), min_widths={"run": 19})
        for r in report.rows:
            run = escape(run_cell(r))
            if not r.comparisons:
                table.add_row(run, result(r), escape((r.skipped or r.error)[:120]), "", "", "", "")
                continue
            for i, c in enumerate(r.comparisons):
                idx = ",".join(map(str, c.argmax))
                table.add_row(run if i == 0 else "", result(r) if i == 0 else "", escape(c.problem or c.name),
                              f"{sci(c.max_abs)}\n@{idx}", f"{sci(c.mean_abs)}\n{sci(c.median_abs)}\n{sci(c.p99_abs)}",
                              f"{sci(c.atol)}\n{sci(c.needed_atol)}",
                              f"{r.median_ms:.2f}" if (i == 0 and r.median_ms is not None) else "")
        out.print(table)
    elif report.failures:
        table = new_table("failures", ("run", "output", "max abs", "atol", "needs atol"),
                          ("max abs", "atol", "needs atol"))
        for r in report.failures:
            c = r.worst
            table.add_row(escape(run_cell(r)),
                          escape(c.name if c is not None else (r.error or "compared nothing")[:60]),
                          sci(c.max_abs) if c is not None else "-", sci(c.atol) if c is not None else "-",
                          sci(c.needed_atol) if c is not None else "-")
        out.print(table)
    summary = new_table(f"verify {report.dtype}: {len(report.rows)} runs",
                        ("runtime", "flavor", "pass", "fail", "n/a", "worst abs", "needs atol", "ms"),
                        ("pass", "fail", "n/a", "worst abs", "needs atol", "ms"))
    groups: dict = {}
    for r in report.rows:
        groups.setdefault((r.runtime, r.flavor), []).append(r)
    for (rt, fl), rs in groups.items():
        # Only values that were compared count: a failed run with no comparison shows "-".
        cs = [c for r in rs for c in r.comparisons if not c.problem]
        failed = sum(1 for r in rs if not r.passed and not r.skipped)
        summary.add_row(rt, fl, str(sum(r.passed for r in rs)), f"[red]{failed}[/red]" if failed else "0",
                        str(sum(bool(r.skipped) for r in rs)),
                        sci(max((c.max_abs for c in cs), default=None)),
                        sci(max((c.needed_atol for c in cs), default=None)),
                        f"{sum(r.median_ms or 0 for r in rs):.1f}")
    out.print(summary)
    kinds: dict = {}
    for r in report.rows:  # which cases ran, and where their expected values came from
        kinds.setdefault(r.expected_kind, {}).setdefault(r.case, None)
    for kind, names in kinds.items():
        shown = ", ".join(list(names)[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        click.echo(f"cases, expected from {kind}: {shown}")
    bases = sorted({r.tolerance.basis for r in report.rows
                    if r.tolerance is not None and not r.tolerance.basis.startswith("exact")})
    if report.dtype == "fp16" and bases:
        click.echo(f"fp16 tolerances: derived per case ({len(bases)} {'basis' if len(bases) == 1 else 'bases'}; "
                   "see --details or --json), "
                   "atol = max(policy, 4 x the error of the fp16-emulated reference)")
    derived = [(c, r) for r in report.rows for c in r.comparisons if "in float64" in c.basis]
    if derived:
        c, r = max(derived, key=lambda cr: cr[0].atol)
        click.echo(f"budgets: per output, atol = max(policy, {FP32_FACTOR:g} x torch's own error against the model "
                   f"in float64), rtol {c.rtol:g}; the largest: {c.name} of {r.case}, atol {c.atol:.3g} ({c.basis})")
    for r in report.rows:  # a lossy language model's accuracy, an encoder's embeddings, in words
        if r.detail and "summary" in r.detail:
            click.echo(f"{r.detail.get('measure', 'accuracy')} on {r.runtime}: {r.detail['summary']}; budget: "
                       f"{r.detail['budget']['text']}")
        if r.detail and r.detail.get("layer_costs"):
            costs = r.detail["layer_costs"][:5]
            if "kl_mean" in costs[0]:  # a language model's
                top = ", ".join(f"{c['group']} {c['kl_mean']:.2g}" for c in costs)
                click.echo(f"layers that cost most, each quantized alone (mean KL vs fp32): {top}")
            else:  # an encoder's
                top = ", ".join(f"{c['group']} {c['cost']:.2g}" for c in costs)
                click.echo(f"layers that cost most, each quantized alone (1 - lowest cosine vs float64): {top}")
    for r in report.failures:
        click.echo(f"FAIL {r.describe(localization=False)}")
        if r.localization is not None and (r.localization.diverged or r.localization.note):
            click.echo(f"  where: {r.localization.describe()}")
    if report.saved_baseline:
        click.echo(f"baseline saved: {report.saved_baseline}")
    if report.resources_line:
        click.echo(f"verify {report.resources_line}")
    s = report.summary()
    verdict = "all passed" if report.ok else f"{s['failed']} failed"
    click.echo(f"verify: {s['passed']} passed, {s['failed']} failed, {s['not_applicable']} not applicable "
               f"({verdict})")



def bench_table(rows, variant, dtype) -> None:
    """The timing table at any width down to 80 columns: two values per cell, notes below it."""
    table = new_table(f"bench {variant} {dtype}, {rows[0].threads if rows else '?'} CPU threads",
                      ("run", "shape", "median ms\np10-p90", "TFLOP/s\npeak", "x torch\nspread", "max err"),
                      ("median ms\np10-p90", "TFLOP/s\npeak", "x torch\nspread", "max err"))
    notes = []
    for r in rows:
        run = f"{r.runtime}\n{r.flavor}" + ("" if r.mode in ("eager", "io-binding") else f" {r.mode}")
        if r.phase:
            run += f" {r.phase}"
        if r.median_ms != r.median_ms:  # not applicable: no timing
            notes.append(f"{r.runtime} {r.flavor}: {r.note}")
            continue
        note = [r.note] if r.note else []
        if r.ratio_to_ort_cpu is not None:
            note.append(f"{r.ratio_to_ort_cpu:.2f}x ort-cpu's time")
        if r.cpu_nodes:
            note.append(f"{len(r.cpu_nodes)} node(s) on CPU: {', '.join(r.cpu_nodes[:3])}")
        if r.peak_mem_bytes is not None:
            note.append(f"peak mem {r.peak_mem_bytes / 2**20:.0f} MiB")
        if note:
            notes.append(f"{r.runtime} {r.flavor} {r.shape_label}: {'; '.join(note)}")
        table.add_row(escape(run), r.shape_label, f"{r.median_ms:.3f}\n{r.p10_ms:.3f}-{r.p90_ms:.3f}",
                      f"{r.tflops:.3f}\n{r.peak_fraction:.2f}",
                      f"{r.ratio_to_torch:.2f}\n{r.ratio_min:.2f}-{r.ratio_max:.2f}", f"{r.max_abs_err:.1e}")
    Console().print(table)
    peaks = sorted({(r.peak_tflops, r.peak_source) for r in rows if r.peak_source})
    for tf, where in peaks:
        click.echo(f"peak: {tf:.3f} TFLOP/s, the best matmul measured ({where}); 'x torch' spread: over "
                   f"{rows[0].rounds} rounds")
    for n in notes:
        click.echo(f"note: {n}")


def bench(result) -> None:
    """`attnexport bench`'s result (`commands.BenchResult`) as text."""
    if result.family is not None:  # a whole model's: its family says its rows
        for line in result.lines():
            click.echo(line)
        return
    rows = result.rows
    bench_table(rows, result.title, result.dtype)
    for rt, shape, flavor, ms in bench_mod.fastest(rows):
        click.echo(f"fastest on {rt} at {shape}: {flavor} ({ms:.3f} ms)")
    for r in rows:
        if r.phase and r.tokens_per_s:
            mode = "" if r.mode == "eager" else f" ({r.mode})"
            bandwidth = f", {r.bandwidth_fraction:.2f} of the {r.bandwidth_gbs:.1f} GB/s memory bandwidth" \
                if r.bandwidth_fraction is not None else ""
            click.echo(f"{r.phase} {r.runtime} {r.flavor}{mode} at {r.shape_label}: {r.median_ms:.3f} ms, "
                       f"{r.tokens_per_s:,.0f} tokens/s{bandwidth}")
    if result.plot:
        click.echo(f"plot: {result.plot}")


def _terminal(console: Console | None) -> Console | None:
    """Where bars are drawn: `console` where it is a terminal; by default stderr's console where
    stderr is a TTY itself (rich takes FORCE_COLOR for a terminal: a CI log would get them); None
    where there is none."""
    if console is None:
        if not sys.stderr.isatty():
            return None
        console = Console(stderr=True)
    return console if console.is_terminal else None


def with_progress(label: str, quiet: bool, work, console: Console | None = None):
    """`work(progress)` with one bar on a terminal (`_terminal`) while it runs: `progress(i, n, what)`,
    the library's callback for golden mode's verify and bench; `work(None)` where `quiet` or no
    terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = None if quiet else _terminal(console)
    if console is None:
        return work(None)
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=None)
        return work(lambda i, n, what: bar.update(task, completed=i, total=n, description=what))


@contextlib.contextmanager
def work_in_progress(console: Console | None = None):
    """While the block runs, on a terminal (`console`'s, stderr's by default; nothing elsewhere):
    each phase's line as it ends (`usage.tell_phases`), and a bar for each counted piece of work while
    it runs (`usage.counted`: the float64 model a layer at a time, the quantizer a matrix at a time),
    gone when it ends. Drawn when a count moves (at most 20 times a second), by no thread of its own:
    a child forked meanwhile finds no drawing under way."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = _terminal(console)
    if console is None:
        yield
        return
    bars = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, auto_refresh=False, redirect_stdout=False,
                    redirect_stderr=False)
    tasks: dict[int, Any] = {}
    drawn = [0.0]

    def show(count: usage.Count) -> None:
        key = id(count)
        if count.ended:
            if key in tasks:
                bars.remove_task(tasks.pop(key))
                bars.refresh()
            return
        if key not in tasks:
            tasks[key] = bars.add_task(count.what, total=count.total)
        bars.update(tasks[key], completed=count.done)
        now = time.monotonic()
        if count.done in (0, count.total) or now - drawn[0] >= 0.05:
            drawn[0] = now
            bars.refresh()

    with usage.telling(lambda p: bars.console.print(usage.phase_line(p), markup=False, highlight=False), show), bars:
        yield
