"""The package's shape: its modules import one another without a cycle, and none reads another's
private names (a name with a leading underscore is its own module's business)."""

import ast
import functools
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
                    if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists():
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
    edges = _imports()["attnexport.cli"]
    assert "attnexport.bench" in edges  # imported inside a command only
    assert "attnexport.models.core" in _imports()["attnexport.modules"]
