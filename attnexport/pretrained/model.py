"""Whole transformers language models: loaded from a `save_pretrained` folder, wrapped into one
step graph with a known cache structure, and exported through the module path.

A causal language model is a user's module whose cache attnexport knows: the wrappers below turn
it into a forward of flat tensors (ids, positions, one key and one value tensor per layer) that
`attnexport.export.export_module` exports as any module, so the export core, the attention
recognition, the flavours and the localization all apply. Three cache forms:

- `none`: input_ids, attention_mask, position_ids -> logits.
- `concat`: the names Optimum's exports use (`input_ids`, `attention_mask`, `position_ids`,
  `past_key_values.{i}.key`/`.value` -> `logits`, `present.{i}.key`/`.value`), so the file loads
  where those do; each present is the past with the block's keys after it. Each layer's attention
  is attnexport's core with the layer's past as its cache (`_concat_attention`), grouped heads as
  they are; transformers makes its masks as for sdpa.
- `static`: `input_ids`, `write_pos`, `past_key_values.{i}.key`/`.value` buffers of `max_seq`
  positions -> `logits`, `present.{i}.key`/`.value` (the buffers written). Each layer's attention
  is attnexport's static step (`attnexport.models.core.attend_static`): the block's keys and
  values written at each sequence's `write_pos`, attention over its valid prefix; the ort flavour
  makes that one GroupQueryAttention that writes the buffers in place. A sequence's positions are
  write_pos + 0..T-1, so prompts of different lengths go in right-padded (each sequence's next
  write_pos is its own length) and no mask is needed.

Grouped heads stay grouped in every cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnexport import signature as SG
from attnexport.errors import UsageError, reason
from attnexport.models.core import attend, attend_static
from attnexport.semantics import Core

TASK = "causal-lm"
FORMS = ("none", "concat", "static")
# The metadata key that says which form a model is and its cache's shape (see `Layout.meta`).
META = "attnexport.hf"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
# What a folder holds when it has a tokenizer (the fast tokenizer's file, or a slow one's vocabulary).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Layout:
    """A language model's step graph, as apps (and verify and bench) drive it: the cache form,
    the layers, the cache's heads and head size, the buffers' positions (static), the vocabulary."""

    form: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_seq: int = 0
    pad_token: int = 0

    def cache_names(self, prefix: str) -> list[str]:
        """`prefix.{i}.key`, `prefix.{i}.value` of every layer, in order (none without a cache)."""
        if self.form == "none":
            return []
        return [f"{prefix}.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]

    @property
    def cache_pairs(self) -> dict[str, str]:
        """{past input: the present output that returns it written}, every layer's key and value."""
        return dict(zip(self.cache_names("past_key_values"), self.cache_names("present"), strict=True))

    @property
    def inputs(self) -> list[str]:
        if self.form == "none":
            return ["input_ids", "attention_mask", "position_ids"]
        if self.form == "concat":
            return ["input_ids", "attention_mask", "position_ids", *self.cache_names("past_key_values")]
        return ["input_ids", "write_pos", *self.cache_names("past_key_values")]

    @property
    def outputs(self) -> list[str]:
        return ["logits"] + ([] if self.form == "none" else self.cache_names("present"))

    def meta(self) -> str:
        return json.dumps({"task": TASK, **vars(self)})

    @classmethod
    def of(cls, model) -> Layout:
        """The layout an export recorded (`attnexport.hf` metadata); a UsageError if it has none."""
        props = {p.key: p.value for p in model.metadata_props}
        if META not in props:
            raise UsageError("the model is not a language model exported with --hf (no attnexport.hf metadata)")
        fields = json.loads(props[META])
        fields.pop("task", None)
        layout = cls(**fields)
        recorded = SG.of(model)  # None: exported before signatures
        if recorded is not None and recorded.caches != layout.signature.caches:
            raise UsageError(f"the model's signature records its caches otherwise than its {layout.form} form does "
                             f"({len(recorded.caches)} pairs, the form has {len(layout.signature.caches)})")
        return layout

    @property
    def signature(self) -> SG.StepSignature:
        """The caches and write position of this layout's step (the graph fills in the rest)."""
        kind = "static" if self.form == "static" else "concat"
        caches = tuple(SG.CachePair(p, q, 2, kind) for p, q in self.cache_pairs.items())
        return SG.StepSignature(caches=caches, write_pos=SG.WritePos("write_pos") if kind == "static" else None)


# --- loading ------------------------------------------------------------------------------------

# The architectures the suite exports and verifies (model_type in the config); others whose layers
# call transformers' attention interface with a layer_idx are tried, and named as untested when
# they fail.
TESTED = ("llama", "mistral", "qwen2", "phi3", "gpt2", "gemma2")


def _has_weights(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _WEIGHT_FILES)


@contextlib.contextmanager
def _quiet_transformers():
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


def load(source: str | Path, seed: int = 0):
    """(model, where its parameters came from) for a causal language model: `source` is a folder
    saved with `save_pretrained` (weights read from it, or drawn from `seed` when it has a config
    only), a GGUF file (its tensors dequantized to float32, as transformers reads them) or a model
    id transformers' `from_pretrained` resolves. The model is in float32, eval mode, with the
    sdpa attention where its architecture has one, else eager (routed through attnexport's core
    at export either way)."""
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf needs transformers: pip install 'attnexport[hf]'") from None
    folder = Path(source)
    if folder.suffix.lower() == ".gguf" or folder.is_file():
        return _load_gguf(folder)
    if not folder.exists() and (str(source).startswith((".", "/", "~")) or str(source).count("/") > 1):
        raise UsageError(f"--hf {source}: no such folder")
    try:
        with _quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(str(source))
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        raise UsageError(f"--hf {source}: no transformers config there ({reason(e)[:200]})") from None
    _check_causal(config, source)
    try:
        with _quiet_transformers():
            if folder.is_dir() and not _has_weights(folder):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    model, _ = _build(lambda attn: transformers.AutoModelForCausalLM.from_config(
                        config, attn_implementation=attn, dtype=torch.float32), source)
                source_of_params = "seed"
            else:
                model, _ = _build(lambda attn: transformers.AutoModelForCausalLM.from_pretrained(
                    str(source), attn_implementation=attn, dtype=torch.float32), source)
                source_of_params = "given: " + (folder.name or str(source))
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        raise UsageError(f"--hf {source}: transformers cannot build the model ({reason(e)[:300]})") from None
    return model.eval(), source_of_params


def _check_causal(config, source) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        found = ", ".join(archs) or f"none ({config.model_type})"
        raise UsageError(f"--hf {source}: not a causal language model (task {TASK}: architectures ending in "
                         f"ForCausalLM or LMHeadModel, tested: {', '.join(TESTED)}; its config lists {found})")


def _load_gguf(path: Path):
    """A GGUF file as transformers reads it: its config (without the quantization, so the model is
    an ordinary float32 one) and its tensors dequantized, loaded into the architecture it names."""
    import transformers
    if not path.is_file():
        raise UsageError(f"--hf {path}: no such file")
    try:
        import gguf  # noqa: F401 - transformers reads the file with it
    except ImportError:
        raise UsageError(f"--hf {path}: reading a GGUF file needs the gguf package: pip install "
                         "'attnexport[real]'") from None
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    try:
        with _quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers' reason, in one line
        raise UsageError(f"--hf {path}: transformers cannot read it as a GGUF model ({reason(e)[:200]})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not getattr(config, "architectures", None):  # GGUF's configs name the model type only
        names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        config.architectures = [names[config.model_type]] if config.model_type in names else []
    _check_causal(config, path)
    try:
        with _quiet_transformers():
            model, _ = _build(lambda attn: transformers.AutoModelForCausalLM.from_config(
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
    return model.eval(), "given: " + path.name


def tokenizer_of(source: str | Path):
    """The tokenizer beside the model at `source` (its folder's tokenizer files, a GGUF file's own
    vocabulary, or the model id's), or None when there is none (a config-only folder)."""
    import transformers
    path = Path(source)
    where, extra = (str(path.parent), {"gguf_file": path.name}) if path.is_file() else (str(source), {})
    if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        with _quiet_transformers():
            return transformers.AutoTokenizer.from_pretrained(where, **extra)
    except Exception:  # noqa: BLE001 - no tokenizer there: prompts are drawn as token ids instead
        return None


def layout_of(model, form: str, max_seq: int = 0) -> Layout:
    """The step graph's layout for `model` in cache form `form`."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
    return Layout(form, config.num_hidden_layers, kv_heads, head_dim, config.vocab_size, max_seq, int(pad))


# --- the step graphs ------------------------------------------------------------------------------

class _Step:
    """One step while the model runs it: what the attention function reads (each layer's past or
    buffers, the static form's write_pos) and fills (each layer's keys and values written)."""

    def __init__(self, buffers, write_pos):
        self.buffers, self.write_pos = buffers, write_pos
        self.written: dict = {}


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("attnexport_hf_step", default=None)
STATIC_ATTENTION = "attnexport_static"


def _static_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface for the static form: the layer's step through
    attnexport's static core (its buffers from the step under way), in place of the cache update
    and the attention; returns (output (B, T, H, d), None) as transformers' attention functions do."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the attnexport_static attention runs inside a StaticStep only")
    if kwargs.get("sliding_window") is not None and kwargs["sliding_window"] < step.buffers[0].shape[2]:
        raise UsageError(f"the static form attends over every written position; this model's layers see the last "
                         f"{kwargs['sliding_window']} only (sliding_window < --max-seq): export with --kv-cache, "
                         "or --max-seq at most the window")
    softcap = kwargs.get("softcap") or 0.0
    i = module.layer_idx
    out, key_out, value_out = attend_static(query, key, value, (step.buffers[2 * i], step.buffers[2 * i + 1]),
                                            step.write_pos, Core(scaling, True, softcap))
    step.written[i] = (key_out, value_out)
    return out.transpose(1, 2).contiguous(), None


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


class LogitsOnly(torch.nn.Module):
    """input_ids, attention_mask, position_ids -> logits (no cache). Position ids are an input, as
    for the concat form: with left padding they count tokens, which absolute position embeddings
    (GPT-2's) see. Each layer's attention is attnexport's core (`_concat_attention` with no past),
    whichever implementation the model was built with (eager where it has no sdpa)."""

    def __init__(self, model):
        super().__init__()
        _register_attention()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        with _stepping(self.model, _Step(None, None), CONCAT_ATTENTION):
            return _logits(self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=False))


CONCAT_ATTENTION = "attnexport_concat"


def _concat_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention interface for the concat form: the layer's past (from the step
    under way) and the block's keys and values through attnexport's core with its cache, grouped
    heads as they are (transformers' sdpa function repeats them to the query heads first, a copy of
    the whole cache each step); the present joined by the core. Returns (output (B, T, H, d), None)."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the attnexport_concat attention runs inside a ConcatStep or LogitsOnly only")
    i = module.layer_idx
    past = (step.buffers[2 * i], step.buffers[2 * i + 1]) if step.buffers is not None else None
    if attention_mask is not None and attention_mask.ndim == 4:  # as transformers' sdpa function takes it
        attention_mask = attention_mask[:, :, :, :(past[0].shape[2] if past else 0) + key.shape[2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    a = attend(query, key, value, attention_mask, cache=past,
               core=Core(scaling, bool(is_causal), kwargs.get("softcap") or 0.0))
    step.written[i] = (a.present_key, a.present_value)
    return a.output.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    """The two attention functions in transformers' registry; the concat one's masks made as for
    sdpa (the static one reads none: its core masks by write_pos)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface.register(STATIC_ATTENTION, _static_attention)
    AttentionInterface.register(CONCAT_ATTENTION, _concat_attention)
    AttentionMaskInterface.register(CONCAT_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def _stepping(model, step: _Step, attention: str):
    """The model's layers calling `attention` with `step` under way."""
    token = _STEP.set(step)
    before = model.config._attn_implementation
    model.config._attn_implementation = attention
    try:
        yield
    finally:
        model.config._attn_implementation = before
        _STEP.reset(token)


def _written(step: _Step, layers: int, form: str) -> tuple:
    """Each layer's key and value written by the step, in order."""
    missing = [i for i in range(layers) if i not in step.written]
    if missing:
        raise UsageError(f"the {form} form needs every layer's attention through transformers' attention "
                         f"interface; layer(s) {missing} did not call it")
    return tuple(t for i in range(layers) for t in step.written[i])


def _past_only(past, layers: int):
    """What a concat step's model sees as its cache: the past's positions (the mask's size), and
    an update that hands the block's keys and values on as they are (the attention joins them)."""
    from transformers import DynamicCache

    class PastOnly(DynamicCache):
        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states
    cache = PastOnly()
    for i in range(layers):
        DynamicCache.update(cache, past[2 * i], past[2 * i + 1], i)
    return cache


class ConcatStep(torch.nn.Module):
    """Optimum's step: input_ids, attention_mask (B, P + T), position_ids, each layer's past key
    and value (B, Hkv, P, d) -> logits, each layer's present (the past, then the block's). Each
    layer's attention is attnexport's core with the past as its cache (`_concat_attention`)."""

    def __init__(self, model, layers: int):
        super().__init__()
        _register_attention()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        step = _Step(past, None)
        with _stepping(self.model, step, CONCAT_ATTENTION):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, **{_cache_keyword(self.model): _past_only(past, self.layers)})
        return (_logits(out), *_written(step, self.layers, "concat"))


def _cache_keyword(model) -> str:
    """The name forward takes the cache by: `cache` in newer transformers, `past_key_values` before."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StaticStep(torch.nn.Module):
    """input_ids (B, T), write_pos (B,), each layer's key and value buffers (B, Hkv, max_seq, d) ->
    logits, each layer's buffers with the block written at write_pos. Position ids are
    write_pos + 0..T-1; the attention of every layer is attnexport's static step."""

    def __init__(self, model, layers: int):
        super().__init__()
        _register_attention()
        self.model, self.layers = model, layers

    def forward(self, input_ids, write_pos, *buffers):
        positions = write_pos.reshape(-1, 1) + torch.arange(input_ids.shape[1], device=input_ids.device)
        step = _Step(buffers, write_pos)
        with _stepping(self.model, step, STATIC_ATTENTION):
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False)
        return (_logits(out), *_written(step, self.layers, "static"))


def step_module(model, layout: Layout):
    """The wrapper that makes `model` the step graph of `layout`."""
    return {"none": lambda: LogitsOnly(model), "concat": lambda: ConcatStep(model, layout.layers),
            "static": lambda: StaticStep(model, layout.layers)}[layout.form]()


def example_feed(layout: Layout, batch: int = 2, block: int = 5, past: int = 3, seed: int = 0,
                 padded: int = 0) -> dict:
    """Inputs for one step of `layout` as NumPy arrays: `block` new tokens after `past` cached
    positions (concat: a cache of `past` positions; static: written up to `past`), every position
    a token (the mask all ones) but the first `padded` of sequence 0 (none and concat: left
    padding, masked out, the positions counting tokens only)."""
    rng = np.random.default_rng(seed)
    past = 0 if layout.form == "none" else past  # no cache: the mask covers the block
    ids = rng.integers(0, layout.vocab, (batch, block), dtype=np.int64)
    mask = np.ones((batch, past + block), np.int64)
    mask[0, :padded] = 0
    positions = positions_of(mask)[:, past:]
    if layout.form == "none":
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    if layout.form == "concat":
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        shape = (batch, layout.kv_heads, past, layout.head_dim)
    else:
        feed = {"input_ids": ids, "write_pos": np.full((batch,), past, np.int64)}
        shape = (batch, layout.kv_heads, layout.max_seq, layout.head_dim)
    for name in layout.cache_names("past_key_values"):
        feed[name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def stepped_logits(run, layout: Layout, ids: np.ndarray, first: int, chunk: int, dtype=np.float32) -> np.ndarray:
    """The logits (B, T, V) of every position of `ids` (B, T) from the step graph `run` (any
    runtime): a prefill of `first` tokens into an empty cache, then blocks of `chunk` tokens, each
    step's cache fed to the next (concat: the presents as pasts; static: the buffers, write_pos the
    tokens so far); the none form runs the whole sequence once."""
    batch, total = ids.shape
    if layout.form == "none":
        mask = np.ones((batch, total), np.int64)
        return np.asarray(run({"input_ids": ids, "attention_mask": mask, "position_ids": positions_of(mask)})["logits"],
                          np.float64)
    pairs = layout.cache_pairs
    positions = layout.max_seq if layout.form == "static" else 0
    state = {n: np.zeros((batch, layout.kv_heads, positions, layout.head_dim), dtype) for n in pairs}
    logits, start = [], 0
    while start < total:
        end = first if start == 0 else min(start + chunk, total)
        block = ids[:, start:end]
        if layout.form == "static":
            feed = {"input_ids": block, "write_pos": np.full(batch, start, np.int64), **state}
        else:
            feed = {"input_ids": block, "attention_mask": np.ones((batch, end), np.int64),
                    "position_ids": np.broadcast_to(np.arange(start, end), block.shape).copy(), **state}
        out = run(feed)
        logits.append(np.asarray(out["logits"], np.float64))
        state = {past: out[present] for past, present in pairs.items()}
        start = end
    return np.concatenate(logits, axis=1)


# --- generation ---------------------------------------------------------------------------------

def prompts_for(layout: Layout, lengths, seed: int = 0) -> list[np.ndarray]:
    """Token ids for prompts of `lengths`, seeded; the pad token and the first few ids (special
    tokens in most vocabularies) left out."""
    rng = np.random.default_rng(seed)
    low = min(3, layout.vocab - 1)
    return [rng.integers(low, layout.vocab, n, dtype=np.int64) for n in lengths]


def left_padded(prompts, pad: int):
    """(ids, mask, positions) of prompts left-padded to the longest, as transformers' generate
    takes them."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    return ids, mask, positions_of(mask)


def positions_of(mask: np.ndarray) -> np.ndarray:
    """Position ids of a padding mask as transformers' generate makes them: each token's count of
    tokens before it; 1 on padding (never attended)."""
    return np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)


@dataclass
class Generation:
    """A greedy generation: the new tokens (B, N), each step's logits of the last position
    (N arrays (B, V)), and the inputs of the first step whose token differs from the tokens
    watched (what localizes a divergence; None when none differs or none was watched)."""

    tokens: np.ndarray
    logits: list
    diverged_feed: dict | None = None


def generate(run, layout: Layout, prompts, new_tokens: int, watch: np.ndarray | None = None,
             dtype=np.float32) -> Generation:
    """Greedy decoding of `new_tokens` tokens after each prompt with the step graph of `layout`:
    `run(feed) -> {output name: array}` runs one step (any runtime). The loop an app writes:
    none: the whole sequence each step; concat: prompts left-padded with the mask and position
    ids, then one token a step with the presents as the next pasts; static: prompts right-padded
    into empty buffers at write_pos 0, each sequence's next write_pos its own length, then one
    token a step at write_pos, the buffers written returned as the next step's. `watch`: the
    tokens expected (B, N), whose first departure's feed is kept; `dtype`: the caches' (the
    model's float type)."""
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts])
    tokens, logits, diverged = [], [], None
    pairs = layout.cache_pairs
    if layout.form == "static":
        if lengths.max() + new_tokens > layout.max_seq:
            raise UsageError(f"prompts of up to {lengths.max()} tokens and {new_tokens} new ones need --max-seq "
                             f">= {lengths.max() + new_tokens}; the model's buffers hold {layout.max_seq}")
        ids = np.full((batch, lengths.max()), layout.pad_token, np.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p
        shape = (batch, layout.kv_heads, layout.max_seq, layout.head_dim)
        feed = {"input_ids": ids, "write_pos": np.zeros(batch, np.int64),
                **{n: np.zeros(shape, dtype) for n in pairs}}
        last = lengths - 1
        write_pos = lengths.copy()
    else:
        ids, mask, positions = left_padded(prompts, layout.pad_token)
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if layout.form == "concat":
            empty = np.zeros((batch, layout.kv_heads, 0, layout.head_dim), dtype)
            feed.update({n: empty for n in pairs})
        last = np.full(batch, ids.shape[1] - 1)
    for step in range(new_tokens):
        out = run(feed)
        step_logits = np.asarray(out["logits"])[np.arange(batch), last]
        token = step_logits.argmax(axis=-1).astype(np.int64)
        if watch is not None and diverged is None and (token != watch[:, step]).any():
            diverged = feed
        tokens.append(token)
        logits.append(step_logits)
        presents = {past: out[present] for past, present in pairs.items()}
        if layout.form == "static":
            feed = {"input_ids": token[:, None], "write_pos": write_pos.copy(), **presents}
            write_pos = write_pos + 1
            last = np.zeros(batch, np.int64)
        elif layout.form == "concat":
            mask = np.concatenate([feed["attention_mask"], np.ones((batch, 1), np.int64)], axis=1)
            feed = {"input_ids": token[:, None], "attention_mask": mask,
                    "position_ids": feed["position_ids"][:, -1:] + 1, **presents}
            last = np.zeros(batch, np.int64)
        else:
            feed = {"input_ids": np.concatenate([feed["input_ids"], token[:, None]], axis=1),
                    "attention_mask": np.concatenate([feed["attention_mask"], np.ones((batch, 1), np.int64)], axis=1),
                    "position_ids": np.concatenate([feed["position_ids"], feed["position_ids"][:, -1:] + 1], axis=1)}
            last = np.full(batch, feed["input_ids"].shape[1] - 1)
    return Generation(np.stack(tokens, axis=1), logits, diverged)


def reference_generation(model, layout: Layout, prompts, new_tokens: int) -> Generation:
    """transformers' own `generate(do_sample=False)` on the prompts (left-padded, with the mask),
    with its own cache and attention: exactly `new_tokens` tokens (no end-of-sequence stop), and
    each step's logits."""
    from transformers import GenerationConfig
    ids, mask, _ = left_padded(prompts, layout.pad_token)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=layout.pad_token, output_logits=True, return_dict_in_generate=True)
    # generate() fills what a config leaves at its default from the model's own generation config
    # (its end-of-sequence token among them, which would stop it): that one has none either while it runs.
    own = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig(pad_token_id=layout.pad_token)
    try:
        with torch.no_grad(), _quiet_transformers():
            out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                 generation_config=config)
    finally:
        model.generation_config = own
    tokens = out.sequences[:, ids.shape[1]:].numpy()
    if tokens.shape[1] != new_tokens:
        raise RuntimeError(f"transformers' generate gave {tokens.shape[1]} tokens for {new_tokens}")
    return Generation(tokens, [t.double().numpy() for t in out.logits])
