"""Model families: what kind of whole model a config is, one class a family, registered in
`FAMILIES` by the task its exports record. A family says which configs it takes (and why it
refuses the others), the transformers class that builds them, the cache forms it exports, the
architectures the suite tests, and its generation loop. Nothing outside these classes asks a
family's name. Decoder-only language models now; encoders and encoder-decoders are families to
come.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from attnexport.errors import UsageError
from attnexport.pretrained import forms as FM


class Family:
    """One family. Subclasses set the class attributes and override what differs."""

    # The task an export records (its step signature's `model`) and verify's rows name.
    task: ClassVar[str]
    # What `--hf` calls a model of it in a refusal.
    what: ClassVar[str]
    # The endings of the architectures (config.architectures) it takes.
    architectures: ClassVar[tuple[str, ...]]
    # transformers' auto class that builds it, and the mapping that names a GGUF file's architecture.
    auto_class: ClassVar[str]
    gguf_mapping: ClassVar[str]
    # The cache forms it exports (`forms.FORMS`' names) and the model types the suite tests.
    forms: ClassVar[tuple[str, ...]]
    tested: ClassVar[tuple[str, ...]]

    def accepts(self, config) -> bool:
        return any(a.endswith(self.architectures) for a in getattr(config, "architectures", None) or [])

    def built(self, model) -> bool:
        """Whether `model` (a transformers model) is one of this family's."""
        return type(model).__name__.endswith(self.architectures)

    def refusal(self) -> str:
        """What a model of it is, in a refusal of a model that is not one."""
        return (f"not a {self.what} (task {self.task}: architectures ending in {' or '.join(self.architectures)}, "
                f"tested: {', '.join(self.tested)}")

    def form(self, name: str) -> FM.CacheForm:
        """The cache form `name` of this family; a UsageError naming its forms otherwise."""
        return FM.form(name, self.forms)

    def generate(self, run, layout, prompts, new_tokens: int, watch: np.ndarray | None = None, dtype=np.float32):
        """Greedy decoding of `new_tokens` tokens after each prompt with the step graph of `layout`
        (`run(feed) -> {output name: array}`, any runtime); returns (tokens (B, N), each step's
        logits (B, V), the feed of the first step whose token departs from `watch` or None)."""
        raise NotImplementedError


class DecoderOnly(Family):
    """Causal language models: a step of tokens after a cache of earlier ones, greedy generation
    the loop an app writes."""

    task = "causal-lm"
    what = "causal language model"
    architectures = ("ForCausalLM", "LMHeadModel")
    auto_class = "AutoModelForCausalLM"
    gguf_mapping = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    forms = ("none", "concat", "static")
    tested = ("llama", "mistral", "qwen2", "phi3", "gpt2", "gemma2")

    def generate(self, run, layout, prompts, new_tokens, watch=None, dtype=np.float32):
        """none: the whole sequence each step; concat: prompts left-padded with the mask and
        position ids, then one token a step with the presents as the next pasts; static: prompts
        right-padded into empty buffers at write_pos 0, each sequence's next write_pos its own
        length, then one token a step at write_pos (the form's `decoding`)."""
        batch = len(prompts)
        decoding = layout.cache_form.decoding(layout, prompts, new_tokens, dtype)
        tokens, logits, diverged = [], [], None
        for step in range(new_tokens):
            out = run(decoding.feed)
            step_logits = np.asarray(out["logits"])[np.arange(batch), decoding.last]
            token = step_logits.argmax(axis=-1).astype(np.int64)
            if watch is not None and diverged is None and (token != watch[:, step]).any():
                diverged = decoding.feed
            tokens.append(token)
            logits.append(step_logits)
            decoding.advance(token, out)
        return np.stack(tokens, axis=1), logits, diverged


# The families, by the task their exports record.
FAMILIES: dict[str, Family] = {f.task: f for f in (DecoderOnly(),)}


def of_config(config, source) -> Family:
    """The family that takes `config` (the first in FAMILIES); a UsageError saying what each
    family takes otherwise."""
    for family in FAMILIES.values():
        if family.accepts(config):
            return family
    archs = list(getattr(config, "architectures", None) or [])
    found = ", ".join(archs) or f"none ({config.model_type})"
    raise UsageError(f"--hf {source}: " + ") or ".join(f.refusal() for f in FAMILIES.values())
                     + f"; its config lists {found})")


def of_model(model) -> Family:
    """The family of a transformers model (by its class, else its config)."""
    for family in FAMILIES.values():
        if family.built(model):
            return family
    return of_config(model.config, type(model).__name__)


def of_task(task: str) -> Family:
    """The family whose exports record `task`; a UsageError otherwise."""
    if task not in FAMILIES:
        raise UsageError(f"the model's task {task!r} is not one attnexport exports ({', '.join(FAMILIES)})")
    return FAMILIES[task]


def tested() -> tuple[str, ...]:
    """Every family's tested model types."""
    return tuple(t for f in FAMILIES.values() for t in f.tested)
