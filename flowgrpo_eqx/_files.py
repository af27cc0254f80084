"""Files written whole or not at all, and JSON Lines logs."""

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any, BinaryIO


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Write a file atomically: `path` holds either its old contents or all the new ones.

    What is written to the handle goes to a temporary file beside `path`
    (`<name>.tmp-<pid>`), which is flushed, synced to disk and then renamed over `path`
    when the block ends. If anything fails (in the block or while syncing), the temporary
    file is removed, `path` is untouched and the error propagates.

    **Arguments:**

    - `path`: the file to write; its folder is created if missing.

    **Returns:**

    A context manager giving the binary handle to write to.

    **Raises:**

    - `OSError`: as raised by the file system (e.g. `ENOSPC`, disk full).
    """
    target = pathlib.Path(path)
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def jsonl_line(record: dict[str, Any]) -> str:
    """One JSON Lines record: `record` with sorted keys on one line, newline included."""
    return json.dumps(record, sort_keys=True) + "\n"
