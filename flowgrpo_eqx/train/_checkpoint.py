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
`load_model`: `policy.eqx` and the base models) stay one `eqx.tree_serialise_leaves` file:
they are exports, read by `flowgrpo-eqx eval` or by users' own code, not checkpoints.
"""

import hashlib
import itertools
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import equinox as eqx
import jax
import numpy as np
import numpy.typing as npt
from jaxtyping import PyTree

from .._distributed import local_copy
from .._misc import data_to_keys, keys_to_data


T = TypeVar("T")

_PREFIX = "ckpt_"
_TEMPORARY_PREFIX = ".tmp-"
_STATE = "state"
_META = "meta.json"
_ARRAYS_KEY = "state_arrays"
_FILES_KEY = "state_files"
_LAYOUT_KEY = "layout_version"
LAYOUT_VERSION = 2
"""The layout of what a checkpoint stores, recorded in every `meta.json` as `layout_version`.

It is raised whenever checkpoints written before can no longer be restored: 2 is the train
state with per-objective typed variables and the EMA in a field of its own; 1 (checkpoints
recording no layout version) was `Variables(policy, held)`. A checkpoint of another layout
is refused with a `CheckpointVersionError`.
"""
# Everything a damaged or mismatched model file makes equinox/numpy raise: `TreePathError` and
# the shape/dtype checks are `RuntimeError`s, a short read is `EOFError` or `ValueError`.
_LOAD_ERRORS = (RuntimeError, ValueError, TypeError, EOFError, OSError)
_PYTHON_SCALARS = (bool, int, float, complex)
# Orbax's barriers need names never used before in the process; saves are collective, so
# every process counts them alike.
_BARRIER_COUNTER = itertools.count()


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


def _fsync_folder(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _one_line(error: BaseException) -> str:
    """An exception and its causes (equinox wraps the real error) as one line."""
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(parts) < 4:
        text = " ".join(str(current).split())
        parts.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__
    return " <- ".join(parts)


def _write_error(error: OSError, path: pathlib.Path, what: str) -> OSError:
    """The same kind of `OSError` (same errno), naming the file being written."""
    reason = error.strerror or str(error)
    message = f"{reason} while writing {what} (nothing older was touched)"
    if error.errno is None:
        return OSError(f"{message}: '{path}'")
    return OSError(error.errno, message, str(path))


def _deserialise(handle: BinaryIO, like: T, path: pathlib.Path, size: int) -> T:
    """Load `like`'s leaves from `handle`, raising `CheckpointError` on any mismatch."""
    try:
        loaded: T = eqx.tree_deserialise_leaves(handle, like)
    except _LOAD_ERRORS as error:
        raise CheckpointError(
            path,
            "does not hold the expected model (a different model or settings, or damaged): "
            + _one_line(error),
        ) from error
    left = size - handle.tell()
    if left:
        raise CheckpointError(
            path,
            f"holds {left} bytes more than the expected model reads "
            "(a different model or settings?)",
        )
    return loaded


def _is_stored(leaf: Any) -> bool:
    """Whether a checkpoint stores `leaf`; other leaves (functions, ...) come from the template."""
    return eqx.is_array(leaf) or isinstance(leaf, _PYTHON_SCALARS)


def _stored_leaves(tree: PyTree[Any]) -> list[tuple[str, Any]]:
    """`(path, leaf)` for every stored leaf of `tree`, typed keys as their raw data."""
    flat, _ = jax.tree_util.tree_flatten_with_path(keys_to_data(tree))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat if _is_stored(leaf)]


def _describe_array(leaf: Any) -> tuple[list[int], str]:
    if isinstance(leaf, _PYTHON_SCALARS):
        leaf = np.asarray(leaf)
    return [int(n) for n in leaf.shape], str(np.dtype(leaf.dtype))


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
        shape, dtype = _describe_array(leaf)
        offset = offsets.get(dtype, 0)
        plan.append(f"packed_{dtype}:{offset}")
        offsets[dtype] = offset + int(np.prod(shape, dtype=np.int64))
    return plan


def _sync(name: str) -> None:
    """Wait for every process (nothing to wait for with one)."""
    if jax.process_count() > 1:
        from orbax.checkpoint import multihost

        multihost.sync_global_processes(f"flowgrpo_eqx:{name}:{next(_BARRIER_COUNTER)}")


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
    _orbax_checkpointer().save(folder.absolute(), args=ocp.args.StandardSave(arrays))


def _file_records(folder: pathlib.Path) -> dict[str, list[Any]]:
    """`relative path -> [bytes, sha256]` of every file under `folder`."""
    records: dict[str, list[Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        records[path.relative_to(folder).as_posix()] = [path.stat().st_size, digest]
    return records


def _read_metadata(folder: pathlib.Path) -> dict[str, Any]:
    meta_path = folder / _META
    if not meta_path.is_file():
        raise CheckpointError(folder, f"{_META} is missing")
    try:
        text = meta_path.read_bytes().decode()
        metadata = json.loads(text)
    except OSError as error:
        raise CheckpointError(folder, f"{_META} cannot be read ({_one_line(error)})") from error
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(folder, f"{_META} is not valid JSON ({_one_line(error)})") from error
    if not isinstance(metadata, dict):
        raise CheckpointError(
            folder, f"{_META} holds a JSON {type(metadata).__name__}, not an object"
        )
    found = metadata.get(_LAYOUT_KEY, 1)
    if type(found) is not int or found != LAYOUT_VERSION:
        raise CheckpointVersionError(folder, found, LAYOUT_VERSION)
    for key in (_ARRAYS_KEY, _FILES_KEY):
        if not isinstance(metadata.get(key), (list, dict)):
            raise CheckpointError(
                folder, f"{_META} records no {key!r} (not a checkpoint written by Checkpointer)"
            )
    return metadata


def _check_state_files(folder: pathlib.Path, metadata: dict[str, Any]) -> None:
    """Every file recorded in `meta.json` is present with its length and checksum."""
    state = folder / _STATE
    if not state.is_dir():
        raise CheckpointError(folder, f"{_STATE}/ is missing")
    for name, record in metadata[_FILES_KEY].items():
        if not (
            isinstance(record, list)
            and len(record) == 2
            and type(record[0]) is int
            and isinstance(record[1], str)
        ):
            raise CheckpointError(
                folder, f"{_META}'s {_FILES_KEY!r} entry {name!r} is not [bytes, sha256]"
            )
        path = state / name
        if not path.is_file():
            raise CheckpointError(folder, f"{_STATE}/{name} is missing")
        size = path.stat().st_size
        if size != record[0]:
            raise CheckpointError(
                folder,
                f"{_STATE}/{name} is {size} bytes but {_META} records {record[0]} "
                "(truncated or overwritten)",
            )
        try:
            with open(path, "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
        except OSError as error:
            raise CheckpointError(
                folder, f"{_STATE}/{name} cannot be read ({_one_line(error)})"
            ) from error
        if digest != record[1]:
            raise CheckpointError(
                folder, f"{_STATE}/{name}'s SHA-256 does not match the one in {_META} (corrupted)"
            )


def _check_arrays(
    folder: pathlib.Path, metadata: dict[str, Any], leaves: list[tuple[str, Any]]
) -> None:
    """The stored arrays are the template's: same paths, shapes and dtypes, same number."""
    recorded = metadata[_ARRAYS_KEY]
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
                f"{_META}'s {_ARRAYS_KEY!r} entry {index} is not [path, shape, dtype, place]",
            )
        shape, dtype = _describe_array(leaf)
        if stored[:3] != [path, shape, dtype]:
            raise CheckpointError(
                folder,
                mismatch + f"array {stored[0]} is {stored[2]}{stored[1]} in the checkpoint, "
                f"the expected state has {path} as {dtype}{shape}",
            )
        if stored[3].startswith("packed_") and stored[3].split(":")[0] != f"packed_{dtype}":
            raise CheckpointError(folder, f"{_META} places the {dtype} array {path} in {stored[3]}")


def _is_place(place: Any) -> bool:
    """Whether `place` is one `_storage_plan` writes: `"<index>"` or `"packed_<dtype>:<offset>"`."""
    if not isinstance(place, str):
        return False
    if place.startswith("packed_"):
        _, _, offset = place.partition(":")
        return offset.isdigit()
    return place.isdigit()


def _restore_target(leaf: Any) -> Any:
    """What Orbax restores a split leaf as: an array with `leaf`'s sharding, or NumPy."""
    if isinstance(leaf, jax.Array):
        # jax.ShapeDtypeStruct.__init__ carries no annotations.
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)  # type: ignore[no-untyped-call]
    shape, dtype = _describe_array(leaf)
    return np.zeros(shape, dtype)


def _placed(value: npt.NDArray[Any], leaf: Any) -> Any:
    """A whole array read from a packed buffer, placed like the template's `leaf`."""
    if isinstance(leaf, _PYTHON_SCALARS):
        return type(leaf)(value.item())
    if isinstance(leaf, jax.Array):
        return jax.make_array_from_callback(value.shape, leaf.sharding, lambda index: value[index])
    return value


def _read_checkpoint(folder: pathlib.Path, like: T) -> tuple[T, dict[str, Any]]:
    """Check and load one checkpoint folder; any problem is a `CheckpointError` naming it."""
    import orbax.checkpoint as ocp

    if not folder.is_dir():
        raise CheckpointError(folder, "no such checkpoint folder")
    metadata = _read_metadata(folder)
    _check_state_files(folder, metadata)
    leaves = _stored_leaves(like)
    _check_arrays(folder, metadata, leaves)
    # Each leaf's Orbax array, and for a packed leaf its slice of that flat buffer.
    places: list[tuple[str, slice | None]] = []
    target: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for (_, leaf), record in zip(leaves, metadata[_ARRAYS_KEY], strict=True):
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
        arrays = _orbax_checkpointer().restore(
            (folder / _STATE).absolute(), args=ocp.args.StandardRestore(target)
        )
    except Exception as error:
        raise CheckpointError(
            folder, f"{_STATE}/ cannot be read by Orbax ({_one_line(error)})"
        ) from error
    values = []
    for (_, leaf), (name, span) in zip(leaves, places, strict=True):
        if span is None:
            values.append(arrays[name])
        else:
            shape, _ = _describe_array(leaf)
            values.append(_placed(np.asarray(arrays[name])[span].reshape(shape), leaf))
    loaded = iter(values)

    def fill(leaf: Any) -> Any:
        return next(loaded) if _is_stored(leaf) else leaf

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

    - `ValueError`: if `keep < 1`.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3):
        if keep < 1:
            raise ValueError(f"`keep` must be >= 1, got {keep}.")
        self.directory = pathlib.Path(directory)
        self.keep = keep

    def paths(self) -> list[pathlib.Path]:
        """Checkpoint folders `ckpt_<step>`, oldest first, intact or damaged.

        Damaged ones (e.g. a missing or garbled `meta.json`) are listed so that reading them
        reports the damage; the `.tmp-*` folders of interrupted saves are not.

        **Returns:**

        The folders, sorted by step; empty when `directory` does not exist.
        """
        if not self.directory.exists():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
        ]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def latest(self) -> pathlib.Path | None:
        """The newest checkpoint folder (not necessarily intact), or `None`.

        **Returns:**

        The last of `paths()`, or `None` when there is none.
        """
        paths = self.paths()
        return paths[-1] if paths else None

    def save(self, step: int, tree: PyTree[Any], metadata: dict[str, Any]) -> pathlib.Path:
        """Write `tree` and `metadata` as checkpoint `step`, atomically, then prune.

        Arrays keep their sharding: every process writes the shards its devices hold (a
        replicated array once). Pruning deletes all but the `keep` newest checkpoints by
        step, never the one just written, and only after it was written successfully.

        **Arguments:**

        - `step`: the checkpoint's number (e.g. the epoch); larger is newer.
        - `tree`: any PyTree of arrays (e.g. a `TrainState`), sharded or not; its other
            leaves (functions, ...) are not stored, and come from the template on restore.
        - `metadata`: JSON-serialisable facts to keep beside it (not `step`,
            `layout_version`, `state_arrays` or `state_files`, which record what was stored).

        **Returns:**

        The checkpoint's folder.

        **Raises:**

        - `ValueError`: if `metadata` uses a reserved key.
        - `OSError`: of the original kind and errno (e.g. `ENOSPC`, disk full), naming the
            checkpoint's folder, if writing fails. Its temporary folder is removed and the
            previous checkpoints are untouched.
        """
        for reserved in ("step", _LAYOUT_KEY, _ARRAYS_KEY, _FILES_KEY):
            if reserved in metadata:
                raise ValueError(f"`metadata` must not use the key {reserved!r}.")
        root = jax.process_index() == 0
        final = self.directory / f"{_PREFIX}{step:08d}"
        temporary = self.directory / f"{_TEMPORARY_PREFIX}{step:08d}"
        leaves = _stored_leaves(tree)
        plan = _storage_plan(leaves)
        try:
            if root:
                self.directory.mkdir(parents=True, exist_ok=True)
                if temporary.exists():
                    shutil.rmtree(temporary)
                temporary.mkdir()
            _sync(f"{temporary}:created")
            _write_state(temporary / _STATE, leaves, plan)
            if root:
                record = {
                    "step": step,
                    _LAYOUT_KEY: LAYOUT_VERSION,
                    **metadata,
                    _ARRAYS_KEY: [
                        [path, *_describe_array(leaf), where]
                        for (path, leaf), where in zip(leaves, plan, strict=True)
                    ],
                    _FILES_KEY: _file_records(temporary / _STATE),
                }
                with open(temporary / _META, "w") as handle:
                    handle.write(json.dumps(record))
                    handle.flush()
                    os.fsync(handle.fileno())
                if final.exists():
                    shutil.rmtree(final)
                os.replace(temporary, final)
                _fsync_folder(self.directory)
        except Exception as error:
            if root:
                shutil.rmtree(temporary, ignore_errors=True)
            if isinstance(error, OSError):
                raise _write_error(error, final, "a checkpoint") from error
            raise
        if root:
            for old in self.paths()[: -self.keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        _sync(f"{final}:saved")
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


def save_model(path: str | os.PathLike[str], model: PyTree[Any]) -> None:
    """Export a model's leaves with `eqx.tree_serialise_leaves`, atomically.

    The leaves go to a temporary file beside `path`, which is synced and then renamed over
    `path`, so `path` holds either the old model or the whole new one.

    **Arguments:**

    - `path`: the file to write (its folder is created if missing).
    - `model`: any PyTree of arrays, e.g. an `eqx.Module`.

    **Raises:**

    - `OSError`: of the original kind and errno (e.g. `ENOSPC`, disk full), naming `path`,
        if writing fails. The temporary file is removed and an existing `path` is untouched.
    """
    target = pathlib.Path(path)
    temporary = target.with_name(target.name + f".tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as handle:
            eqx.tree_serialise_leaves(handle, model)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except Exception as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise _write_error(error, target, "a model") from error
        raise


def load_model(path: str | os.PathLike[str], like: T) -> T:
    """Load a model exported by `save_model` into the structure of `like`.

    **Arguments:**

    - `path`: the file `save_model` wrote.
    - `like`: a model of the same structure (e.g. freshly built with any key); only its
        structure, shapes and dtypes are used.

    **Returns:**

    `like` with the saved leaves.

    **Raises:**

    - `FileNotFoundError`: if `path` does not exist.
    - `CheckpointError`: naming `path`, if it does not hold a model shaped like `like`
        (another structure, shape or dtype, or truncated).
    """
    target = pathlib.Path(path)
    with open(target, "rb") as handle:
        return _deserialise(handle, like, target, os.fstat(handle.fileno()).st_size)
