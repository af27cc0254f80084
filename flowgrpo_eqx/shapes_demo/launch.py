"""`flowgrpo-eqx launch --local N -- ...`: N local processes on JAX's distributed runtime.

For prototyping and tests on one machine: each process gets `--coordinator 127.0.0.1:PORT
--num-processes N --process-id I`, their output is streamed with a `[rank I]` prefix, and if
one fails the others are given a short grace period to fail on their own (JAX's runtime
notices a dead peer) and are then stopped, and the launcher exits with the failing one's
status and error. SIGTERM and SIGINT sent to the launcher are passed on to every process, which
then stop together after the same epoch; the launcher exits with `PREEMPTED_EXIT_STATUS`.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import IO, Any

from ..train import PREEMPTED_EXIT_STATUS


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _pump(rank: int, stream: IO[str], tail: deque[str], lock: threading.Lock) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))
        with lock:
            sys.stdout.write(f"[rank {rank}] {line}")
            sys.stdout.flush()


def _forward_signals(
    children: list["subprocess.Popen[str]"],
) -> dict[int, Any]:
    """Pass SIGTERM and SIGINT on to every running child (a scheduler signals the launcher;
    the ranks then stop together at the same epoch). Returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum: int, frame: Any) -> None:
        del frame
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    return {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def stopped_responding(pid: int) -> bool:
    """Whether process `pid` is stopped (by SIGSTOP or a debugger), so it cannot answer its
    peers: read from `/proc/<pid>/stat` (Linux); `False` where that cannot be read.

    **Arguments:**

    - `pid`: a process id.

    **Returns:**

    `True` for a process in state `T` (stopped) or `t` (stopped while traced).
    """
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may hold spaces.
    return stat[stat.rindex(")") + 2 :][:1] in ("T", "t")


def failure_lines(
    codes: Sequence[int | None], tails: Sequence[Sequence[str]], hung: Sequence[int]
) -> list[str]:
    """The launcher's one line per failed process, once every process has ended or been
    stopped.

    A process that stopped responding is named as such; the others then fail waiting for
    it, so their last lines (often a runtime's abort and stack frames) are not quoted.

    **Arguments:**

    - `codes`: each process's exit status (`None` for one the launcher stopped).
    - `tails`: each process's last lines of output.
    - `hung`: the processes found stopped, unable to respond.

    **Returns:**

    The lines, in process order.
    """
    if hung:
        waited = [
            rank
            for rank, code in enumerate(codes)
            if rank not in hung and code not in (0, PREEMPTED_EXIT_STATUS)
        ]
        lines = [f"[launch] process {rank} stopped responding." for rank in hung]
        if waited:
            ranks = ", ".join(str(rank) for rank in waited)
            lines.append(f"[launch] process(es) {ranks} failed waiting for it.")
        return lines
    lines = []
    for rank, code in enumerate(codes):
        if code is not None and code not in (0, PREEMPTED_EXIT_STATUS):
            last = next((line for line in reversed(tails[rank]) if line.strip()), "(no output)")
            lines.append(f"[launch] rank {rank} failed (exit status {code}): {last}")
    return lines


def launch_local(
    processes: int,
    command: Sequence[str],
    *,
    grace_seconds: float = 60.0,
    port: int | None = None,
    own_process: bool = False,
) -> int:
    """Run `flowgrpo-eqx <command>` as `processes` cooperating local processes.

    **Arguments:**

    - `processes`: how many processes (>= 1).
    - `command`: the subcommand and its arguments, e.g. `["train", "--preset", "tiny"]`.
    - `grace_seconds`: after one process fails, how long the others may take to stop on
        their own before they are killed.
    - `port`: the coordinator's port (default: a free one).
    - `own_process`: whether launching is all this process does (the `flowgrpo-eqx launch`
        script). The handlers that pass SIGTERM and SIGINT on then stay until the process
        ends, so a signal that arrives once the children are gone changes nothing: the
        launcher still exits with their status. Otherwise the previous handlers come back.

    **Returns:**

    0 if every process succeeded, else the exit status of the first that failed.

    **Raises:**

    - `ValueError`: for `processes < 1` or an empty command.
    """
    if processes < 1:
        raise ValueError(f"`processes` (--local) must be an int >= 1, got {processes}.")
    if not command:
        raise ValueError("`command` must name a subcommand, e.g. `-- train --preset tiny`.")
    address = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    children: list[subprocess.Popen[str]] = []
    forwarded = _forward_signals(children)
    tails, pumps = _start_children(children, processes, command, address, lock)
    failed, stopped, hung = _watch(children, grace_seconds, lock)
    for pump in pumps:
        pump.join(timeout=5)
    if not own_process:
        _restore_signals(forwarded)
    if failed is None:
        return 0
    if all(child.returncode == PREEMPTED_EXIT_STATUS for child in children):
        print(
            "[launch] every rank stopped after a signal and checkpointed; continue with --resume.",
            flush=True,
        )
        return PREEMPTED_EXIT_STATUS
    # Ranks that died within one poll of each other cannot be ordered, so each failed rank is
    # named with its status and last line; the exit status is the first one seen.
    codes = [None if rank in stopped else child.returncode for rank, child in enumerate(children)]
    for line in failure_lines(codes, tails, hung):
        print(line, flush=True)
    code = failed[1]
    return code if code > 0 else 128 - code


def _start_children(
    children: list[subprocess.Popen[str]],
    processes: int,
    command: Sequence[str],
    address: str,
    lock: threading.Lock,
) -> tuple[list[deque[str]], list[threading.Thread]]:
    """Start the `processes` ranks of `flowgrpo-eqx <command>` into `children`, each with a
    thread that prints its output line by line under `lock`.

    **Returns:**

    `(tails, pumps)`: each rank's last 20 lines, and the threads that read them.
    """
    tails: list[deque[str]] = []
    pumps = []
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for rank in range(processes):
        arguments = [
            sys.executable,
            "-m",
            "flowgrpo_eqx.cli",
            *command,
            "--coordinator",
            address,
            "--num-processes",
            str(processes),
            "--process-id",
            str(rank),
        ]
        child = subprocess.Popen(
            arguments,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
        )
        tail: deque[str] = deque(maxlen=20)
        assert child.stdout is not None
        pump = threading.Thread(target=_pump, args=(rank, child.stdout, tail, lock), daemon=True)
        pump.start()
        children.append(child)
        tails.append(tail)
        pumps.append(pump)
    return tails, pumps


def _watch(
    children: list[subprocess.Popen[str]], grace_seconds: float, lock: threading.Lock
) -> tuple[tuple[int, int] | None, set[int], list[int]]:
    """Wait for every child to end; after the first failure, give the others `grace_seconds`
    to stop on their own, then kill those still running.

    **Returns:**

    `(failed, stopped, hung)`: the first failed rank and its exit status (`None` if none
    failed), the ranks killed, and the ranks found to have stopped responding.
    """
    failed: tuple[int, int] | None = None
    deadline: float | None = None
    while True:
        codes = [child.poll() for child in children]
        if failed is None:
            failed = _first_failure(codes)
            if failed is not None:
                deadline = time.monotonic() + grace_seconds
                with lock:
                    print(
                        f"[launch] rank {failed[0]} failed with exit status {failed[1]}; "
                        f"waiting up to {grace_seconds:g} s for the others to stop.",
                        flush=True,
                    )
        if all(code is not None for code in codes):
            return failed, set(), []
        if failed is not None and deadline is not None and time.monotonic() > deadline:
            hung = [r for r, child in enumerate(children) if stopped_responding(child.pid)]
            return failed, _kill_running(children, failed[0], lock), hung
        time.sleep(0.2)


def _first_failure(codes: list[int | None]) -> tuple[int, int] | None:
    """The first rank that ended with a non-zero exit status, and that status."""
    return next(((rank, code) for rank, code in enumerate(codes) if code not in (None, 0)), None)


def _kill_running(
    children: list[subprocess.Popen[str]], failed_rank: int, lock: threading.Lock
) -> set[int]:
    """Kill every child still running, saying so, and wait for all; returns the ranks killed."""
    stopped: set[int] = set()
    for rank, child in enumerate(children):
        if child.poll() is None:
            with lock:
                print(f"[launch] stopping rank {rank}: rank {failed_rank} failed.", flush=True)
            child.kill()
            stopped.add(rank)
    for child in children:
        child.wait()
    return stopped
