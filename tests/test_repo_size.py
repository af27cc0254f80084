"""`tools/repo_size.py`: the tracked files outside the test fixtures fit the repository's
budget (6 MB), and the check counts what it says it counts."""

import pathlib
import subprocess

import pytest

from tools.repo_size import BUDGET_MB, report, tracked_bytes, tracked_files


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_repository_fits_its_budget():
    try:
        paths = tracked_files(ROOT)
    except (FileNotFoundError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    line, fits = report(tracked_bytes(ROOT, paths))
    assert fits, line


def test_the_fixtures_are_left_out_and_the_line_says_the_budget(tmp_path):
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "tests" / "data" / "weights.bin").write_bytes(b"x" * 5_000)
    (tmp_path / "library.py").write_bytes(b"y" * 1_200)
    paths = ["tests/data/weights.bin", "library.py", "deleted.md"]
    assert tracked_bytes(tmp_path, paths) == 1_200
    assert report(3_100_000) == (
        "== tracked files outside tests/data: 3.1 MB of a 6 MB budget",
        True,
    )
    line, fits = report(int(BUDGET_MB * 1e6) + 1)
    assert not fits and line.endswith("OVER BUDGET")


def test_the_command_fails_over_its_budget(capsys):
    from tools.repo_size import main

    try:
        tracked_files(ROOT)
    except (FileNotFoundError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert main(["--budget", "0.001"]) == 1
    assert "OVER BUDGET" in capsys.readouterr().out
    assert main([]) == 0
