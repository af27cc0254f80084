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
