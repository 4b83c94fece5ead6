"""Whole models, loaded: from a `save_pretrained` folder, a GGUF file, a model id in the local
cache, or a folder a family reads itself (`registry.Family.reads`); and a step graph's layout,
recorded in its step signature.

A whole model of one step graph is a user's module whose inputs and cache attnexport knows: its
form (`attnexport.pretrained.forms`) wraps it into a forward of flat tensors (ids, positions, one
key and one value tensor per layer) that `attnexport.export.export_module` exports as any module,
so the export core, the attention recognition, the flavours and the localization all apply.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import io
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from attnexport import files as F
from attnexport import signature as SG
from attnexport import usage as U
from attnexport.errors import UsageError, reason
from attnexport.pretrained import forms, registry
from attnexport.record import ExportRecord

# Where files exported before the step signature recorded a model's sizes (the export record's
# `hf`); the signature's `model` holds them since (`Layout.sizes`).
OLD_META = "attnexport.hf"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
# What a folder holds when it has a tokenizer (the fast tokenizer's file, or a slow one's vocabulary).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Layout:
    """A whole model's step graph, as apps (and verify and bench) drive it: the form, the layers,
    the cache's heads and head size, the buffers' positions (static), the vocabulary, and what its
    family records beside (`extra`, its own fields by name). An export records it in its step
    signature (`signature.StepSignature.model`)."""

    form: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_seq: int = 0  # static: the buffers' positions; an encoder: the longest sequence its positions take
    pad_token: int = 0
    task: str = registry.FIRST_TASK  # the family's (files from before it record the one there was)
    # An encoder's: the token types it takes (0: no token_type_ids input), its pooling and normalisation.
    token_types: int = 0
    pooling: str = ""
    normalize: bool = False
    # A family's own sizes beyond these (an image's size and channels), recorded only where it has any.
    extra: dict = field(default_factory=dict)

    @property
    def cache_form(self) -> forms.CacheForm:
        return registry.of_task(self.task).form(self.form)

    @property
    def family(self) -> registry.Family:
        return registry.of_task(self.task)

    def cache_names(self, prefix: str) -> list[str]:
        """`prefix.{i}.key`, `prefix.{i}.value` of every layer, in order (none without a cache)."""
        return self.cache_form.cache_names(self, prefix)

    @property
    def cache_pairs(self) -> dict[str, str]:
        """{past input: the present output that returns it written}, every layer's key and value."""
        return dict(zip(self.cache_names("past_key_values"), self.cache_names("present"), strict=True))

    @property
    def inputs(self) -> list[str]:
        return self.cache_form.inputs(self)

    @property
    def outputs(self) -> list[str]:
        return self.cache_form.outputs(self)

    def sizes(self) -> dict:
        """The fields the step signature records (`model`); `extra` only where the family has any."""
        fields = dict(vars(self))
        if not fields["extra"]:
            del fields["extra"]
        return fields

    @classmethod
    def of(cls, model) -> Layout:
        """The layout an export recorded: its step signature's `model` (files exported before it:
        their `attnexport.hf` metadata, checked against the signature's caches where there is
        one); a UsageError if it has none."""
        recorded = SG.of(model)  # None: exported before signatures
        fields = recorded.model if recorded is not None else None
        if fields is None:
            fields = ExportRecord.of(model).parsed("hf")
        if fields is None:
            raise UsageError("the model is not a language model exported with --hf (its signature records no "
                             "model sizes)")
        if not isinstance(fields, dict) or set(fields) - {f for f in cls.__dataclass_fields__}:
            raise UsageError(f"the model's recorded sizes are damaged: {fields!r:.120}")
        registry.of_task(fields.get("task", registry.FIRST_TASK)).form(str(fields.get("form", "")))
        try:
            layout = cls(**fields)
        except TypeError as e:
            raise UsageError(f"the model's recorded sizes are damaged ({e})") from None
        expected = layout.signature.caches
        if recorded is not None and recorded.caches != expected:
            raise UsageError(f"the model's signature records its caches otherwise than its {layout.form} form does "
                             f"({len(recorded.caches)} pairs, the form has {len(expected)})")
        return layout

    @property
    def signature(self) -> SG.StepSignature:
        """The caches, write position and sizes of this layout's step (the graph fills in the rest)."""
        return replace(self.cache_form.signature(self), model=self.sizes())


# --- loading ------------------------------------------------------------------------------------

def downloads_allowed() -> bool:
    """Whether a model id may be looked up on the Hugging Face Hub: only when the user asks for it
    (HF_HUB_OFFLINE=0); else it is read from the local cache alone, with no network wait."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("0", "false", "no", "off")


def config_of(source):
    """transformers' config of the folder or model id `source` (a model id from the local cache
    alone unless downloads are allowed); a one-line UsageError where there is none."""
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf needs transformers: pip install 'attnexport[hf]'") from None
    folder = Path(str(source))
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        return _gguf_config(folder)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UsageError(f"--hf {source}: a folder without a config.json (a save_pretrained folder, "
                         f"{registry.own_sources()}, or a GGUF file)")
    local = not folder.exists() and not downloads_allowed()
    try:
        with quiet_transformers():
            return transformers.AutoConfig.from_pretrained(str(source), local_files_only=local)
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        if local:
            raise UsageError(f"--hf {source}: no such file or folder, and no model of that id in the Hugging Face "
                             "cache (nothing is downloaded unless asked: HF_HUB_OFFLINE=0)") from None
        raise UsageError(f"--hf {source}: no transformers config there ({reason(e)[:200]})") from None


def _has_weights(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _WEIGHT_FILES)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars and warnings kept from the user while a model loads."""
    from transformers.utils import logging as tlog
    bars, verbosity = tlog.is_progress_bar_enabled(), tlog.get_verbosity()
    tlog.disable_progress_bar()
    tlog.set_verbosity_error()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def _build(make, source) -> tuple:
    """`make(attn_implementation)` with the sdpa attention where the architecture has it, else
    eager (Gemma2's in newer transformers); the attention is routed through attnexport's core at
    export either way, and the implementation is the reference's."""
    try:
        return make("sdpa"), "sdpa"
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
    return make("eager"), "eager"


def load(source: str | Path, seed: int | None = None, mapped_in: Path | None = None):
    """(model, where its parameters came from) of any family's model: `source` is a folder
    saved with `save_pretrained` (weights read from it; a config alone is refused unless `seed` is
    given, when its weights are drawn from it: a random model is never made unasked), a folder a
    family reads itself, a GGUF file (its tensors dequantized to float32, as transformers reads
    them) or a model id transformers' `from_pretrained` resolves. The model is in float32, eval
    mode, with the sdpa attention where its architecture has one, else eager (routed through
    attnexport's core at export either way). With `mapped_in` (a folder), a folder's weights are
    read from a file there rather than held (`map_float32`); a half-precision folder's are loaded
    as its files' own mapping first, so no whole float32 copy is ever made in memory."""
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf needs transformers: pip install 'attnexport[hf]'") from None
    folder = Path(source)
    if folder.suffix.lower() == ".gguf" or folder.is_file():
        return _load_gguf(folder)
    if not folder.exists() and (str(source).startswith((".", "/", "~")) or str(source).count("/") > 1):
        raise UsageError(f"--hf {source}: no such folder")
    reader = registry.reading(folder) if folder.is_dir() else None
    if reader is not None:  # a folder of a family's own
        return reader.load(folder)
    config = config_of(source)
    local = not folder.exists() and not downloads_allowed()
    family = registry.of_config(config, source)
    build = getattr(transformers, family.auto_class)
    if folder.is_dir() and not _has_weights(folder) and seed is None:
        raise UsageError(f"--hf {source}: a config and no weights ({' or '.join(_WEIGHT_FILES[::2])}): the model "
                         "made from it would be randomly initialised; give --seed N to make one on purpose (its "
                         "weights drawn from N)")
    try:
        with quiet_transformers():
            if folder.is_dir() and not _has_weights(folder):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    model, _ = _build(lambda attn: build.from_config(
                        config, attn_implementation=attn, dtype=torch.float32), source)
                if (folder / "generation_config.json").is_file():  # from_config reads only the model's config
                    model.generation_config = transformers.GenerationConfig.from_pretrained(str(folder))
                source_of_params = "seed"
            else:
                # A half-precision folder mapped: transformers keeps its own type's tensors as the
                # files' mapping (nothing read until used); map_float32 then widens them a tensor at a time.
                dtype = (_half_files(folder) if mapped_in is not None and folder.is_dir() else None) or torch.float32
                model, _ = _build(lambda attn: build.from_pretrained(
                    str(source), attn_implementation=attn, dtype=dtype, local_files_only=local), source)
                source_of_params = "given: " + (folder.name or str(source))
                if mapped_in is not None:
                    map_float32(model, mapped_in)
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        raise UsageError(f"--hf {source}: transformers cannot build the model ({reason(e)[:300]})") from None
    return model.eval(), source_of_params


def _safetensors(folder: Path) -> dict:
    """{tensor name: (file, byte offset of its data, safetensors dtype, shape)} of every tensor in the
    folder's safetensors files (sharded too), from their headers alone; {} where a header cannot be read."""
    import json
    import struct
    found = {}
    try:
        for f in sorted(folder.glob("*.safetensors")):
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, t in header.items():
                if name != "__metadata__":
                    found[name] = (f, 8 + n + int(t["data_offsets"][0]), t["dtype"], tuple(int(d) for d in t["shape"]))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return {}
    return found


def _half_files(folder: Path):
    """torch's bfloat16 or float16 where every floating tensor of the folder's safetensors files is
    of that one type (their headers read, nothing loaded), else None."""
    floats = {t[2] for t in _safetensors(folder).values()} & {"F64", "F32", "F16", "BF16"}
    return {frozenset({"BF16"}): torch.bfloat16, frozenset({"F16"}): torch.float16}.get(frozenset(floats))


# Each parameter of a mapped model starts at a multiple of this in its file (mmap's offsets are in pages).
_MAP_ALIGN = 64 << 10


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process that map a file (/proc/self/maps), sorted; [] elsewhere."""
    ranges = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) > 5 and fields[5].startswith("/"):
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    except (OSError, ValueError):
        return []
    return sorted(ranges)


def _in_file_mapping(address: int, ranges: list[tuple[int, int]]) -> bool:
    i = bisect.bisect_right(ranges, (address, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= address < ranges[i][1]


def map_float32(model, folder: Path) -> int:
    """Every floating parameter of `model` made float32 and read from a file's mapping (copy-on-write)
    rather than held: its pages are the kernel's to drop and read again under memory pressure, not
    the process's own, and the whole model in float32 is never held in memory. A float32 parameter
    already in a file's mapping (transformers maps a float32 safetensors file) is left so; the
    others are widened and written a parameter at a time to one file in `folder`, mapped, its name
    removed at once. Tied parameters stay one. Returns the bytes written
    to `folder`; one with no room (OSError) is a UsageError naming what it needed."""
    import tempfile

    import numpy as np
    params, seen = [], set()
    for p in model.parameters():
        if p.is_floating_point() and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    mapped = _file_mappings()
    # transformers keeps a float32 safetensors file's tensors as the file's mapping: those are left so
    spilled = [p for p in params if not (p.dtype == torch.float32 and _in_file_mapping(p.data_ptr(), mapped))]
    offsets, end = [], 0
    for p in spilled:
        offsets.append(-(-end // _MAP_ALIGN) * _MAP_ALIGN)
        end = offsets[-1] + p.numel() * 4
    path = None
    try:
        if spilled:
            fd, temp = tempfile.mkstemp(prefix=".attnexport-weights-", dir=folder)
            path = Path(temp)
            with os.fdopen(fd, "r+b") as f:
                for p, at in zip(spilled, offsets, strict=True):
                    f.seek(at)
                    f.write(memoryview(p.detach().to(torch.float32).contiguous().numpy()).cast("B"))
            for p, at in zip(spilled, offsets, strict=True):
                p.data = torch.from_numpy(np.memmap(path, np.float32, mode="c", offset=at, shape=tuple(p.shape)))
    except OSError as e:
        raise UsageError(f"cannot hold the model's float32 weights ({F.human_size(end)}) in {folder}: "
                         f"{e.strerror or e}") from None
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
    for b in model.buffers():
        if b.is_floating_point() and b.dtype != torch.float32:
            b.data = b.data.to(torch.float32)
    model.config.dtype = torch.float32
    U.give_back()
    return end


def random_note(source, seed) -> str:
    """What an export of a folder with a config and no weights says of them."""
    return (f"the weights are random: {Path(str(source)).name} has a config and no weights, so they were drawn "
            f"from --seed {seed} (verify finds the seed in the file's record)")


class _Parsed:
    """What one `gguf_parsed_once` block has read: each GGUF file's reader (until `drop_readers`)
    and each file's tokenizer (until the block ends)."""

    def __init__(self):
        self.readers: dict = {}
        self.tokenizers: dict = {}

    def drop_readers(self) -> None:
        """Lets the readers go once the model and its tokenizer are made (about 0.4 GB of objects for
        Gemma-3-270M's vocabulary); a reader asked for later parses its file again."""
        self.readers.clear()


_PARSED: contextvars.ContextVar[_Parsed | None] = contextvars.ContextVar("attnexport_gguf_parsed", default=None)


def _file_key(path) -> tuple:
    """A file's identity within a block: where it is, its size and its time (a file changed is new)."""
    status = os.stat(path)
    return os.path.realpath(path), status.st_size, status.st_mtime_ns


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block each GGUF file is parsed once, however many readers are asked for: its
    parameter count, transformers' config, tensors and tokenizer each make a `gguf.GGUFReader` of
    their own, and one takes 9 s for Gemma-3-270M (the 262,144 strings of its vocabulary are read one
    Python object at a time); and `tokenizer_of` a GGUF file makes its tokenizer once. Yields the
    block's `_Parsed` (its `drop_readers`). A block within a block is the outer one."""
    outer = _PARSED.get()
    if outer is not None:
        yield outer
        return
    try:
        import gguf
    except ImportError:  # nothing reads a GGUF file without it (`_gguf_config` says so)
        gguf = None
    parsed = _Parsed()
    real = gguf.GGUFReader if gguf is not None else None

    def reader(path, mode="r"):
        key = (*_file_key(path), mode)
        if key not in parsed.readers:
            parsed.readers[key] = real(path, mode)
        return parsed.readers[key]

    token = _PARSED.set(parsed)
    if gguf is not None:
        gguf.GGUFReader = reader
    try:
        yield parsed
    finally:
        if gguf is not None:
            gguf.GGUFReader = real
        _PARSED.reset(token)
        parsed.readers.clear()
        parsed.tokenizers.clear()


def loaded_readers_dropped(source) -> None:
    """Within `gguf_parsed_once`, once the model at `source` is loaded: a GGUF file's tokenizer made
    now, from the reader the load parsed (a later `tokenizer_of` returns it), and then the block's
    readers let go, so that they are not held through the work that follows."""
    parsed = _PARSED.get()
    if parsed is None:
        return
    if Path(str(source)).is_file():
        tokenizer_of(source)
    parsed.drop_readers()


def _gguf_config(path: Path):
    """A GGUF file's config as transformers reads it, without the quantization (the model it makes
    is an ordinary float32 one), its architecture named from its model type."""
    import transformers
    try:
        import gguf  # noqa: F401 - transformers reads the file with it
    except ImportError:
        raise UsageError(f"--hf {path}: reading a GGUF file needs the gguf package: pip install "
                         "'attnexport[real]'") from None
    try:
        with quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        raise UsageError(f"--hf {path}: transformers cannot read it as a GGUF model ({reason(e)[:200]})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not getattr(config, "architectures", None):  # GGUF's configs name the model type only
        for family in registry.families().values():
            names = getattr(transformers.models.auto.modeling_auto, family.gguf_mapping)
            if config.model_type in names:
                config.architectures = [names[config.model_type]]
                break
    return config


def _load_gguf(path: Path):
    """A GGUF file as transformers reads it: its config (without the quantization, so the model is
    an ordinary float32 one) and its tensors dequantized, loaded into the architecture it names."""
    import transformers
    if not path.is_file():
        raise UsageError(f"--hf {path}: no such file")
    config = _gguf_config(path)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    family = registry.of_config(config, path)
    try:
        with quiet_transformers():
            model, _ = _build(lambda attn: getattr(transformers, family.auto_class).from_config(
                config, attn_implementation=attn, dtype=torch.float32), path)
            with contextlib.redirect_stderr(io.StringIO()):  # its own progress bar, outside transformers' switch
                tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        raise UsageError(f"--hf {path}: transformers cannot load its tensors ({reason(e)[:300]})") from None
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise UsageError(f"--hf {path}: its tensors do not fit {config.architectures[0]} (missing: "
                         f"{', '.join(sorted(set(missing) - tied)[:3]) or 'none'}; unexpected: "
                         f"{', '.join(unexpected[:3]) or 'none'})")
    model.tie_weights()
    del tensors
    U.give_back()  # the file's dequantized copies, let go: their pages back to the system
    return model.eval(), "given: " + path.name


# What an export and a verify hold at their peak, measured (docs/scale.md): about FACTOR times the
# model's weights in float32 above the process's own BASE (torch and the runtimes, loaded). A 1.07B
# Llama measured 1.1 (export, its weights beside the graph), 2.4 (int4) and 1.3 (verify, in two
# passes: 2.4 in one); the export of one file, 5.5 at 135M (its check session made from the model in memory).
MEMORY_BASE = 512 << 20
MEMORY_FACTORS = {"export": 1.6, "export quantized": 2.6, "export in one file": 6.0, "verify": 1.6,
                  "verify in one pass": 2.6,
                  # The model's weights read from files' mappings (`map_float32`): the process's own
                  # memory, the mapped pages being the kernel's to drop (measured: a 1.07B fp32 export
                  # 0.14, a 3.0B int4 export from bfloat16 0.62 and 0.67), with room to spare.
                  "export, mapped": 0.5, "export quantized, mapped": 1.0,
                  # verify's own memory with the source mapped: a 1.07B fp32 verify 1.18, int4 in one
                  # pass 1.03 (its session, the quantized graph read whole, the rows' logits)
                  "verify, mapped": 1.6, "verify in one pass, mapped": 1.6,
                  # A whole model's failing verify row localized (`check.Context.localize`), beside what
                  # verify holds: a fresh export of the model (Gemma-3-270M's alone peaked at 6.9 times
                  # its 1.07 GB of fp32 weights), then both graphs' weights as arrays and every node's
                  # output exposed on the runtime (the graph copied for its shapes) and in the ONNX
                  # reference evaluator. Measured from below, 2026-12-05: verifies of that model on
                  # WebGPU went from 5 GB to 14.4 and 15.1 GB and were killed for memory, reporting
                  # nothing, once inside the fresh export and once exposing every intermediate (the
                  # second with 12 here: the browser grows beside it too).
                  "localize": 16,
                  # Where that does not fit, the graph on the runtime against itself on ONNX Runtime's
                  # CPU provider, a part at a time (`localize.locate_bounded`), counted rather than
                  # measured whole: the graph read whole, its serialized copy, the CPU session with its
                  # packed weights, the runtime's own session (the browser's for WebGPU), few values at
                  # once (Gemma-3-270M on WebGPU: verify's Python process peaked at 5.4 GB in all with it,
                  # about 5 times the graph's 1.07 GB, the browser beside it).
                  "localize, bounded": 6}


def parameter_count(source: str | Path) -> int | None:
    """The parameters of the model at `source` as its files' headers give them, nothing loaded: a
    folder's safetensors (sharded too) or a GGUF file's tensors; None where the files do not say
    (a pytorch_model.bin, a model id, a folder a family reads itself)."""
    path = Path(str(source))
    try:
        if path.is_file() and path.suffix.lower() == ".gguf":
            import gguf
            return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
        tensors = _safetensors(path) if path.is_dir() else {}
        if not tensors:
            return None
        return sum(math.prod(t[3]) for t in tensors.values())
    except Exception:  # noqa: BLE001 - a header it cannot read: no estimate, the load says what is wrong
        return None


def check_fits(source: str | Path, work: str) -> None:
    """Refuses, before anything loads, a model whose `work` (a MEMORY_FACTORS key) would need more
    memory than the machine has available: one line with what it needs and what there is."""
    count = parameter_count(source)
    if count is None:
        return
    short = memory_short(count, work)
    if short is not None:
        raise UsageError(f"--hf {source}: {count / 1e9:.2f}B parameters ({F.human_size(4 * count)} in float32); "
                         f"{short} (--no-memory-check tries anyway)")


def memory_short(count: int, work: str) -> str | None:
    """Where `work` (a MEMORY_FACTORS key) on a model of `count` parameters needs more memory than
    the machine has available, what it needs and what there is, in words; None where it fits or the
    machine does not say."""
    have = U.available()
    need = MEMORY_BASE + MEMORY_FACTORS[work] * 4 * count
    if have is None or need <= have:
        return None
    return (f"{work.split()[0].rstrip(',')} needs about {F.human_size(int(need))} of memory and this machine has "
            f"{F.human_size(have)} available")


def tokenizer_of(source: str | Path):
    """The tokenizer beside the model at `source` (its folder's tokenizer files, a GGUF file's own
    vocabulary, or the model id's), or None when there is none (a config-only folder). Within
    `gguf_parsed_once` a GGUF file's is made once."""
    import transformers
    path = Path(source)
    where = str(path.parent) if path.is_file() else str(source)
    extra: dict = {"gguf_file": path.name} if path.is_file() else {}
    if not path.exists() and not downloads_allowed():
        extra["local_files_only"] = True
    if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    parsed = _PARSED.get() if path.is_file() else None
    key = _file_key(path) if parsed is not None else None
    if parsed is not None and key in parsed.tokenizers:  # a GGUF file's, made once in a block
        return parsed.tokenizers[key]
    try:
        with quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(where, **extra)
    except Exception:  # noqa: BLE001 - no tokenizer there: prompts are drawn as token ids instead
        tokenizer = None
    if parsed is not None:
        parsed.tokenizers[key] = tokenizer
    return tokenizer


def check_tokenizer(layout: Layout, tokenizer, source) -> None:
    """A family whose checks embed real sentences needs the model's tokenizer: a one-line refusal
    where its folder has none."""
    if tokenizer is None and layout.family.needs_tokenizer:
        raise UsageError(f"--hf {source}: a {layout.family.what} needs its tokenizer beside it (tokenizer.json, "
                         "or vocab.txt with tokenizer_config.json): its embeddings are judged on real sentences")


def layout_of(model, form: str | None, max_seq: int = 0, source=None) -> Layout:
    """The step graph's layout for `model` in cache form `form` (None: its family's default), its
    family's own fields read from the model and the folder at `source`."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
    family = registry.of_model(model)
    form = form or family.default_form
    family.form(form)
    fields = {"max_seq": max_seq, **family.layout_fields(model, source)}
    return Layout(form, config.num_hidden_layers, kv_heads, head_dim, int(getattr(config, "vocab_size", 0) or 0),
                  pad_token=int(pad), task=family.task, **fields)


# --- the step graphs ------------------------------------------------------------------------------

def step_module(model, layout: Layout):
    """The wrapper that makes `model` the step graph of `layout`, in eval mode (as the model is: an
    export then traces the model itself, not a copy)."""
    return layout.cache_form.wrapper(model, layout).eval()


def example_feed(layout: Layout, batch: int = 2, block: int = 5, past: int = 3, seed: int = 0,
                 padded: int = 0) -> dict:
    """Inputs for one step of `layout` as NumPy arrays: `block` new tokens after `past` cached
    positions (concat: a cache of `past` positions; static: written up to `past`), every position
    a token (the mask all ones) but the first `padded` of sequence 0 (none and concat: left
    padding, masked out, the positions counting tokens only)."""
    return layout.cache_form.example_feed(layout, batch, block, past, seed, padded)


