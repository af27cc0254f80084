"""`tools/tpu/run.sh await`: a command on the TPU machine waits for the process an earlier
command left holding the chip (a JAX process killed by `timeout` can outlive its command by
seconds, holding libtpu's lock), gives up after `FLOWGRPO_TPU_AWAIT` seconds, and does not wait
for a finished holder or for another program that has taken its process id."""

import os
import pathlib
import subprocess
import sys

import pytest


SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "tools" / "tpu" / "run.sh"


def _await(holder: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "await"],
        env={**os.environ, "FLOWGRPO_TPU_HOLDER": str(holder), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _python_sleeping(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_await_returns_only_after_the_holder_has_ended(tmp_path: pathlib.Path) -> None:
    holder = _python_sleeping(2)
    (tmp_path / "holder.pid").write_text(f"{holder.pid}\n")
    try:
        done = _await(tmp_path / "holder.pid")
        assert holder.poll() is not None
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0
    assert f"waiting for process {holder.pid}, which holds the chip" in done.stderr


def test_await_gives_up_after_its_limit_and_says_so(tmp_path: pathlib.Path) -> None:
    holder = _python_sleeping(60)
    (tmp_path / "holder.pid").write_text(f"{holder.pid}\n")
    try:
        done = _await(tmp_path / "holder.pid", FLOWGRPO_TPU_AWAIT="1")
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0
    assert f"process {holder.pid} still holds the chip after 1 s; going on" in done.stderr


@pytest.mark.parametrize("holder_is", ["absent", "finished", "another_program"])
def test_await_does_not_wait_without_a_live_holder(holder_is: str, tmp_path: pathlib.Path) -> None:
    holder = _python_sleeping(0) if holder_is == "finished" else subprocess.Popen(["sleep", "60"])
    try:
        if holder_is == "finished":
            holder.wait()
        if holder_is != "absent":
            (tmp_path / "holder.pid").write_text(f"{holder.pid}\n")
        done = _await(tmp_path / "holder.pid")
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0
    assert "holds the chip" not in done.stderr


def test_the_usage_names_await() -> None:
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2
    assert "bash tools/tpu/run.sh await" in usage.stdout


# --- what the script deletes, its variables, its failures ---------------------------------

FAKE_PYTHON = """#!/usr/bin/env bash
# python3 as the script calls it, without a network: `-m pip download ... -d DIR` and
# `-m pip install ... --target DIR` (each failing when FAKE_PIP_FAILS is set, as an
# unreachable index does), anything else printed.
if [ "$1 $2" = "-m pip" ]; then
    if [ -n "${FAKE_PIP_FAILS:-}" ]; then
        echo "ERROR: Could not find a version that satisfies the requirement equinox" \\
            "(network is unreachable)" >&2
        exit 1
    fi
    while [ $# -gt 0 ]; do
        case "$1" in
            -d|--target) mkdir -p "$2"; touch "$2/pkg-$RANDOM.whl"; shift ;;
        esac
        shift
    done
    exit 0
fi
echo "python3 $*"
"""


@pytest.fixture
def sandbox(tmp_path: pathlib.Path) -> pathlib.Path:
    """A checkout holding only the script, with a `python3` that reaches no network."""
    (tmp_path / "tools" / "tpu").mkdir(parents=True)
    (tmp_path / "tools" / "tpu" / "run.sh").write_bytes(SCRIPT.read_bytes())
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tmp_path


def _run(sandbox: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "PATH": f"{sandbox / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "FLOWGRPO_TPU_HOLDER": str(sandbox / "holder.pid"),
        "FLOWGRPO_TPU_SITE": str(sandbox / "site"),
        "OUT": str(sandbox / "records"),
        **env,
    }
    return subprocess.run(
        ["bash", str(sandbox / "tools" / "tpu" / "run.sh"), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _files(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_wheels_keeps_the_old_folder_when_the_index_is_unreachable(sandbox: pathlib.Path) -> None:
    """It emptied .whl-tpu/ before pip failed."""
    made = _run(sandbox, "wheels")
    assert made.returncode == 0, made.stderr
    before = _files(sandbox / ".whl-tpu")
    assert ".made-by-run-sh" in before and len(before) == 2
    failed = _run(sandbox, "wheels", FAKE_PIP_FAILS="1")
    assert failed.returncode == 2
    assert "network is unreachable" in failed.stderr
    assert "run.sh: pip could not download the wheels (does it reach PyPI?); .whl-tpu is " \
        "unchanged" in failed.stderr  # fmt: skip
    assert _files(sandbox / ".whl-tpu") == before
    assert _files(sandbox) == [".whl-tpu", "bin", "tools"]  # no half-made folder left
    again = _run(sandbox, "wheels")
    assert again.returncode == 0 and _files(sandbox / ".whl-tpu") != before


def test_wheels_never_replaces_a_folder_it_did_not_make(sandbox: pathlib.Path) -> None:
    (sandbox / ".whl-tpu").mkdir()
    (sandbox / ".whl-tpu" / "mine.whl").write_text("a wheel of the user's")
    refused = _run(sandbox, "wheels")
    assert refused.returncode == 2
    assert "run.sh: .whl-tpu exists and was not made by 'run.sh wheels'" in refused.stderr
    assert _files(sandbox / ".whl-tpu") == ["mine.whl"]


def test_an_install_folder_of_the_users_is_never_removed(sandbox: pathlib.Path) -> None:
    """FLOWGRPO_TPU_SITE naming an existing folder had it removed (`rm -rf`) first."""
    assert _run(sandbox, "wheels").returncode == 0
    site = sandbox / "site"
    site.mkdir()
    (site / "notes.txt").write_text("the user's")
    refused = _run(sandbox, "python", "-c", "pass")
    assert refused.returncode == 2
    assert f"run.sh: FLOWGRPO_TPU_SITE={site} holds files this script did not put there" in (
        refused.stderr
    )
    assert _files(site) == ["notes.txt"]
    # A new folder (or an empty one) becomes the script's own, and is replaced on a new install.
    other = sandbox / "other-site"
    ran = _run(sandbox, "python", "-c", "pass", FLOWGRPO_TPU_SITE=str(other))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "python3 -c pass\n"
    assert ".flowgrpo-tpu-site" in _files(other)
    (sandbox / ".whl-tpu" / "another.whl").write_text("")
    again = _run(sandbox, "python", "-c", "pass", FLOWGRPO_TPU_SITE=str(other))
    assert again.returncode == 0 and "installed into" in again.stderr


@pytest.mark.parametrize(
    ("variable", "value", "command"),
    [
        ("FLOWGRPO_TPU_AWAIT", "abc", "await"),
        ("FLOWGRPO_TPU_AWAIT", "-1", "python"),
        ("FLOWGRPO_TPU_TIMEOUT", "ten", "test"),
        ("FLOWGRPO_TPU_TIMEOUT", "0", "test"),
        ("FLOWGRPO_TPU_BUDGET", "9.5", "suite"),
    ],
)
def test_a_variable_that_is_not_a_number_of_seconds_is_refused_by_name(
    sandbox: pathlib.Path, variable: str, value: str, command: str
) -> None:
    """FLOWGRPO_TPU_AWAIT=abc looped forever printing "integer expression expected", and
    FLOWGRPO_TPU_TIMEOUT=ten ended in "unbound variable"."""
    holder = _python_sleeping(30)
    (sandbox / "holder.pid").write_text(f"{holder.pid}\n")
    try:
        refused = _run(sandbox, command, **{variable: value})
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"run.sh: {variable} must be a whole number of seconds")
    assert f"got '{value}'" in line


def test_a_suite_that_cannot_start_fails_and_says_why(sandbox: pathlib.Path) -> None:
    """Without .whl-tpu/ it printed only "suite (exit 2, at 0 s):" and exited 0, the reason in
    its log."""
    failed = _run(sandbox, "suite")
    assert failed.returncode == 2
    assert failed.stdout.startswith("suite (exit 2, at ")
    assert "no test ran" in failed.stdout
    assert "run.sh: no .whl-tpu/ here: run 'bash tools/tpu/run.sh wheels'" in failed.stderr
