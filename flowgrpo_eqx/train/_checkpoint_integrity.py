"""What a checkpoint's `meta.json` records, and the checks made before trusting a checkpoint.

A checkpoint is trusted only if its `meta.json` is a JSON object recording this version's
layout (`LAYOUT_VERSION`), every file it records is present with its length and SHA-256, and
the arrays it records have the template's paths, shapes and dtypes. Every failure is a
`CheckpointError` naming the checkpoint and the problem; a checkpoint of another layout is a
`CheckpointVersionError`, which is not damage and must not be skipped.
"""

import hashlib
import json
import os
import pathlib
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._files import one_line
from .._misc import keys_to_data


STATE = "state"
META = "meta.json"
ARRAYS_KEY = "state_arrays"
FILES_KEY = "state_files"
LAYOUT_KEY = "layout_version"
LAYOUT_VERSION = 2
"""The layout of what a checkpoint stores, recorded in every `meta.json` as `layout_version`.

It is raised whenever checkpoints written before can no longer be restored: 2 is the train
state with per-objective typed variables and the EMA in a field of its own; 1 (checkpoints
recording no layout version) was `Variables(policy, held)`. A checkpoint of another layout
is refused with a `CheckpointVersionError`.
"""


PYTHON_SCALARS = (bool, int, float, complex)


class CheckpointError(ValueError):
    """A checkpoint (or a checkpoint folder) cannot be used: its files are missing or damaged,
    or it holds a different state than the one expected.

    A `ValueError`, like other errors about data that cannot be decoded (e.g.
    `json.JSONDecodeError`); failing to *write* a checkpoint is an `OSError` instead.

    **Arguments:**

    - `path`: the checkpoint's folder (or the folder of checkpoints, or a model file).
    - `problem`: what is wrong, in one line.

    The message is `"<path>: <problem>"`; both are kept as attributes.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str):
        self.path = pathlib.Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class CheckpointVersionError(CheckpointError):
    """A checkpoint written by another version of flowgrpo_eqx, with another layout of what it
    stores, which this version cannot resume.

    Unlike a damaged checkpoint, it is never skipped for an older one: every checkpoint of the
    run was most likely written by the same version, and the user has to choose (resume with
    the version that wrote it, or start afresh in another folder).

    **Arguments:**

    - `path`: the checkpoint's folder.
    - `found`: the layout version its `meta.json` records (1 when it records none).
    - `expected`: the layout version this version of flowgrpo_eqx reads and writes.

    The message names both versions; `found` and `expected` are kept as attributes too.
    """

    def __init__(self, path: str | os.PathLike[str], found: Any, expected: int):
        self.found = found
        self.expected = expected
        older = type(found) is int and found < expected
        super().__init__(
            path,
            f"the checkpoint has layout version {found!r} but this version of flowgrpo_eqx "
            f"reads layout version {expected}: it was written by "
            f"{'an older' if older else 'another'} version of flowgrpo_eqx and cannot be "
            "resumed by this one (resume it with the version that wrote it, or start a new "
            "run in another folder)",
        )


def write_error(error: OSError, path: pathlib.Path, what: str) -> OSError:
    """The same kind of `OSError` (same errno), naming the file being written."""
    reason = error.strerror or str(error)
    message = f"{reason} while writing {what} (nothing older was touched)"
    if error.errno is None:
        return OSError(f"{message}: '{path}'")
    return OSError(error.errno, message, str(path))


def is_stored(leaf: Any) -> bool:
    """Whether a checkpoint stores `leaf`; other leaves (functions, ...) come from the template."""
    return eqx.is_array(leaf) or isinstance(leaf, PYTHON_SCALARS)


def stored_leaves(tree: PyTree[Any]) -> list[tuple[str, Any]]:
    """`(path, leaf)` for every stored leaf of `tree`, typed keys as their raw data."""
    flat, _ = jax.tree_util.tree_flatten_with_path(keys_to_data(tree))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat if is_stored(leaf)]


def describe_array(leaf: Any) -> tuple[list[int], str]:
    if isinstance(leaf, PYTHON_SCALARS):
        leaf = np.asarray(leaf)
    return [int(n) for n in leaf.shape], str(np.dtype(leaf.dtype))


def _is_place(place: Any) -> bool:
    """Whether `place` is one `_storage_plan` writes: `"<index>"` or `"packed_<dtype>:<offset>"`."""
    if not isinstance(place, str):
        return False
    if place.startswith("packed_"):
        _, _, offset = place.partition(":")
        return offset.isdigit()
    return place.isdigit()


def _sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_records(folder: pathlib.Path) -> dict[str, list[Any]]:
    """`relative path -> [bytes, sha256]` of every file under `folder`."""
    records: dict[str, list[Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        records[path.relative_to(folder).as_posix()] = [path.stat().st_size, _sha256(path)]
    return records


def read_metadata(folder: pathlib.Path) -> dict[str, Any]:
    meta_path = folder / META
    if not meta_path.is_file():
        raise CheckpointError(folder, f"{META} is missing")
    try:
        text = meta_path.read_bytes().decode()
        metadata = json.loads(text)
    except OSError as error:
        raise CheckpointError(folder, f"{META} cannot be read ({one_line(error)})") from error
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(folder, f"{META} is not valid JSON ({one_line(error)})") from error
    if not isinstance(metadata, dict):
        raise CheckpointError(
            folder, f"{META} holds a JSON {type(metadata).__name__}, not an object"
        )
    found = metadata.get(LAYOUT_KEY, 1)
    if type(found) is not int or found != LAYOUT_VERSION:
        raise CheckpointVersionError(folder, found, LAYOUT_VERSION)
    for key in (ARRAYS_KEY, FILES_KEY):
        if not isinstance(metadata.get(key), (list, dict)):
            raise CheckpointError(
                folder, f"{META} records no {key!r} (not a checkpoint written by Checkpointer)"
            )
    return metadata


def check_state_files(folder: pathlib.Path, metadata: dict[str, Any]) -> None:
    """Every file recorded in `meta.json` is present with its length and checksum."""
    state = folder / STATE
    if not state.is_dir():
        raise CheckpointError(folder, f"{STATE}/ is missing")
    for name, record in metadata[FILES_KEY].items():
        if not (
            isinstance(record, list)
            and len(record) == 2
            and type(record[0]) is int
            and isinstance(record[1], str)
        ):
            raise CheckpointError(
                folder, f"{META}'s {FILES_KEY!r} entry {name!r} is not [bytes, sha256]"
            )
        path = state / name
        if not path.is_file():
            raise CheckpointError(folder, f"{STATE}/{name} is missing")
        size = path.stat().st_size
        if size != record[0]:
            raise CheckpointError(
                folder,
                f"{STATE}/{name} is {size} bytes but {META} records {record[0]} "
                "(truncated or overwritten)",
            )
        try:
            digest = _sha256(path)
        except OSError as error:
            raise CheckpointError(
                folder, f"{STATE}/{name} cannot be read ({one_line(error)})"
            ) from error
        if digest != record[1]:
            raise CheckpointError(
                folder, f"{STATE}/{name}'s SHA-256 does not match the one in {META} (corrupted)"
            )


def check_arrays(
    folder: pathlib.Path, metadata: dict[str, Any], leaves: list[tuple[str, Any]]
) -> None:
    """The stored arrays are the template's: same paths, shapes and dtypes, same number."""
    recorded = metadata[ARRAYS_KEY]
    mismatch = "does not hold the expected state (a different model or settings?): "
    if len(recorded) != len(leaves):
        raise CheckpointError(
            folder,
            mismatch + f"it stores {len(recorded)} arrays, the expected state has {len(leaves)}",
        )
    for index, ((path, leaf), stored) in enumerate(zip(leaves, recorded, strict=True)):
        if not (isinstance(stored, list) and len(stored) == 4 and _is_place(stored[3])):
            raise CheckpointError(
                folder,
                f"{META}'s {ARRAYS_KEY!r} entry {index} is not [path, shape, dtype, place]",
            )
        shape, dtype = describe_array(leaf)
        if stored[:3] != [path, shape, dtype]:
            raise CheckpointError(
                folder,
                mismatch + f"array {stored[0]} is {stored[2]}{stored[1]} in the checkpoint, "
                f"the expected state has {path} as {dtype}{shape}",
            )
        if stored[3].startswith("packed_") and stored[3].split(":")[0] != f"packed_{dtype}":
            raise CheckpointError(folder, f"{META} places the {dtype} array {path} in {stored[3]}")
