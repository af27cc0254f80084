"""Stop a training run gracefully when the cluster asks: finish the update, checkpoint, exit.

A scheduler that preempts or cancels a job sends SIGTERM and, after a grace period, SIGKILL.
`GracefulStop` turns the first SIGTERM (or SIGINT, Ctrl-C) into a flag that the training loop
reads once per epoch, through `agreed`, so that every process stops after the same epoch, saves
a checkpoint and exits with `PREEMPTED_EXIT_STATUS`. A second signal ends the process at once.
"""

import contextlib
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import jax
import numpy as np
from jax.experimental import multihost_utils


PREEMPTED_EXIT_STATUS: Final = 75
"""The exit status after a graceful stop: 75, `EX_TEMPFAIL` of `sysexits.h` ("temporary
failure, try again"). The run saved a checkpoint and can be resumed with `--resume`; schedulers
and retry wrappers can tell it apart from success (0) and from failure (1)."""

_Handler = Callable[[int, types.FrameType | None], Any] | int | None


def exit_now(signum: int, status: int | None) -> None:
    """End the process at once from a signal handler: with exit status `status` after
    flushing stdout and stderr, or, when `status` is `None`, by the signal itself with its
    default action (as if no handler were installed).

    **Arguments:**

    - `signum`: the signal being handled.
    - `status`: the exit status, or `None` to end by the signal.
    """
    if status is not None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@final
class GracefulStop:
    """A context manager that turns SIGTERM and SIGINT into a request to stop.

    While active, the first of these signals only sets a flag and logs one line (e.g.
    `"received SIGTERM: finishing the current update, then checkpointing and stopping"`); the
    training loop asks `agreed(step)` after each epoch and, when it is `True`, saves a
    checkpoint and exits with `PREEMPTED_EXIT_STATUS`.

    A second signal (of either kind) stops the process at once (no Python cleanup runs;
    checkpoints are written atomically, so at worst a `.tmp-*` folder is left). When
    `exit_status` gives a status, the process exits with it (`os._exit`, after flushing
    stdout and stderr); otherwise the handler restores the default action for that signal and
    sends it to the process again with `os.kill`, so the process is killed by that signal,
    exactly as without `GracefulStop`: its exit status is `-signum` in `subprocess` (`-15`
    for SIGTERM, `-2` for SIGINT), `128 + signum` in a shell (143, 130).

    On exit the previous handlers are restored. Handlers can only be installed from the main
    thread: entered from another thread, `GracefulStop` installs nothing and `requested()`
    stays `False`. A signal that is ignored (`SIG_IGN`, e.g. SIGINT of a background job) when
    entering stays ignored.

    With several processes, enter it *after* `jax.distributed.initialize`: JAX's preemption
    service (on by default) installs its own SIGTERM handler at that point, which only logs
    "SIGTERM caught" and keeps the process running; entering afterwards replaces it (and on
    exit the default action, termination, is restored, not JAX's handler, which Python cannot
    see).

    **Arguments:**

    - `log`: called with the one line announcing a stop (default `print`).
    - `signals`: the signals to catch.
    - `exit_status`: called on a second signal; the status to exit with at once (e.g.
        `PREEMPTED_EXIT_STATUS` when a checkpoint is kept, so that a scheduler resumes the
        run), or `None` to die by the signal. `None` (the default): always die by it.

    **Raises:**

    - `RuntimeError`: if entered while already active.
    """

    def __init__(
        self,
        log: Callable[[str], None] = print,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
        exit_status: Callable[[], int | None] | None = None,
    ):
        self._log = log
        self._signals = tuple(signals)
        self._exit_status = exit_status
        self._previous: dict[signal.Signals, _Handler] = {}
        self._received: signal.Signals | None = None
        self._unlogged: str | None = None
        self._agreed = False
        self._active = False

    def __enter__(self) -> "GracefulStop":
        if self._active:
            raise RuntimeError("This GracefulStop is already active.")
        self._active = True
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self._signals:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            # `None`: a handler installed outside Python, which cannot be reinstated.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self._active = False

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        if self._received is not None:
            exit_now(signum, self._exit_status() if self._exit_status is not None else None)
            return
        self._received = signal.Signals(signum)
        name = self._received.name
        message = (
            f"received {name}: finishing the current update, then checkpointing and stopping "
            f"(a second {name} stops at once)"
        )
        # The handler runs between two bytecodes of the main thread, which may be inside a
        # write to the same stream (a progress bar); then the line waits for `requested()`.
        try:
            self._log(message)
        except Exception:  # noqa: BLE001
            self._unlogged = message

    @property
    def received(self) -> signal.Signals | None:
        """The signal that requested the stop, or `None`."""
        return self._received

    def requested(self) -> bool:
        """Whether this process received a stop signal."""
        if self._unlogged is not None:
            message, self._unlogged = self._unlogged, None
            self._log(message)
        return self._received is not None

    def agreed(self, step: int) -> bool:
        """Whether to stop after `step`, the same answer on every process.

        With one process this is `requested()`. With several (`jax.process_count() > 1`)
        every process must call it at the same point of every step (e.g. after each epoch);
        the processes exchange their flags and steps in one tiny all-gather
        (`multihost_utils.process_allgather`) and all stop as soon as any one was signalled,
        e.g. when a SIGTERM reached only one of them. Once `True` it stays `True` (without
        further collectives, on every process alike).

        JAX offers `multihost_utils.reached_preemption_sync_point(step)` for this, but it is
        not used: it needs `jax.distributed.initialize` (so it never fires in a one-process
        run), JAX's preemption service enabled, and JAX's own SIGTERM handler in place (which
        this class replaces, and which ignores SIGINT); it fires at exactly one step chosen in
        the background, so it must be polled every step; and it cannot report which process
        was signalled. The all-gather costs one small collective per call and catches any
        signal this class catches.

        **Arguments:**

        - `step`: the step just finished; it must be the same on every process.

        **Returns:**

        `True` if this or any other process received a stop signal.

        **Raises:**

        - `RuntimeError`: if the processes called it at different steps.
        """
        if self._agreed:
            return True
        local = self.requested()
        if jax.process_count() == 1:
            self._agreed = local
            return local
        gathered = multihost_utils.process_allgather(np.asarray([int(local), step], np.int32))
        votes = np.asarray(gathered).reshape(-1, 2)
        steps = sorted({int(s) for s in votes[:, 1]})
        if len(steps) > 1:
            raise RuntimeError(
                "GracefulStop.agreed was called at different steps on different processes: "
                f"{[int(s) for s in votes[:, 1]]} (by process rank)."
            )
        signalled = [rank for rank, flag in enumerate(votes[:, 0]) if flag]
        if signalled:
            self._agreed = True
            if not local:
                self._log(
                    f"process {', '.join(map(str, signalled))} received a stop signal: "
                    f"stopping after step {step}, then checkpointing"
                )
        return self._agreed
