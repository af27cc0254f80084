"""Atomic, verified, sharded checkpoints on Orbax: every process writes its own shards.

A checkpoint is a folder `ckpt_<step>` holding

- `state/`: the state's arrays, written by `orbax.checkpoint` (`StandardCheckpointHandler`,
  TensorStore/OCDBT). Every process writes the shards its devices hold of each array split
  over devices (FSDP), so a sharded state is never gathered onto one process to be saved.
  Whole arrays (replicated, on one device, or NumPy) are written once, by process 0, packed
  into one flat buffer per dtype: Orbax's cost is per array, and a train state has hundreds
  of small ones.
- `meta.json`: the caller's metadata plus `step`, `layout_version` (`LAYOUT_VERSION`), the
  path, shape, dtype and place (its own Orbax array, or a packed buffer and offset) of every
  stored array (`state_arrays`), and the byte length and SHA-256 of every file under `state/`
  (`state_files`).

Saving is atomic: everything is written into a `.tmp-<step>` folder which is renamed into
place only when complete, so a save interrupted at any point (even by SIGKILL) leaves at most
that folder, which is ignored and removed by the next save of the same step, and the previous
checkpoints stay loadable. A write that fails (a full disk) removes its temporary folder and
raises an `OSError` naming the checkpoint.

Restoring places each array with the sharding of the corresponding leaf of the template, so
a checkpoint written on 4 devices restores onto 2 or onto 1 (or onto another sharding) with
identical values, each process reading only what its devices hold.

Reading checks everything it can before trusting a checkpoint: that `meta.json` is a JSON
object recording this version's layout, that every recorded file is present with its recorded
length and checksum, and that the stored arrays have the template's paths, shapes and dtypes,
no more and no fewer. Any failure is a `CheckpointError` naming the checkpoint and the
problem; `Checkpointer.restore_latest` skips such checkpoints, says so, and continues from the
newest usable one. A checkpoint of another layout (written by another version of
flowgrpo_eqx) is not damaged and is never skipped: it is a `CheckpointVersionError` naming
both versions, which stops the run.

Orbax (rather than a format of our own, or one `eqx.tree_serialise_leaves` file per process)
because it is the JAX ecosystem's maintained answer to exactly this: per-process shard writes
coordinated across hosts, and restoring onto any sharding without materialising whole arrays.
It is imported only when a checkpoint is saved or read. Single models (`save_model`,
`load_model`: `policy.eqx` and the base models) stay one `eqx.tree_serialise_leaves` file
(`_model_file.py`): they are exports, read by `flowgrpo-eqx eval` or by users' own code, not
checkpoints. What `meta.json` records and the checks made on reading are in
`_checkpoint_integrity.py`; how the arrays are written and read through Orbax, in
`_checkpoint_orbax.py`.
"""

import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jaxtyping import PyTree

from .._distributed import sync_processes
from .._files import atomic_file, one_line
from .._misc import check_int, data_to_keys, keys_to_data
from ._checkpoint_integrity import (
    ARRAYS_KEY,
    FILES_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION as LAYOUT_VERSION,
    META,
    STATE,
    CheckpointError as CheckpointError,
    CheckpointVersionError as CheckpointVersionError,
    check_arrays,
    check_state_files,
    describe_array,
    file_records,
    is_stored,
    read_metadata,
    stored_leaves,
    write_error,
)
from ._checkpoint_orbax import (
    os_error_of,
    placed_array,
    restore_arrays,
    restore_target,
    storage_plan,
    write_state,
)
from ._model_file import load_model as load_model, save_model as save_model


T = TypeVar("T")

_PREFIX = "ckpt_"
_TEMPORARY_PREFIX = ".tmp-"
# Orbax's barriers need names never used before in the process; saves are collective, so
# every process counts them alike.


def _check_metadata(metadata: Any) -> None:
    """Raise a `ValueError` naming `metadata` (and the key) unless it is a dict of `str` keys,
    none reserved, whose values `json.dumps` writes as they are (no value is converted)."""
    if not isinstance(metadata, dict):
        raise ValueError(f"`metadata` must be a dict, got {type(metadata).__name__}.")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise ValueError(f"`metadata` keys must be str, got the key {key!r}.")
        if key in ("step", LAYOUT_KEY, ARRAYS_KEY, FILES_KEY):
            raise ValueError(f"`metadata` must not use the key {key!r}.")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"`metadata`[{key!r}] is not JSON-serialisable ({type(value).__name__}: "
                f"{error}); pass Python values (e.g. float(x) for a NumPy scalar)."
            ) from error


def _fsync_folder(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _read_checkpoint(folder: pathlib.Path, like: T) -> tuple[T, dict[str, Any]]:
    """Check and load one checkpoint folder; any problem is a `CheckpointError` naming it."""
    if not folder.is_dir():
        raise CheckpointError(folder, "no such checkpoint folder")
    metadata = read_metadata(folder)
    check_state_files(folder, metadata)
    leaves = stored_leaves(like)
    check_arrays(folder, metadata, leaves)
    # Each leaf's Orbax array, and for a packed leaf its slice of that flat buffer.
    places: list[tuple[str, slice | None]] = []
    target: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for (_, leaf), record in zip(leaves, metadata[ARRAYS_KEY], strict=True):
        where = str(record[3])
        if where.startswith("packed_"):
            name, offset = where.split(":")
            start = int(offset)
            end = start + int(np.prod(record[1], dtype=np.int64))
            places.append((name, slice(start, end)))
            sizes[name] = max(sizes.get(name, 0), end)
        else:
            places.append((where, None))
            target[where] = restore_target(leaf)
    for name, size in sizes.items():
        target[name] = np.zeros(size, np.dtype(name[len("packed_") :]))
    try:
        arrays = restore_arrays(folder / STATE, target)
    except Exception as error:
        raise CheckpointError(
            folder, f"{STATE}/ cannot be read by Orbax ({one_line(error)})"
        ) from error
    values = []
    for (_, leaf), (name, span) in zip(leaves, places, strict=True):
        if span is None:
            values.append(arrays[name])
        else:
            shape, _ = describe_array(leaf)
            values.append(placed_array(np.asarray(arrays[name])[span].reshape(shape), leaf))
    loaded = iter(values)

    def fill(leaf: Any) -> Any:
        return next(loaded) if is_stored(leaf) else leaf

    data = keys_to_data(like)
    restored: T = data_to_keys(jax.tree.map(fill, data), like)
    return restored, metadata


def _describe(metadata: dict[str, Any], folder: pathlib.Path) -> str:
    step = metadata.get("step", folder.name[len(_PREFIX) :].lstrip("0") or "0")
    if "epoch" in metadata:
        return f"step {step}, epoch {metadata['epoch']}"
    return f"step {step}"


class Checkpointer:
    """Save, list, prune, verify and restore checkpoints in one folder.

    With several processes (`jax.distributed`), `save`, `restore` and `restore_latest` are
    collective: every process calls them, in the same order, with its view of the same global
    arrays. Each process writes and reads only its own shards; process 0 writes `meta.json`,
    renames the finished checkpoint into place and prunes.

    **Arguments:**

    - `directory`: where checkpoints live (created if missing); with several processes, a
        folder every process sees (a shared file system).
    - `keep`: how many of the newest checkpoints to keep (older ones are deleted).

    **Raises:**

    - `ValueError`: naming `keep` if it is not an int >= 1.

    Every method that reads or writes the folder raises a `CheckpointError` naming
    `directory` when it is a file (or anything but a folder).
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3):
        check_int("keep", keep, 1)
        self.directory = pathlib.Path(directory)
        self.keep = keep

    def _check_directory(self) -> bool:
        """Whether `directory` exists (as a folder).

        **Raises:**

        - `CheckpointError`: naming `directory`, when something else is there (a file).
        """
        if not self.directory.exists():
            return False
        if not self.directory.is_dir():
            raise CheckpointError(
                self.directory,
                "is a file, not a folder: a Checkpointer keeps its checkpoints in a folder "
                "(pass the folder they are saved in, or a new one)",
            )
        return True

    def paths(self) -> list[pathlib.Path]:
        """Checkpoint folders `ckpt_<step>`, oldest first, intact or damaged.

        Damaged ones (e.g. a missing or garbled `meta.json`) are listed so that reading them
        reports the damage; the `.tmp-*` folders of interrupted saves are not.

        **Returns:**

        The folders, sorted by step; empty when `directory` does not exist.

        **Raises:**

        - `CheckpointError`: naming `directory`, when it is a file.
        """
        if not self._check_directory():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
        ]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def unfinished_writes(self) -> list[pathlib.Path]:
        """The `.tmp-*` folders of saves that never completed (a process stopped mid-write),
        oldest first: not checkpoints, never restored, but what is left of the attempt.

        **Returns:**

        The folders, sorted by name (which begins with the step); empty when `directory`
        does not exist.

        **Raises:**

        - `CheckpointError`: naming `directory`, when it is a file.
        """
        if not self._check_directory():
            return []
        return sorted(p for p in self.directory.iterdir() if p.name.startswith(_TEMPORARY_PREFIX))

    def latest(self) -> pathlib.Path | None:
        """The newest checkpoint folder (not necessarily intact), or `None`.

        **Returns:**

        The last of `paths()`, or `None` when there is none.
        """
        paths = self.paths()
        return paths[-1] if paths else None

    def latest_metadata(self) -> tuple[dict[str, Any], pathlib.Path] | None:
        """What the newest checkpoint recorded, read from its `meta.json` alone (no arrays):
        to compare a run's settings with a checkpoint's before any work.

        Checkpoints whose `meta.json` cannot be read are passed over, as `restore_latest`
        passes them over.

        **Returns:**

        `(metadata, path)`: the metadata `save` was given (with `step`), or `None` when no
        checkpoint's `meta.json` reads.

        **Raises:**

        - `CheckpointError`: naming `directory`, when it is a file.
        - `CheckpointVersionError`: naming the checkpoint and both layout versions, for the
            newest readable checkpoint of another version of flowgrpo_eqx.
        """
        for folder in reversed(self.paths()):
            try:
                return read_metadata(folder), folder
            except CheckpointVersionError:
                raise
            except CheckpointError:
                continue
        return None

    def save(self, step: int, tree: PyTree[Any], metadata: dict[str, Any]) -> pathlib.Path:
        """Write `tree` and `metadata` as checkpoint `step`, atomically, then prune.

        Arrays keep their sharding: every process writes the shards its devices hold (a
        replicated array once). Pruning deletes all but the `keep` newest checkpoints by
        step, never the one just written, and only after it was written successfully.

        **Arguments:**

        - `step`: the checkpoint's number (e.g. the epoch), an int >= 0; larger is newer.
        - `tree`: any PyTree of arrays (e.g. a `TrainState`), sharded or not; its other
            leaves (functions, ...) are not stored, and come from the template on restore.
        - `metadata`: JSON-serialisable facts to keep beside it, by `str` key (Python values:
            a NumPy scalar such as `np.float32(0.5)` is refused, not converted; not `step`,
            `layout_version`, `state_arrays` or `state_files`, which record what was stored).

        **Returns:**

        The checkpoint's folder.

        **Raises:**

        - `ValueError`: naming `step` if it is not an int >= 0; naming `metadata` if it is
            not a dict, uses a reserved key or a key that is not a `str`, or (naming the key)
            holds a value JSON cannot write; a `CheckpointError` naming `directory` when it
            is a file. Each before anything is written.
        - `OSError`: of the original kind and errno (e.g. `ENOSPC`, disk full; `EFBIG`, past
            the process's file-size limit), naming the checkpoint's folder, if writing fails
            (in the file system, or inside Orbax and TensorStore, which report the errno in
            their own error). Its temporary folder is removed and the
            previous checkpoints are untouched.
        """
        check_int("step", step, 0)
        step = int(step)
        _check_metadata(metadata)
        self._check_directory()
        root = jax.process_index() == 0
        final = self.directory / f"{_PREFIX}{step:08d}"
        temporary = self.directory / f"{_TEMPORARY_PREFIX}{step:08d}"
        leaves = stored_leaves(tree)
        plan = storage_plan(leaves)
        try:
            if root:
                self.directory.mkdir(parents=True, exist_ok=True)
                if temporary.exists():
                    shutil.rmtree(temporary)
                temporary.mkdir()
            sync_processes(f"{temporary}:created")
            write_state(temporary / STATE, leaves, plan)
            if root:
                record = {
                    "step": step,
                    LAYOUT_KEY: LAYOUT_VERSION,
                    **metadata,
                    ARRAYS_KEY: [
                        [path, *describe_array(leaf), where]
                        for (path, leaf), where in zip(leaves, plan, strict=True)
                    ],
                    FILES_KEY: file_records(temporary / STATE),
                }
                with atomic_file(temporary / META) as handle:
                    handle.write(json.dumps(record).encode())
                if final.exists():
                    shutil.rmtree(final)
                os.replace(temporary, final)
                _fsync_folder(self.directory)
        except Exception as error:
            if root:
                shutil.rmtree(temporary, ignore_errors=True)
            cause = os_error_of(error)
            if cause is not None:
                raise write_error(cause, final, "a checkpoint") from error
            raise
        if root:
            for old in self.paths()[: -self.keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        sync_processes(f"{final}:saved")
        return final

    def verify(self, path: str | os.PathLike[str], like: PyTree[Any]) -> None:
        """Check that a checkpoint is intact and holds a state shaped like `like`.

        This loads the checkpoint (so it costs as much as `restore`) and discards it.

        **Arguments:**

        - `path`: the checkpoint folder.
        - `like`: a PyTree of the expected structure, shapes and dtypes.

        **Raises:**

        - `CheckpointError`: naming `path` and the problem: no such folder; `meta.json`
            missing, unreadable or not a JSON object; a file under `state/` missing, or of
            another length or checksum than recorded; or arrays of other paths, shapes or
            dtypes than `like`'s. A `CheckpointVersionError` (a `CheckpointError`) naming
            both versions if it was written with another `LAYOUT_VERSION` (none recorded:
            version 1).
        """
        _read_checkpoint(pathlib.Path(path), like)

    def restore(
        self, like: T, path: str | os.PathLike[str] | None = None
    ) -> tuple[T, dict[str, Any]]:
        """Load a checkpoint into the structure, and onto the shardings, of `like`.

        **Arguments:**

        - `like`: a PyTree of the same structure, shapes and dtypes (e.g. a fresh state).
            Each restored array takes the sharding of its leaf in `like`, whatever mesh the
            checkpoint was written from.
        - `path`: the checkpoint folder; the newest one when `None` (use `restore_latest`
            to skip damaged ones instead).

        **Returns:**

        `(tree, metadata)`.

        **Raises:**

        - `FileNotFoundError`: if `path` is `None` and there is no checkpoint.
        - `CheckpointError`: naming the checkpoint, if it is damaged or does not match
            `like` (see `verify`).
        """
        folder = pathlib.Path(path) if path is not None else self.latest()
        if folder is None:
            raise FileNotFoundError(f"No checkpoint in {self.directory}.")
        return _read_checkpoint(folder, like)

    def restore_latest(
        self, like: T, *, report: Callable[[str], None] = print
    ) -> tuple[T, dict[str, Any], pathlib.Path] | None:
        """Restore the newest usable checkpoint, reporting and skipping damaged ones (but
        stopping at one written by another version of flowgrpo_eqx).

        **Arguments:**

        - `like`: a PyTree of the same structure, shapes and dtypes (e.g. a fresh state),
            whose leaves' shardings the restored arrays take.
        - `report`: called with one line per skipped checkpoint (its path and problem) and
            one naming the checkpoint, step and epoch it continues from.

        **Returns:**

        `(tree, metadata, path)`, or `None` if the folder holds no checkpoint at all.

        **Raises:**

        - `CheckpointError`: naming the folder and each checkpoint's problem, if there are
            checkpoints but none is usable.
        - `CheckpointVersionError`: naming the checkpoint and both layout versions, as soon
            as one (the newest that is not damaged) was written by another version of
            flowgrpo_eqx: it is not skipped, since resuming from an older checkpoint of this
            version instead would silently lose the newer ones.
        """
        paths = self.paths()
        if not paths:
            return None
        problems = []
        for folder in reversed(paths):
            try:
                tree, metadata = _read_checkpoint(folder, like)
            except CheckpointVersionError:
                raise
            except CheckpointError as error:
                report(f"Skipping unusable checkpoint {error}")
                problems.append(f"{folder.name}: {error.problem}")
                continue
            report(f"Continuing from checkpoint {folder} ({_describe(metadata, folder)}).")
            return tree, metadata, folder
        raise CheckpointError(
            self.directory,
            f"none of its {len(paths)} checkpoints is usable: " + "; ".join(problems),
        )
