"""Small sentence encoders from transformers' configs (random weights drawn from a seed, nothing
downloaded), saved as a sentence-transformers folder holding a config, the weights
(model.safetensors), a WordPiece tokenizer whose vocabulary is the words of attnexport's check
sentences, and the pooling modules, as a trained encoder's folder is. What the suite exports.

    python examples/tiny_encoders.py bert tiny-bert                     # 2 layers, hidden 64, mean, normalised
    python examples/tiny_encoders.py roberta tiny-roberta --pooling cls --no-normalize
"""

import argparse
import json
import re
from pathlib import Path

ARCHITECTURES = ("bert", "roberta")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def config(arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 0, positions: int = 128):
    """The config of a small `arch` encoder (`vocab` 0: the tokenizer's)."""
    import transformers as T
    sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": layers,
             "intermediate_size": hidden * 4, "vocab_size": vocab or len(words()) + len(SPECIAL)}
    if arch == "roberta":  # positions counted from after the padding index, one token type
        return T.RobertaConfig(max_position_embeddings=positions + 2, type_vocab_size=1, pad_token_id=0,
                               architectures=["RobertaModel"], **sizes)
    return T.BertConfig(max_position_embeddings=positions, type_vocab_size=2, pad_token_id=0,
                        architectures=["BertModel"], **sizes)


def words() -> list[str]:
    """The lower-cased words and marks of the sentences attnexport's checks embed."""
    from attnexport.pretrained.encoders import measures as embeddings
    found = {w for text in embeddings.sentences() for w in re.findall(r"\w+|[^\w\s]", text.lower())}
    return sorted(found)


def save(arch: str, folder, pooling: str = "mean", normalize: bool = True, seed: int = 0, **sizes) -> None:
    """The encoder's config and weights (drawn with torch seeded with `seed`), its tokenizer, and
    sentence-transformers' modules.json with the pooling (and a Normalize module where `normalize`)."""
    import torch
    from transformers import AutoModel, BertTokenizerFast
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModel.from_config(config(arch, **sizes), dtype=torch.float32)
    model.save_pretrained(str(folder))
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join([*SPECIAL, *words()]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True).save_pretrained(str(folder))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": pooling == "max"}
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": sizes.get("hidden", 64), **modes}, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("folder")
    for flag, default in (("layers", 2), ("hidden", 64), ("heads", 4)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--pooling", choices=("mean", "cls", "max"), default="mean")
    parser.add_argument("--no-normalize", dest="normalize", action="store_false")
    a = parser.parse_args()
    save(a.arch, a.folder, a.pooling, a.normalize, layers=a.layers, hidden=a.hidden, heads=a.heads)
    print(f"wrote {a.folder} ({a.arch}, {a.layers} layers, hidden {a.hidden}, {a.pooling} pooling"
          f"{', normalised' if a.normalize else ''})")
