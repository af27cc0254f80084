"""Every `pip install` the README, the docs and the library's messages print is one that works
from what a user has: the checkout (`pip install -e ".[extras]"`, the form `.ci/run` runs),
the built wheel (`dist/flowgrpo_eqx-<version>-py3-none-any.whl[extras]`, the form `.ci/wheel`
installs), or a package this project itself depends on. `flowgrpo_eqx` is not on a package
index, so `pip install 'flowgrpo_eqx[server]'` fails: it is refused here. Also what the
README and the guides tell newcomers: no `huggingface-cli` (gone from huggingface_hub), and why
the library's `clip_range` default differs from the demo's.
"""

import collections
import inspect
import pathlib
import re
import shlex
import tomllib

import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import make_config


ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = set(PYPROJECT["optional-dependencies"])
WHEEL = f"dist/flowgrpo_eqx-{PYPROJECT['version']}-py3-none-any.whl"
_REQUIREMENTS = PYPROJECT["dependencies"] + [
    r for extra in PYPROJECT["optional-dependencies"].values() for r in extra
]
DECLARED = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in _REQUIREMENTS}
"""Every distribution pyproject.toml names (`tensorboardx`, `aiohttp`, ...); the project's own
extras (`flowgrpo_eqx[docs]`) among them are left out below."""


def _sources() -> list[pathlib.Path]:
    return sorted(
        [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").rglob("*.py")]
        + list((ROOT / "flowgrpo_eqx").rglob("*.py"))
    )


def _arguments(text: str, start: int) -> str:
    """What follows `pip install ` at `start`, up to the end of the command: an unquoted
    backtick, `#`, `(`, `)`, `&`, `;` or the line's end."""
    quote = None
    for index in range(start, len(text)):
        char = text[index]
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "`#()&;\n":
            return text[start:index]
    return text[start:]


def install_commands() -> list[tuple[str, str]]:
    """`(where, arguments)` of every `pip install` in the README, the docs and the package."""
    found = []
    for path in _sources():
        text = path.read_text()
        for match in re.finditer(r"pip install ", text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            found.append((where, _arguments(text, match.end()).strip()))
    return found


def _extras_known(extras: str | None) -> bool:
    return extras is None or set(extras.split(",")) <= EXTRAS


def problem(arguments: str) -> str | None:
    """Why `pip install ARGUMENTS` does not work from a checkout or the wheel; None if it does."""
    tokens = shlex.split(arguments)
    if not tokens:
        return "installs nothing"
    if tokens[0] == "-e":
        checkout = re.fullmatch(r"\.(?:\[([\w,]+)\])?", tokens[1]) if len(tokens) == 2 else None
        if checkout is None:
            return "an editable install that is not the checkout (`-e .` or `-e '.[extras]'`)"
        return None if _extras_known(checkout.group(1)) else "an extra pyproject.toml lacks"
    for token in tokens:
        wheel = re.fullmatch(re.escape(WHEEL) + r"(?:\[([\w,]+)\])?", token)
        if wheel is not None:
            if not _extras_known(wheel.group(1)):
                return "an extra pyproject.toml lacks"
        elif token.lower().replace("-", "_") == "flowgrpo_eqx" or token.lower().startswith(
            ("flowgrpo_eqx[", "flowgrpo-eqx[")
        ):
            return "flowgrpo_eqx from a package index, where it is not"
        elif token.lower() not in DECLARED:
            return f"{token!r}, which pyproject.toml does not name"
    return None


def test_the_scan_finds_the_readme_commands():
    arguments = {a for _, a in install_commands()}
    assert {"-e .", '-e ".[dev]"', '-e ".[server]"', WHEEL} <= arguments


def _test_ids(commands: list[tuple[str, str]]) -> list[str]:
    """Each command's test id: its file and its arguments, numbered from the second time the
    same file holds the same command, but not its line, so that an edit above it in a page
    (not in the code's digest, `tests/suite_record.py`) leaves the ids as they were."""
    ids: list[str] = []
    seen: collections.Counter[str] = collections.Counter()
    for where, arguments in commands:
        name = f"{where.rsplit(':', 1)[0]}-{arguments}"
        seen[name] += 1
        ids.append(f"{name}#{seen[name]}" if seen[name] > 1 else name)
    return ids


COMMANDS = install_commands()


@pytest.mark.parametrize("where, arguments", COMMANDS, ids=_test_ids(COMMANDS))
def test_every_install_command_works_from_a_checkout_or_the_wheel(where, arguments):
    assert problem(arguments) is None, f"{where}: pip install {arguments}: {problem(arguments)}"


@pytest.mark.parametrize(
    "arguments, wrong",
    [
        ("'flowgrpo_eqx[server]'", "package index"),
        ("flowgrpo-eqx", "package index"),
        ("-e '.[gpu]'", "extra pyproject.toml lacks"),
        (f"'{WHEEL}[gpu]'", "extra pyproject.toml lacks"),
        ("-e ../elsewhere", "not the checkout"),
        ("torch", "does not name"),
    ],
)
def test_commands_that_would_fail_are_named(arguments, wrong):
    assert wrong in problem(arguments)


def test_no_page_names_the_removed_huggingface_cli():
    # huggingface_hub replaced `huggingface-cli download` with `hf download`.
    for path in _sources():
        assert "huggingface-cli" not in path.read_text(), path


def test_the_readme_says_why_the_library_and_the_demo_clip_differently():
    library = inspect.signature(fg.FlowGRPOObjective).parameters["clip_range"].default
    demo = make_config().objective.clip_range
    text = " ".join((ROOT / "README.md").read_text().split())
    assert (library, demo) == (1e-4, 0.2)
    assert "The library's `clip_range` default, 1e-4, is the Flow-GRPO release's" in text
    assert "the demo and the example pass 0.2" in text
