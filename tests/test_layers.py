"""The package's shape: its modules import one another without a cycle, and none reads another's
private names (a name with a leading underscore is its own module's business)."""

import ast
import functools
import sys
from pathlib import Path

import attnexport

PACKAGE = Path(attnexport.__file__).parent


@functools.cache
def _imports() -> dict[str, dict[str, set[str]]]:
    """{module: {attnexport module it imports (at the top or inside a function): names used}}."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        edges, aliases = {}, {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnexport"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    where = PACKAGE.parent / sub.replace(".", "/")
                    if where.with_suffix(".py").exists() or (where / "__init__.py").exists():  # a module or a package
                        edges.setdefault(sub, set())
                        aliases[a.asname or a.name] = sub
                    else:
                        edges.setdefault(node.module, set()).add(a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("attnexport"):
                        edges.setdefault(a.name, set())
        for node in ast.walk(tree):  # names read through a module alias: E._quiet
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                edges[aliases[node.value.id]].add(node.attr)
        for target, names in list(edges.items()):  # a package's module read from it: `pretrained.bench`
            where = PACKAGE.parent / target.replace(".", "/")
            for n in names:
                if (where / f"{n}.py").exists() or (where / n / "__init__.py").exists():
                    edges.setdefault(f"{target}.{n}", set())
        graph[name] = {k: v for k, v in edges.items() if k != name}
    return graph


def test_no_module_reads_another_modules_private_names():
    private = [f"{m} uses {target}.{n}" for m, edges in _imports().items() for target, names in edges.items()
               for n in names if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_the_imports_have_no_cycle():
    graph = {m: {t for t in edges if t in _imports() and t != "attnexport"} for m, edges in _imports().items()}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state and m != "attnexport":
            visit(m, [m])
    assert cycles == []


def test_the_check_sees_lazy_imports():
    edges = _imports()["attnexport.commands"]
    assert "attnexport.pretrained.bench" in edges  # read from the package when a command runs
    assert "attnexport.models.core" in _imports()["attnexport.modules"]
    assert "attnexport.onnx_attention" in _imports()["attnexport.export"]  # imported inside a function


# Modules whose tests live in a file named for their job rather than for them.
TESTED_ELSEWHERE = {
    "__init__": "the package's two shortcuts, used by test_modules.py",
    "__main__": "`python -m attnexport`: test_cli.py",
    "errors": "the error types, raised and read by every test",
    "semantics": "the operator's enumerations and Core: test_onnx_attention.py, test_sdpa_operator.py",
    "core": "models/core.py, the attention core: test_sdpa_operator.py, test_oracles.py",
    "additive": "models/: every variant's module against the reference in test_models.py",
    "dot_product": "models/: test_models.py", "kernel": "models/: test_models.py",
    "multi_head": "models/: test_models.py", "transformer": "models/: test_models.py",
    "js": "runtimes/js.py: test_js_runtimes.py", "ort": "runtimes/ort.py: test_runtimes.py, test_placement.py",
    "pytorch": "runtimes/pytorch.py: test_runtimes.py",
    "base": "runtimes/base.py, the registry and what the adapters share: test_runtimes.py",
    "request": "verify/: test_verify.py", "run": "verify/: test_verify.py", "execute": "verify/: test_verify.py",
    "golden_plan": "verify/: test_verify.py", "model_plan": "verify/: test_verify.py, test_trust.py",
    "decode_checks": "verify/: test_decode.py", "module_check": "verify/: test_modules.py",
    "pretrained/model": "loading and the step graph's layout: every family's export and verify tests "
                        "(test_pretrained_causal_check.py, test_pretrained_registry.py), test_pretrained_reference.py",
    "encdec/export": "the encoder-decoder core's export, the family's graphs through it: "
                     "test_pretrained_whisper_export.py, test_pretrained_whisper_static.py, "
                     "test_pretrained_whisper_cost.py",
    "encdec/layers": "an encoder-decoder's attentions over its modules' parameters, in each family's graphs "
                     "against transformers: test_pretrained_whisper_graphs.py, test_pretrained_seq2seq_graphs.py",
    "encdec/check": "the encoder-decoder core's verify rows, run by its family: test_pretrained_whisper_check.py, "
                    "test_pretrained_whisper_foreign.py",
    "pretrained/bench": "bench --hf, run by each family: test_pretrained_causal_bench.py, "
                        "test_pretrained_encoders_bench.py, test_pretrained_whisper_bench.py",
    "fusions/graph": "what the ort flavour's rewrites share: each rewrite's tests (test_pretrained_fusions_*.py)",
    "render": "what the commands print: test_cli.py, test_bench.py and test_verify.py read it",
}


# The whole-model package's modules share their names with the variant side's (export, reference,
# bench): their tests are test_pretrained_<module>.py.
PREFIXED = ("pretrained",)


def _test_name(path: Path) -> str:
    """What a module's test file is called, less `test_`: its name, or (in the whole-model package)
    its packages' and its own: pretrained/fusions/rms.py is tested by test_pretrained_fusions_rms.py."""
    parts = [p for p in path.relative_to(PACKAGE).with_suffix("").parts if p != "__init__"]
    return "_".join(parts) if parts and parts[0] in PREFIXED else path.stem


def test_every_logic_module_has_its_test_file():
    tests = {p.stem.removeprefix("test_") for p in (PACKAGE.parent / "tests").glob("test_*.py")}
    missing = sorted(_test_name(p) for p in PACKAGE.rglob("*.py") if _test_name(p) not in tests
                     and p.stem not in TESTED_ELSEWHERE and f"{p.parent.name}/{p.stem}" not in TESTED_ELSEWHERE)
    assert missing == []


# The functions whose parameters are a schema another library reads from the signature: the
# attention op's (torch.library makes the op's schema from it; its fake kernel and its ONNX
# translation take the same, as torch.onnx passes them) and the reference evaluator's op (onnx
# passes the node's inputs and attributes so).
SCHEMAS = {("models/core.py", "attention"), ("models/core.py", "static_attention"), ("models/core.py", "_"),
           ("onnx_attention.py", "translation"), ("onnx_attention.py", "_ort_static"),
           ("runtimes/reference.py", "_run")}


def test_no_function_takes_more_than_about_8_parameters():
    """The commands too: their options are a table (`attnexport.options`), read as one object."""
    many = []
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - (a.args[:1] != [] and a.args[0].arg
                                                                                  in ("self", "cls"))
                if count > 9 and (where, node.name) not in SCHEMAS:
                    many.append(f"{where}:{node.lineno} {node.name} ({count})")
    assert many == []


HEAVY = {"torch", "transformers", "onnxscript", "timm"}  # what a module imports in a function to put off
# `import attnexport` stays light: the package's two shortcuts import their modules when called.
LAZY_BY_DESIGN = {("attnexport", "attnexport.export"), ("attnexport", "attnexport.verify")}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _targets(node) -> list[str]:
    """The attnexport modules an import statement loads (a name that is a module or a package: it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("attnexport")]
    if not (node.module or "").startswith("attnexport"):
        return []
    out = []
    for a in node.names:
        where = PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")
        out.append(f"{node.module}.{a.name}" if where.with_suffix(".py").exists() or (where / "__init__.py").exists()
                   else node.module)
    return out


def test_a_function_imports_a_module_of_the_package_only_to_put_off_torch():
    """An import inside a function is for a module that loads torch, transformers or onnxscript
    when imported, from one that does not: everything else is imported at the top, where the
    layer test and a reader see it."""
    top, inner = {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        name, tree = _module_name(path), ast.parse(path.read_text())
        heavy = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names} | \
            {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
        top[name] = ({t for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) for t in _targets(n)},
                     bool(heavy & HEAVY))
        inner += [(name, n.lineno, t) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                  for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom) for t in _targets(n)]

    @functools.cache
    def loads_heavy(m: str) -> bool:
        deps, heavy = top.get(m, (set(), False))
        return heavy or any(loads_heavy(d) for d in deps if d != m and d != "attnexport")
    assert 0 < len(inner) <= 5  # the check sees the imports it judges; the packages put off the rest themselves
    needless = [f"{m}:{line} imports {t}" for m, line, t in inner
                if (m, t) not in LAZY_BY_DESIGN and (not loads_heavy(t) or loads_heavy(m))]
    assert needless == []


def _top_level_names(module: str) -> set[str]:
    """The names a package module defines or imports at its top (inside ifs and trys too)."""
    where = PACKAGE.parent / module.replace(".", "/")
    path = where.with_suffix(".py") if where.with_suffix(".py").exists() else where / "__init__.py"
    names, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            todo += node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def test_the_benchmarks_use_only_the_public_names_the_package_has():
    """Every script under benchmarks/ (tools and probes) reads the package's public names only, and
    each name it imports or reads through a module exists: a renamed or removed function fails here,
    not on the GPU machine."""
    bad = []
    for path in sorted((PACKAGE.parent / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules: dict[str, str] = {}
        used: list[tuple[str, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnexport"):
                for a in node.names:
                    sub = PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")
                    if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                        modules[a.asname or a.name] = f"{node.module}.{a.name}"
                    else:
                        used.append((node.module, a.name))
            elif isinstance(node, ast.Import):
                modules.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("attnexport")})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                used.append((modules[node.value.id], node.attr))
        for module, name in used:
            if name.startswith("_") or name not in _top_level_names(module):
                bad.append(f"{path.relative_to(PACKAGE.parent)}: {module}.{name}")
    assert bad == []


def test_the_injected_bugs_still_apply_to_the_code():
    """tests/inject_bugs.py's every bug is an edit of text the checkout still holds, checked by test
    files that exist: a module moved or a line rewritten without its entry fails here, not when the
    check is next run by hand."""
    sys.path.insert(0, str(PACKAGE.parent / "tests"))
    try:
        import inject_bugs
    finally:
        sys.path.pop(0)
    assert inject_bugs.stale() == []
