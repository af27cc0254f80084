"""A run folder's mechanics that every command writing one shares: refusing an `--out` that
cannot be a folder, one writer at a time (an advisory lock), and moving a run aside.

One process writes a run folder at a time: `lock_run_folder` holds an advisory lock on
`LOCK_FILE` for the whole run, and a second writer is refused naming the first's pid and host.
"""

import contextlib
import fcntl
import os
import pathlib
import shutil
import socket
from collections.abc import Iterable, Iterator


LOCK_FILE = "run.lock"
"""The run folder's lock file: held (`fcntl.flock`) by the process writing the folder, and
holding that process's pid and host; it stays when the run ends, unlocked."""


class RunFolderError(ValueError):
    """The run folder holds another run, or `--resume` would change what the run computes.

    A `ValueError` whose message says what differs and how to go on.
    """


def check_out_folder(out: pathlib.Path) -> None:
    """Refuse an `--out` that cannot be a folder, before any work: a file, or a path under one.

    **Arguments:**

    - `out`: the folder a command writes into (created if missing).

    **Raises:**

    - `RunFolderError`: naming `out` (and the file above it), saying a folder is needed.
    """
    for existing in (out, *out.parents):
        if not existing.exists():
            continue
        if existing.is_dir():
            return
        where = "is a file" if existing == out else f"lies under {existing}, which is a file"
        raise RunFolderError(
            f"`--out` {out} {where}, not a folder: the command writes its files into a folder "
            "(created if missing). Pass the path of a folder, or move the file."
        )


@contextlib.contextmanager
def lock_run_folder(out: pathlib.Path) -> Iterator[None]:
    """Hold the run folder's advisory lock (`LOCK_FILE`, `fcntl.flock`) for the duration.

    The lock goes with the open file: it is released when the block ends, and by the
    operating system when the process dies, however it dies.

    **Arguments:**

    - `out`: the run folder (created if missing).

    **Raises:**

    - `RunFolderError`: naming the pid and host recorded by the process that holds the
        lock, if another one does; as `check_out_folder`.
    """
    check_out_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 4096, 0).decode(errors="replace").strip()
            raise RunFolderError(
                f"{out} is in use by another run ({holder or 'a process that has not said who'} "
                f"holds {path}): one process writes a run folder at a time. Wait for it to end "
                "(or stop it), or train into another folder."
            ) from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)


def replaced_name(out: pathlib.Path) -> pathlib.Path:
    """Where `replace_run` moves the run in `out`: `<out>.replaced-<k>`, the first free k."""
    index = 1
    while (candidate := out.with_name(f"{out.name}.replaced-{index}")).exists():
        index += 1
    return candidate


def move_run_aside(out: pathlib.Path, keep: Iterable[str] = ()) -> pathlib.Path:
    """Move everything in `out` to `replaced_name(out)`, but the lock file (`LOCK_FILE`, which
    the caller may hold); the files named in `keep` are copied back.

    **Arguments:**

    - `out`: the run folder.
    - `keep`: glob patterns of files copied back into `out` after the move (cached inputs).

    **Returns:**

    Where the old run went.
    """
    target = replaced_name(out)
    target.mkdir()
    for entry in sorted(out.iterdir()):
        if entry.name != LOCK_FILE:
            shutil.move(str(entry), str(target / entry.name))
    for pattern in keep:
        for kept in target.glob(pattern):
            if kept.is_dir():
                shutil.copytree(kept, out / kept.name)
            else:
                shutil.copy2(kept, out / kept.name)
    return target
