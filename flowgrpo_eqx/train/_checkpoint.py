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
`_checkpoint_integrity.py`.
"""

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np
import numpy.typing as npt
from jaxtyping import PyTree

from .._distributed import local_copy, sync_processes
from .._files import atomic_file, one_line
from .._misc import check_int, data_to_keys, keys_to_data
from ._checkpoint_integrity import (
    ARRAYS_KEY,
    FILES_KEY,
    LAYOUT_KEY,
    LAYOUT_VERSION as LAYOUT_VERSION,
    META,
    PYTHON_SCALARS,
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


def _is_split(leaf: Any) -> bool:
    """Whether `leaf` is a global array split over devices (not whole on each of them)."""
    return isinstance(leaf, jax.Array) and not leaf.sharding.is_fully_replicated


def _storage_plan(leaves: list[tuple[str, Any]]) -> list[str]:
    """Where each leaf is stored: `"<index>"` for an array of its own (a split one: every
    process writes its shards), or `"packed_<dtype>:<offset>"` inside one flat buffer per
    dtype holding every whole array (Orbax's cost is per array, and the main job's state has
    hundreds of small ones)."""
    plan: list[str] = []
    offsets: dict[str, int] = {}
    for index, (_, leaf) in enumerate(leaves):
        if _is_split(leaf):
            plan.append(f"{index:06d}")
            continue
        shape, dtype = describe_array(leaf)
        offset = offsets.get(dtype, 0)
        plan.append(f"packed_{dtype}:{offset}")
        offsets[dtype] = offset + int(np.prod(shape, dtype=np.int64))
    return plan


def _orbax_checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _write_state(folder: pathlib.Path, leaves: list[tuple[str, Any]], plan: list[str]) -> None:
    """Every process writes its shards of the split leaves, process 0 the packed buffers
    of the whole ones, into `folder` (collective)."""
    import orbax.checkpoint as ocp

    arrays: dict[str, Any] = {}
    packed: dict[str, list[npt.NDArray[Any]]] = {}
    for (_, leaf), where in zip(leaves, plan, strict=True):
        if where.startswith("packed_"):
            # A whole array's local copy: nothing is gathered.
            packed.setdefault(where.split(":")[0], []).append(np.asarray(local_copy(leaf)).ravel())
        else:
            arrays[where] = leaf
    for name, parts in packed.items():
        arrays[name] = np.concatenate(parts)
    with _orbax_call():
        _orbax_checkpointer().save(folder.absolute(), args=ocp.args.StandardSave(arrays))


@contextlib.contextmanager
def _orbax_call() -> Iterator[None]:
    """Around a call of Orbax: its logs held back (`_orbax_quiet`), and the event loops it
    makes finish their writes before they close (`_finishing_event_loops`)."""
    with _orbax_quiet(), _finishing_event_loops():
        yield


@contextlib.contextmanager
def _orbax_quiet() -> Iterator[None]:
    """Orbax (through absl) logs a failed write's traceback, about 100 lines on a full disk,
    before raising; the caller names the error in one line, so those logs are held back."""
    loggers = [logging.getLogger(name) for name in ("absl", "orbax")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


_LOOP_DRAIN_SECONDS = 120.0
"""How long a closing event loop waits for the writes still running on it."""


class _FinishingEventLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed with tasks still running, lets them finish first.

    Orbax runs each save in an event loop of its own, which it closes as soon as the save's
    coroutine ends. When one write of many fails (a full disk, a file-size limit), the
    coroutine ends with that error while TensorStore's other writes still run; each of them,
    on finishing, hands its result to the closed loop, which raises `RuntimeError: Event loop
    is closed` in TensorStore's thread and prints its traceback. Writes still going on would
    also race the removal of the unfinished checkpoint. This loop waits for them instead.

    A write that failed in the loop's last turn before it stopped is done, but the callbacks
    it scheduled have not run: among them `asyncio.gather`'s, which marks a second failure as
    seen. Closed with them unrun, the loop would log `Task exception was never retrieved` with
    the write's traceback when the task is collected, so one more turn runs them.
    """

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [task for task in asyncio.all_tasks(self) if not task.done()]
            if pending:
                self.run_until_complete(asyncio.wait(pending, timeout=_LOOP_DRAIN_SECONDS))
            self.run_until_complete(asyncio.sleep(0))
        super().close()


class _FinishingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _FinishingEventLoop()


_POLICY_LOCK = threading.Lock()
_policy_users = 0


@contextlib.contextmanager
def _finishing_event_loops() -> Iterator[None]:
    """New event loops are `_FinishingEventLoop`s for the duration (when the process uses
    asyncio's default policy; another, such as uvloop's, is left alone)."""
    global _policy_users
    with _POLICY_LOCK:
        policy = asyncio.get_event_loop_policy()
        ours = isinstance(policy, _FinishingPolicy)
        if not ours and type(policy) is not asyncio.DefaultEventLoopPolicy:
            active = False
        else:
            active = True
            if _policy_users == 0:
                asyncio.set_event_loop_policy(_FinishingPolicy())
            _policy_users += 1
    try:
        yield
    finally:
        if active:
            with _POLICY_LOCK:
                _policy_users -= 1
                if _policy_users == 0:
                    asyncio.set_event_loop_policy(None)


_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")


def _os_error_of(error: Exception) -> OSError | None:
    """The `OSError` behind a failed write: `error` itself, or the one TensorStore reports
    inside its own error (`... File too large [os_error_code='27']`); `None` for neither."""
    if isinstance(error, OSError):
        return error
    found = _OS_ERROR_CODE.search(str(error))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def _restore_target(leaf: Any) -> Any:
    """What Orbax restores a split leaf as: an array with `leaf`'s sharding, or NumPy."""
    if isinstance(leaf, jax.Array):
        # jax.ShapeDtypeStruct.__init__ carries no annotations.
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)  # type: ignore[no-untyped-call]
    shape, dtype = describe_array(leaf)
    return np.zeros(shape, dtype)


def _placed(value: npt.NDArray[Any], leaf: Any) -> Any:
    """A whole array read from a packed buffer, placed like the template's `leaf`."""
    if isinstance(leaf, PYTHON_SCALARS):
        return type(leaf)(value.item())
    if isinstance(leaf, jax.Array):
        return jax.make_array_from_callback(value.shape, leaf.sharding, lambda index: value[index])
    return value


def _read_checkpoint(folder: pathlib.Path, like: T) -> tuple[T, dict[str, Any]]:
    """Check and load one checkpoint folder; any problem is a `CheckpointError` naming it."""
    import orbax.checkpoint as ocp

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
            target[where] = _restore_target(leaf)
    for name, size in sizes.items():
        target[name] = np.zeros(size, np.dtype(name[len("packed_") :]))
    try:
        with _orbax_call():
            arrays = _orbax_checkpointer().restore(
                (folder / STATE).absolute(), args=ocp.args.StandardRestore(target)
            )
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
            values.append(_placed(np.asarray(arrays[name])[span].reshape(shape), leaf))
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
        plan = _storage_plan(leaves)
        try:
            if root:
                self.directory.mkdir(parents=True, exist_ok=True)
                if temporary.exists():
                    shutil.rmtree(temporary)
                temporary.mkdir()
            sync_processes(f"{temporary}:created")
            _write_state(temporary / STATE, leaves, plan)
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
            cause = _os_error_of(error)
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
