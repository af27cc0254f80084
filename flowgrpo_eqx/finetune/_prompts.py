"""Prompts files and their embeddings, computed once and kept in the run folder.

A prompts file is one prompt a line (any suffix but `.jsonl`), or JSON Lines: one object a
line with a string `"prompt"`, the whole object passed to host rewards as the prompt's
metadata (flow_grpo's GenEval and OCR prompt files). Blank lines are skipped.

`EmbeddingStore` keeps each prompt set's condition (and what a device reward reads of each
prompt) as `.npy` files under `RUN/embeddings/`, with `index.json` recording what they were
made from; a resumed run whose prompts and text settings are the same reads them back
(memory-mapped) instead of running the text encoders again.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np


class PromptsError(ValueError):
    """A prompts file that cannot be used: the message names the file (and the line)."""


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """The prompts of one file, with each one's metadata (`{}` for a text file)."""

    prompts: tuple[str, ...]
    metadata: tuple[dict[str, Any], ...]
    source: str

    def __len__(self) -> int:
        return len(self.prompts)

    def fingerprint(self) -> str:
        """A digest of the prompts and their metadata."""
        text = json.dumps([self.prompts, self.metadata], sort_keys=True, ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def first(self, count: int | None) -> "PromptSet":
        """The first `count` prompts (all for `None`)."""
        if count is None or count >= len(self):
            return self
        return PromptSet(self.prompts[:count], self.metadata[:count], self.source)


def read_prompts(path: str | os.PathLike[str], setting: str) -> PromptSet:
    """Read a prompts file.

    **Arguments:**

    - `path`: the file.
    - `setting`: the setting that names it (`prompts.train`), for messages.

    **Returns:**

    The `PromptSet`.

    **Raises:**

    - `PromptsError`: naming the setting and the file when it cannot be read, is not UTF-8,
        holds no prompt, or (JSON Lines) a line is not a JSON object with a string
        `"prompt"` (naming the line).
    """
    file = pathlib.Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptsError(f"Setting `{setting}`: {file} does not exist.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PromptsError(
            f"Setting `{setting}`: {file} cannot be read as UTF-8 text: {error}"
        ) from None
    prompts: list[str] = []
    metadata: list[dict[str, Any]] = []
    json_lines = file.suffix == ".jsonl"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if not json_lines:
            prompts.append(line.strip())
            metadata.append({})
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise PromptsError(
                f"Setting `{setting}`: {file} line {number} is not JSON ({error}); a .jsonl "
                'prompts file holds one object a line, e.g. {"prompt": "a red cube", ...}.'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise PromptsError(
                f'Setting `{setting}`: {file} line {number} has no string "prompt": each '
                'line of a .jsonl prompts file is an object such as {"prompt": "a red cube"}.'
            )
        prompts.append(record["prompt"])
        metadata.append(record)
    if not prompts:
        raise PromptsError(f"Setting `{setting}`: {file} holds no prompt.")
    return PromptSet(tuple(prompts), tuple(metadata), str(file))


Rows = dict[str, np.ndarray]


class EmbeddingStore:
    """Per-prompt arrays in `folder`, one `.npy` per set and field, recorded in `index.json`
    with the key they were made for.

    **Arguments:**

    - `folder`: the run folder's `embeddings/`.
    """

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder

    def _index(self) -> dict[str, Any]:
        try:
            loaded = json.loads((self.folder / "index.json").read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def load(self, name: str, key: str) -> Rows | None:
        """The arrays of set `name` if they were stored for `key`, memory-mapped; else
        `None`."""
        entry = self._index().get(name)
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None
        rows: Rows = {}
        try:
            for field, dtype in entry["fields"].items():
                raw = np.load(self.folder / f"{name}.{field}.npy", mmap_mode="r")
                rows[field] = raw.view(jnp.dtype(dtype)) if dtype == "bfloat16" else raw
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return rows

    def stored(self, name: str) -> Rows | None:
        """The arrays of set `name` whatever they were made for, or `None`."""
        entry = self._index().get(name)
        return None if not isinstance(entry, dict) else self.load(name, str(entry.get("key")))

    def save(self, name: str, key: str, rows: Rows) -> Rows:
        """Store set `name`'s arrays for `key`, replacing what was there; returns them
        memory-mapped from the files."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fields = {}
        for field, array in rows.items():
            dtype = str(array.dtype)
            stored = array.view(np.uint16) if dtype == "bfloat16" else array
            temporary = self.folder / f".{name}.{field}.npy"
            np.save(temporary, stored)
            os.replace(temporary, self.folder / f"{name}.{field}.npy")
            fields[field] = dtype
        index = self._index()
        index[name] = {"key": key, "fields": fields}
        temporary = self.folder / ".index.json"
        temporary.write_text(json.dumps(index, indent=1))
        os.replace(temporary, self.folder / "index.json")
        loaded = self.load(name, key)
        assert loaded is not None
        return loaded

    def get(self, name: str, key: str, make: Callable[[], Rows]) -> tuple[Rows, bool]:
        """The stored arrays of `name` for `key`, or `make()`'s, stored.

        **Returns:**

        `(rows, reused)`.
        """
        found = self.load(name, key)
        if found is not None:
            return found, True
        return self.save(name, key, make()), False
