"""The command line: parses, calls the library, formats. No logic of its own."""

from __future__ import annotations

import functools
import json
import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnexport import bench as bench_mod
from attnexport import cache as cache_mod
from attnexport import cases as cases_mod
from attnexport import clients as clients_mod
from attnexport import dtypes as D
from attnexport import export as export_mod
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import golden as golden_mod
from attnexport import jsonout, modules, schema
from attnexport import runtimes as R
from attnexport import signature as SG
from attnexport import variants as V
from attnexport import verify as verify_mod
from attnexport.compare import FP32_FACTOR, check_tolerance_values
from attnexport.errors import AttnExportError, UsageError
from attnexport.inspect import describe
from attnexport.precision import MINIMUM_FORMS as P_MINIMUM_FORMS
from attnexport.precision import PRECISIONS
from attnexport.runtimes import js


def _console() -> Console:
    """A console made per command, so that the width is the terminal's (or $COLUMNS) now."""
    return Console()


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


def _option_text(opt: schema.Option) -> str:
    if opt.type is bool:
        return opt.flag
    default = "auto" if opt.default is None else opt.default  # None: derived (e.g. --kv-heads = --heads)
    if opt.choices:
        return f"{opt.flag} {{{'|'.join(opt.choices)}}}={default}"
    return f"{opt.flag}={default}"


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
    table = Table(title=f"{len(rows)} attention variants", show_lines=True)
    for col in ("variant", "inputs -> outputs", "options"):
        table.add_column(col, overflow="fold")  # fold long choices, never cut them
    for r, v in zip(rows, V.VARIANTS.values(), strict=True):
        ins = ", ".join(("[" + i["name"] + "]") if i["optional"] else i["name"] for i in r["inputs"])
        outs = ", ".join(("[" + i["name"] + "]") if i["optional"] else i["name"] for i in r["outputs"])
        table.add_row(f"[bold]{r['name']}[/bold]\n{escape(r['summary'])}", escape(f"{ins} -> {outs}"),
                      escape(" ".join(_option_text(opt) for opt in v.options)))
    _console().print(table)


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
    d = cache_mod.directory()
    if clear:
        n = cache_mod.clear()
        click.echo(f"removed {n} entries from {d}" if d is not None
                   else "the export cache is off (ATTNEXPORT_CACHE=off)")
        return
    doc = cache_mod.describe()
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


def _given(kwargs) -> dict:
    given = {k: v for k, v in kwargs.items() if v is not None}
    cache = given.get("kv_cache")
    if cache in ("concat", "static"):  # the option is a bool; static is the bool with --max-seq
        if cache == "static" and given.get("max_seq") is None:
            raise UsageError("--kv-cache static needs --max-seq S, the buffers' positions")
        if cache == "concat" and given.get("max_seq") is not None:
            raise UsageError("--max-seq is the static cache's size: give --kv-cache static")
        given["kv_cache"] = True
    return given


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
    if sum(x is not None for x in (variant, module_spec, hf_path)) != 1:
        raise UsageError("give --variant NAME, --module FILE.py:NAME or --hf PATH (one of them)")
    check_tolerance_values(rtol, atol)
    if deploy is not None and hf_path is None:
        raise UsageError("--deploy writes a language model's folder: it goes with --hf")
    quant = {"precision": precision, "block_size": block_size, "accuracy_level": accuracy_level, "keep": keep,
             "symmetric": symmetric, "requantize": requantize, "minimums": minimums}
    if hf_path is None and any(v is not None for v in quant.values()):
        raise UsageError("--precision, --block-size, --accuracy-level, --keep, --symmetric, --requantize and "
                         "--minimums go with --hf")
    if hf_path is not None:
        if input_specs or dynamic_specs or nan_rows or allow_unfused or cache_specs or write_pos or output_names:
            raise UsageError("--input, --dynamic, --nan-rows, --allow-unfused, --cache, --write-pos and --output-names "
                             "go with --module (--hf knows its model's inputs, outputs and cache)")
        result = _export_hf(hf_path, flavor, opset, dtype, seed, output, deploy, rtol, atol, quant, options)
        click.echo(jsonout.dumps(result.to_dict()) if as_json else result.summary())
        return
    if variant is not None and (rtol is not None or atol is not None):
        raise UsageError("--rtol/--atol set the check before writing of --hf and --module exports; a variant's "
                         "export is checked by verify (which takes them too)")
    if module_spec is None and (input_specs or dynamic_specs or nan_rows or allow_unfused or cache_specs or write_pos
                                or output_names):
        raise UsageError("--input, --dynamic, --nan-rows, --allow-unfused, --cache, --write-pos and --output-names go "
                         "with --module")
    if module_spec is not None:
        request = export_mod.ModuleExport(
            flavor=flavor, opset=opset, dtype=dtype, dynamic=_dynamic_axes(dynamic_specs), output=output,
            name=module_spec, nan_rows=nan_rows, seed=seed, allow_unfused=allow_unfused,
            cache=_cache_pairs(cache_specs) or None, write_pos=write_pos,
            output_names=output_names.split(",") if output_names else None, rtol=rtol, atol=atol)
        result = _export_module(module_spec, input_specs, request, options)
    else:
        result = export_mod.export(export_mod.ExportRequest(variant, _given(options), flavor, opset, dtype,
                                                            seed=seed, output=output))
    if as_json:
        click.echo(jsonout.dumps(result.to_dict()))
    else:
        click.echo(result.summary())


def _hf_form(options: dict) -> tuple[str, int]:
    """(cache form, max_seq) from --kv-cache [static] and --max-seq (`hf.export_hf` checks that
    they go together); no other variant option."""
    kv_cache, max_seq = options.pop("kv_cache", None), options.pop("max_seq", None)
    rest = {k: v for k, v in options.items() if v is not None}
    if rest:
        raise UsageError(f"--hf takes no variant options but --kv-cache and --max-seq "
                         f"({', '.join('--' + k.replace('_', '-') for k in rest)})")
    return kv_cache or "none", max_seq or 0


def _export_hf(path, flavor, opset, dtype, seed, output, deploy, rtol, atol, quant, options):
    from attnexport import hf_export
    form, max_seq = _hf_form(options)
    plan_options = {k: v for k, v in quant.items() if k != "precision"}
    request = hf_export.request(path, plan_options, form=form, max_seq=max_seq, flavor=flavor, opset=opset,
                                dtype=dtype, output=output, seed=seed, deploy=deploy, rtol=rtol, atol=atol,
                                precision=quant["precision"])
    return hf_export.export_hf(request)[0]


def _precisions(text, flag, valid) -> tuple:
    """`--precision a,b` as a tuple, each checked; None: fp32 alone."""
    if text is None:
        return ("fp32",)
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UsageError(f"{flag} takes {', '.join(valid)} separated by commas, got {text!r}")
    return names


def _bench_hf(path, contexts, flavors, threads, warmup, iters, seed, genai_python, precisions, genai_precisions,
              as_json):
    from attnexport import hf_bench
    request = hf_bench.HFBenchRequest(path, tuple(contexts or hf_bench.CONTEXTS),
                                      flavors=tuple(flavors) or hf_bench.HFBenchRequest.flavors, threads=threads or 0,
                                      iters=iters, warmup=warmup, seed=seed, genai_python=genai_python,
                                      precisions=precisions, genai_precisions=genai_precisions)
    rows, info = hf_bench.bench_hf(request, said=(lambda text: None) if as_json else
                                   (lambda text: click.echo(f"timing {text}", err=True)))
    if as_json:
        click.echo(jsonout.dumps({"rows": hf_bench.to_json(rows), "info": info}))
        return
    click.echo(f"{path}: {info['layers']} layers, {info['parameters']:,} parameters, fp32, {info['threads']} "
               f"thread(s); memory read bandwidth {info['bandwidth_gbs']:.1f} GB/s")
    for row in rows:
        if row.median_ms != row.median_ms:  # NaN: the export failed
            click.echo(f"{row.engine} {row.precision} {row.form} {row.flavor}: {row.note}")
            continue
        ratio = f", {row.ratio_to_transformers:.2f}x transformers" if row.ratio_to_transformers else ""
        band = f", {row.bandwidth_fraction:.2f} of the memory bandwidth" if row.bandwidth_fraction is not None else ""
        agree = hf_bench.agreement_text(row.agreement)
        click.echo(f"{row.phase:7s} {row.context:>5d}  {row.engine} {row.precision} {row.form} {row.flavor} "
                   f"({row.mode}): "
                   f"{row.median_ms:.3f} ms (p10 {row.p10_ms:.3f}, p90 {row.p90_ms:.3f}), "
                   f"{row.tokens_per_s:,.0f} tokens/s{ratio}{band}" + (f"; {agree}" if agree else "")
                   + (f"; {row.note}" if row.note else ""))
    for engine, why in info["skipped"].items():
        click.echo(f"note: {engine} not timed: {why}")


def _module_weights(options: dict):
    """With --module, `--weights FILE` is the module's trained weights (the variant option of that
    name, an output choice, means nothing for a module)."""
    weights = options.pop("weights", None)
    if weights == "softmax":  # `--weights` given without a value
        raise UsageError("with --module, --weights takes a file: a state_dict saved with torch.save, or .safetensors")
    return weights


def _module_variant(spec, input_specs, seed, weights):
    module, example, names = modules.load_with_inputs(spec, input_specs, seed, weights)
    return bench_mod.module_variant(spec, module, example, names)


def _cache_pairs(specs) -> dict:
    """`--cache INPUT:OUTPUT` (repeatable) -> {input: output}."""
    pairs = {}
    for text in specs:
        past, sep, present = text.partition(":")
        if not sep or not past or not present or ":" in present:
            raise UsageError(f"--cache takes INPUT:OUTPUT (e.g. past_key:present_key), got {text!r}")
        pairs[past] = present
    return pairs


def _dynamic_axes(specs) -> dict | None:
    """`--dynamic NAME:AXIS=DIM` (repeatable) -> {input: {axis: dim name}}, or None."""
    if not specs:
        return None
    dynamic: dict = {}
    for t in specs:
        n, axis, dim = modules.parse_dynamic(t)
        dynamic.setdefault(n, {})[axis] = dim
    return dynamic


def _export_module(spec, input_specs, request, options):
    weights = _module_weights(options)
    if _given(options):
        flags = ", ".join("--" + k.replace("_", "-") for k in _given(options))
        raise UsageError(f"--module takes no variant options ({flags})")
    return export_mod.export_module_file(spec, input_specs, request, weights)


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
    opsets = ", ".join(f"{k} {v}" for k, v in d["opsets"].items())
    _console().print(f"[bold]{escape(d['path'])}[/bold]: IR {d['ir_version']}, opsets {escape(opsets)}, "
                  f"{d['nodes']} nodes, {d['parameters']} parameters, {F.human_size(d['size'])}")
    _console().print(f"attention op: [bold]{escape(d['attention_op'])}[/bold]")
    table = Table(show_header=True)
    for col in ("", "name", "dtype", "dims"):
        table.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in d[kind]:
            table.add_row(kind[:-1], t["name"], t["dtype"], escape(str(t["dims"])))
    _console().print(table)
    _console().print("ops: " + escape(", ".join(f"{k} x{v}" for k, v in d["op_counts"].items())))
    if d["attnexport"]:
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
                    f", axis {a} {d}" for a, d in i["dynamic"].items()) for i in json.loads(v))
            _console().print(f"  {k}: {escape(json.dumps(v) if isinstance(v, dict) else str(v))}")
    else:
        _console().print("no attnexport metadata")


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

    if models and len(variants) > 1:
        raise UsageError("a MODEL takes one --variant")
    if clients_text is not None and hf_path is None:
        raise UsageError("--clients generate from a language model's deployment folder: it goes with --hf")
    if budget is not None and hf_path is None:
        raise UsageError("--budget is the accuracy budget of a quantized or fp16 language model: it goes with --hf")
    if hf_path is not None:
        from attnexport.accuracy import Budget
        from attnexport.verify.hf_check import HFCheck, verify_hf
        if len(models) != 1 or module_spec is not None:
            raise UsageError("--hf compares one MODEL with the language model it was exported from: give one MODEL "
                             "(and no --module)")
        if _given(options) or variants or flavors or cases or input_specs or cache_specs or write_pos:
            raise UsageError("--hf takes no --variant, --flavor, --case, --input, --cache, --write-pos or variant "
                             "options: the model says what it is")
        check = HFCheck(models[0], hf_path, runtimes, rtol, atol, skip_unavailable, seed, new_tokens,
                        tuple(clients_mod.parse(clients_text)), Budget().with_overrides(budget),
                        strict_placement)
        _report_verify(verify_hf(check), details, as_json)
        return
    if module_spec is not None:
        if len(models) != 1:
            raise UsageError("--module compares one MODEL with the module it was exported from: give one MODEL")
        weights = _module_weights(options)
        if _given(options) or variants or flavors or cases:
            raise UsageError("--module takes no --variant, --flavor, --case or variant options: the model and the "
                             "module say what to compare")
        parsed = [modules.parse_input(t) for t in input_specs] or None
        report = verify_mod.verify_module(models[0], module_spec, runtimes, rtol=rtol, atol=atol,
                                          skip_unavailable=skip_unavailable,
                                          input_specs=parsed, seed=seed, weights_file=weights,
                                          cache=_cache_pairs(cache_specs) or None, write_pos=write_pos,
                                          strict_placement=strict_placement)
        _report_verify(report, details, as_json)
        return
    if input_specs or cache_specs or write_pos:
        raise UsageError("--input, --cache and --write-pos go with --module (the inputs of a MODEL exported from a "
                         "module)")
    if models and cases:
        raise UsageError("--case selects golden cases to export and run; a MODEL runs those of its own options")
    model_variant = variants[0] if models and variants else None
    request = verify_mod.VerifyRequest(
        variants=None if models else (list(variants) or None), flavors=list(flavors) or None,
        runtimes=runtimes, dtype=dtype, golden_dir=golden_dir, models=list(models) or None, rtol=rtol,
        atol=atol, skip_unavailable=skip_unavailable, strict_placement=strict_placement,
        model_variant=model_variant, model_options=_given(options) or None, seed=seed, localize=localize,
        baseline=baseline_dir, save_baseline=save_baseline, max_growth=max_growth, cases=list(cases) or None)
    report = _with_progress("verify", as_json, lambda progress: verify_mod.verify(request, progress=progress))
    _report_verify(report, details, as_json)


def _report_verify(report, details, as_json):
    """Prints a verify report (a table, or JSON); exit 1 unless it passed."""
    if as_json:
        click.echo(jsonout.dumps(report.to_dict()))
    else:
        _print_verify(report, details)
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


def _e(x) -> str:
    return "-" if x is None or x != x or x == float("inf") else f"{x:.2e}"


def _table(title, columns, numeric, min_widths=None):
    """A table that fits 80 columns: no vertical rules, text columns fold, numbers never cut."""
    from rich import box
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in columns:
        if col in numeric:
            table.add_column(col, justify="right", no_wrap=True)
        else:
            table.add_column(col, overflow="fold", min_width=(min_widths or {}).get(col))
    return table


def _run_cell(r) -> str:
    """A run's table cell: the model file, the case and where it ran on lines of their own, so a
    narrow terminal wraps between them, not inside a name (a case's steps break after the /)."""
    case = r.case.replace("/", "/ ")
    return "\n".join(([f"{r.model}:"] if r.model else []) + [case, f"{r.flavor} {r.runtime}"])


def _result(r) -> str:
    return "n/a" if r.skipped else ("[green]pass[/green]" if r.passed else "[red]FAIL[/red]")


def _print_verify(report, details, out=None):
    out = out or _console()
    for r in report.runtimes:
        if not r["available"]:
            click.echo(f"skipped {r['name']}: {r['reason']}", err=True)
    if details:
        table = _table(f"verify {report.dtype}: every run", ("run", "ok", "output", "max abs\n@ index",
                                                             "mean\nmedian\np99", "atol\nneeds", "ms"),
                       ("max abs\n@ index", "mean\nmedian\np99", "atol\nneeds", "ms"), min_widths={"run": 19})
        for r in report.rows:
            run = escape(_run_cell(r))
            if not r.comparisons:
                table.add_row(run, _result(r), escape((r.skipped or r.error)[:120]), "", "", "", "")
                continue
            for i, c in enumerate(r.comparisons):
                idx = ",".join(map(str, c.argmax))
                table.add_row(run if i == 0 else "", _result(r) if i == 0 else "", escape(c.problem or c.name),
                              f"{_e(c.max_abs)}\n@{idx}", f"{_e(c.mean_abs)}\n{_e(c.median_abs)}\n{_e(c.p99_abs)}",
                              f"{_e(c.atol)}\n{_e(c.needed_atol)}",
                              f"{r.median_ms:.2f}" if (i == 0 and r.median_ms is not None) else "")
        out.print(table)
    elif report.failures:
        table = _table("failures", ("run", "output", "max abs", "atol", "needs atol"),
                       ("max abs", "atol", "needs atol"))
        for r in report.failures:
            c = r.worst
            table.add_row(escape(_run_cell(r)),
                          escape(c.name if c is not None else (r.error or "compared nothing")[:60]),
                          _e(c.max_abs) if c is not None else "-", _e(c.atol) if c is not None else "-",
                          _e(c.needed_atol) if c is not None else "-")
        out.print(table)
    summary = _table(f"verify {report.dtype}: {len(report.rows)} runs",
                     ("runtime", "flavor", "pass", "fail", "n/a", "worst abs", "needs atol", "ms"),
                     ("pass", "fail", "n/a", "worst abs", "needs atol", "ms"))
    groups = {}
    for r in report.rows:
        groups.setdefault((r.runtime, r.flavor), []).append(r)
    for (rt, fl), rs in groups.items():
        # Only values that were compared count: a failed run with no comparison shows "-".
        cs = [c for r in rs for c in r.comparisons if not c.problem]
        failed = sum(1 for r in rs if not r.passed and not r.skipped)
        summary.add_row(rt, fl, str(sum(r.passed for r in rs)), f"[red]{failed}[/red]" if failed else "0",
                        str(sum(bool(r.skipped) for r in rs)),
                        _e(max((c.max_abs for c in cs), default=None)),
                        _e(max((c.needed_atol for c in cs), default=None)),
                        f"{sum(r.median_ms or 0 for r in rs):.1f}")
    out.print(summary)
    kinds = {}
    for r in report.rows:  # which cases ran, and where their expected values came from
        kinds.setdefault(r.expected_kind, {}).setdefault(r.case, None)
    for kind, names in kinds.items():
        shown = ", ".join(list(names)[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        click.echo(f"cases, expected from {kind}: {shown}")
    bases = sorted({r.tolerance.basis for r in report.rows if r.tolerance is not None})
    if report.dtype == "fp16" and bases:
        click.echo(f"fp16 tolerances: derived per case ({len(bases)} {'basis' if len(bases) == 1 else 'bases'}; "
                   "see --details or --json), "
                   "atol = max(policy, 4 x the error of the fp16-emulated reference)")
    derived = [(c, r) for r in report.rows for c in r.comparisons if "in float64" in c.basis]
    if derived:
        c, r = max(derived, key=lambda cr: cr[0].atol)
        click.echo(f"budgets: per output, atol = max(policy, {FP32_FACTOR:g} x torch's own error against the model "
                   f"in float64), rtol {c.rtol:g}; the largest: {c.name} of {r.case}, atol {c.atol:.3g} ({c.basis})")
    for r in report.rows:  # a lossy language model's accuracy, in words
        if r.detail and "summary" in r.detail:
            click.echo(f"accuracy on {r.runtime}: {r.detail['summary']}; budget: {r.detail['budget']['text']}")
        if r.detail and r.detail.get("layer_costs"):
            top = ", ".join(f"{c['group']} {c['kl_mean']:.2g}" for c in r.detail["layer_costs"][:5])
            click.echo(f"layers that cost most, each quantized alone (mean KL vs fp32): {top}")
    for r in report.failures:
        click.echo(f"FAIL {r.describe(localization=False)}")
        if r.localization is not None and (r.localization.diverged or r.localization.note):
            click.echo(f"  where: {r.localization.describe()}")
    if report.saved_baseline:
        click.echo(f"baseline saved: {report.saved_baseline}")
    s = report.summary()
    verdict = "all passed" if report.ok else f"{s['failed']} failed"
    click.echo(f"verify: {s['passed']} passed, {s['failed']} failed, {s['not_applicable']} not applicable "
               f"({verdict})")


def _int_list(flag, text):
    if text is None:
        return None
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes positive integers, got {text!r}")
    return values


def _print_bench(rows, variant, dtype):
    """The timing table at any width down to 80 columns: two values per cell, notes below it."""
    table = _table(f"bench {variant} {dtype}, {rows[0].threads if rows else '?'} CPU threads",
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
    _console().print(table)
    peaks = sorted({(r.peak_tflops, r.peak_source) for r in rows if r.peak_source})
    for tf, where in peaks:
        click.echo(f"peak: {tf:.3f} TFLOP/s, the best matmul measured ({where}); 'x torch' spread: over "
                   f"{rows[0].rounds} rounds")
    for n in notes:
        click.echo(f"note: {n}")


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

    if sum(x is not None for x in (variant, module_spec, hf_path)) != 1:
        raise UsageError("give --variant NAME, --module FILE.py:NAME or --hf PATH (one of them)")
    if (genai_python or precisions or genai_precisions) is not None and hf_path is None:
        raise UsageError("--genai-python, --precision and --genai-precision go with --hf")
    if hf_path is not None:
        if not decode or _given(options) or input_specs or batch or seq or kv_seq or cuda_graph or plot or \
                dtype != "fp32" or (runtimes and runtimes != ["ort-cpu"]):
            raise UsageError("--hf takes --decode with --context, --flavor, --threads, --warmup, --iters, --seed and "
                             "--json (fp32 on ort-cpu, beside transformers and Optimum)")
        _bench_hf(hf_path, _int_list("--context", context), flavors, threads, warmup, iters, seed, genai_python,
                  _precisions(precisions, "--precision", PRECISIONS), _precisions(genai_precisions, "--genai-precision",
                                                                                   ("fp32", "int4")), as_json)
        return
    if module_spec is not None:
        weights = _module_weights(options)
        if decode or _given(options) or kv_seq:
            raise UsageError("--module takes --batch and --seq (no --decode, --kv-seq or variant options)")
        variant = _module_variant(module_spec, input_specs, seed, weights)
    elif input_specs:
        raise UsageError("--input goes with --module")
    opts = _given(options)
    for name, text in (("batch", batch), ("seq", seq), ("kv_seq", kv_seq)):
        values = _int_list("--" + name.replace("_", "-"), text)
        if values:
            opts[name] = values
    request = bench_mod.BenchRequest(variant, opts, runtimes, list(flavors) or None, dtype, warmup, iters,
                                     cuda_graph, threads, seed, repeat)
    if plot:
        plot = str(F.resolve_target(plot))  # before the benchmark runs, not after
    if not as_json:
        for w in bench_mod.warnings_for(runtimes, dtype, cuda_graph):
            click.echo(f"note: {w}", err=True)
    contexts = _int_list("--context", context)
    if contexts and not decode:
        raise UsageError("--context goes with --decode")
    if decode:
        rows = _with_progress("bench", as_json, lambda progress: bench_mod.bench_decode(
            request, None, contexts, progress=progress))
    else:
        rows = _with_progress("bench", as_json, lambda progress: bench_mod.bench(request, progress=progress))
    title = module_spec or variant
    if plot:
        bench_mod.plot(rows, plot, f"{title} {dtype}, median latency")
    if as_json:
        click.echo(jsonout.dumps(bench_mod.to_json(rows)))
        return
    _print_bench(rows, title, dtype)
    for rt, shape, flavor, ms in bench_mod.fastest(rows):
        click.echo(f"fastest on {rt} at {shape}: {flavor} ({ms:.3f} ms)")
    for r in rows:
        if r.phase and r.tokens_per_s:
            mode = "" if r.mode == "eager" else f" ({r.mode})"
            bandwidth = f", {r.bandwidth_fraction:.2f} of the {r.bandwidth_gbs:.1f} GB/s memory bandwidth" \
                if r.bandwidth_fraction is not None else ""
            click.echo(f"{r.phase} {r.runtime} {r.flavor}{mode} at {r.shape_label}: {r.median_ms:.3f} ms, "
                       f"{r.tokens_per_s:,.0f} tokens/s{bandwidth}")
    if plot:
        click.echo(f"plot: {plot}")
