"""CTranslate2 model folders (what faster-whisper and CTranslate2's converters write): `model.bin`,
its `config.json` and `tokenizer.json`, read without CTranslate2 itself. Whisper models are loaded
into transformers' WhisperForConditionalGeneration in float32; any other kind of CTranslate2 model
is refused in one line.

`model.bin`'s layout (binary version 6 and the ones before it that share it): a uint32 version, the
spec's name and a uint32 revision, then a uint32 count of variables, each its name, its rank (uint8)
and dimensions (uint32 each), its type (uint8: float32, int8, int16, int32, float16, bfloat16), its
byte count (uint32) and its bytes; then a uint32 count of aliases (a name, the variable it names).
Strings are a uint16 length (the terminating zero counted), the UTF-8 bytes and a zero. Quantized
matrices (int8, int16) carry `<name>_scale`, one float a row: the float matrix is the integers
divided by it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnexport.errors import UsageError

_TYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")
WHISPER = "WhisperSpec"


def is_folder(path: Path) -> bool:
    """Whether `path` is a CTranslate2 model folder (a model.bin beside a config.json)."""
    return path.is_dir() and (path / "model.bin").is_file()


@dataclass
class Bin:
    """A model.bin read: the spec's name and revision, its variables by name (aliases resolved)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]

    def scalar(self, name: str) -> int:
        return int(np.asarray(self.variables[name]).reshape(-1)[0])

    def matrix(self, name: str) -> np.ndarray:
        """A float32 weight, dequantized where the file holds it as integers with a scale a row."""
        value = self.variables[name]
        scale = self.variables.get(name + "_scale")
        if value.dtype in (np.int8, np.int16) and scale is not None:
            scale = np.asarray(scale, np.float32)
            return value.astype(np.float32) / (scale.reshape(-1, *[1] * (value.ndim - 1)) if scale.ndim else scale)
        return value.astype(np.float32)


def read_spec(path: Path) -> str:
    """The spec's name a model.bin holds (its first bytes only); "" where it has none or is not one."""
    with open(path, "rb") as f:
        head = f.read(4 + 2 + 256)
    if len(head) < 6 or not 2 <= struct.unpack_from("<I", head)[0] <= 6:
        return ""
    n = struct.unpack_from("<H", head, 4)[0]
    return head[6:6 + n - 1].decode("utf-8", errors="replace")


def read(path: Path) -> Bin:
    """The model.bin at `path`; a UsageError for a file that is not one."""
    data = path.read_bytes()
    at = 0

    def take(fmt: str):
        nonlocal at
        size = struct.calcsize("<" + fmt)
        if at + size > len(data):
            raise UsageError(f"{path}: not a CTranslate2 model.bin (it ends at byte {len(data)}, inside a record)")
        value = struct.unpack_from("<" + fmt, data, at)
        at += size
        return value[0] if len(value) == 1 else value

    def text() -> str:
        nonlocal at
        n = take("H")
        raw = data[at:at + n - 1]
        at += n
        return raw.decode("utf-8", errors="replace")

    version = take("I")
    if not 1 <= version <= 6:
        raise UsageError(f"{path}: not a CTranslate2 model.bin this reads (binary version {version}; 1 to 6 read)")
    spec = text() if version >= 2 else ""
    revision = take("I") if version >= 2 else 1
    variables: dict[str, np.ndarray] = {}
    for _ in range(take("I")):
        name = text()
        shape = [take("I") for _ in range(take("B"))]
        kind = take("B") if version >= 4 else 0
        size = take("I")
        if kind >= len(_TYPES) or at + size > len(data):
            raise UsageError(f"{path}: not a CTranslate2 model.bin (variable {name!r} is damaged)")
        raw = data[at:at + size]
        at += size
        if _TYPES[kind] == "bfloat16":
            value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            value = np.frombuffer(raw, _TYPES[kind])
        variables[name] = value.reshape(shape)
    if version >= 3:
        for _ in range(take("I")):
            alias, target = text(), text()
            variables[alias] = variables[target]
    return Bin(spec, revision, variables)


def load(folder: Path):
    """(a transformers WhisperForConditionalGeneration in float32, eval mode, its weights those of the
    CTranslate2 folder, its generation config the folder's token suppression, and where they came
    from); a UsageError for a folder of another kind of model."""
    found = read(folder / "model.bin")
    if found.spec != WHISPER:
        raise UsageError(f"--hf {folder}: a CTranslate2 {found.spec or 'model'} folder; attnexport reads "
                         f"CTranslate2's Whisper models ({WHISPER}) only")
    try:
        from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration
    except ImportError:
        raise UsageError("--hf needs transformers: pip install 'attnexport[hf]'") from None
    import torch
    ct2 = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    tokens = special_tokens(folder)
    config = whisper_config(found, tokens, WhisperConfig)
    state = whisper_state(found, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    if set(missing) - {"proj_out.weight"} or unexpected:
        raise UsageError(f"--hf {folder}: its variables do not fit Whisper (missing: {', '.join(sorted(missing)[:3])}; "
                         f"unexpected: {', '.join(unexpected[:3])})")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id,
        suppress_tokens=[int(t) for t in ct2.get("suppress_ids", [])],
        begin_suppress_tokens=[int(t) for t in ct2.get("suppress_ids_begin", [])],
        max_length=config.max_target_positions, **generation_fields(tokens, config.vocab_size))
    return model.eval(), "given: " + folder.name


def special_tokens(folder: Path) -> dict[str, int]:
    """The tokenizer's added tokens ({content: id}); a UsageError where the folder has no tokenizer.json."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"--hf {folder}: a Whisper model needs its tokenizer.json beside model.bin")
    return {t["content"]: int(t["id"]) for t in json.loads(path.read_text()).get("added_tokens", [])}


def generation_fields(tokens: dict[str, int], vocab: int) -> dict:
    """What Whisper's generation config tells transformers' and transformers.js' Whisper generation
    beside the token suppression: the no-timestamps token, whether the model is multilingual, its
    languages' and tasks' tokens (from which they build the start tokens)."""
    languages = {t: i for t, i in tokens.items() if t[:2] == "<|" and t[-2:] == "|>" and 2 <= len(t) - 4 <= 3
                 and t[2:-2].isalpha() and t[2:-2].islower()}
    fields: dict = {"forced_decoder_ids": None, "no_timestamps_token_id": tokens.get("<|notimestamps|>"),
                    "is_multilingual": multilingual(vocab), "max_initial_timestamp_index": 50}
    if multilingual(vocab):  # an English-only model's start has no language or task (given, they would be put in)
        fields.update(lang_to_id=languages, task_to_id={t: tokens[f"<|{t}|>"] for t in ("transcribe", "translate")
                                                        if f"<|{t}|>" in tokens})
    return fields


def multilingual(vocab: int) -> bool:
    """Whisper's multilingual models have 51865 tokens or more, the English-only ones 51864."""
    return vocab >= 51865


def start_tokens(tokens: dict[str, int], vocab: int) -> list[int]:
    """The decoder's first tokens for an English transcription without timestamps: the start of
    transcript, then (multilingual models) the language and the task, then no-timestamps."""
    names = ["<|startoftranscript|>", *(("<|en|>", "<|transcribe|>") if multilingual(vocab) else ()),
             "<|notimestamps|>"]
    missing = [n for n in names if n not in tokens]
    if missing:
        raise UsageError(f"its tokenizer.json has no {', '.join(missing)}: not a Whisper tokenizer")
    return [tokens[n] for n in names]


def _layers(found: Bin, side: str) -> int:
    n = 0
    while any(k.startswith(f"{side}/layer_{n}/") for k in found.variables):
        n += 1
    return n


def whisper_config(found: Bin, tokens: dict[str, int], config_class):
    """transformers' WhisperConfig of the sizes the variables have."""
    v = found.variables
    for name, want in (("decoder/scale_embeddings", 0), ("decoder/pre_norm", 1)):
        if name in v and found.scalar(name) != want:
            raise UsageError(f"a CTranslate2 Whisper model with {name} = {found.scalar(name)}: not Whisper's "
                             "architecture, which this reads")
    width = v["decoder/embeddings/weight"].shape[1]
    vocab = v["decoder/embeddings/weight"].shape[0]
    end = tokens.get("<|endoftext|>")
    if end is None or "<|startoftranscript|>" not in tokens:
        raise UsageError("its tokenizer.json has no <|endoftext|> or <|startoftranscript|>: not a Whisper tokenizer")
    return config_class(
        vocab_size=vocab, num_mel_bins=v["encoder/conv1/weight"].shape[1], d_model=width,
        encoder_layers=_layers(found, "encoder"), decoder_layers=_layers(found, "decoder"),
        encoder_attention_heads=found.scalar("encoder/num_heads"),
        decoder_attention_heads=found.scalar("decoder/num_heads"),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=tokens["<|startoftranscript|>"], eos_token_id=end, pad_token_id=end, bos_token_id=end,
        scale_embedding=False, activation_function="gelu", architectures=["WhisperForConditionalGeneration"],
        tie_word_embeddings=True, begin_suppress_tokens=None, suppress_tokens=None)


def whisper_parts(config) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """How CTranslate2's Whisper variables and transformers' parameters correspond: (kind, the
    CTranslate2 name, transformers' name, the projections stacked) each, where kind is `norm` (gamma
    and beta: a layer norm's weight and bias), `linear` (weight and bias), `stacked` (the rows of
    one CTranslate2 linear are several projections': a self-attention's linear_0 q, k and v, a
    cross-attention's linear_1 k and v; k has no bias) or `table` (a matrix as it is: the position
    encodings, the embeddings). The last linear of an attention is its output projection; a
    feed-forward's linear_0 and linear_1 are fc1 and fc2."""
    parts: list[tuple[str, str, str, tuple[str, ...]]] = []
    for side, count in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        base = f"model.{side}"
        parts += [("norm", f"{side}/layer_norm", f"{base}.layer_norm", ()),
                  ("table", f"{side}/position_encodings/encodings", f"{base}.embed_positions.weight", ())]
        for i in range(count):
            src, dst = f"{side}/layer_{i}", f"{base}.layers.{i}"
            parts += [("norm", f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm", ()),
                      ("stacked", f"{src}/self_attention/linear_0", f"{dst}.self_attn", ("q", "k", "v")),
                      ("linear", f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj", ())]
            if side == "decoder":
                parts += [("norm", f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm", ()),
                          ("linear", f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj", ()),
                          ("stacked", f"{src}/attention/linear_1", f"{dst}.encoder_attn", ("k", "v")),
                          ("linear", f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj", ())]
            parts += [("norm", f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm", ()),
                      ("linear", f"{src}/ffn/linear_0", f"{dst}.fc1", ()),
                      ("linear", f"{src}/ffn/linear_1", f"{dst}.fc2", ())]
    parts += [("linear", f"encoder/{conv}", f"model.encoder.{conv}", ()) for conv in ("conv1", "conv2")]
    parts.append(("table", "decoder/embeddings/weight", "model.decoder.embed_tokens.weight", ()))
    return parts


def whisper_state(found: Bin, config) -> dict[str, np.ndarray]:
    """transformers' state dict (float32) from the CTranslate2 variables (`whisper_parts`)."""
    m, width = found.matrix, config.d_model
    state: dict[str, np.ndarray] = {}
    for kind, src, dst, stacked in whisper_parts(config):
        if kind == "norm":
            state[dst + ".weight"], state[dst + ".bias"] = m(src + "/gamma"), m(src + "/beta")
        elif kind == "table":
            state[dst] = m(src)
        elif kind == "linear":
            state[dst + ".weight"], state[dst + ".bias"] = m(src + "/weight"), m(src + "/bias")
        else:
            for i, name in enumerate(stacked):
                rows = slice(i * width, (i + 1) * width)
                state[f"{dst}.{name}_proj.weight"] = m(src + "/weight")[rows]
                if name != "k":
                    state[f"{dst}.{name}_proj.bias"] = m(src + "/bias")[rows]
    return state


def whisper_variables(state: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """CTranslate2's variables (float32) of a transformers Whisper's state dict: `whisper_state`'s
    inverse (a stacked k's bias zeros), with the heads' counts."""
    out: dict[str, np.ndarray] = {}
    for kind, src, dst, stacked in whisper_parts(config):
        if kind == "norm":
            out[src + "/gamma"], out[src + "/beta"] = state[dst + ".weight"], state[dst + ".bias"]
        elif kind == "table":
            out[src] = state[dst]
        elif kind == "linear":
            out[src + "/weight"], out[src + "/bias"] = state[dst + ".weight"], state[dst + ".bias"]
        else:
            out[src + "/weight"] = np.concatenate([state[f"{dst}.{n}_proj.weight"] for n in stacked])
            out[src + "/bias"] = np.concatenate([state.get(f"{dst}.{n}_proj.bias", np.zeros(config.d_model, np.float32))
                                                 for n in stacked])
    out["encoder/num_heads"] = np.array(config.encoder_attention_heads, np.int16)
    out["decoder/num_heads"] = np.array(config.decoder_attention_heads, np.int16)
    return out
