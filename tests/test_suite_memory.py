"""`python -m tools.suite_memory`: the table of each test file's time and peak memory."""

import os
import re

import pytest

from tools import suite_memory


def test_the_closing_line_is_read_for_the_counts():
    line = "===== 1 failed, 12 passed, 2 skipped in 3.1s ====="
    assert suite_memory.outcome_of(f"....\n{line}\n") == "1 failed, 12 passed, 2 skipped"
    assert suite_memory.outcome_of("no closing line") == "?"


def test_every_test_file_is_listed():
    files = suite_memory.suite_files()
    assert "tests/test_suite_memory.py" in files
    assert any(path.startswith("property_tests/") for path in files)
    assert all(path.split("/")[-1].startswith("test_") for path in files)


def test_the_table_puts_the_largest_peak_first():
    rows = [
        {"file": "tests/a.py", "outcome": "3 passed", "seconds": 1.4, "peak_mb": 400.2},
        {"file": "tests/b.py", "outcome": "1 failed", "seconds": 12.6, "peak_mb": 2500.0},
        {"file": "tests/c.py", "outcome": "?", "seconds": 0.3, "peak_mb": None},
    ]
    assert suite_memory.files_table(rows).splitlines() == [
        "| file | tests | seconds | peak MB |",
        "|---|---|---:|---:|",
        "| `tests/b.py` | 1 failed | 13 | 2,500 |",
        "| `tests/a.py` | 3 passed | 1 | 400 |",
        "| `tests/c.py` | ? | 0 | ? |",
    ]


@pytest.mark.several_processes("runs a test file in a pytest process of its own")
def test_a_file_is_run_alone_and_its_peak_read_back(tmp_path, capsys):
    out = tmp_path / "table.md"
    assert suite_memory.main(["files", "tests/test_checks.py", "--out", str(out)]) == 0
    (row,) = out.read_text().splitlines()[2:]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == "`tests/test_checks.py`"
    assert cells[1].endswith("passed") and "failed" not in cells[1]
    # A process that imported JAX holds more than 50 MB.
    assert float(cells[3].replace(",", "")) > 50


CGROUP_WRITABLE = os.access(suite_memory.CGROUP_MEMORY, os.W_OK)


@pytest.mark.skipif(not CGROUP_WRITABLE, reason="needs cgroup v1's memory controller, as root")
@pytest.mark.several_processes("runs pytest with a worker of its own")
def test_a_worker_over_its_cgroup_limit_is_killed_by_the_kernel_and_named(tmp_path, capfd):
    test_file = tmp_path / "test_grows.py"
    test_file.write_text(
        "import time\n\nimport numpy as np\n\n\n"
        "def test_grows():\n"
        "    time.sleep(2)  # the worker is in its cgroup by then\n"
        "    held = np.ones(400 * 2**20, np.uint8)\n"
        "    assert held.sum() > 0\n"
    )
    # The suite itself may run with its workers in such cgroups (FLOWGRPO_CI_CGROUP_MB).
    others = set(suite_memory.CGROUP_MEMORY.glob("flowgrpo_suite_*"))
    status, result = suite_memory.run_suite(
        ["-n", "1", "-p", "no:cacheprovider", str(test_file)], 0.2, cgroup_mb=200
    )
    assert status != 0
    out = capfd.readouterr().out
    # The test's id is relative to pytest's rootdir, which a config file above it may move.
    assert re.search(r"worker 'gw0' crashed while running '[^']*test_grows\.py::test_grows'", out)
    assert set(suite_memory.CGROUP_MEMORY.glob("flowgrpo_suite_*")) == others
    del result
