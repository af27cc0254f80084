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
