"""A small random Whisper (transformers' WhisperForConditionalGeneration of a small config, seeded,
nothing downloaded) written as a CTranslate2 model folder, as faster-whisper's models come: model.bin
in CTranslate2's layout (float32, float16 or int8 with a scale a row), config.json with the token
suppression, and a tokenizer.json with Whisper's special tokens at their ids (its words: those of
attnexport's check text). `attnexport export --hf FOLDER --deploy OUT` reads it. What the suite exports.

    python examples/tiny_whisper.py tiny-whisper                 # English-only, 2+2 layers, width 64
    python examples/tiny_whisper.py tiny-whisper-ml --multilingual --dtype int8
"""

import argparse
import json
import re
import struct
from pathlib import Path

import numpy as np

TYPES = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}
LANGUAGES = ("en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr")


def special_tokens(multilingual: bool) -> dict[str, int]:
    """Whisper's special tokens at their ids: the end of text first, then the start of transcript,
    the languages (99 of them before large-v3 added a hundredth; named here by the first ten and
    placeholders), the tasks and the rest."""
    end = 50257 if multilingual else 50256
    tokens = {"<|endoftext|>": end, "<|startoftranscript|>": end + 1}
    for i in range(99):
        tokens[f"<|{LANGUAGES[i]}|>" if i < len(LANGUAGES) else f"<|lang{i}|>"] = end + 2 + i
    after = end + 101
    for i, name in enumerate(("translate", "transcribe", "startoflm", "startofprev", "nocaptions", "notimestamps")):
        tokens[f"<|{name}|>"] = after + i
    return tokens


def tokenizer_json(multilingual: bool) -> str:
    """A word-level tokenizer: the check text's words (a leading space each, as Whisper's byte-level
    tokens carry it), filler tokens to the special ones, the special tokens as added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from attnexport.pretrained.whisper import export as speech
    words = sorted(set(re.findall(r"\w+|[^\w\s]", speech.CHECK_TEXT)))
    special = special_tokens(multilingual)
    vocab = {f"<|filler{i}|>": i for i in range(min(special.values()))}
    for i, w in enumerate(words):
        del vocab[f"<|filler{i + 1}|>"]
        vocab[w] = i + 1
    vocab.update(special)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|filler0|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(special))
    return tokenizer.to_str()


def model(multilingual: bool = False, layers: int = 2, width: int = 64, heads: int = 4, mels: int = 80, seed: int = 0):
    """transformers' Whisper of a small config, its parameters drawn from `seed`."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    special = special_tokens(multilingual)
    vocab = max(special.values()) + 1 + (1501 if multilingual else 1500)  # the timestamp tokens after them
    config = WhisperConfig(vocab_size=vocab, num_mel_bins=mels, d_model=width, encoder_layers=layers,
                           decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                           encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width, max_source_positions=1500,
                           max_target_positions=64, decoder_start_token_id=special["<|startoftranscript|>"],
                           eos_token_id=special["<|endoftext|>"], pad_token_id=special["<|endoftext|>"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = WhisperForConditionalGeneration(config).eval()
        for p in built.parameters():  # a trained model's scale: the random init's biases are zeros
            p.data.add_(0.02 * torch.randn_like(p))
    return built


def variables(built) -> dict[str, np.ndarray]:
    """CTranslate2's WhisperSpec variables of a transformers Whisper (`ctranslate2.whisper_variables`),
    with the flags and sizes CTranslate2's converter writes beside them (activation 3: its GELU)."""
    from attnexport.pretrained.whisper import ctranslate2 as ctranslate2
    state = {k: v.detach().float().numpy() for k, v in built.state_dict().items()}
    out = ctranslate2.whisper_variables(state, built.config)
    out.update({"decoder/scale_embeddings": np.array(0, np.int8), "decoder/pre_norm": np.array(1, np.int8),
                "decoder/activation": np.array(3, np.int8), "decoder/alibi": np.array(0, np.int8),
                "decoder/alignment_heads": np.array(1, np.int16), "decoder/alignment_layer": np.array(-1, np.int16),
                "decoder/start_from_zero_embedding": np.array(0, np.int8)})
    return out


def quantized(values: dict, dtype: str) -> dict:
    """Each weight matrix (and convolution) in `dtype`: float16 as it is, int8 with a float32 scale a
    row (127 over the row's largest magnitude: CTranslate2's); the rest float32."""
    out = {}
    for name, v in values.items():
        if v.dtype != np.float32 or not name.endswith("/weight") or v.ndim < 2 or dtype == "float32":
            out[name] = v
        elif dtype == "float16":
            out[name] = v.astype(np.float16)
        else:
            rows = v.reshape(v.shape[0], -1)
            scale = (127.0 / np.maximum(np.abs(rows).max(axis=1), 1e-12)).astype(np.float32)
            out[name] = np.round(rows * scale[:, None]).astype(np.int8).reshape(v.shape)
            out[name + "_scale"] = scale
    return out


def write_bin(path: Path, values: dict, spec: str = "WhisperSpec", aliases=(("decoder/projection/weight",
                                                                             "decoder/embeddings/weight"),)) -> None:
    """model.bin in CTranslate2's layout (binary version 6)."""
    def text(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<H", len(raw) + 1) + raw + b"\0"
    parts = [struct.pack("<I", 6), text(spec), struct.pack("<I", 3), struct.pack("<I", len(values))]
    for name, v in values.items():
        v = np.asarray(v, order="C")  # a scalar stays of rank 0
        parts += [text(name), struct.pack("<B", v.ndim), *[struct.pack("<I", d) for d in v.shape],
                  struct.pack("<B", TYPES[v.dtype.name]), struct.pack("<I", v.nbytes), v.tobytes()]
    parts.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases:
        parts += [text(alias), text(target)]
    path.write_bytes(b"".join(parts))


def save(folder, multilingual: bool = False, dtype: str = "float32", **sizes) -> None:
    """The CTranslate2 folder: model.bin, config.json (token suppression as CTranslate2's converter
    writes it), tokenizer.json, vocabulary.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    built = model(multilingual, **sizes)
    write_bin(folder / "model.bin", quantized(variables(built), dtype))
    special = special_tokens(multilingual)
    config = {"suppress_ids": [1, 2, special["<|translate|>"], special["<|transcribe|>"]],
              "suppress_ids_begin": [special["<|endoftext|>"]], "lang_ids": [], "alignment_heads": []}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = tokenizer_json(multilingual)
    (folder / "tokenizer.json").write_text(tokenizer)
    # CTranslate2's own vocabulary file (its converter writes one): the tokens by id
    vocab = json.loads(tokenizer)["model"]["vocab"]
    words = [""] * built.config.vocab_size
    for word, i in vocab.items():
        words[i] = word
    for i in range(len(vocab), len(words)):  # the timestamp tokens
        words[i] = f"<|{(i - len(vocab)) * 0.02:.2f}|>"
    (folder / "vocabulary.json").write_text(json.dumps(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--multilingual", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "float16", "int8"), default="float32")
    a = parser.parse_args()
    save(a.folder, a.multilingual, a.dtype)


if __name__ == "__main__":
    main()
