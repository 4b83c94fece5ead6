"""Small causal language models from transformers' configs (random weights drawn from a seed,
nothing downloaded), saved as `save_pretrained` folders (config.json and model.safetensors), as a
trained model's folder is. What the suite and the benchmarks export.

    python examples/tiny_lms.py llama tiny-llama            # 2 layers, hidden 64
    python examples/tiny_lms.py llama bench-llama --layers 4 --hidden 512 --heads 8 --kv-heads 2 --vocab 32000
"""

import argparse

ARCHITECTURES = ("llama", "mistral", "qwen2", "phi3", "gpt2", "gemma2", "gemma3")


def config(arch: str, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 1000,
           positions: int = 8192, window: int = 4):
    """The config of a small `arch` model; token ids 0 (padding), 1 (begin) and 2 (end). Gemma2's
    layers alternate a sliding window of `window` positions with full attention, and cap their
    scores and logits (softcap 50 and 30, its defaults). Gemma 3's (its text model) has six layers
    at least, the sixth global, each head twice the width hidden / heads, as Gemma-3-270M's."""
    import transformers as T
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if arch == "gpt2":  # no grouped heads; learned absolute positions
        return T.GPT2Config(n_embd=hidden, n_head=heads, n_layer=layers, n_positions=positions, vocab_size=vocab,
                            architectures=["GPT2LMHeadModel"], **ids)
    if arch == "gemma2":
        return T.Gemma2Config(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, head_dim=hidden // heads, num_hidden_layers=layers,
                              vocab_size=vocab, max_position_embeddings=positions, sliding_window=window,
                              architectures=["Gemma2ForCausalLM"], **ids)
    if arch == "gemma3":  # five sliding-window layers to each global one, q/k norms, one key/value head
        return T.Gemma3TextConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
                                  num_key_value_heads=1, head_dim=hidden // heads * 2, num_hidden_layers=max(layers, 6),
                                  vocab_size=vocab, max_position_embeddings=positions, sliding_window=window,
                                  query_pre_attn_scalar=hidden // heads * 2, architectures=["Gemma3ForCausalLM"], **ids)
    classes = {"llama": (T.LlamaConfig, "LlamaForCausalLM"), "mistral": (T.MistralConfig, "MistralForCausalLM"),
               "qwen2": (T.Qwen2Config, "Qwen2ForCausalLM"), "phi3": (T.Phi3Config, "Phi3ForCausalLM")}
    cls, name = classes[arch]
    extra = {"sliding_window": None} if arch == "mistral" else {}  # every position attended, as the others
    return cls(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
               num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab,
               max_position_embeddings=positions, architectures=[name], **ids, **extra)


def save(arch: str, folder, seed: int = 0, **sizes) -> None:
    """The `arch` model's folder: its config and its weights, drawn with torch seeded with `seed`."""
    save_config(config(arch, **sizes), folder, seed)


def save_config(c, folder, seed: int = 0) -> None:
    """The folder of a model of config `c`, its weights drawn with torch seeded with `seed`."""
    import torch
    import transformers as T
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T.AutoModelForCausalLM.from_config(c, dtype=torch.float32)
    model.save_pretrained(str(folder))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("folder")
    for flag, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("kv-heads", 2), ("vocab", 1000),
                          ("window", 4), ("seed", 0)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    a = parser.parse_args()
    save(a.arch, a.folder, seed=a.seed, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
         vocab=a.vocab, window=a.window)
    print(f"wrote {a.folder}/config.json and model.safetensors ({a.arch}, {a.layers} layers, hidden {a.hidden}, "
          f"vocab {a.vocab}, weights drawn from seed {a.seed})")
