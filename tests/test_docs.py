"""The README and docs/ as a reader meets them: every link resolves (files and #anchors), every
`attnexport` command in a shell block parses with the command line's own options and values,
every Python block compiles, and the README's first Python block runs. The loops of the
deployment section and docs/caches.md run in tests/test_export.py and tests/test_js_runtimes.py."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from attnexport.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def doc_block(page: str, heading: str, language: str) -> str:
    """The first `language` block of `page` (relative to the checkout) after the line `heading`."""
    text = (ROOT / page).read_text()
    assert heading in text, f"{page} has no {heading!r}"
    return text.split(heading, 1)[1].split(f"```{language}\n", 1)[1].split("```", 1)[0]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _blocks(language: str):
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            if m.group(1) == language:
                yield page, m.group(2)


def test_pages_exist_and_the_readme_is_short():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"variants.md", "exporting.md", "verify.md", "runtimes.md", "caches.md", "modules.md", "operator.md",
            "bench.md", "benchmarks.md", "layout.md", "development.md"} <= names
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    first_screen = "\n".join(readme.splitlines()[:40])
    for needed in ("## Install", "pip install", "attnexport export", "attnexport verify"):
        assert needed in first_screen, needed
    linked = set(re.findall(r"\(docs/([\w-]+\.md)", readme))
    assert names <= linked, f"pages the README does not link: {sorted(names - linked)}"


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _commands():
    for page, block in (*_blocks("bash"), *_blocks("")):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            # Synopses ("--variant NAME [options]") are not commands.
            if not line.startswith("attnexport ") or "[" in line or "NAME " in line.replace("FILE.py:NAME", ""):
                continue
            yield page, line


def test_every_documented_command_parses():
    """Each `attnexport ...` line is parsed by the command it names, its values converted by the
    options' own types, so a renamed option or a value outside a closed set fails here."""
    seen = 0
    for page, line in _commands():
        args = shlex.split(line, comments=True)[1:]
        name, rest = args[0], args[1:]
        command = main.get_command(click.Context(main), name)
        assert command is not None, f"{page.name}: {line}"
        try:
            command.make_context(name, rest, parent=click.Context(main, info_name="attnexport"))
        except click.exceptions.Exit:
            pass
        except click.ClickException as e:
            pytest.fail(f"{page.relative_to(ROOT)}: `{line}`: {e.format_message()}")
        seen += 1
    assert seen >= 30


def test_every_python_block_compiles():
    blocks = list(_blocks("python"))
    assert len(blocks) >= 5
    for page, block in blocks:
        compile(block, str(page), "exec")


def test_the_readme_python_api_block_runs(tmp_path):
    code = doc_block("README.md", "The same from Python:", "python")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("True")
    assert (tmp_path / "models" / "mha8.onnx").exists()


def test_the_layout_names_every_module_and_no_other():
    """docs/layout.md's table says where each module sits: every module of the package is in it
    (a package's files too: models/, runtimes/, verify/ and pretrained/ by name in their row), and every name
    in it is a module that exists. Adding or removing a module without the page fails here."""
    text = (ROOT / "docs" / "layout.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    package = ROOT / "attnexport"
    named = {name for row in rows for name in re.findall(r"`([\w/]+)`", row[1])}
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    packages = {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert named == modules | packages, (f"not in docs/layout.md: {sorted(modules | packages - named)}; "
                                         f"named there but absent: {sorted(named - modules - packages)}")
    for pkg in ("runtimes", "verify", "pretrained"):
        row = next(r for r in rows if f"`{pkg}/`" in r[1])
        files = {p.stem for p in (package / pkg).glob("*.py")}
        said = set(re.findall(r"`([\w]+)`", row[2])) | set(re.findall(r"`" + pkg + r"/(\w+)`", row[2]))
        assert files <= said, f"docs/layout.md's {pkg}/ row does not name {sorted(files - said)}"


NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
           "eleven": 11, "twelve": 12, "thirteen": 13}


def _said(page: str, pattern: str) -> int:
    """The count a page names where `pattern` (with a `(\\w+)` for the number) matches it."""
    found = re.search(pattern, (ROOT / page).read_text())
    assert found, f"{page} no longer says {pattern!r}: mend this test with the page"
    word = found.group(1)
    return int(word) if word.isdigit() else NUMBERS[word]


def test_the_counts_the_pages_name_are_the_codes():
    """What the README and docs count (the flavours, the architectures the suite runs, the
    variants with a decode step, the real blocks) is read from the code: a flavour, an
    architecture or a block added or removed without the page fails here."""
    import ast

    from attnexport import flavors as FL
    from attnexport import variants as V
    from attnexport.pretrained.causal import CausalLM
    assert _said("README.md", r"to ONNX in (\w+) flavours") == len(FL.FLAVORS)
    assert _said("docs/language-models.md", r"small configs of the (\w+) architectures") == \
        len(CausalLM.tested)
    decoding = [v for v in V.VARIANTS.values() if any(o.name == "kv_cache" for o in v.options)]
    assert _said("docs/caches.md", r"`bench --decode` takes all (\w+) variants") == len(decoding)
    tree = ast.parse((ROOT / "benchmarks" / "real_modules.py").read_text())
    blocks = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "MODULES")
    assert _said("docs/modules.md", r"of the (\w+) blocks exported") == len(blocks.elts)


def test_what_a_deployment_needs_of_its_dependencies_is_said_and_installed():
    """transformers 5 reads GGUF files through accelerate: the [real] extra brings it and the README
    says why; a Node app's onnxruntime-node install is told the variable attnexport's own install sets."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("accelerate") for d in extras["real"])
    assert "| accelerate (extra `real`) |" in (ROOT / "README.md").read_text()
    source = (ROOT / "attnexport" / "runtimes" / "js.py").read_text()
    variable = re.search(r'"(ONNXRUNTIME_NODE_INSTALL)": "(\w+)"', source)
    assert variable is not None
    assert f"{variable[1]}={variable[2]} npm install @huggingface/transformers" in \
        (ROOT / "docs" / "language-models.md").read_text()
