"""The command line: declares each command's options (types, defaults, help), calls the library
(`attnexport.commands` for export, verify and bench, which check what goes together and build the
request) and prints (`attnexport.render`). No logic of its own."""

from __future__ import annotations

import contextlib
import errno
import functools
import sys

import click

from attnexport import cases as cases_mod
from attnexport import commands, jsonout, memo, options, render
from attnexport import files as F
from attnexport import golden as golden_mod
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.errors import AttnExportError, UsageError
from attnexport.reading import describe
from attnexport.runtimes import js


def _fail(message: str, code: int):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def reports_errors(fn):
    """Turns the library's typed errors into one line on stderr and the error's exit code."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AttnExportError as e:
            _fail(str(e), e.exit_code)
        except OSError as e:
            # A full disk wherever a command writes: one line (what was staged is discarded as the
            # error passes); any other system error is a defect, shown whole.
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            _fail(f"cannot write{' ' + str(e.filename) if e.filename else ''}: {e.strerror}", 2)
        except KeyboardInterrupt:
            # Files are written to a temporary name and renamed: nothing is left half-written.
            _fail("interrupted", 130)
    return wrapper


# The exception click 8.2 added for a group called with no arguments; a class no error is with older clicks.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", type("_NeverRaised", (Exception,), {}))


class _OneLineErrors(click.Group):
    """click's own usage errors (an unknown option, a value that is not a number) as one line
    and exit 2, like the library's: `error: No such option '--bogus'. (attnexport export --help)`."""

    def main(self, *args, **kwargs):
        if not kwargs.pop("standalone_mode", True):
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS_IS_HELP as e:  # click >= 8.2; older clicks print the help and exit 0 themselves
            click.echo(e.ctx.get_help() if e.ctx else e.format_message())
            sys.exit(0)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            command = f"attnexport {ctx.command.name}" if ctx is not None and ctx.parent is not None else "attnexport"
            hint = f" (see `{command} --help`)"
            _fail(f"{e.format_message()}{hint}", e.exit_code)
        except click.exceptions.Abort:
            _fail("interrupted", 130)
        sys.exit(0)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attnexport")
def main():
    """attnexport: attention layers exported to ONNX, checked against golden outputs, timed."""


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def list_cmd(as_json):
    """List the attention variants, their inputs, outputs and options.

    Example: attnexport list --json
    """
    rows = V.catalogue()
    if as_json:
        click.echo(jsonout.dumps(rows, indent=1))
        return
    render.variants(rows, [v.options for v in V.VARIANTS.values()])


@main.command("runtimes")
@click.option("--install", is_flag=True,
              help="Install the pinned npm packages of ort-node, ort-wasm and ort-webgpu (else done on first use).")
@click.option("--json", "as_json", is_flag=True, help="Print the runtimes as JSON.")
@reports_errors
def runtimes_command(install, as_json):
    """List every runtime: whether it can run here, and what it is or why not.

    Example: attnexport runtimes; attnexport runtimes --install
    """
    if install:
        where = js.install()
        click.echo(f"installed {', '.join(f'{n} {v}' for n, v in js.pins().items())} in {where}", err=as_json)
    rows = [{"name": n, "available": s.available, "reason": s.reason, "default": n in R.DEFAULT_RUNTIMES}
            for n, s in ((n, R.status(n)) for n in R.RUNTIMES)]
    if as_json:
        click.echo(jsonout.dumps(rows, indent=1))
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "yes" if r["available"] else "no "
        click.echo(f"{r['name']:<{width}}  {state}  {r['reason']}")


@main.command("cache")
@click.option("--clear", is_flag=True, help="Remove every entry (attnexport's files only).")
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@reports_errors
def cache_command(clear, as_json):
    """Show the export cache: where it is, its size and limit, its entries; or clear it.

    Example: attnexport cache; attnexport cache --clear; ATTNEXPORT_CACHE_SIZE=500M attnexport cache
    """
    d = memo.directory()
    if clear:
        n = memo.clear()
        click.echo(f"removed {n} entries from {d}" if d is not None
                   else "the export cache is off (ATTNEXPORT_CACHE=off)")
        return
    doc = memo.describe()
    if as_json:
        click.echo(jsonout.dumps(doc, indent=1))
        return
    if d is None:
        click.echo("the export cache is off (ATTNEXPORT_CACHE=off)")
        return
    size, limit = F.human_size(doc["size_bytes"]), F.human_size(doc["limit_bytes"])
    click.echo(f"{d}: {doc['entries']} entries, {size} of {limit} ({doc['entries_of_this_version']} of this version, "
               f"{doc['entries_of_other_versions']} of other versions, removed first)")


@main.command()
@click.option("--list", "as_list", is_flag=True, help="List the golden cases: name, variant, where each comes from.")
@click.option("--check", is_flag=True, help="Regenerate every case in memory and report drift (the default).")
@click.option("--write", is_flag=True, help="Regenerate and write every golden file (needs --dir when "
                                            "attnexport is installed, not run from a checkout).")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Golden folder (default: the one attnexport uses: its checkout's golden/, or the installed copy).")
@reports_errors
def golden(as_list, check, write, directory):
    """Check (or write, or list) the golden cases against the float64 NumPy reference.

    Example: attnexport golden --check; attnexport golden --list
    """
    if sum((as_list, check, write)) > 1:
        raise UsageError("--list, --check and --write exclude each other")
    if as_list:
        width = max(len(n) for n in golden_mod.CASES)
        for case in golden_mod.CASES.values():
            click.echo(f"{case.name:<{width}}  {case.variant:<14}  {cases_mod.provenance_line(case)}")
        return
    if write:
        if directory is None and golden_mod.default_dir_is_installed():
            raise UsageError(f"--write would change the installed copy in {golden_mod.default_dir()}: "
                             "give --dir (e.g. the golden/ folder of a checkout)")
        paths = golden_mod.write(directory)
        folder = paths[0].parent if paths else directory
        click.echo(f"wrote {len(paths)} golden cases and {golden_mod.MANIFEST} to {folder}")
        foreign = golden_mod.foreign_files(folder)
        if foreign:
            click.echo(f"left {len(foreign)} file(s) there that are not golden cases: {', '.join(foreign)}")
        return
    drift = golden_mod.check(directory)
    for d in drift:
        click.echo(f"drift: {d}")
    if drift:
        _fail(f"{len(drift)} of {len(golden_mod.CASES)} golden cases drifted from the reference", 1)
    click.echo(f"golden: {len(golden_mod.CASES)} cases match the reference "
               f"(manifest {golden_mod.manifest_hash(directory)[:12]})")


def _variant_options(fn=None, *, exclude=()):
    """Adds every variant option in the registry as a CLI option (None unless given)."""
    if fn is None:
        return functools.partial(_variant_options, exclude=exclude)
    seen, choices = {}, {}
    for v in V.VARIANTS.values():
        for opt in v.options:
            if opt.name not in exclude:
                seen.setdefault(opt.name, opt)
                if opt.choices:  # the union over the variants; each variant checks its own
                    choices.setdefault(opt.name, [])
                    choices[opt.name] += [c for c in opt.choices if c not in choices[opt.name]]
    for opt in reversed(list(seen.values())):
        if opt.name == "weights":  # a flag (the softmax weights), or sdpa's score mode as its value
            deco = click.option(opt.flag, opt.name, is_flag=False, flag_value="softmax", default=None,
                                help="also output the attention weights; sdpa: --weights raw|softcap|bias|softmax; "
                                     "with --module: --weights FILE, the module's trained weights (a state_dict "
                                     "saved with torch.save, or .safetensors)")
        elif opt.name == "kv_cache":  # a flag (the concat cache), or --kv-cache static
            deco = click.option(opt.flag, opt.name, is_flag=False, flag_value="concat", default=None,
                                type=click.Choice(["concat", "static"]),
                                help="key/value cache step graph: --kv-cache (past_key/past_value in, present_* "
                                     "out, grown by concatenation) or --kv-cache static --max-seq S (fixed buffers "
                                     "written in place at write_pos; mha, sdpa, decoder)")
        elif opt.type is bool:
            deco = click.option(opt.flag, opt.name, flag_value=True, default=None, help=opt.help)
        else:
            kind = click.Choice(choices[opt.name]) if opt.name in choices else \
                click.IntRange(min=opt.minimum) if opt.type is int else opt.type
            deco = click.option(opt.flag, opt.name, type=kind, default=None,
                                help=f"{opt.help} (where the variant takes it)")
        fn = deco(fn)
    return fn


@main.command()
@_variant_options
@reports_errors
def export(as_json, **given):
    """Export a variant, your own module or a transformers language model to ONNX (checked, with
    metadata, written atomically).

    Examples: attnexport export --variant mha --heads 8 --flavor ort -o mha.onnx;
    attnexport export --module examples/causal_self_attention.py:example -o block.onnx;
    attnexport export --hf ./tiny-llama --kv-cache static --max-seq 512 --flavor ort -o llama.onnx;
    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache --deploy smollm2-onnx
    """
    with render.work_in_progress():  # a whole model's export: its phases and its layers, on a terminal
        result = commands.export(**given)
    click.echo(jsonout.dumps(result.to_dict()) if as_json else result.summary())


@main.command()
@click.argument("model", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
@reports_errors
def inspect(model, as_json):
    """Describe an ONNX file: opset, IR version, inputs/outputs, ops, attention op, metadata.

    Example: attnexport inspect models/mha.onnx
    """
    d = describe(model)
    if as_json:
        click.echo(jsonout.dumps(d, indent=1))
        return
    render.inspection(d)


@main.command()
@click.argument("models", nargs=-1, type=click.Path())
@_variant_options
@reports_errors
def verify(models, details, as_json, **given):
    """Check exported models against the golden cases on every runtime; exit 1 on any mismatch.

    With no MODEL: exports every selected golden case in every selected flavor and runs it.
    With MODEL files: takes each model's variant, options, dtype and weights from the file
    (a model without metadata: --variant and its options, e.g. --heads 8) and runs the golden
    cases with those options, or seeded inputs at two shapes, through it.

    Example: attnexport verify --runtimes torch,ort-cpu --flavor attention
    """

    def run(progress=None):
        return commands.verify(models, progress=progress, **given)

    if given["hf_path"] is not None:  # a language model's: its phases, and a bar per layer of its oracle
        with contextlib.nullcontext() if as_json else render.work_in_progress():
            report = run()
    else:  # a bar over golden mode's and model files' runs (a module's check reports none)
        report = render.with_progress("verify", as_json or given["module_spec"] is not None, run)
    if as_json:
        click.echo(jsonout.dumps(report.to_dict()))
    else:
        render.verify(report, details)
    if not report.ok:
        sys.exit(1)


@main.command()
@_variant_options(exclude=("batch", "seq", "kv_seq"))
@reports_errors
def bench(as_json, plot, **given):
    """Time a variant on every runtime and flavor against PyTorch eager.

    Examples: attnexport bench --variant mha --runtimes torch,ort-cpu --batch 8 --seq 512 --dim 512 --heads 8;
    attnexport bench --hf ./tiny-llama --decode --context 128,1024 --threads 2
    """

    result = render.with_progress("bench", as_json or given["hf_path"] is not None, lambda progress: commands.bench(
        plot=plot, progress=progress, said=None if as_json else (lambda text: click.echo(text, err=True)), **given))
    if as_json:
        click.echo(jsonout.dumps(result.to_json()))
        return
    render.bench(result)


# Each command's options, declared once (attnexport.options), before the variant options.
export.params[:0] = options.EXPORT
verify.params[1:1] = options.VERIFY  # after its MODEL arguments
bench.params[:0] = options.BENCH
