"""Model families: what kind of whole model a config is, one class a family, registered in
`FAMILIES` by the task its exports record. A family says which configs it takes (and why it
refuses the others), the transformers class that builds them, the cache forms it exports, the
architectures the suite tests, the checks verify runs of it, and its generation loop. Nothing
outside these classes asks a family's name. Decoder-only language models and sentence encoders
and Whisper's encoder-decoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np

from attnexport.errors import UsageError
from attnexport.pretrained import embeddings as EM
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
    # What verify --hf checks of a float model of it beside its answers (`attnexport.pretrained.check`'s
    # row makers, by name), and what judges its answers: in fp32, and in a lossy precision.
    checks: ClassVar[tuple[str, ...]]
    answers: ClassVar[tuple[str, str]]
    # Whether its export and verify need the model's tokenizer (its checks embed real sentences).
    needs_tokenizer: ClassVar[bool] = False
    # Whether its models embed sentences (bench --hf times them so; else their decoding, with --decode).
    embeds: ClassVar[bool] = False
    # The clients that load its deployment folder (`attnexport.pretrained.clients`), and the check of them.
    clients: ClassVar[tuple[str, ...]]
    client_rows: ClassVar[str]
    # The ort flavour's fusions of an encoder's layers (`fusions.encoder`: the attention with the padding
    # mask, the skip layer norms, the bias GELU) beside those every family's steps get.
    fuses_encoder_layers: ClassVar[bool] = False
    # How `export --hf` exports it (`attnexport.pretrained.export`'s exporters, by name): one step graph,
    # or Whisper's graphs (`speech`).
    exporter: ClassVar[str] = "step"

    @property
    def default_form(self) -> str:
        """The form an export without --kv-cache makes."""
        return self.forms[0]

    def layout_fields(self, model, source) -> dict:
        """What this family's layout records beyond the sizes every family has (`model.layout_of`)."""
        return {}

    def deploy_files(self, source) -> list[str]:
        """The files of the folder `source` its deployment folder keeps beside the tokenizer's (paths
        relative to it)."""
        return []

    def finish_folder(self, folder: Path, source, layout) -> None:
        """What this family's deployment folder (being written in `folder`, its files copied from
        `source`) needs changed so that every client reads it alike."""

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
    checks = ("shapes", "decode")
    answers = ("generation", "accuracy")
    clients = ("optimum", "transformers.js")
    client_rows = "generating clients"

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


class Encoder(Family):
    """Sentence encoders (BERT and its kin): a sequence in, each token's state and the sentence's
    embedding out (pooled and normalised as its sentence-transformers config says), no cache."""

    task = "feature-extraction"
    what = "sentence encoder"
    architectures = ("BertModel", "RobertaModel", "XLMRobertaModel")
    auto_class = "AutoModel"
    gguf_mapping = "MODEL_MAPPING_NAMES"
    forms = ("embed",)
    tested = ("bert", "roberta")
    checks = ("shapes",)
    answers = ("embeddings", "embeddings")
    needs_tokenizer = True
    embeds = True
    clients = ("sentence-transformers", "optimum", "transformers.js")
    client_rows = "embedding clients"
    fuses_encoder_layers = True

    def form(self, name: str) -> FM.CacheForm:
        if name not in self.forms:
            raise UsageError(f"a {self.what} keeps no cache: --kv-cache and --max-seq go with causal language models")
        return FM.FORMS[name]

    def layout_fields(self, model, source) -> dict:
        """The position table's length (the longest sequence), whether it takes token_type_ids,
        and its pooling and normalisation (`embeddings.pooling_of`)."""
        config, embeddings = model.config, getattr(model, "embeddings", None)
        # RoBERTa's kin count positions from after the padding index (its `padding_idx`), BERT's from 0.
        first = getattr(embeddings, "padding_idx", -1) + 1 if embeddings is not None else 0
        pooling, normalize = EM.pooling_of(source)
        return {"max_seq": int(config.max_position_embeddings) - first,
                "token_types": int(getattr(config, "type_vocab_size", 0) or 0), "pooling": pooling,
                "normalize": normalize}

    def deploy_files(self, source) -> list[str]:
        """sentence-transformers' files (modules.json, its configs, each module's folder), which its
        loader and transformers.js' pipeline read for the pooling and normalisation."""
        folder = Path(source)
        if not folder.is_dir():
            return []
        found = [f for f in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
                 if (folder / f).is_file()]
        if "modules.json" in found:
            for module in json.loads((folder / "modules.json").read_text()):
                where = folder / module.get("path", "")
                if module.get("path") and where.is_dir():
                    found += sorted(str(p.relative_to(folder)) for p in where.rglob("*") if p.is_file())
        return found

    def finish_folder(self, folder: Path, source, layout) -> None:
        """One longest input in every file a client reads (`embeddings.max_length`: the model's own),
        and no fixed padding: tokenizer.json's truncation (a plain tokenizers loop, transformers.js'
        tokenizer), tokenizer_config.json's model_max_length (transformers' and Optimum's tokenizer,
        transformers.js' pipeline) and sentence_bert_config.json's max_seq_length (sentence-transformers)."""
        EM.state_max_length(folder, EM.max_length(source, layout.max_seq))

    def generate(self, run, layout, prompts, new_tokens, watch=None, dtype=np.float32):
        raise UsageError(f"a {self.what} generates no tokens")


class EncoderDecoder(Family):
    """Speech recognition with Whisper: an encoder over 30 s of log-mel features, a decoder whose
    cross-attention reads the encoder's output as a cache computed once, and whose self cache grows a
    token a step; three graphs (`attnexport.pretrained.whisper`), exported by `attnexport.pretrained.speech`."""

    task = "automatic-speech-recognition"
    what = "speech recognition model (Whisper)"
    architectures = ("WhisperForConditionalGeneration",)
    auto_class = "AutoModelForSpeechSeq2Seq"
    gguf_mapping = "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"
    forms = ("concat",)
    tested = ("whisper",)
    checks = ()
    answers = ("transcripts", "transcripts")
    clients = ("optimum", "transformers.js")
    client_rows = "transcribing clients"

    exporter = "speech"


# The families, by the task their exports record.
FAMILIES: dict[str, Family] = {f.task: f for f in (DecoderOnly(), Encoder(), EncoderDecoder())}


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
