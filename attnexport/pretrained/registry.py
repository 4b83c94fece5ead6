"""The model families and how one is found: a family is a package under `attnexport.pretrained`
that registers one `Family` when it is imported, and `PACKAGES` is the list of them (adding a
family is a package and a line there). A source (a folder, a GGUF file, a model id) or an exported
folder or file is recognized from what it says of itself: a transformers config's architectures,
a CTranslate2 folder's spec, a GGUF file's architecture, an export's record (its step signature's
task). Nothing here, nor anywhere outside a family's package, names a family.

The `Family` base says what every family has (the task its exports record, what `--hf` calls a
model of it, the architectures it takes, transformers' class that builds them, its forms, its
precisions, its clients, its budget) and the hooks the core calls: load a source it reads itself,
export, verify, bench. Each hook is a method a family overrides where it differs; the base's are
those of a family whose model is one step graph (`attnexport.pretrained.export`,
`attnexport.pretrained.check`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, ClassVar

from attnexport.errors import UsageError
from attnexport.pretrained import forms as FM

# The family packages, in the order a config is offered to them (the first that takes it has it).
PACKAGES = ("causal", "encoders", "whisper", "vision", "seq2seq")
# The task of exports made before a step signature recorded one: the first family's, the one there was.
FIRST_TASK = "causal-lm"

# The families registered, by the task their exports record.
FAMILIES: dict[str, Family] = {}


class Family:
    """One family. Subclasses set the class attributes and override the hooks that differ."""

    # The task an export records (its step signature's `model`) and verify's rows name.
    task: ClassVar[str]
    # What `--hf` calls a model of it in a refusal.
    what: ClassVar[str]
    # The endings of the architectures (config.architectures) it takes.
    architectures: ClassVar[tuple[str, ...]]
    # transformers' auto class that builds it, and the mapping that names a GGUF file's architecture.
    auto_class: ClassVar[str] = "AutoModel"
    gguf_mapping: ClassVar[str] = "MODEL_MAPPING_NAMES"
    # The cache forms it exports (`forms.FORMS`' names; the first is an export's default) and the model
    # types the suite tests.
    forms: ClassVar[tuple[str, ...]] = ()
    tested: ClassVar[tuple[str, ...]] = ()
    # The precisions `--precision` takes for it (`precision.TABLE`'s names).
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "fp16", "int8", "int4", "q4f16")
    # Whether its export and verify need the model's tokenizer (its checks read real text).
    needs_tokenizer: ClassVar[bool] = False
    # The clients that load its deployment folder (`attnexport.pretrained.clients`).
    clients: ClassVar[tuple[str, ...]] = ()
    # Whether a float export's verify computes every row's torch expectations first and lets the
    # source model go before ONNX Runtime maps the file (`check.verify_step`): the model and the
    # file's weights are never resident together. Its rows take torch's side from `Context.expect`.
    expects_first: ClassVar[bool] = False
    # The ort flavour's fusions of an encoder's layers (`fusions.encoder`) beside every family's.
    fuses_encoder_layers: ClassVar[bool] = False
    # Optimum's exporter task for the same model (bench's anchor), or "" where Optimum has none.
    optimum_task: ClassVar[str] = ""
    # What a source folder of its own (`reads`) is, in a refusal ("" where it reads none).
    own_source: ClassVar[str] = ""
    # How `--precision int8` runs its matrices unless `--int8-kernel` says (`precision.KERNELS`).
    int8_kernel: ClassVar[str] = "blockwise"

    # --- what a family is ---------------------------------------------------------------------

    @property
    def default_form(self) -> str:
        """The form an export without --kv-cache makes."""
        return self.forms[0]

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

    def module(self, name: str):
        """This family's module `name` (imported when first asked for: most import torch): its
        package's, or (a family made from another's class) the first of its classes' packages that
        has one."""
        for cls in type(self).__mro__:
            if cls is Family:
                break
            try:
                return importlib.import_module(f"{cls.__module__}.{name}")
            except ModuleNotFoundError as e:
                if e.name not in (f"{cls.__module__}.{name}", cls.__module__):
                    raise
        raise ModuleNotFoundError(f"the {self.task} family has no module {name!r}")

    # --- sources --------------------------------------------------------------------------------

    def reads(self, path: Path) -> bool:
        """Whether `path` is a source folder this family reads itself, not through a transformers
        config (a CTranslate2 Whisper folder)."""
        return False

    def load(self, path: Path):
        """(model, where its parameters came from) of a source folder this family `reads`."""
        raise NotImplementedError(f"{self.task} reads no folder of its own")

    def layout_fields(self, model, source) -> dict:
        """What this family's layout records beyond the sizes every step graph has (`model.layout_of`)."""
        return {}

    def deploy_files(self, source) -> list[str]:
        """The files of the folder `source` its deployment folder keeps beside the tokenizer's (paths
        relative to it)."""
        return []

    def finish_folder(self, folder: Path, source, layout) -> None:
        """What this family's deployment folder (being written in `folder`, its files copied from
        `source`) needs changed so that every client reads it alike."""

    # --- what the core calls --------------------------------------------------------------------

    def export(self, request, model, params_source: str) -> Any:
        """`export --hf` of a model of this family: one step graph by default."""
        exporter = importlib.import_module("attnexport.pretrained.export")
        return exporter.export_hf(request, (model, params_source))[0]

    def exported(self, path: Path) -> bool:
        """Whether `path` (a folder or a file verify was given) is this family's export, read from
        its files' records and configs, never from their names alone (False by default: an export of
        one step graph is found by its signature's task)."""
        return False

    def verify(self, check) -> Any:
        """`verify MODEL --hf SOURCE` of an export of this family (`check`: the request)."""
        verifier = importlib.import_module("attnexport.pretrained.check")
        return verifier.verify_step(check)

    # The options of verify this family's checks take beyond every family's (`audio`).
    verify_options: ClassVar[tuple[str, ...]] = ()

    def verify_inputs(self, tokenizer, layout) -> Any:
        """What a step graph's verify rows of this family read (a language model's prompts), kept
        in the rows' context."""
        return None

    def verify_needs(self, layout, inputs, new_tokens: int, tokenizer) -> list[tuple[int, str]]:
        """(positions, what needs them) of each of verify's checks: the step must hold them."""
        return [(max(past + block for _, _, block, past, _ in layout.cache_form.verify_checks),
                 "verify --hf checks steps")]

    def check_feed(self, reference, tokenizer, batch: int, block: int, past: int, padded: int, seed: int) -> dict:
        """The feed of one checked step of this family's form: text tokens (windows of the checks'
        passage where the model has a tokenizer) over a cache the model wrote from their prefix."""
        checks = importlib.import_module("attnexport.pretrained.reference")
        ids = checks.token_rows(tokenizer, reference.layout.vocab, batch, past + block, seed)
        return checks.prefilled_feed(reference, ids, past, padded)

    def float_rows(self, ctx) -> None:
        """The rows of a float export beyond its shapes (`check.shape_rows`)."""

    def answer_rows(self, ctx, lossy: bool) -> None:
        """The rows that judge its answers: as its users do (`lossy`: by its budget)."""

    def client_rows(self, ctx) -> None:
        """The rows of its clients loading the deployment folder."""

    def calibration(self, layout, tokenizer):
        """The integer int8 form's calibration (`calibrate.choose`): (the step's feeds of text the
        family owns, never the text verify judges; cost(want, got): its measure of the step's
        outputs, a list of {output: array} a feed each, against the model's own; the whole graph's
        cost to stay under), or None where the family has none (each matrix quantized as it is)."""
        return None

    def budget(self, text: str | None):
        """The budget of a lossy export of this family, with `--budget KEY=VALUE,...` applied (a key
        that is not one of its limits refused in one line)."""
        if text:
            raise UsageError(f"a {self.what}'s export is judged by no accuracy budget: --budget does not apply")
        return None

    def bench(self, source, told, said) -> tuple[list, dict]:
        """`bench --hf SOURCE`: (rows, the run's info) of this family's engines; `told` is the
        command line's options (`bench.run`), refused in one line where this family takes them not."""
        raise UsageError(f"bench --hf times no {self.what}")

    def bench_lines(self, rows, info: dict, title: str) -> list[str]:
        """What bench prints of this family's rows."""
        return [str(row) for row in rows]

    def bench_json(self, rows, info: dict) -> dict:
        """`bench --json` of this family's rows (each its `to_dict()` where it has one: `bench.Row`)."""
        from dataclasses import asdict
        return {"rows": [row.to_dict() if hasattr(row, "to_dict") else asdict(row) for row in rows], "info": info}


def lazy(package: str):
    """A family package's `__getattr__`: its module `name` imported when first read from it (most
    import torch and transformers), so that importing the package (registering the family) is light."""
    def __getattr__(name: str):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":  # the module exists; something it imports does not
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


def tested() -> tuple[str, ...]:
    """Every family's tested model types."""
    return tuple(t for f in families().values() for t in f.tested)


def register(family: Family) -> Family:
    """Puts `family` in FAMILIES (a family package calls it as it is imported)."""
    FAMILIES[family.task] = family
    return family


def families() -> dict[str, Family]:
    """Every family, each package of PACKAGES imported once (its Family registered), in the order of
    PACKAGES whatever order they were imported in; a family registered from elsewhere (a user's, a
    test's) before them, in the order registered, so that it takes a config before the built-in ones."""
    for name in PACKAGES:
        importlib.import_module(f"{__package__}.{name}")
    rank = {f"{__package__}.{name}": i for i, name in enumerate(PACKAGES)}

    def place(family: Family) -> int:
        return next((i for module, i in rank.items() if type(family).__module__.startswith(module)), -1)
    return dict(sorted(FAMILIES.items(), key=lambda item: place(item[1])))


def of_config(config, source) -> Family:
    """The family that takes `config` (the first in FAMILIES); a UsageError saying what each
    family takes otherwise."""
    for family in families().values():
        if family.accepts(config):
            return family
    archs = list(getattr(config, "architectures", None) or [])
    found = ", ".join(archs) or f"none ({getattr(config, 'model_type', '') or 'no model type'})"
    raise UsageError(f"--hf {source}: " + ") or ".join(f.refusal() for f in families().values())
                     + f"; its config lists {found})")


def of_model(model) -> Family:
    """The family of a transformers model (by its class, else its config)."""
    for family in families().values():
        if family.built(model):
            return family
    return of_config(model.config, type(model).__name__)


def of_task(task: str) -> Family:
    """The family whose exports record `task`; a UsageError otherwise."""
    found = families()
    if task not in found:
        raise UsageError(f"the model's task {task!r} is not one attnexport exports ({', '.join(found)})")
    return found[task]


def form(name: str):
    """The form `name` of any family (its packages imported); a UsageError naming the forms otherwise."""
    families()
    return FM.form(name)


def own_sources() -> str:
    """The source folders families read themselves, said in a refusal."""
    return ", ".join(f.own_source for f in families().values() if f.own_source) or "none of a family's own"


def reading(path: Path) -> Family | None:
    """The family that reads the source folder `path` itself (`Family.reads`), or None."""
    return next((f for f in families().values() if f.reads(path)), None)


class _Config:
    """A config.json as the families read it: its architectures and model type."""

    def __init__(self, data: dict):
        self.architectures = list(data.get("architectures") or [])
        self.model_type = str(data.get("model_type") or "")


def config_of(folder: Path) -> _Config | None:
    """A folder's config.json (its architectures and model type), or None where it has none."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        return _Config(json.loads(path.read_text()))
    except (ValueError, OSError):
        return None


def of_source(source) -> Family:
    """The family of a source `--hf` names, from what it says of itself without building the model:
    a folder this family reads itself, a config.json's architectures, a GGUF file's architecture
    (read by the gguf package), or a model id's config in the Hugging Face cache."""
    path = Path(str(source))
    reader = reading(path) if path.is_dir() else None
    if reader is not None:
        return reader
    config = config_of(path) if path.is_dir() else None
    if config is not None:
        return of_config(config, source)
    loading = importlib.import_module("attnexport.pretrained.model")
    return of_config(loading.config_of(source), source)


def of_export(path) -> Family:
    """The family whose export `path` is (a folder or a file verify was given): the family that
    recognizes the folder (`Family.exported`), else the task a step graph's signature records."""
    where = Path(str(path))
    for family in families().values():
        if family.exported(where):
            return family
    checking = importlib.import_module("attnexport.pretrained.check")
    return checking.family_of_file(where)
