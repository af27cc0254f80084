"""Atomic checkpoints: write into a temporary folder, then rename it into place.

A checkpoint is a folder `ckpt_<step>` holding `state.eqx` (`eqx.tree_serialise_leaves`) and
`meta.json`. A write interrupted at any point leaves at most a `.tmp-*` folder, which is
ignored, and the previous checkpoints stay loadable.
"""

import json
import os
import pathlib
import shutil
from typing import Any, TypeVar

import equinox as eqx
from jaxtyping import PyTree

from .._misc import data_to_keys, keys_to_data


T = TypeVar("T")

_PREFIX = "ckpt_"


def _fsync_folder(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Checkpointer:
    """Save, list, prune and restore checkpoints in one folder.

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
        """Complete checkpoints, oldest first."""
        if not self.directory.exists():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(_PREFIX) and (p / "meta.json").exists()
        ]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def latest(self) -> pathlib.Path | None:
        """The newest complete checkpoint, or `None`."""
        paths = self.paths()
        return paths[-1] if paths else None

    def save(self, step: int, tree: PyTree[Any], metadata: dict[str, Any]) -> pathlib.Path:
        """Write `tree` and `metadata` as checkpoint `step`, atomically, then prune.

        **Arguments:**

        - `step`: the checkpoint's number (e.g. the epoch); larger is newer.
        - `tree`: any PyTree of arrays (e.g. a `TrainState`).
        - `metadata`: JSON-serialisable facts to keep beside it.

        **Returns:**

        The checkpoint's folder.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{_PREFIX}{step:08d}"
        temporary = self.directory / f".tmp-{step:08d}-{os.getpid()}"
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir()
        with open(temporary / "state.eqx", "wb") as handle:
            eqx.tree_serialise_leaves(handle, keys_to_data(tree))
            handle.flush()
            os.fsync(handle.fileno())
        with open(temporary / "meta.json", "w") as handle:
            json.dump({"step": step, **metadata}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
        _fsync_folder(self.directory)
        for old in self.paths()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(
        self, like: T, path: str | os.PathLike[str] | None = None
    ) -> tuple[T, dict[str, Any]]:
        """Load a checkpoint into the structure of `like`.

        **Arguments:**

        - `like`: a PyTree of the same structure, shapes and dtypes (e.g. a fresh state).
        - `path`: the checkpoint folder; the latest when `None`.

        **Returns:**

        `(tree, metadata)`.

        **Raises:**

        - `FileNotFoundError`: if there is no checkpoint.
        """
        folder = pathlib.Path(path) if path is not None else self.latest()
        if folder is None or not (folder / "meta.json").exists():
            raise FileNotFoundError(f"No checkpoint in {self.directory}.")
        with open(folder / "state.eqx", "rb") as handle:
            loaded = eqx.tree_deserialise_leaves(handle, keys_to_data(like))
        with open(folder / "meta.json") as handle:
            metadata: dict[str, Any] = json.load(handle)
        restored: T = data_to_keys(loaded, like)
        return restored, metadata


def save_model(path: str | os.PathLike[str], model: PyTree[Any]) -> None:
    """Export a model's leaves with `eqx.tree_serialise_leaves`, atomically."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + f".tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        eqx.tree_serialise_leaves(handle, model)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, target)


def load_model(path: str | os.PathLike[str], like: T) -> T:
    """Load a model exported by `save_model` into the structure of `like`."""
    with open(path, "rb") as handle:
        loaded: T = eqx.tree_deserialise_leaves(handle, like)
    return loaded
