"""The documentation site's code runs as written, and its API reference covers every name.

Every fenced ```python block of every page under `docs/` runs: a page's blocks in order, in
one fresh namespace, in a temporary working directory (so files a block writes, e.g.
`runs/shapes`, land there). A block is skipped only when the line right before its fence is
`<!-- no-run: REASON -->`, for code that needs what a test cannot have (a model to download,
a server on another machine); the comment is invisible on the site and must give a reason.
Blocks of other languages (```bash, ```toml, ```text) are never run.

The reference (`docs/api/*.md`) must have a `::: name` entry for every public name of the
library's public modules (the package's names re-exported with `from ._x import X as X`, or
a module's `__all__`), or one for the whole module. The site itself is built by
`mkdocs build --strict` in `.ci/run`, which fails on any unresolved reference.
"""

import ast
import importlib
import pathlib
import pkgutil
import re
from dataclasses import dataclass

import jax
import pytest

import flowgrpo_eqx


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The demo application is documented by its page (docs/demo.md), not in the API reference.
NOT_REFERENCED = {"flowgrpo_eqx.shapes_demo", "flowgrpo_eqx.cli"}  # the demo, the program

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run(?::\s*(?P<reason>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    no_run: bool
    no_run_reason: str | None


def fenced_blocks(page: pathlib.Path) -> list[Block]:
    """Every fenced code block of a Markdown page, with its language and no-run marker."""
    lines = page.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        fence, indent = match["fence"], match["indent"]
        info = match["info"].strip()
        language = info.split()[0].lstrip("{.").rstrip("}") if info else ""
        previous = lines[index - 1] if index > 0 else ""
        marker = _NO_RUN.match(previous)
        body = []
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            line = lines[end]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            end += 1
        blocks.append(
            Block(
                page=page,
                line=index + 1,
                language=language,
                code="\n".join(body) + "\n",
                no_run=marker is not None,
                no_run_reason=None if marker is None else marker["reason"],
            )
        )
        index = end + 1
    return blocks


def pages() -> list[pathlib.Path]:
    return sorted(DOCS.rglob("*.md"))


def pages_with_python() -> list[pathlib.Path]:
    return [p for p in pages() if any(b.language == "python" for b in fenced_blocks(p))]


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(DOCS))


RUN_ELSEWHERE = {"guides/lora.md": "tests/test_lora.py::test_docs_example_runs"}
"""Pages whose blocks a test of their own runs (with `run_page`) and checks further."""


def run_page(page, tmp_path, monkeypatch):
    """Run all of `page`'s runnable Python blocks, in order, in one namespace, in `tmp_path`;
    returns the namespace."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    runnable = [b for b in fenced_blocks(page) if b.language == "python" and not b.no_run]
    for block in runnable:
        # Compiled with the page's name and the block's line offset, so that a failure's
        # traceback points at the page and line to fix.
        source = "\n" * block.line + block.code
        # As a user runs it: under JAX's default dtype promotion, not the suite's strict one
        # (optax's own arithmetic mixes Python floats with its int32 step count).
        with jax.numpy_dtype_promotion("standard"):
            exec(compile(source, str(block.page), "exec"), namespace)
    return namespace


@pytest.mark.parametrize(
    "page", [p for p in pages_with_python() if _page_id(p) not in RUN_ELSEWHERE], ids=_page_id
)
def test_page_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    """All of a page's runnable Python blocks run, in order, in one namespace."""
    run_page(page, tmp_path, monkeypatch)
    capsys.readouterr()


def test_pages_run_elsewhere_have_python_blocks():
    assert set(RUN_ELSEWHERE) <= {_page_id(p) for p in pages_with_python()}


def test_no_run_blocks_say_why():
    skipped = [b for p in pages() for b in fenced_blocks(p) if b.no_run]
    for block in skipped:
        where = f"{_page_id(block.page)}:{block.line}"
        assert block.no_run_reason, f"{where}: write <!-- no-run: REASON -->"
        assert block.language == "python", f"{where}: only Python blocks run; drop the marker"


def test_block_extraction_finds_the_getting_started_example():
    index = [b for b in fenced_blocks(DOCS / "index.md") if b.language == "python"]
    assert any("class MyVelocity" in b.code and "rl_epoch" in b.code for b in index)
    assert not any(b.no_run for b in index)


def test_block_extraction_markers_and_indents(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n"
        "```python\nx = 1\n```\n\n"
        "<!-- no-run: needs a GPU -->\n"
        "```python\ny = 2\n```\n\n"
        "- a list item:\n\n"
        "    ```python\n    if x:\n        z = 3\n    ```\n\n"
        "```bash\necho hi\n```\n"
    )
    first, skipped, indented, shell = fenced_blocks(page)
    assert (first.code, first.no_run, first.line) == ("x = 1\n", False, 3)
    assert (skipped.no_run, skipped.no_run_reason) == (True, "needs a GPU")
    assert indented.code == "if x:\n    z = 3\n"
    assert shell.language == "bash"


def test_every_python_block_parses():
    for page in pages():
        for block in fenced_blocks(page):
            if block.language == "python":
                try:
                    ast.parse(block.code)
                except SyntaxError as error:
                    raise AssertionError(f"{_page_id(page)}:{block.line}: {error}") from error


def public_modules() -> list[str]:
    found = ["flowgrpo_eqx"]
    for info in pkgutil.iter_modules(flowgrpo_eqx.__path__, "flowgrpo_eqx."):
        if not info.name.rsplit(".", 1)[1].startswith("_") and info.name not in NOT_REFERENCED:
            found.append(info.name)
    return found


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return list(exported)
    file = module.__file__
    assert file is not None
    tree = ast.parse(pathlib.Path(file).read_text())
    names = [
        alias.asname
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname is not None and alias.asname == alias.name
    ]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            names.append(node.name)
    return names


def reference_entries() -> set[str]:
    entries = set()
    for page in (DOCS / "api").rglob("*.md"):
        entries.update(re.findall(r"^:::\s*([\w.]+)\s*$", page.read_text(), flags=re.M))
    return entries


def test_public_modules_include_train_and_models():
    assert {"flowgrpo_eqx", "flowgrpo_eqx.train", "flowgrpo_eqx.models"} <= set(public_modules())


@pytest.mark.parametrize("module_name", public_modules())
def test_api_reference_covers_every_public_name(module_name):
    entries = reference_entries()
    if module_name in entries:
        return
    names = public_names(module_name)
    assert names, f"{module_name} exports nothing"
    module = importlib.import_module(module_name)

    def documented(name: str) -> bool:
        """Referenced as `module.NAME`, or, when the package re-exports it (the objectives
        package's names are `flowgrpo_eqx`'s), as `flowgrpo_eqx.NAME`."""
        if f"{module_name}.{name}" in entries:
            return True
        same = getattr(flowgrpo_eqx, name, None) is getattr(module, name)
        return same and f"flowgrpo_eqx.{name}" in entries

    missing = [name for name in names if not documented(name)]
    assert not missing, (
        f"docs/api/ has no `::: {module_name}.NAME` entry for {missing}; add one per name, or "
        f"a page with `::: {module_name}` and a line for it in mkdocs.yml's nav."
    )


def test_every_api_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (DOCS / "api").rglob("*.md"):
        assert str(page.relative_to(DOCS)) in nav, page


def test_api_overview_lists_every_api_page():
    """The overview's table links every page of the reference's navigation, once each."""
    nav = re.findall(r"^\s*- [^:\n]+: (api/[\w/]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    overview = (DOCS / "api" / "index.md").read_text()
    linked = re.findall(r"^\| \[[^\]]+\]\(([\w/]+\.md)\) \|", overview, flags=re.M)
    assert sorted(f"api/{page}" for page in linked) == sorted(p for p in nav if p != "api/index.md")


def test_every_mention_of_a_readme_is_a_link():
    """A page that refers a reader to a README links to it (or to the page that shows it)."""
    for page in pages():
        text = re.sub(r"<!--.*?-->", "", page.read_text(), flags=re.S)
        text = re.sub(r'^--8<-- ".*"$', "", text, flags=re.M)  # an included file (the hook)
        unlinked = re.sub(r"\[[^\]]*\]\([^)]*\)", "", text)
        assert "README" not in unlinked, f"{_page_id(page)}: link the README it mentions"
