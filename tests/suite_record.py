"""The suite's record, for a machine whose commands are limited in time (docs/accelerators.md).

The borrowed TPU machine runs a command for 10 minutes at most, and the suite takes longer
there. Two variables (conftest.py) let it run across commands without losing what a command
finished:

- `FLOWGRPO_TEST_RECORD=FILE` appends one JSON line per event to `FILE`, flushed at once, so
  that a run stopped by its timeout (or killed) keeps every test it finished: a `run` line
  after collection (the code's digest, the backend, every test collected), a `start` line as
  each test begins and an `outcome` line as it ends.
- `FLOWGRPO_TEST_RESUME=FOLDER[:FOLDER...]` deselects each test whose last outcome in the
  records there (`*.jsonl`, read in name order) passed or was skipped, for the same code
  (`source_digest`). Failed tests and tests never finished run again.
- `FLOWGRPO_TEST_DEADLINE=SECONDS` (since the epoch), with a record: when the command will be
  interrupted (`tools/tpu/run.sh` sets it). No test starts in its last `START_MARGIN` seconds,
  and a test that fails after it is left unfinished rather than failed, since the interrupt
  itself may have failed it (a training run inside a test takes SIGINT as a request to stop).

`python -m tools.tpu.tally FOLDER...` counts the records.
"""

import dataclasses
import hashlib
import json
import pathlib
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import pytest


RECORD = "FLOWGRPO_TEST_RECORD"
RESUME = "FLOWGRPO_TEST_RESUME"
DEADLINE = "FLOWGRPO_TEST_DEADLINE"

# Longer than every test but two took on the TPU (the sixth run's longest: 82 s, 68 s, then
# 57 s), so that a test begun before it almost always ends before the interrupt.
START_MARGIN = 60.0

# What the tests run: the library, the tests themselves, the benches and tools they import,
# and the configuration. The pages of docs/ and the README are left out, so that a page's
# figures can be written after the run that measured them (the docs tests check every page in
# CI); bench/README.md, a page too, goes with the benches.
CODE = (
    "flowgrpo_eqx",
    "tests",
    "property_tests",
    "bench",
    "tools",
    "conftest.py",
    "pyproject.toml",
    "mypy.ini",
)

Outcome = Literal["passed", "failed", "skipped"]

MESSAGE_CHARACTERS = 1000


def source_digest(root: pathlib.Path) -> str:
    """A digest of the code a run tests: every file of `CODE` below `root` except compiled
    Python and hidden files, by path and content.

    **Arguments:**

    - `root`: the repository's root.

    **Returns:**

    The first 16 hex digits of a SHA-256.
    """
    digest = hashlib.sha256()
    for name in CODE:
        top = root / name
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in paths:
            relative = path.relative_to(root)
            if path.suffix == ".pyc" or any(part.startswith(".") for part in relative.parts):
                continue
            digest.update(str(relative).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Result:
    """One test's last outcome in the records.

    **Arguments:**

    - `test`: the test's id.
    - `outcome`: `"passed"`, `"failed"` or `"skipped"`; `"started"` if it began and no
        outcome followed (its run was stopped or died in it).
    - `seconds`: its setup, call and teardown together (0 if it never ended).
    - `reason`: why it was skipped, or its failure's message; empty otherwise.
    - `record`: the file it was read from.
    """

    test: str
    outcome: Literal["passed", "failed", "skipped", "started"]
    seconds: float
    reason: str
    record: str

    @property
    def finished(self) -> bool:
        """Whether a resumed run leaves the test out: it passed or was skipped."""
        return self.outcome in ("passed", "skipped")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run's `run` line.

    **Arguments:**

    - `record`: the file.
    - `source`: `source_digest` of the code it ran.
    - `backend`: JAX's default backend there.
    - `collected`: every test it collected, before resuming deselected any.
    - `selected`: how many it kept to run.
    """

    record: str
    source: str
    backend: str
    collected: tuple[str, ...]
    selected: int


def read_records(
    files: Iterable[pathlib.Path],
) -> tuple[list[Run], dict[str, dict[str, Result]]]:
    """The runs and, for each code digest, each test's last result, from record files.

    **Arguments:**

    - `files`: the `.jsonl` records, oldest first; a later line overrides an earlier one.

    **Returns:**

    The runs in order, and a mapping from a digest to test ids to their `Result`.

    **Raises:**

    - `ValueError`: naming the file and line, for a line that is not a record's.
    """
    runs: list[Run] = []
    results: dict[str, dict[str, Result]] = {}
    for path in files:
        source = ""
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                event: dict[str, Any] = json.loads(line)
                kind = event["kind"]
                if kind == "run":
                    source = event["source"]
                    runs.append(
                        Run(
                            record=str(path),
                            source=source,
                            backend=event["backend"],
                            collected=tuple(event["collected"]),
                            selected=int(event["selected"]),
                        )
                    )
                    continue
                test = event["test"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number} is not a test record line: {error}") from None
            if not source:
                raise ValueError(f"{path}:{number}: a {kind!r} line before the run's line")
            if kind == "start":
                result = Result(test, "started", 0.0, "", str(path))
            else:
                result = Result(
                    test, event["outcome"], float(event["seconds"]), event["reason"], str(path)
                )
            results.setdefault(source, {})[test] = result
    return runs, results


def record_files(folders: Iterable[pathlib.Path]) -> list[pathlib.Path]:
    """The records (`*.jsonl`) of `folders`, folder by folder, each folder's in name order.

    **Arguments:**

    - `folders`: the folders, oldest first.

    **Returns:**

    The files, oldest first.

    **Raises:**

    - `ValueError`: naming a folder that does not exist (a mistyped path would rerun all).
    """
    files: list[pathlib.Path] = []
    for folder in folders:
        if not folder.is_dir():
            raise ValueError(f"{str(folder)!r} is not a folder")
        files.extend(sorted(folder.glob("*.jsonl")))
    return files


def finished_tests(folders: Iterable[pathlib.Path], source: str) -> set[str]:
    """The tests whose last outcome for `source` in the records of `folders` is passed or
    skipped: what a resumed run leaves out.

    **Arguments:**

    - `folders`: folders of `.jsonl` records.
    - `source`: the code's `source_digest`.

    **Returns:**

    The tests' ids.

    **Raises:**

    - `ValueError`: naming the variable and a folder that does not exist.
    """
    try:
        files = record_files(folders)
    except ValueError as error:
        raise ValueError(f"{RESUME}: {error}") from None
    _, results = read_records(files)
    return {test for test, result in results.get(source, {}).items() if result.finished}


class Recorder:
    """A pytest plugin that appends a run's events to a record file, one flushed JSON line
    each (conftest.py registers it when `FLOWGRPO_TEST_RECORD` is set).

    **Arguments:**

    - `path`: the record file (appended to; made with its folder if missing).
    - `deadline`: when the run will be interrupted, in seconds since the epoch (`DEADLINE`),
        or `None`: no test starts in its last `START_MARGIN` seconds, and a failure that ends
        after it is not written, so the test stays begun and unfinished.
    - `clock`: the time now, in seconds since the epoch.
    """

    def __init__(
        self,
        path: pathlib.Path,
        deadline: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._phases: dict[str, list[tuple[str, float, str]]] = {}
        self._deadline = deadline
        self._clock = clock
        self._session: pytest.Session | None = None

    def _write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()

    def run(self, source: str, backend: str, collected: list[str], selected: int) -> None:
        """The run's line: its code, backend and collection."""
        self._write(
            {
                "kind": "run",
                "source": source,
                "backend": backend,
                "collected": collected,
                "selected": selected,
            }
        )

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Keeps the session, to stop it before the deadline."""
        self._session = session

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        """A test begins."""
        self._write({"kind": "start", "test": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """One phase of a test (setup, call, teardown); after its teardown, the test's
        outcome: failed if a phase failed, else skipped if one was skipped, else passed (a
        failure after the deadline is not written), and the session stopped if the deadline
        is less than `START_MARGIN` seconds away."""
        phases = self._phases.setdefault(report.nodeid, [])
        phases.append((report.outcome, report.duration, _reason(report)))
        if report.when != "teardown":
            return
        del self._phases[report.nodeid]
        outcome: Outcome = "passed"
        reason = ""
        for phase_outcome, _, phase_reason in phases:
            if phase_outcome == "failed":
                outcome, reason = "failed", phase_reason
                break
            if phase_outcome == "skipped" and outcome == "passed":
                outcome, reason = "skipped", phase_reason
        now = self._clock()
        if self._deadline is not None and now >= self._deadline - START_MARGIN:
            if self._session is not None:
                self._session.shouldstop = f"{DEADLINE}: less than {START_MARGIN:.0f} s left"
            if outcome == "failed" and now >= self._deadline:
                return
        self._write(
            {
                "kind": "outcome",
                "test": report.nodeid,
                "outcome": outcome,
                "seconds": round(sum(phase[1] for phase in phases), 3),
                "reason": reason,
            }
        )

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


def _reason(report: pytest.TestReport) -> str:
    """Why a phase was skipped, or its failure's message (its lines joined by " / ", at most
    `MESSAGE_CHARACTERS`: enough for the figures of an `assert_allclose`); empty if it passed."""
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "")) or report.longreprtext
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return " / ".join(lines)[:MESSAGE_CHARACTERS] if lines else report.outcome
