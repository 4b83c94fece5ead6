"""The options of export, verify and bench, each declared once: its flag, the name the library
takes it by, its type, default and help, as the click option the command line shows
(`attnexport.cli` puts each table on its command). `attnexport.commands` reads what it is given
against the same table (`read`): a default is written here and nowhere else, and a name the table
lacks is a variant option (or, misspelt, a TypeError)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import click

from attnexport import dtypes as D
from attnexport import flavors as FL
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.errors import UsageError
from attnexport.pretrained.precision import KERNELS, MINIMUM_FORMS, PRECISIONS
from attnexport.verify.request import Checking


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


SEED = click.IntRange(0, 2**63 - 1)  # what numpy's and torch's generators take


# The options of `attnexport export`, in the order --help lists them.
EXPORT = (
    click.Option(["--variant"], type=VARIANT, default=None, help="The variant to export (see `attnexport list`)."),
    click.Option(["--module", "module_spec"], default=None, metavar="FILE.py:NAME",
                 help="Your own module instead: an nn.Module class taking no arguments, or a function returning "
                      "a module or (module, example_inputs)."),
    click.Option(["--hf", "hf_path"], default=None, metavar="PATH",
                 help="A transformers causal language model or sentence encoder instead: a folder saved with "
                      "save_pretrained (a config alone: weights from --seed) or a model id; a language model: "
                      "--kv-cache (Optimum's names) or --kv-cache static --max-seq N (buffers written in place), "
                      "none without; an encoder: its token states and sentence embedding."),
    click.Option(["--input", "input_specs"], multiple=True, metavar="NAME:SHAPE[:DTYPE]",
                 help="With --module: an example input, e.g. x:2x16x64 (repeatable; default: the NAME function's)."),
    click.Option(["--nan-rows"], is_flag=True,
                 help="With --module and --flavor primitives: a fully masked query row gives NaN, as in torch "
                      "(default: zeros)."),
    click.Option(["--allow-unfused"], is_flag=True,
                 help="With --module: export attention that is not recognized as MatMul+Softmax in a fused flavor "
                      "(default: exit 1 naming it)."),
    click.Option(["--cache", "cache_specs"], multiple=True, metavar="INPUT:OUTPUT",
                 help="With --module: the module's own key/value cache, an input and the output returning it "
                      "updated, e.g. past_key:present_key (repeatable; {i} stands for a layer's number: "
                      "'past.{i}.key:present.{i}.key'); verify then checks decoding with it."),
    click.Option(["--write-pos"], default=None, metavar="INPUT",
                 help="With --module and --cache: the cache is static, its buffers keep their size and each step "
                      "writes its block where INPUT says (each sequence's first position (B,), or the block's "
                      "positions (T,)); verify then decodes sequences of different lengths with it."),
    click.Option(["--output-names"], default=None, metavar="A,B,...",
                 help="With --module: the model's output names (default: from the module's return structure)."),
    click.Option(["--dynamic", "dynamic_specs"], multiple=True, metavar="NAME:AXIS=DIM",
                 help="With --module: a symbolic axis, e.g. x:1=seq (repeatable; default: axes 0 and 1 of every "
                      "input, where the model allows)."),
    click.Option(["--flavor"], type=FLAVOR, default=FL.DEFAULT, show_default=True,
                 help="The graph flavor."),
    click.Option(["--opset"], type=int, default=None,
                 help="Opset (primitives/ort: 17-18, default 18; attention: 23-24, default 23, 24 for sdpa --nonpad)."),
    click.Option(["--dtype"], type=DTYPE, default="fp32", show_default=True, help="The model's float type."),
    click.Option(["--seed"], type=SEED, default=None,
                 help="Seed of the parameters (default 0; of a --module class's too: torch's generator is seeded "
                      "first; with --hf, a folder with a config and no weights is exported only when it is given)."),
    click.Option(["-o", "--output"], type=click.Path(), default=None,
                 help="Output file (default: models/<variant>.onnx)."),
    click.Option(["--memory-check/--no-memory-check"], default=True, show_default=True,
                 help="With --hf: refuse, before loading it, a model the machine has not the memory to export."),
    click.Option(["--external-data/--one-file", "external_data"], default=None,
                 help="With --hf: the weights in one file beside the graph (model.onnx -> model.onnx_data), or all in "
                      "the .onnx (default: beside it from 1 GiB of weights; a file above 2 GB cannot be one file)."),
    click.Option(["--stamp/--trace-all-layers", "stamp"], default=True, show_default=True,
                 help="With --hf: a model of more than three alike layers is traced with three and the rest "
                      "stamped from the third's graph (checked against the model like any export); "
                      "--trace-all-layers traces every one."),
    click.Option(["--deploy"], type=click.Path(), default=None, metavar="FOLDER",
                 help="With --hf, instead of -o: write the folder a deployment loads (config.json, "
                      "generation_config.json, the tokenizer's files, the graphs in onnx/), as Optimum and "
                      "transformers.js read it."),
    click.Option(["--rtol"], type=float, default=None,
                 help="With --hf or --module: the relative tolerance of the check before writing (default: the "
                      "policy's, or for --hf derived from torch's own error against the model in float64)."),
    click.Option(["--atol"], type=float, default=None, help="With --hf or --module: the absolute tolerance, likewise."),
    click.Option(["--precision"], type=click.Choice(PRECISIONS), default=None,
                 help="With --hf: fp32 (the default), fp16 (exported in half), int8 or int4 (weight matrices as ONNX "
                      "Runtime's MatMulNBits, a GGUF's own 4- or 8-bit grid carried exactly), q4f16 (int4's weights, "
                      "fp16 activations); verify says what it costs."),
    click.Option(["--block-size"], type=int, default=None,
                 help="With --precision int8/int4/q4f16: the block along each matrix's input axis (16, 32, 64, 128; "
                      "default 32)."),
    click.Option(["--accuracy-level"], type=int, default=None,
                 help="With --precision int8/int4/q4f16: MatMulNBits's accuracy_level, 4 (default: int8 activations, "
                      "the fastest CPU kernels) or 0 (float activations: a carried grid gives the model's own "
                      "answers)."),
    click.Option(["--keep"], default=None, metavar="GROUP[=HOW],...",
                 help="With --precision int8/int4/q4f16: groups held otherwise, e.g. "
                      "head=int8,first,layers:28-29=int8@0 "
                      "(GROUP: head, first, last, layer:I, layers:I-J; HOW: fp32 (default), int8, int4, @LEVEL). "
                      "Default for int4: head=int8. 'none' quantizes everything alike."),
    click.Option(["--symmetric/--asymmetric"], default=None,
                 help="With --precision int8/int4/q4f16: ONNX Runtime's quantizer without or with zero points (default "
                      "asymmetric); a carried grid keeps its own."),
    click.Option(["--requantize"], is_flag=True, default=None,
                 help="With --precision int8/int4/q4f16: round every matrix with ONNX Runtime's quantizer, even one "
                      "that "
                      "already holds a grid of the bits asked for (default: such a grid is carried exactly)."),
    click.Option(["--file-widths/--asked-width"], default=None,
                 help="With --precision int4/q4f16 and a GGUF source: a tensor of the file in a format wider than "
                      "4 bits (Q5_0, Q6_K, Q8_0) carried exactly at 8 bits, as the file mixes its widths (default), "
                      "or rounded to 4 bits by ONNX Runtime's quantizer."),
    click.Option(["--minimums"], type=click.Choice(MINIMUM_FORMS), default=None,
                 help="With --precision int4/q4f16: how a carried grid's float minimums (GGUF's Q4_1) are held: folded "
                      "(default: integer zero points and a 4-bit residual row per block, no extra op per matrix; each "
                      "weight within a small fraction of a step of the model's), exact (bit for bit, a MatMul and an "
                      "Add per matrix, slower) or float (float zero points: one op a matrix, each weight within the "
                      "zero "
                      "point's rounding; for CUDA, its CPU kernel is slow)."),
    click.Option(["--int8-kernel"], type=click.Choice(KERNELS), default=None,
                 help="With --precision int8: blockwise (MatMulNBits: int8 blocks of weights and activations, fast "
                      "for a language model's few rows a step) or integer (DynamicQuantizeMatMul: int8 weights per "
                      "column, uint8 activations per tensor, ONNX Runtime's integer GEMM for many rows; a sentence "
                      "encoder's smoothed and with its costliest matrices in float as calibration on the project's "
                      "text chooses, Whisper's encoder not calibrated, its decoder blockwise). Default: the "
                      "family's (sentence encoders and Whisper integer, the rest blockwise, which they alone take; "
                      "MatMulNBits's options choose blockwise)."),
    click.Option(["--json", "as_json"], is_flag=True, help="Print the result as JSON."),
)

# `attnexport verify`'s (its MODEL arguments are the command's).
VERIFY = (
    click.Option(["--variant", "variants"], multiple=True, type=VARIANT,
                 help="Only these variants (repeatable); with MODEL files: the variant of a model without metadata."),
    click.Option(["--flavor", "flavors"], multiple=True, type=FLAVOR,
                 help="Only these flavors (repeatable; default: all); with a MODEL: its flavor, checked."),
    click.Option(["--runtimes"], type=RUNTIME_LIST, default=None,
                 help="Comma-separated runtimes (default: all available)."),
    click.Option(["--dtype"], type=DTYPE, default=None, help="The float type (default: fp32; a MODEL's own dtype)."),
    click.Option(["--golden", "golden_dir"], type=click.Path(), default=None, help="Golden folder to use."),
    click.Option(["--rtol"], type=float, default=None, help="Override the relative tolerance (finite, >= 0)."),
    click.Option(["--atol"], type=float, default=None, help="Override the absolute tolerance (finite, >= 0)."),
    click.Option(["--skip-unavailable"], is_flag=True, help="Skip requested runtimes that cannot run here."),
    click.Option(["--memory-check/--no-memory-check"], default=True, show_default=True,
                 help="With --hf: refuse, before loading it, a model the machine has not the memory to verify."),
    click.Option(["--strict-placement"], is_flag=True, help="Fail when ort-cuda runs a compute node on the CPU."),
    click.Option(["--seed"], type=SEED, default=None,
                 help="Parameters' seed of a MODEL without metadata, or of a --module class (default 0)."),
    click.Option(["--localize"], is_flag=True,
                 help="Compare every intermediate value with the export; name the first diverging node."),
    click.Option(["--save-baseline"], type=click.Path(), default=None,
                 help="Write every run's inputs and outputs to this folder (a known-good baseline)."),
    click.Option(["--baseline"], type=click.Path(), default=None,
                 help="Fail runs whose error grew more than --max-growth times since this baseline."),
    click.Option(["--max-growth"], type=float, default=Checking.max_growth, show_default=True,
                 help="Allowed growth of the max abs error against --baseline."),
    click.Option(["--details"], is_flag=True, help="Show every run with its error statistics."),
    click.Option(["--case", "cases"], multiple=True,
                 help="Only these golden cases (repeatable; `attnexport golden --list` lists them)."),
    click.Option(["--module", "module_spec"], default=None, metavar="FILE.py:NAME",
                 help="With one MODEL: compare it with this module (--weights FILE: its trained weights)."),
    click.Option(["--hf", "hf_path"], default=None, metavar="PATH",
                 help="With one MODEL exported with export --hf: compare it with this language model (its shapes, "
                      "the decode property, greedy generation against transformers' generate) or sentence encoder "
                      "(its shapes, each sentence's cosine and top-5 retrieval against float64)."),
    click.Option(["--new-tokens"], type=click.IntRange(min=1), default=48, show_default=True,
                 help="With --hf: the tokens generated for the parity check."),
    click.Option(["--clients", "clients_text"], default=None, metavar="optimum,transformers.js,...|all",
                 help="With --hf and a deployment folder as MODEL (export --hf --deploy): also run it with these "
                      "clients and compare: a language model's generate (Optimum's ORTModel, "
                      "transformers.js in Node), an encoder's embed (sentence-transformers, Optimum, "
                      "transformers.js)."),
    click.Option(["--audio"], multiple=True, type=click.Path(dir_okay=False), metavar="FILE.wav",
                 help="With --hf and a Whisper deployment folder as MODEL: a clip (16 kHz mono WAV, up to 30 s; "
                      "repeatable) whose greedy transcripts are compared with transformers' (default: a synthetic "
                      "clip)."),
    click.Option(["--budget"], default=None, metavar="LIMIT=VALUE,...",
                 help="With --hf and a quantized or fp16 MODEL: the accuracy budget's limits instead of the defaults "
                      "(kl-mean=0.05, top1=0.85, perplexity=0.05, first-tokens=0, margin=1; 'none' drops a limit)."),
    click.Option(["--input", "input_specs"], multiple=True, metavar="NAME:SHAPE[:DTYPE]",
                 help="With --module and a MODEL from another exporter: its inputs, as for export --module."),
    click.Option(["--cache", "cache_specs"], multiple=True, metavar="INPUT:OUTPUT",
                 help="With --module: the module's own cache (as for export --module; default: what the MODEL "
                      "records): check decoding with it."),
    click.Option(["--write-pos"], default=None, metavar="INPUT",
                 help="With --module and --cache: the cache is static, written where INPUT says (as for export "
                      "--module; default: what the MODEL records)."),
    click.Option(["--json", "as_json"], is_flag=True, help="Print one JSON document and nothing else."),
)

# `attnexport bench`'s.
BENCH = (
    click.Option(["--variant"], type=VARIANT, default=None, help="The variant to time (see `attnexport list`)."),
    click.Option(["--module", "module_spec"], default=None, metavar="FILE.py:NAME",
                 help="Your own module instead (as for export --module); every symbolic length takes --seq."),
    click.Option(["--hf", "hf_path"], default=None, metavar="PATH",
                 help="A transformers causal language model (as for export --hf), with --decode: each cache form and "
                      "flavor against transformers eager (and Optimum's export and onnxruntime-genai's model builder "
                      "when installed); or a sentence encoder, without --decode: sentences a second at --batch x --seq "
                      "(default 1x16, 32x128, 8x512) beside transformers and Optimum's export (optimized, and its "
                      "dynamic int8) when installed."),
    click.Option(["--audio"], type=click.Path(dir_okay=False), default=None, metavar="FILE.wav",
                 help="With --hf and a Whisper model: the clip (16 kHz mono WAV, up to 30 s) transcribed (default: a "
                      "synthetic clip); each engine's encoder, decoder a token and real-time factor beside "
                      "transformers, Optimum's export and CTranslate2 (float32, int8) when installed."),
    click.Option(["--genai-python"], default=None, metavar="PYTHON",
                 help="With --hf: the Python that runs onnxruntime-genai's model builder (default: this one; the "
                      "builder may want another transformers than Optimum)."),
    click.Option(["--precision", "precisions_text"], default=None, metavar="P,...",
                 help="With --hf: attnexport's precisions to time (fp32, fp16, int8, int4, q4f16; default fp32, an "
                      "encoder's fp32,int8), each beside its accuracy."),
    click.Option(["--int8-kernel", "int8_kernels_text"], default=None, metavar="K,...",
                 help="With --hf and a Whisper model: the int8 forms to time (blockwise, integer, or both separated "
                      "by a comma; default: the family's), each an export of its own beside its accuracy."),
    click.Option(["--genai-precision", "genai_precisions_text"], default=None, metavar="P,...",
                 help="With --hf: onnxruntime-genai builder's precisions to time (its -p: fp32, int4; default fp32); "
                      "int4 may carry its --extra_options after colons (algo_config, is_symmetric, block_size, "
                      "accuracy_level: int4:algo_config=k_quant_mixed:is_symmetric=false)."),
    click.Option(["--input", "input_specs"], multiple=True, metavar="NAME:SHAPE[:DTYPE]",
                 help="With --module: an example input (repeatable; default: the NAME function's)."),
    click.Option(["--batch"], default=None, help="Batch size, or several separated by commas."),
    click.Option(["--seq"], default=None, help="Sequence length, or several: --seq 512,2048,8192."),
    click.Option(["--kv-seq", "kv_seq"], default=None, help="Key/value length, or several."),
    click.Option(["--decode"], is_flag=True,
                 help="Generation with a KV cache: prefill and one decoding step at each --context length."),
    click.Option(["--context"], default=None, help="With --decode: context lengths, e.g. --context 128,1024,4096."),
    click.Option(["--runtimes"], type=TIMED_RUNTIME_LIST, default=None,
                 help="Comma-separated runtimes (default: every available one)."),
    click.Option(["--flavor", "flavors"], multiple=True, type=FLAVOR,
                 help="Flavors to time (repeatable; default: all)."),
    click.Option(["--dtype"], type=DTYPE, default="fp32", show_default=True, help="The float type."),
    click.Option(["--warmup"], type=click.IntRange(min=0), default=5, show_default=True, help="Untimed runs first."),
    click.Option(["--iters"], type=click.IntRange(min=1), default=30, show_default=True,
                 help="Timed runs (median, p10, p90)."),
    click.Option(["--cuda-graph"], is_flag=True,
                 help="Also time torch in a CUDA graph; ONNX Runtime with CUDA graphs."),
    click.Option(["--threads"], type=click.IntRange(min=1), default=None,
                 help="CPU threads for torch and ONNX Runtime (default: all)."),
    click.Option(["--repeat"], type=click.IntRange(min=1), default=5, show_default=True,
                 help="Rounds the timed runs are split into; each ratio is reported with its spread over them."),
    click.Option(["--load"], type=click.IntRange(min=0, max=64), default=0, show_default=True,
                 help="With --hf: time under a fixed background load, this many busy processes (one core each) "
                      "that bench starts and stops itself (a shared machine's figures, reproducibly)."),
    click.Option(["--seed"], type=SEED, default=None,
                 help="Seed of parameters and inputs (default 0; with --hf, a folder with a config and no weights "
                      "is timed only when it is given)."),
    click.Option(["--json", "as_json"], is_flag=True, help="Print the rows as a JSON list and nothing else."),
    click.Option(["--plot"], type=click.Path(dir_okay=False), default=None, help="Write a latency chart (PNG)."),
)

def read(table, given: dict) -> tuple[SimpleNamespace, dict]:
    """(every option of `table` as given, else its default; the rest of `given`: the variant
    options, None where not given)."""
    names = {o.name: o for o in table}
    values = {name: given[name] if name in given else _default(o) for name, o in names.items()}
    return SimpleNamespace(**values), {k: v for k, v in given.items() if k not in names}


def pick(values: SimpleNamespace, request_class, **given) -> dict:
    """Keywords for the dataclass `request_class`: `given`, and every field of it that `values`
    (what `read` returns) holds under the same name: an option is then passed on by its name alone,
    never restated as `name=a.name`."""
    taken = {f.name: getattr(values, f.name) for f in dataclasses.fields(request_class)
             if f.init and f.name not in given and hasattr(values, f.name)}
    return {**taken, **given}


def _default(option: click.Option):
    """What click passes for an option not given: its default; for one declared without a default,
    () when repeatable, False when a flag, else None (newer clicks keep a sentinel there)."""
    default = option.default
    if option.multiple:
        return tuple(default) if isinstance(default, list | tuple) else ()
    if default is None or isinstance(default, str | int | float | bool):
        return default
    return False if option.is_flag and not option.secondary_opts else None
