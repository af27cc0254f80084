"""`MetricsLog`: a JSON Lines log of records, appended as training goes and read back."""

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any, final

from .._files import atomic_file, jsonl_line


@final
class MetricsLog:
    """`metrics.jsonl`: one JSON object per line, appended and flushed as training goes.

    **Arguments:**

    - `path`: the file, or `None` for a log that keeps nothing (e.g. on processes other than
        process 0, which writes the run's files).
    """

    def __init__(self, path: str | os.PathLike[str] | None):
        self.path = None if path is None else pathlib.Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record.

        **Arguments:**

        - `record`: a JSON-serialisable dict, written with sorted keys on one line.
        """
        if self.path is None:
            return
        with open(self.path, "a") as handle:
            handle.write(jsonl_line(record))
            handle.flush()

    def read(self) -> list[dict[str, Any]]:
        """Every record written so far, oldest first.

        **Returns:**

        The records as dicts; empty for a log that keeps nothing or has no file yet.
        """
        if self.path is None or not self.path.exists():
            return []
        with open(self.path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def clear(self) -> None:
        """Start an empty log."""
        if self.path is not None and self.path.exists():
            self.path.unlink()

    def keep_only(self, keep: Callable[[dict[str, Any]], bool]) -> None:
        """Rewrite the log with only the records `keep` accepts (used when resuming).

        **Arguments:**

        - `keep`: `True` for a record to keep, e.g. one of an epoch before the checkpoint.
        """
        if self.path is None:
            return
        records = [r for r in self.read() if keep(r)]
        with atomic_file(self.path) as handle:
            handle.write("".join(jsonl_line(record) for record in records).encode())
