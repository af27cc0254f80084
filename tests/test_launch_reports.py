"""The launcher's report when a process stops responding: one line naming it, no stack frames."""

import os
import signal
import subprocess
import sys
import time

from flowgrpo_eqx.shapes_demo.launch import failure_lines, stopped_responding


def test_a_stopped_process_is_seen_as_not_responding():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not stopped_responding(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):
            if stopped_responding(child.pid):
                break
            time.sleep(0.05)
        assert stopped_responding(child.pid)
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait()
    assert not stopped_responding(child.pid)


def test_a_hung_process_is_named_in_one_line_and_no_frame_is_quoted():
    tails = [["...", "  frame #3: xla::CoordinationService abort"], ["loading"], []]
    lines = failure_lines([134, None, 0], tails, hung=[1])
    assert lines == [
        "[launch] process 1 stopped responding.",
        "[launch] process(es) 0 failed waiting for it.",
    ]
    assert not any("frame" in line for line in lines)


def test_without_a_hung_process_each_failure_is_named_with_its_last_line():
    lines = failure_lines([1, 0, 75], [["Error: bad reward", ""], [], []], hung=[])
    assert lines == ["[launch] rank 0 failed (exit status 1): Error: bad reward"]
