"""A worker that dies or hangs ends the run, failed, naming its test (`tests/worker_health.py`,
`timeout` in `pyproject.toml`).

Each test runs pytest with two xdist workers, this project's settings (`-c pyproject.toml`)
and its worker plugin, on a few tests written for it, none of which imports the library.
"""

import subprocess
import sys
import textwrap

from tests.cli_helpers import REPO, environment


# Run as a whole file on one worker (`--dist loadfile`), while the other worker runs `OTHERS`.
DIES = """
    import os
    import signal


    def test_before():
        pass


    def test_dies():
        os.kill(os.getpid(), signal.SIGKILL)


    def test_after():
        pass
"""

HANGS = """
    import threading


    def test_hangs():
        threading.Event().wait()
"""

OTHERS = """
    import pytest


    @pytest.mark.parametrize("n", range(3))
    def test_passes(n):
        pass
"""


def _pytest(folder, files, *args):
    """pytest run in `folder` on `files` (name: source) with two workers, to its end."""
    for name, source in files.items():
        (folder / name).write_text(textwrap.dedent(source))
    command = [
        sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
        str(folder), "-p", "no:cacheprovider", "-p", "tests.worker_health", "-n", "2",
        "--dist", "loadfile", *args, *files,
    ]  # fmt: skip
    # A guard against the very stall this file tests for: the runs take seconds.
    return subprocess.run(
        command, cwd=folder, capture_output=True, text=True, env=environment(), timeout=300
    )


def test_a_killed_worker_ends_the_run_failed_naming_its_test_at_once(tmp_path):
    done = _pytest(tmp_path, {"test_dies.py": DIES, "test_others.py": OTHERS})
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    named = "crashed while running test_dies.py::test_dies"
    assert named in output, output
    # Said as it happens, before pytest's closing report, not only in it.
    assert output.index(named) < output.index("= FAILURES =")
    # Not replaced: the dead worker's test is not run again on a new worker, and the one it
    # had not reached is not run at all.
    assert "replacing crashed worker" not in output
    assert "crashed and worker restarting disabled" in output
    assert "1 failed, 4 passed" in output, output


def test_a_hung_test_is_stopped_by_the_timeout_and_named(tmp_path):
    done = _pytest(tmp_path, {"test_hangs.py": HANGS, "test_others.py": OTHERS}, "--test-timeout=5")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    # Every thread's stack, from the worker itself: the hung test's frame among them.
    assert "Timeout (0:00:05)!" in output, output
    assert 'test_hangs.py", line 6 in test_hangs' in output, output
    assert "crashed while running test_hangs.py::test_hangs" in output, output
    assert "1 failed, 3 passed" in output, output


def test_restarts_can_still_be_asked_for(tmp_path):
    """`--max-worker-restart=N` is xdist's as ever: the dead worker is replaced and the test
    that killed it is run again on the new one (here it kills that one too)."""
    done = _pytest(
        tmp_path, {"test_dies.py": DIES, "test_others.py": OTHERS}, "--max-worker-restart=1"
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "replacing crashed worker" in output
    assert "maximum crashed workers reached: 1" in output
