"""A dead xdist worker ends the run, named at once; each test process's peak memory is shown.

The root `conftest.py` registers this plugin for every run:

- a test still running after `TIMEOUT` seconds (`--test-timeout=S`, 0 for none), its
  fixtures included, has its process print every thread's stack to the terminal and exit
  (`faulthandler`: its watchdog is a thread that needs no Python to run, so a test hung in
  compiled code is stopped too; pytest-timeout's thread method writes to an xdist worker's
  standard output, which goes nowhere);
- a worker that dies (killed for want of memory, a crash in compiled code, a test past its
  timeout) is not replaced: `--max-worker-restart` defaults to 0 here. xdist's own default
  replaces up to 4 per worker, and the replacement runs the dead worker's file again from
  the test that killed it, which, when memory ran out, is the likeliest to kill it again;
  a replacement has also been seen to sit idle, printing nothing, with tests left. The test
  the worker was running is reported failed, and the run ends, failed, once the other
  workers have finished what they were sent. `--max-worker-restart=N` lets N be replaced;
- a line names the dead worker and its test as it is found dead, where xdist names the test
  only in the closing summary;
- at the end of a run, one line gives the peak resident memory (the kernel's high-water mark,
  `getrusage`'s `ru_maxrss`) of each test process: each xdist worker, or the one process of
  a run without workers. Not of the processes tests start: the kernel's figure for those
  includes the memory of the test process they were forked from;
- `FLOWGRPO_TEST_MEMORY=FILE`: the process's figures are written to `FILE` as JSON at its
  end (`tools/suite_memory.py` reads them), with a worker's id in the name
  (`FILE.gw0`, `FILE.gw1`, ...);
- `FLOWGRPO_TEST_MEMORY_LOG=FOLDER`: after each test, one JSON line in `FOLDER/<worker>.jsonl`
  with the test, the process's resident memory then and its peak so far, in MB, to find
  what holds memory from one test to the next.
"""

import faulthandler
import json
import os
import pathlib
import resource
import sys
import time
from typing import Any

import pytest


MEMORY = "FLOWGRPO_TEST_MEMORY"
MEMORY_LOG = "FLOWGRPO_TEST_MEMORY_LOG"

_KEY = "flowgrpo_peak_memory"


def _megabytes(maxrss: int) -> float:
    """`ru_maxrss` in MB (10^6 bytes): kilobytes on Linux, bytes on macOS."""
    return maxrss / 1e6 if sys.platform == "darwin" else maxrss * 1024 / 1e6


def peak_megabytes() -> float:
    """This process's peak resident memory so far, in MB."""
    return _megabytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def resident_megabytes() -> float | None:
    """This process's resident memory now, in MB (None where /proc is not)."""
    try:
        pages = int(pathlib.Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


TIMEOUT = 900.0
"""Seconds a test may run, its fixtures included. The longest take about 2 minutes on a
2-core machine that runs other work besides the suite's two workers."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--test-timeout",
        type=float,
        default=TIMEOUT,
        metavar="S",
        help=f"seconds a test, its fixtures included, may run before its process prints every "
        f"thread's stack and exits; 0: no limit ({TIMEOUT:g}, tests/worker_health.py)",
    )


_STDERR = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """`--max-worker-restart` 0 unless given, before xdist reads it; the terminal's standard
    error kept for a timeout's stacks (a test's own is captured)."""
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"
    config.stash[_STDERR] = os.dup(sys.__stderr__.fileno() if sys.__stderr__ else 2)


def pytest_unconfigure(config: pytest.Config) -> None:
    descriptor = config.stash.get(_STDERR, None)
    if descriptor is not None:
        os.close(descriptor)
        del config.stash[_STDERR]


def timeout_seconds(config: pytest.Config) -> float:
    """`--test-timeout`: seconds, 0 for no limit."""
    seconds = float(config.getoption("--test-timeout"))
    if seconds < 0:
        raise pytest.UsageError(f"the test timeout must be 0 or more seconds, got {seconds:g}")
    return seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    seconds = timeout_seconds(item.config)
    descriptor = item.config.stash.get(_STDERR, None)
    if seconds <= 0 or descriptor is None:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True, file=descriptor)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _worker_id(config: pytest.Config) -> str | None:
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    folder = os.environ.get(MEMORY_LOG)
    if not folder:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {
        "test": nodeid,
        "pid": os.getpid(),
        "time": time.time(),
        "rss_mb": resident_megabytes(),
        "peak_mb": peak_megabytes(),
    }
    with open(pathlib.Path(folder) / f"{worker}.jsonl", "a") as log:
        log.write(json.dumps(line) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    peak = peak_megabytes()
    worker = _worker_id(config)
    path = os.environ.get(MEMORY)
    if path:
        target = pathlib.Path(path if worker is None else f"{path}.{worker}")
        target.write_text(json.dumps({"peak_mb": peak}))
    if worker is not None:
        config.workeroutput[_KEY] = peak  # type: ignore[attr-defined]
    elif not config.pluginmanager.has_plugin("dsession"):
        config.stash[_PEAKS] = {"": peak}


_PEAKS = pytest.StashKey[dict[str, float]]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    peak = getattr(node, "workeroutput", {}).get(_KEY)
    if peak is not None:
        node.config.stash.setdefault(_PEAKS, {})[str(node.gateway.id)] = peak


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """xdist found a worker dead in the middle of `crashitem`: say so now, not only in the
    summary at the end (a worker killed for want of memory leaves no other trace)."""
    worker = getattr(getattr(report, "node", None), "gateway", None)
    name = getattr(worker, "id", "?")
    config = getattr(getattr(report, "node", None), "config", None)
    reporter = None if config is None else config.pluginmanager.get_plugin("terminalreporter")
    line = (
        f"worker {name} crashed while running {crashitem}: killed (for want of memory?), "
        "crashed, or past the test timeout (its threads' stacks printed above, 'Timeout')"
    )
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(line, red=True, bold=True)
    else:
        print(line, file=sys.stderr, flush=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    peaks = config.stash.get(_PEAKS, None)
    if not peaks or _worker_id(config) is not None:
        return
    parts = [f"{name + ' ' if name else ''}{peak:,.0f} MB" for name, peak in sorted(peaks.items())]
    terminalreporter.write_line("peak resident memory of the test processes: " + ", ".join(parts))
