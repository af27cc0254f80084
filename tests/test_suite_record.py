"""The suite's record and resumption (`tests/suite_record.py`) and the TPU tally over them."""

import json
import pathlib

import pytest

from tests.suite_record import (
    START_MARGIN,
    Recorder,
    finished_tests,
    read_records,
    source_digest,
)
from tools.tpu.tally import main, tally, unfinished


SAMPLE = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("not on this machine")

def test_setup_errors(broken):
    pass
"""


def _run_module(
    folder: pathlib.Path, name: str, text: str, recorder: Recorder, source: str, tests: list[str]
) -> pytest.ExitCode | int:
    """Writes `text` as `folder/name/test_NAME.py` (a module name of its own: pytest imports
    each once per process) and runs it in this process with `recorder`, after a run line that
    collected `tests` (their names without `test_`); closes the record and returns the exit
    code."""
    sample = folder / name / f"test_{name}.py"
    sample.parent.mkdir(parents=True, exist_ok=True)
    sample.write_text(text)
    (sample.parent / "pytest.ini").write_text("[pytest]\n")
    recorder.run(source, "cpu", [f"test_{name}.py::test_{test}" for test in tests], len(tests))
    code = pytest.main(
        [str(sample), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-c", str(sample.parent / "pytest.ini")],
        plugins=[recorder],
    )  # fmt: skip
    recorder.close()
    return code


def _record_sample(tmp_path: pathlib.Path, record: pathlib.Path, source: str) -> None:
    """Runs `SAMPLE` in this process with a `Recorder` on `record`, after a run line."""
    names = ["passes", "fails", "skips", "setup_errors"]
    code = _run_module(tmp_path, "sample", SAMPLE, Recorder(record), source, names)
    assert code == pytest.ExitCode.TESTS_FAILED


IN_ORDER = """
def test_first():
    pass

def test_second():
    assert False, "stopped by the interrupt, perhaps"

def test_third():
    pass
"""


def _record_in_order(tmp_path, name, times):
    """Runs `IN_ORDER` as `test_NAME.py` with a `Recorder` whose deadline is 1000 and whose
    clock reads `times` at each test's end; the exit code and the recorded results."""
    record = tmp_path / f"{name}.jsonl"
    clock = iter(times)
    recorder = Recorder(record, deadline=1000.0, clock=lambda: next(clock))
    code = _run_module(tmp_path, name, IN_ORDER, recorder, "s", ["first", "second", "third"])
    _, results = read_records([record])
    return code, {test.split("::")[1]: r.outcome for test, r in results["s"].items()}


def test_no_test_starts_in_the_last_minute_and_a_failure_after_the_deadline_stays_unfinished(
    tmp_path,
):
    code, outcomes = _record_in_order(tmp_path, "late", [0.0, 1001.0])
    assert code == pytest.ExitCode.INTERRUPTED
    assert outcomes == {"test_first": "passed", "test_second": "started"}
    # Before the deadline but within the margin: the failure stands, and the run stops there.
    code, outcomes = _record_in_order(tmp_path, "close", [0.0, 1000.0 - START_MARGIN / 2])
    assert code == pytest.ExitCode.INTERRUPTED
    assert outcomes == {"test_first": "passed", "test_second": "failed"}
    code, outcomes = _record_in_order(tmp_path, "early", [0.0, 1.0, 2.0])
    assert code == pytest.ExitCode.TESTS_FAILED
    assert outcomes == {"test_first": "passed", "test_second": "failed", "test_third": "passed"}


def test_the_record_holds_each_outcome_and_a_resumed_run_leaves_out_what_finished(tmp_path):
    folder = tmp_path / "records"
    _record_sample(tmp_path, folder / "record-1.jsonl", "abc")
    runs, results = read_records([folder / "record-1.jsonl"])
    assert [(run.source, run.selected) for run in runs] == [("abc", 4)]
    outcome = {test.split("::")[1]: r for test, r in results["abc"].items()}
    assert {name: r.outcome for name, r in outcome.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
        "test_setup_errors": "failed",
    }
    assert outcome["test_skips"].reason == "not on this machine"
    assert outcome["test_fails"].reason == "AssertionError: one is not two / assert 1 == 2"
    assert "the fixture broke" in outcome["test_setup_errors"].reason
    # Passed and skipped tests are done for this code only; failures run again.
    done = finished_tests([folder], "abc")
    assert {test.split("::")[1] for test in done} == {"test_passes", "test_skips"}
    assert finished_tests([folder], "other code") == set()
    with pytest.raises(ValueError, match="FLOWGRPO_TEST_RESUME: .*missing.* is not a folder"):
        finished_tests([tmp_path / "missing"], "abc")


def test_a_test_that_began_and_never_ended_is_not_finished_and_a_later_outcome_wins(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run = {"kind": "run", "source": "s", "backend": "tpu", "collected": ["a", "b", "c"]}
    lines = [
        {**run, "selected": 3},
        {"kind": "start", "test": "a"},
        {"kind": "outcome", "test": "a", "outcome": "failed", "seconds": 1.5, "reason": "x"},
        {"kind": "start", "test": "b"},
    ]
    (first / "record-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert finished_tests([first], "s") == set()
    later = [
        {**run, "selected": 2},
        {"kind": "start", "test": "a"},
        {"kind": "outcome", "test": "a", "outcome": "passed", "seconds": 2.0, "reason": ""},
        {"kind": "start", "test": "b"},
        {"kind": "outcome", "test": "b", "outcome": "skipped", "seconds": 0.0, "reason": "why"},
    ]
    (second / "record-2.jsonl").write_text("".join(json.dumps(e) + "\n" for e in later))
    assert finished_tests([first, second], "s") == {"a", "b"}
    text = tally([first, second])
    assert "of 3 tests: 1 passed, 0 failed, 1 skipped, 1 not yet run to their end" in text
    assert "skipped 1: why" in text
    # Without the second folder: a's failure is named, b began and never ended.
    alone = tally([first])
    assert "FAILED a: x" in alone and "NOT ENDED b" in alone
    assert "2 not yet run to their end" in alone
    # What a run of changed code takes first: the failed, the unended, the never run.
    assert unfinished([first]) == ["a", "b", "c"]
    assert unfinished([first, second]) == ["c"]
    listed = tmp_path / "unfinished.txt"
    assert main([str(first), str(second), "--unfinished", str(listed)]) == 0
    assert listed.read_text() == "c\n"


def test_records_of_other_code_are_not_mixed_in(tmp_path):
    old = {"kind": "run", "source": "old", "backend": "tpu", "collected": ["a"], "selected": 1}
    new = {**old, "source": "new"}
    passed = {"kind": "outcome", "test": "a", "outcome": "passed", "seconds": 1.0, "reason": ""}
    (tmp_path / "record-1.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(passed) + "\n")
    (tmp_path / "record-2.jsonl").write_text(json.dumps(new) + "\n")
    text = tally([tmp_path])
    assert "code new" in text and "0 passed" in text and "1 not yet run" in text
    assert "records of other code, not counted: old" in text


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    record = tmp_path / "record-1.jsonl"
    record.write_text('{"kind": "run", "source": "s"}\n')
    with pytest.raises(ValueError, match=r"record-1.jsonl:1 is not a test record line"):
        read_records([record])
    record.write_text('{"kind": "start", "test": "a"}\n')
    with pytest.raises(ValueError, match=r"record-1.jsonl:1: a 'start' line before the run"):
        read_records([record])


def test_the_source_digest_follows_the_code_and_not_the_pages(tmp_path):
    (tmp_path / "flowgrpo_eqx").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "flowgrpo_eqx" / "a.py").write_text("x = 1\n")
    (tmp_path / "docs" / "page.md").write_text("# a page\n")
    before = source_digest(tmp_path)
    (tmp_path / "docs" / "page.md").write_text("# a page, with its figures\n")
    (tmp_path / "flowgrpo_eqx" / "__pycache__").mkdir()
    (tmp_path / "flowgrpo_eqx" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert source_digest(tmp_path) == before
    (tmp_path / "flowgrpo_eqx" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before
