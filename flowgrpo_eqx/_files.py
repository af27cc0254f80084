"""Files written whole or not at all, trees of arrays read whole, and JSON Lines logs."""

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any, BinaryIO, TypeVar

import equinox as eqx


T = TypeVar("T")

# Everything a damaged or mismatched file makes equinox/numpy raise while its leaves are read:
# `TreePathError` and the shape/dtype checks are `RuntimeError`s, a short read is `EOFError` or
# `ValueError`.
_LEAF_READ_ERRORS = (RuntimeError, ValueError, TypeError, EOFError, OSError)


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


def one_line(error: BaseException) -> str:
    """An exception and its causes (equinox wraps the real error) as one line."""
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(parts) < 4:
        text = " ".join(str(current).split())
        parts.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__
    return " <- ".join(parts)


def read_leaves_to_end(handle: BinaryIO, like: T, what: str) -> T:
    """Read `like`'s leaves, as `eqx.tree_serialise_leaves` wrote them, from `handle`'s
    position, and check that the file ends where they do.

    **Arguments:**

    - `handle`: a binary file opened for reading, at the first byte of the leaves.
    - `like`: a tree of the expected structure, shapes and dtypes.
    - `what`: what the leaves should be, for the message (e.g. `"the expected model"`).

    **Returns:**

    `like` with the leaves read.

    **Raises:**

    - `ValueError`: whose message, starting in lower case for the caller to put the file's
        name before, says that the file does not hold `what` (with the reason the leaves did
        not load) or how many bytes it holds after them.
    """
    try:
        loaded: T = eqx.tree_deserialise_leaves(handle, like)
    except _LEAF_READ_ERRORS as error:
        raise ValueError(
            f"does not hold {what} (truncated, damaged or written for another): {one_line(error)}"
        ) from error
    left = os.fstat(handle.fileno()).st_size - handle.tell()
    if left:
        raise ValueError(
            f"holds {left} bytes more than {what} reads (appended to, or written for another?)"
        )
    return loaded
