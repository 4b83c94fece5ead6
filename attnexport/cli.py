"""The command line: declares each command's options (types, defaults, help), calls the library
(`attnexport.commands` for export, verify and bench, which check what goes together and build the
request) and prints (`attnexport.render`). No logic of its own."""

from __future__ import annotations

import functools
import sys

import click
from rich.console import Console

from attnexport import cases as cases_mod
from attnexport import commands, jsonout, memo, render
from attnexport import dtypes as D
from attnexport import export as export_mod
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import golden as golden_mod
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.errors import AttnExportError, UsageError
from attnexport.pretrained.precision import MINIMUM_FORMS as P_MINIMUM_FORMS
from attnexport.pretrained.precision import PRECISIONS
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
        except KeyboardInterrupt:
            # Files are written to a temporary name and renamed: nothing is left half-written.
            _fail("interrupted", 130)
    return wrapper


class _Checked(click.Choice):
    """A closed set of values as a click Choice (`--help` lists them, shells complete them) whose
    error is attnexport's own one line (`unknown flavor 'atention' (did you mean attention?); valid: ...`)."""

    def __init__(self, choices, check):
        super().__init__(list(choices))
        self._check = check

    def convert(self, value, param, ctx):
        try:
            return self._check(value)
        except UsageError as e:
            self.fail(str(e), param, ctx)


class _RuntimeList(click.ParamType):
    """`--runtimes a,b,...`: names from `names`, comma-separated, each checked (runtimes.parse); `--help`
    lists them and shells complete the name after the last comma."""

    name = "runtimes"

    def __init__(self, names, what=""):
        self.names, self.what = tuple(names), what

    def get_metavar(self, param, ctx=None):  # ctx: click >= 8.2 passes it
        return "[" + "|".join(self.names) + "],..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            names = R.parse(value)
        except UsageError as e:
            self.fail(str(e), param, ctx)
        for n in names:
            if n not in self.names:
                self.fail(f"unknown runtime {n!r}{self.what}; valid: {', '.join(self.names)}", param, ctx)
        return names

    def shell_complete(self, ctx, param, incomplete):
        from click.shell_completion import CompletionItem
        done, _, last = incomplete.rpartition(",")
        prefix = f"{done}," if done else ""
        return [CompletionItem(prefix + n) for n in self.names if n.startswith(last)]


FLAVOR = _Checked(FL.FLAVORS, FL.check)
DTYPE = _Checked(D.DTYPES, D.check)
VARIANT = _Checked(V.VARIANTS, lambda name: V.get(name).name)
RUNTIME_LIST = _RuntimeList(R.RUNTIMES)
TIMED_RUNTIME_LIST = _RuntimeList(R.TIMED_RUNTIMES, " for bench")


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


SEED = click.IntRange(0, 2**63 - 1)  # what numpy's and torch's generators take


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
@click.option("--variant", type=VARIANT, default=None, help="The variant to export (see `attnexport list`).")
@click.option("--module", "module_spec", default=None, metavar="FILE.py:NAME",
              help="Your own module instead: an nn.Module class taking no arguments, or a function returning "
                   "a module or (module, example_inputs).")
@click.option("--hf", "hf_path", default=None, metavar="PATH",
              help="A transformers causal language model instead: a folder saved with save_pretrained (a config "
                   "alone: weights from --seed) or a model id; --kv-cache (Optimum's names) or --kv-cache static "
                   "--max-seq N (buffers written in place), none without.")
@click.option("--input", "input_specs", multiple=True, metavar="NAME:SHAPE[:DTYPE]",
              help="With --module: an example input, e.g. x:2x16x64 (repeatable; default: the NAME function's).")
@click.option("--nan-rows", is_flag=True,
              help="With --module and --flavor primitives: a fully masked query row gives NaN, as in torch "
                   "(default: zeros).")
@click.option("--allow-unfused", is_flag=True,
              help="With --module: export attention that is not recognized as MatMul+Softmax in a fused flavor "
                   "(default: exit 1 naming it).")
@click.option("--cache", "cache_specs", multiple=True, metavar="INPUT:OUTPUT",
              help="With --module: the module's own key/value cache, an input and the output returning it "
                   "updated, e.g. past_key:present_key (repeatable; {i} stands for a layer's number: "
                   "'past.{i}.key:present.{i}.key'); verify then checks decoding with it.")
@click.option("--write-pos", default=None, metavar="INPUT",
              help="With --module and --cache: the cache is static, its buffers keep their size and each step "
                   "writes its block where INPUT says (each sequence's first position (B,), or the block's "
                   "positions (T,)); verify then decodes sequences of different lengths with it.")
@click.option("--output-names", default=None, metavar="A,B,...",
              help="With --module: the model's output names (default: from the module's return structure).")
@click.option("--dynamic", "dynamic_specs", multiple=True, metavar="NAME:AXIS=DIM",
              help="With --module: a symbolic axis, e.g. x:1=seq (repeatable; default: axes 0 and 1 of every "
                   "input, where the model allows).")
@click.option("--flavor", type=FLAVOR, default=export_mod.DEFAULT_FLAVOR, show_default=True,
              help="The graph flavor.")
@click.option("--opset", type=int, default=None,
              help="Opset (primitives/ort: 17-18, default 18; attention: 23-24, default 23, 24 for sdpa --nonpad).")
@click.option("--dtype", type=DTYPE, default="fp32", show_default=True, help="The model's float type.")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed of the parameters (of a --module class's too: torch's generator is seeded first).")
@click.option("-o", "--output", type=click.Path(), default=None,
              help="Output file (default: models/<variant>.onnx).")
@click.option("--deploy", type=click.Path(), default=None, metavar="FOLDER",
              help="With --hf, instead of -o: write the folder a deployment loads (config.json, "
                   "generation_config.json, the tokenizer's files, onnx/model.onnx), as Optimum's "
                   "ORTModelForCausalLM and transformers.js read it.")
@click.option("--rtol", type=float, default=None,
              help="With --hf or --module: the relative tolerance of the check before writing (default: the "
                   "policy's, or for --hf derived from torch's own error against the model in float64).")
@click.option("--atol", type=float, default=None, help="With --hf or --module: the absolute tolerance, likewise.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="With --hf: fp32 (the default), fp16 (exported in half), int8 or int4 (weight matrices as ONNX "
                   "Runtime's MatMulNBits, a GGUF's own 4- or 8-bit grid carried exactly), q4f16 (int4's weights, "
                   "fp16 activations); verify says what it costs.")
@click.option("--block-size", type=int, default=None,
              help="With --precision int8/int4/q4f16: the block along each matrix's input axis (16, 32, 64, 128; "
                   "default 32).")
@click.option("--accuracy-level", type=int, default=None,
              help="With --precision int8/int4/q4f16: MatMulNBits's accuracy_level, 4 (default: int8 activations, the "
                   "fastest CPU kernels) or 0 (float activations: a carried grid gives the model's own answers).")
@click.option("--keep", default=None, metavar="GROUP[=HOW],...",
              help="With --precision int8/int4/q4f16: groups held otherwise, e.g. head=int8,first,layers:28-29=int8@0 "
                   "(GROUP: head, first, last, layer:I, layers:I-J; HOW: fp32 (default), int8, int4, @LEVEL). "
                   "Default for int4: head=int8. 'none' quantizes everything alike.")
@click.option("--symmetric/--asymmetric", default=None,
              help="With --precision int8/int4/q4f16: ONNX Runtime's quantizer without or with zero points (default "
                   "asymmetric); a carried grid keeps its own.")
@click.option("--requantize", is_flag=True, default=None,
              help="With --precision int8/int4/q4f16: round every matrix with ONNX Runtime's quantizer, even one that "
                   "already holds a grid of the bits asked for (default: such a grid is carried exactly).")
@click.option("--minimums", type=click.Choice(P_MINIMUM_FORMS), default=None,
              help="With --precision int4/q4f16: how a carried grid's float minimums (GGUF's Q4_1) are held: folded "
                   "(default: integer zero points and a 4-bit residual row per block, no extra op per matrix; each "
                   "weight within a small fraction of a step of the model's), exact (bit for bit, a MatMul and an "
                   "Add per matrix, slower) or float (float zero points: one op a matrix, each weight within the zero "
                   "point's rounding; for CUDA, its CPU kernel is slow).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_variant_options
@reports_errors
def export(variant, hf_path, module_spec, input_specs, nan_rows, allow_unfused, cache_specs, write_pos, output_names,
           dynamic_specs, flavor, opset, dtype, seed, output, deploy, rtol, atol, precision, block_size, accuracy_level,
           keep, symmetric, requantize, minimums, as_json, **options):
    """Export a variant, your own module or a transformers language model to ONNX (checked, with
    metadata, written atomically).

    Examples: attnexport export --variant mha --heads 8 --flavor ort -o mha.onnx;
    attnexport export --module examples/causal_self_attention.py:example -o block.onnx;
    attnexport export --hf ./tiny-llama --kv-cache static --max-seq 512 --flavor ort -o llama.onnx;
    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf --kv-cache --deploy smollm2-onnx
    """
    result = commands.export(variant, module_spec, hf_path, input_specs=input_specs, nan_rows=nan_rows,
                             allow_unfused=allow_unfused, cache_specs=cache_specs, write_pos=write_pos,
                             output_names=output_names, dynamic_specs=dynamic_specs, flavor=flavor, opset=opset,
                             dtype=dtype, seed=seed, output=output, deploy=deploy, rtol=rtol, atol=atol,
                             precision=precision, block_size=block_size, accuracy_level=accuracy_level, keep=keep,
                             symmetric=symmetric, requantize=requantize, minimums=minimums, **options)
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
@click.option("--variant", "variants", multiple=True, type=VARIANT,
              help="Only these variants (repeatable); with MODEL files: the variant of a model without metadata.")
@click.option("--flavor", "flavors", multiple=True, type=FLAVOR,
              help="Only these flavors (repeatable; default: all); with a MODEL: its flavor, checked.")
@click.option("--runtimes", type=RUNTIME_LIST, default=None,
              help="Comma-separated runtimes (default: all available).")
@click.option("--dtype", type=DTYPE, default=None, help="The float type (default: fp32; a MODEL's own dtype).")
@click.option("--golden", "golden_dir", type=click.Path(), default=None, help="Golden folder to use.")
@click.option("--rtol", type=float, default=None, help="Override the relative tolerance (finite, >= 0).")
@click.option("--atol", type=float, default=None, help="Override the absolute tolerance (finite, >= 0).")
@click.option("--skip-unavailable", is_flag=True, help="Skip requested runtimes that cannot run here.")
@click.option("--strict-placement", is_flag=True, help="Fail when ort-cuda runs a compute node on the CPU.")
@click.option("--seed", type=SEED, default=None,
              help="Parameters' seed of a MODEL without metadata, or of a --module class (default 0).")
@click.option("--localize", is_flag=True,
              help="Compare every intermediate value with the export; name the first diverging node.")
@click.option("--save-baseline", type=click.Path(), default=None,
              help="Write every run's inputs and outputs to this folder (a known-good baseline).")
@click.option("--baseline", "baseline_dir", type=click.Path(), default=None,
              help="Fail runs whose error grew more than --max-growth times since this baseline.")
@click.option("--max-growth", type=float, default=10.0, show_default=True,
              help="Allowed growth of the max abs error against --baseline.")
@click.option("--details", is_flag=True, help="Show every run with its error statistics.")
@click.option("--case", "cases", multiple=True,
              help="Only these golden cases (repeatable; `attnexport golden --list` lists them).")
@click.option("--module", "module_spec", default=None, metavar="FILE.py:NAME",
              help="With one MODEL: compare it with this module (--weights FILE: its trained weights).")
@click.option("--hf", "hf_path", default=None, metavar="PATH",
              help="With one MODEL exported with export --hf: compare it with this language model (its shapes, "
                   "the decode property, greedy generation against transformers' generate).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=48, show_default=True,
              help="With --hf: the tokens generated for the parity check.")
@click.option("--clients", "clients_text", default=None, metavar="optimum,transformers.js|all",
              help="With --hf and a deployment folder as MODEL (export --hf --deploy): also generate from it with "
                   "these clients (Optimum's ORTModelForCausalLM, transformers.js in Node) and compare their tokens.")
@click.option("--budget", default=None, metavar="LIMIT=VALUE,...",
              help="With --hf and a quantized or fp16 MODEL: the accuracy budget's limits instead of the defaults "
                   "(kl-mean=0.05, top1=0.85, perplexity=0.05, first-tokens=0, margin=1; 'none' drops a limit).")
@click.option("--input", "input_specs", multiple=True, metavar="NAME:SHAPE[:DTYPE]",
              help="With --module and a MODEL from another exporter: its inputs, as for export --module.")
@click.option("--cache", "cache_specs", multiple=True, metavar="INPUT:OUTPUT",
              help="With --module: the module's own cache (as for export --module; default: what the MODEL "
                   "records): check decoding with it.")
@click.option("--write-pos", default=None, metavar="INPUT",
              help="With --module and --cache: the cache is static, written where INPUT says (as for export "
                   "--module; default: what the MODEL records).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document and nothing else.")
@_variant_options
@reports_errors
def verify(models, variants, flavors, runtimes, dtype, golden_dir, rtol, atol, skip_unavailable,
           strict_placement, seed, localize, save_baseline, baseline_dir, max_growth, details, cases, module_spec,
           hf_path, new_tokens, clients_text, budget, input_specs, cache_specs, write_pos, as_json, **options):
    """Check exported models against the golden cases on every runtime; exit 1 on any mismatch.

    With no MODEL: exports every selected golden case in every selected flavor and runs it.
    With MODEL files: takes each model's variant, options, dtype and weights from the file
    (a model without metadata: --variant and its options, e.g. --heads 8) and runs the golden
    cases with those options, or seeded inputs at two shapes, through it.

    Example: attnexport verify --runtimes torch,ort-cpu --flavor attention
    """

    # A progress bar over golden mode's and model files' runs (a module's and a language model's
    # checks report none).
    quiet = as_json or module_spec is not None or hf_path is not None
    report = _with_progress("verify", quiet, lambda progress: commands.verify(
        models, variants=variants, flavors=flavors, runtimes=runtimes, dtype=dtype, golden_dir=golden_dir, rtol=rtol,
        atol=atol, skip_unavailable=skip_unavailable, strict_placement=strict_placement, seed=seed, localize=localize,
        save_baseline=save_baseline, baseline_dir=baseline_dir, max_growth=max_growth, cases=cases,
        module_spec=module_spec, hf_path=hf_path, new_tokens=new_tokens, clients_text=clients_text, budget=budget,
        input_specs=input_specs, cache_specs=cache_specs, write_pos=write_pos, progress=progress, **options))
    if as_json:
        click.echo(jsonout.dumps(report.to_dict()))
    else:
        render.verify(report, details)
    if not report.ok:
        sys.exit(1)


def _with_progress(label, quiet, work):
    """Runs work(progress) with a progress bar on stderr when it is a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    err_console = Console(stderr=True)
    if quiet or not err_console.is_terminal:
        return work(None)
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("", total=None)
        return work(lambda i, n, what: bar.update(task, completed=i, total=n, description=what))


@main.command()
@click.option("--variant", type=VARIANT, default=None, help="The variant to time (see `attnexport list`).")
@click.option("--module", "module_spec", default=None, metavar="FILE.py:NAME",
              help="Your own module instead (as for export --module); every symbolic length takes --seq.")
@click.option("--hf", "hf_path", default=None, metavar="PATH",
              help="A transformers causal language model (as for export --hf), with --decode: each cache form and "
                   "flavor against transformers eager (and Optimum's export and onnxruntime-genai's model builder "
                   "when installed).")
@click.option("--genai-python", default=None, metavar="PYTHON",
              help="With --hf: the Python that runs onnxruntime-genai's model builder (default: this one; the "
                   "builder may want another transformers than Optimum).")
@click.option("--precision", "precisions", default=None, metavar="P,...",
              help="With --hf: attnexport's precisions to time (fp32, fp16, int8, int4, q4f16; default fp32), "
                   "each beside its accuracy.")
@click.option("--genai-precision", "genai_precisions", default=None, metavar="P,...",
              help="With --hf: onnxruntime-genai builder's precisions to time (its -p: fp32, int4; default fp32).")
@click.option("--input", "input_specs", multiple=True, metavar="NAME:SHAPE[:DTYPE]",
              help="With --module: an example input (repeatable; default: the NAME function's).")
@click.option("--batch", default=None, help="Batch size, or several separated by commas.")
@click.option("--seq", default=None, help="Sequence length, or several: --seq 512,2048,8192.")
@click.option("--kv-seq", "kv_seq", default=None, help="Key/value length, or several.")
@click.option("--decode", is_flag=True,
              help="Generation with a KV cache: prefill and one decoding step at each --context length.")
@click.option("--context", default=None, help="With --decode: context lengths, e.g. --context 128,1024,4096.")
@click.option("--runtimes", type=TIMED_RUNTIME_LIST, default=None,
              help="Comma-separated runtimes (default: every available one).")
@click.option("--flavor", "flavors", multiple=True, type=FLAVOR, help="Flavors to time (repeatable; default: all).")
@click.option("--dtype", type=DTYPE, default="fp32", show_default=True, help="The float type.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Untimed runs first.")
@click.option("--iters", type=click.IntRange(min=1), default=30, show_default=True,
              help="Timed runs (median, p10, p90).")
@click.option("--cuda-graph", is_flag=True, help="Also time torch in a CUDA graph; ONNX Runtime with CUDA graphs.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for torch and ONNX Runtime (default: all).")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True,
              help="Rounds the timed runs are split into; each ratio is reported with its spread over them.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of parameters and inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as a JSON list and nothing else.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a latency chart (PNG).")
@_variant_options(exclude=("batch", "seq", "kv_seq"))
@reports_errors
def bench(variant, module_spec, hf_path, genai_python, precisions, genai_precisions, input_specs, batch, seq, kv_seq,
          decode, context, runtimes, flavors, dtype, warmup, iters, cuda_graph, threads, repeat, seed, as_json, plot,
          **options):
    """Time a variant on every runtime and flavor against PyTorch eager.

    Examples: attnexport bench --variant mha --runtimes torch,ort-cpu --batch 8 --seq 512 --dim 512 --heads 8;
    attnexport bench --hf ./tiny-llama --decode --context 128,1024 --threads 2
    """

    result = _with_progress("bench", as_json or hf_path is not None, lambda progress: commands.bench(
        variant, module_spec, hf_path, genai_python=genai_python, precisions_text=precisions,
        genai_precisions_text=genai_precisions, input_specs=input_specs, batch=batch, seq=seq, kv_seq=kv_seq,
        decode=decode, context=context, runtimes=runtimes, flavors=flavors, dtype=dtype, warmup=warmup, iters=iters,
        cuda_graph=cuda_graph, threads=threads, repeat=repeat, seed=seed, plot=plot, progress=progress,
        said=None if as_json else (lambda text: click.echo(text, err=True)), **options))
    if as_json:
        click.echo(jsonout.dumps(result.to_json()))
        return
    render.bench(result)
