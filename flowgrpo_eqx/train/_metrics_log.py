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

        **Raises:**

        - `ValueError`: naming the file and the line, for a line that is not a JSON object
            (`keep_only` cuts back a torn last line instead).
        """
        numbered, torn = self._records()
        if torn is not None:
            raise ValueError(f"{self.path}: line {torn} is not a JSON object (a torn write?).")
        return [record for _, record in numbered]

    def _records(self) -> tuple[list[tuple[int, dict[str, Any]]], int | None]:
        """The records with their line numbers, and the number of a torn last line (or
        `None`)."""
        if self.path is None or not self.path.exists():
            return [], None
        # Bytes that are not UTF-8 spoil only their line, which is then named like any other.
        lines = self.path.read_bytes().decode("utf-8", errors="replace").splitlines()
        records: list[tuple[int, dict[str, Any]]] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                if number == len(lines):
                    return records, number
                raise ValueError(
                    f"{self.path}: line {number} is not a JSON object; nothing was cut. Mend "
                    "or remove that line."
                )
            records.append((number, record))
        return records, None

    def clear(self) -> None:
        """Start an empty log."""
        if self.path is not None and self.path.exists():
            self.path.unlink()

    def keep_only(
        self, keep: Callable[[dict[str, Any]], bool], *, report: Callable[[str], None] = print
    ) -> None:
        """Rewrite the log with only the records `keep` accepts (used when resuming).

        A torn last line (a crash or a full disk mid-write) is cut back, and `report` says so
        in one line.

        **Arguments:**

        - `keep`: `True` for a record to keep, e.g. one of an epoch before the checkpoint.
        - `report`: where the line about a torn last line goes.

        **Raises:**

        - `ValueError`: naming the file and the line, for a line before the last that is not
            a JSON object, or a record `keep` cannot judge (it raises `TypeError`,
            `ValueError` or `KeyError`, as for `{"epoch": "x"}` compared with a number).
            The file is then left as it was.
        """
        if self.path is None:
            return
        numbered, torn = self._records()
        records = []
        for number, record in numbered:
            try:
                kept = keep(record)
            except (TypeError, ValueError, KeyError) as error:
                raise ValueError(
                    f"{self.path}: line {number} ({json.dumps(record)[:200]}) cannot be read "
                    f"as a record of this log ({type(error).__name__}: {error}); nothing was "
                    "cut. Mend or remove that line."
                ) from error
            if kept:
                records.append(record)
        if torn is not None:
            report(f"Cut back the torn last line {torn} of {self.path}.")
        with atomic_file(self.path) as handle:
            handle.write("".join(jsonl_line(record) for record in records).encode())
