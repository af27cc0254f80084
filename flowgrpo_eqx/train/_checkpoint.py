"""Atomic, verified checkpoints: write into a temporary folder, then rename it into place.

A checkpoint is a folder `ckpt_<step>` holding `state.eqx` (`eqx.tree_serialise_leaves`) and
`meta.json`: the caller's metadata plus `step`, and the byte length (`state_bytes`) and
SHA-256 (`state_sha256`) of `state.eqx`. A write interrupted at any point leaves at most a
`.tmp-*` folder, which is ignored, and the previous checkpoints stay loadable; a write that
fails (a full disk) removes its temporary folder and raises an `OSError` naming the checkpoint.

Reading checks everything it can before trusting a checkpoint: that `meta.json` is a JSON
object, that `state.eqx` has the recorded length and checksum, and that it loads into the
expected structure with the expected shapes and dtypes and nothing left over. Any failure is a
`CheckpointError` naming the checkpoint and the problem; `Checkpointer.restore_latest` skips
such checkpoints, says so, and continues from the newest usable one.
"""

import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import equinox as eqx
from jaxtyping import PyTree

from .._misc import data_to_keys, keys_to_data


T = TypeVar("T")

_PREFIX = "ckpt_"
_STATE = "state.eqx"
_META = "meta.json"
_SIZE_KEY = "state_bytes"
_CHECKSUM_KEY = "state_sha256"
# Everything a damaged or mismatched `state.eqx` makes equinox/numpy raise: `TreePathError` and
# the shape/dtype checks are `RuntimeError`s, a short read is `EOFError` or `ValueError`.
_LOAD_ERRORS = (RuntimeError, ValueError, TypeError, EOFError, OSError)


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


class _HashingWriter:
    """A binary file that also computes the SHA-256 and length of what goes through it."""

    def __init__(self, handle: BinaryIO):
        self._handle = handle
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        written = self._handle.write(data)
        self._digest.update(data)
        self.size += memoryview(data).nbytes
        return written

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


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
            "does not hold the expected state (a different model or settings, or damaged): "
            + _one_line(error),
        ) from error
    left = size - handle.tell()
    if left:
        raise CheckpointError(
            path,
            f"holds {left} bytes more than the expected state reads "
            "(a different model or settings?)",
        )
    return loaded


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
    return metadata


def _check_state_file(folder: pathlib.Path, metadata: dict[str, Any]) -> int:
    """Check `state.eqx` against the recorded length and checksum; return its length."""
    state_path = folder / _STATE
    if not state_path.is_file():
        raise CheckpointError(folder, f"{_STATE} is missing")
    size = state_path.stat().st_size
    # Checkpoints written before the checksum was recorded are checked only by loading them.
    if _SIZE_KEY in metadata:
        recorded = metadata[_SIZE_KEY]
        if not isinstance(recorded, int) or isinstance(recorded, bool):
            raise CheckpointError(folder, f"{_META}'s {_SIZE_KEY!r} is not an integer")
        if size != recorded:
            raise CheckpointError(
                folder,
                f"{_STATE} is {size} bytes but {_META} records {recorded} "
                "(truncated or overwritten)",
            )
    if _CHECKSUM_KEY in metadata:
        try:
            with open(state_path, "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
        except OSError as error:
            raise CheckpointError(
                folder, f"{_STATE} cannot be read ({_one_line(error)})"
            ) from error
        if digest != metadata[_CHECKSUM_KEY]:
            raise CheckpointError(
                folder, f"{_STATE}'s SHA-256 does not match the one in {_META} (corrupted)"
            )
    return size


def _read_checkpoint(folder: pathlib.Path, like: T) -> tuple[T, dict[str, Any]]:
    """Check and load one checkpoint folder; any problem is a `CheckpointError` naming it."""
    if not folder.is_dir():
        raise CheckpointError(folder, "no such checkpoint folder")
    metadata = _read_metadata(folder)
    size = _check_state_file(folder, metadata)
    try:
        with open(folder / _STATE, "rb") as handle:
            loaded = _deserialise(handle, keys_to_data(like), folder, size)
    except OSError as error:
        raise CheckpointError(folder, f"{_STATE} cannot be read ({_one_line(error)})") from error
    restored: T = data_to_keys(loaded, like)
    return restored, metadata


def _describe(metadata: dict[str, Any], folder: pathlib.Path) -> str:
    step = metadata.get("step", folder.name[len(_PREFIX) :].lstrip("0") or "0")
    if "epoch" in metadata:
        return f"step {step}, epoch {metadata['epoch']}"
    return f"step {step}"


class Checkpointer:
    """Save, list, prune, verify and restore checkpoints in one folder.

    **Arguments:**

    - `directory`: where checkpoints live (created if missing).
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

        Pruning deletes all but the `keep` newest checkpoints by step, never the one just
        written, and only after it was written successfully.

        **Arguments:**

        - `step`: the checkpoint's number (e.g. the epoch); larger is newer.
        - `tree`: any PyTree of arrays (e.g. a `TrainState`).
        - `metadata`: JSON-serialisable facts to keep beside it (not `state_bytes` or
            `state_sha256`, which record the checksum).

        **Returns:**

        The checkpoint's folder.

        **Raises:**

        - `ValueError`: if `metadata` uses a key reserved for the checksum.
        - `OSError`: of the original kind and errno (e.g. `ENOSPC`, disk full), naming the
            checkpoint's folder, if writing fails. Its temporary folder is removed and the
            previous checkpoints are untouched.
        """
        for reserved in (_SIZE_KEY, _CHECKSUM_KEY):
            if reserved in metadata:
                raise ValueError(f"`metadata` must not use the key {reserved!r}.")
        final = self.directory / f"{_PREFIX}{step:08d}"
        temporary = self.directory / f".tmp-{step:08d}-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if temporary.exists():
                shutil.rmtree(temporary)
            temporary.mkdir()
            with open(temporary / _STATE, "wb") as handle:
                writer = _HashingWriter(handle)
                eqx.tree_serialise_leaves(writer, keys_to_data(tree))
                handle.flush()
                os.fsync(handle.fileno())
            record = {
                "step": step,
                **metadata,
                _SIZE_KEY: writer.size,
                _CHECKSUM_KEY: writer.hexdigest(),
            }
            text = json.dumps(record)
            with open(temporary / _META, "w") as text_handle:
                text_handle.write(text)
                text_handle.flush()
                os.fsync(text_handle.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(temporary, final)
        except Exception as error:
            shutil.rmtree(temporary, ignore_errors=True)
            if isinstance(error, OSError):
                raise _write_error(error, final, "a checkpoint") from error
            raise
        _fsync_folder(self.directory)
        for old in self.paths()[: -self.keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def verify(self, path: str | os.PathLike[str], like: PyTree[Any]) -> None:
        """Check that a checkpoint is intact and holds a state shaped like `like`.

        This loads the checkpoint (so it costs as much as `restore`) and discards it.

        **Arguments:**

        - `path`: the checkpoint folder.
        - `like`: a PyTree of the expected structure, shapes and dtypes.

        **Raises:**

        - `CheckpointError`: naming `path` and the problem: no such folder; `meta.json`
            missing, unreadable or not a JSON object; `state.eqx` missing, of another length
            or checksum than recorded; or a state of another structure, shape or dtype
            than `like`.
        """
        _read_checkpoint(pathlib.Path(path), like)

    def restore(
        self, like: T, path: str | os.PathLike[str] | None = None
    ) -> tuple[T, dict[str, Any]]:
        """Load a checkpoint into the structure of `like`.

        **Arguments:**

        - `like`: a PyTree of the same structure, shapes and dtypes (e.g. a fresh state).
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
        """Restore the newest usable checkpoint, reporting and skipping damaged ones.

        **Arguments:**

        - `like`: a PyTree of the same structure, shapes and dtypes (e.g. a fresh state).
        - `report`: called with one line per skipped checkpoint (its path and problem) and
            one naming the checkpoint, step and epoch it continues from.

        **Returns:**

        `(tree, metadata, path)`, or `None` if the folder holds no checkpoint at all.

        **Raises:**

        - `CheckpointError`: naming the folder and each checkpoint's problem, if there are
            checkpoints but none is usable.
        """
        paths = self.paths()
        if not paths:
            return None
        problems = []
        for folder in reversed(paths):
            try:
                tree, metadata = _read_checkpoint(folder, like)
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
