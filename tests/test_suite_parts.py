"""`FLOWGRPO_TEST_PART`: the suite in parts, for machines whose commands are limited in time."""

import os
import subprocess
import sys

import pytest

from tests.suite_parts import files_of_part, parse_part


def test_every_file_is_in_exactly_one_part_and_the_long_ones_are_dealt_round():
    files = [f"tests/test_{name}.py" for name in "abcdefg"]
    parts = [files_of_part(files, k, 3) for k in (1, 2, 3)]
    assert set().union(*parts) == set(files)
    assert sum(len(p) for p in parts) == len(files)
    # The first (longest) files go one to each part.
    assert [files[0] in parts[0], files[1] in parts[1], files[2] in parts[2]] == [True] * 3
    assert files_of_part(files, 1, 1) == set(files)


@pytest.mark.parametrize("bad", ["", "3", "0/2", "3/2", "a/b", "1/0", "-1/2"])
def test_a_part_that_is_not_k_of_n_is_named(bad: str):
    with pytest.raises(pytest.UsageError, match=r"FLOWGRPO_TEST_PART must be K/N.*got"):
        parse_part(bad)
    assert parse_part("2/3") == (2, 3)


@pytest.mark.several_processes("collects the suite in another pytest process")
def test_the_parts_of_a_collection_cover_it_once():
    def collected(part: str | None) -> set[str]:
        env = {k: v for k, v in os.environ.items() if k != "FLOWGRPO_TEST_PART"}
        if part is not None:
            env["FLOWGRPO_TEST_PART"] = part
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q",
             "-p", "no:cacheprovider", "tests/test_suite_parts.py", "tests/test_readme.py",
             "tests/test_sde.py"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return {line.split("::")[0] for line in out.splitlines() if "::" in line}

    whole = collected(None)
    parts = [collected(f"{k}/2") for k in (1, 2)]
    assert len(whole) == 3
    assert parts[0] | parts[1] == whole and not parts[0] & parts[1]


def _junit(folder, name, cases, seconds, log):
    """A `part_K_of_N.xml` with `cases` (id -> "passed" | "failed" | "skipped") and its log."""
    body = []
    for test, outcome in cases.items():
        classname, _, case = test.partition("::")
        inner = {"failed": "<failure message='x'/>", "skipped": "<skipped message='y'/>"}
        body.append(
            f"<testcase classname='{classname}' name='{case}'>{inner.get(outcome, '')}</testcase>"
        )
    xml = f"<testsuites><testsuite time='{seconds}'>{''.join(body)}</testsuite></testsuites>"
    (folder / f"{name}.xml").write_text(xml)
    (folder / f"{name}.log").write_text(log)


def test_the_tpu_tally_counts_each_part_once_from_its_last_finished_run(tmp_path):
    from tools.tpu.tally import latest_parts, table

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    done = "3 passed in 4.0s\n"
    stopped = "!!!!!!! KeyboardInterrupt !!!!!!!\n1 passed in 9.0s\n"
    cases = {"tests.a::one": "passed", "tests.a::two": "failed", "tests.a::three": "skipped"}
    _junit(first, "part_1_of_3", cases, 4.0, done)
    _junit(first, "part_2_of_3", {"tests.b::one": "passed"}, 9.0, stopped)
    _junit(second, "part_2_of_3", {"tests.b::one": "passed", "tests.b::two": "passed"}, 5.0, done)
    parts = latest_parts([first, second])
    assert [(p.number, p.passed, p.failed, p.skipped, p.finished) for p in parts] == [
        (1, 1, 1, 1, True),
        (2, 2, 0, 0, True),
    ]
    assert parts[1].folder == str(second)
    text = table(parts)
    assert "finished parts: 2; their tests: 3 passed, 1 failed, 1 skipped, in 9 s" in text
    assert "of 3: not yet run to their end: [3]" in text
    assert "FAILED (1/3) tests.a::two" in text
    # A part stopped by its timeout is not counted among the finished ones.
    assert "not yet run to their end: [2, 3]" in table(latest_parts([first]))
