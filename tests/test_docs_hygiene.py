"""The user-facing pages say what is true now: no commit hashes, no ordinal labels of runs
("the twenty-third session", "the final code is ..."), and no page outside the site's
navigation. History lives in `git log`, run records outside the repository.

The pages: the README, `bench/README.md` (shown as the benchmarks page) and every Markdown
page under `docs/`. A commit of another project may be pinned by a link to it (the URL is
not read); written out in the text it is refused like one of this repository's.
"""

import pathlib
import re
from dataclasses import dataclass

import pytest
import yaml


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"

_UNITS = [
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
]
_TEENS = [
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
]
_TENS = ["twentieth", "thirtieth", "fortieth"]
ORDINALS = (
    _UNITS
    + _TEENS
    + _TENS
    + [f"{tens}-{unit}" for tens in ("twenty", "thirty", "forty") for unit in _UNITS]
)
_ORDINAL = r"(?:" + "|".join(sorted(ORDINALS, key=len, reverse=True)) + r"|\d+(?:st|nd|rd|th))"

COMMIT_HASH = re.compile(r"(?<![\w.@])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w@])")
"""7 to 40 lowercase hex characters, at least one digit and one letter, standing alone (not
part of a name such as `base_4afcfc0bfe1d.eqx` or of a version)."""

RUN_LABELS = [
    re.compile(rf"\b{_ORDINAL}\s+(?:sessions?|runs?|rounds?)\b", re.IGNORECASE),
    re.compile(r"\bsessions?\s+\d+\b", re.IGNORECASE),
    re.compile(r"\bthe\s+final\s+code\b", re.IGNORECASE),
]
"""An ordinal label of a run of the project's own ("the twenty-third session", "the fifth
run", "the 3rd round"), a numbered session, and the chronicle's "the final code"."""

_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_URL = re.compile(r"<?https?://[^\s)>]+>?")


@dataclass(frozen=True)
class Finding:
    line: int
    what: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}: {self.text!r}"


def _blanked(match: re.Match[str]) -> str:
    return " " * len(match.group())


def findings(text: str) -> list[Finding]:
    """What in `text` (a Markdown page) is a commit hash or an ordinal label of a run, with
    its line. Link targets and bare URLs are not read (blanked, so that offsets stay)."""
    prose = _URL.sub(_blanked, _LINK_TARGET.sub(lambda m: "](" + _blanked(m)[3:] + ")", text))
    found = [(m.start(), "a commit hash", m.group()) for m in COMMIT_HASH.finditer(prose)]
    for pattern in RUN_LABELS:
        found += [
            (m.start(), "an ordinal label of a run", m.group()) for m in pattern.finditer(prose)
        ]
    return [
        Finding(prose.count("\n", 0, start) + 1, what, " ".join(matched.split()))
        for start, what, matched in sorted(found)
    ]


def user_pages() -> list[pathlib.Path]:
    """The README, the benchmarks' README (a page of the site) and every page under docs/."""
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted(DOCS.rglob("*.md"))]


def nav_pages(config: dict) -> set[str]:
    """Every page that mkdocs.yml's `nav` names, relative to `docs_dir`."""
    found: set[str] = set()

    def walk(entry: object) -> None:
        if isinstance(entry, str):
            found.add(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)
        elif isinstance(entry, list):
            for value in entry:
                walk(value)

    walk(config.get("nav", []))
    return {page for page in found if page.endswith(".md")}


def pages_outside_nav(docs: pathlib.Path, config: dict) -> list[str]:
    """The pages under `docs` that the navigation does not name, but those in a folder that
    `exclude_docs` leaves out of the site."""
    excluded = [line.strip() for line in str(config.get("exclude_docs", "")).splitlines()]
    excluded = [folder for folder in excluded if folder]
    named = nav_pages(config)
    outside = []
    for page in sorted(docs.rglob("*.md")):
        relative = page.relative_to(docs).as_posix()
        if any(relative.startswith(folder.strip("/") + "/") for folder in excluded):
            continue
        if relative not in named:
            outside.append(relative)
    return outside


def _config() -> dict:
    config = yaml.safe_load(MKDOCS.read_text())
    assert isinstance(config, dict)
    return config


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_has_no_commit_hash_and_no_ordinal_label_of_a_run(page):
    problems = findings(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(map(str, problems))


def test_every_page_is_in_the_navigation():
    outside = pages_outside_nav(DOCS, _config())
    assert not outside, f"pages not in mkdocs.yml's nav (add them or remove them): {outside}"


@pytest.mark.parametrize(
    "planted",
    [
        "The step is 886.1 ms on `655c3f0`.",
        "measured on 655c3f0 (digest a5fc1c641a5d0022)",
        "The final code is e54815d.",
        "the JSON in tpu-records/5305c5911327412f/bench/",
        "as the twenty-third session profiled it",
        "In the fifth run, 1,237 passed.",
        "the 3rd round of the sweep",
        "session 12 timed it",
        "Sixteenth session, 2026-12-07",
    ],
)
def test_a_planted_hash_or_run_label_is_found(planted):
    page = f"# A page\n\nSome text.\n\n{planted}\n"
    problems = findings(page)
    assert problems, planted
    assert all(problem.line == 5 for problem in problems), problems


@pytest.mark.parametrize(
    "clean",
    [
        "1,536 keys, 0.311 MFU, 2026-12-07, JAX 0.10.2",
        "the shipped base model, `base_4afcfc0bfe1d.eqx`",
        "[the commit read here](https://github.com/Luo-Yihong/DGPO/tree/01ceb4b)",
        "https://github.com/Tencent-Hunyuan/UniRL/commit/1a7b501",
        "a deadbeef comment, a 12345678 count and dtype bfloat16",
        "Each round calls every variant once; the first call compiles.",
        "the first transition, the second update, the sequence-minor layout",
    ],
)
def test_clean_text_is_not_flagged(clean):
    assert findings(clean) == []


def test_a_page_outside_the_navigation_is_found(tmp_path):
    docs = tmp_path / "docs"
    (docs / "guides").mkdir(parents=True)
    (docs / "_hooks").mkdir()
    for page in ("index.md", "guides/a.md", "guides/run_log.md", "_hooks/notes.md"):
        (docs / page).write_text("# page\n")
    config = {
        "nav": [{"Home": "index.md"}, {"Guides": [{"A": "guides/a.md"}]}],
        "exclude_docs": "_hooks/\n",
    }
    assert pages_outside_nav(docs, config) == ["guides/run_log.md"]
