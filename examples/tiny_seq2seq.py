"""Small text encoder-decoders from transformers' configs (random weights drawn from a seed, nothing
downloaded), saved as a trained model's folder is: the config, the weights (model.safetensors), the
generation config and a tokenizer (tokenizer.json, a Unigram model as T5's and Marian's
sentencepiece ones are, whose pieces are the words of attnexport's check texts and their letters):
T5 (relative position bias, RMS norms, gated GELU, tied head) and Marian (sinusoidal positions,
post-norm layers, padding never generated, the end token forced at the last position). What the
suite exports.

    python examples/tiny_seq2seq.py t5 tiny-t5          # 2 layers each side, d_model 32, 4 heads
    python examples/tiny_seq2seq.py marian tiny-marian
"""

import argparse
import json
import re
from pathlib import Path

ARCHITECTURES = ("t5", "marian")
SPECIAL = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: T5's order


def pieces() -> list[str]:
    """The tokenizer's pieces after the special ones: each word of the check texts with its leading
    space (sentencepiece's "▁"), then every letter and mark alone (any other text still encodes)."""
    from attnexport.pretrained.seq2seq import texts
    words = sorted({w for text in texts.TEXTS for w in re.findall(r"\w+|[^\w\s]", text)})
    letters = sorted({c for text in texts.TEXTS for c in text if not c.isspace()} | set("abcdefghijklmnopqrstuvwxyz"))
    return [*(f"\u2581{w}" for w in words), "\u2581", *letters]


def tokenizer():
    """A Unigram tokenizer over `pieces()` (longer pieces scored higher), appending </s> as T5's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = [(t, 0.0) for t in SPECIAL] + [(p, -1.0 / len(p)) for p in pieces()]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return tok


def config(arch: str, layers: int = 2, d_model: int = 32, heads: int = 4):
    """The config of a small `arch` model over the tokenizer's vocabulary."""
    import transformers as T
    vocab = len(SPECIAL) + len(pieces())
    if arch == "t5":
        return T.T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads, d_ff=d_model * 2, num_layers=layers,
                          num_decoder_layers=layers, num_heads=heads, relative_attention_num_buckets=8,
                          relative_attention_max_distance=16, feed_forward_proj="gated-gelu", pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=True,
                          architectures=["T5ForConditionalGeneration"])
    return T.MarianConfig(vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                          encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=d_model * 2,
                          decoder_ffn_dim=d_model * 2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, scale_embedding=True,
                          architectures=["MarianMTModel"])


def save(arch: str, folder, seed: int = 0, **sizes) -> None:
    """The model's config and weights (drawn with torch seeded with `seed`), its generation config
    (Marian's: padding never generated, the end token forced last), and its tokenizer."""
    import torch
    import transformers as T
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T.AutoModelForSeq2SeqLM.from_config(config(arch, **sizes), dtype=torch.float32)
    if arch == "marian":
        model.generation_config.bad_words_ids = [[0]]
        model.generation_config.forced_eos_token_id = 1
    model.save_pretrained(str(folder))
    tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"],
         "pad_token": "<pad>", "eos_token": "</s>",
         "unk_token": "<unk>", "model_max_length": 64}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("folder")
    for flag, default in (("layers", 2), ("d-model", 32), ("heads", 4), ("seed", 0)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    a = parser.parse_args()
    save(a.arch, a.folder, seed=a.seed, layers=a.layers, d_model=a.d_model, heads=a.heads)
    print(f"wrote {a.folder} ({a.arch}, {a.layers} layers each side, d_model {a.d_model}, {a.heads} heads)")
