"""Single models exported as one `eqx.tree_serialise_leaves` file (`save_model`, `load_model`).

`policy.eqx` and the base models are exports, read by `flowgrpo-eqx eval` or by users' own
code, not checkpoints: one file, written atomically, checked against the expected model when
read.
"""

import os
import pathlib
from typing import Any, BinaryIO, TypeVar

import equinox as eqx
from jaxtyping import PyTree

from .._files import atomic_file
from ._checkpoint_integrity import CheckpointError, one_line, write_error


T = TypeVar("T")

# Everything a damaged or mismatched model file makes equinox/numpy raise: `TreePathError` and
# the shape/dtype checks are `RuntimeError`s, a short read is `EOFError` or `ValueError`.
_LOAD_ERRORS = (RuntimeError, ValueError, TypeError, EOFError, OSError)


def _deserialise(handle: BinaryIO, like: T, path: pathlib.Path, size: int) -> T:
    """Load `like`'s leaves from `handle`, raising `CheckpointError` on any mismatch."""
    try:
        loaded: T = eqx.tree_deserialise_leaves(handle, like)
    except _LOAD_ERRORS as error:
        raise CheckpointError(
            path,
            "does not hold the expected model (a different model or settings, or damaged): "
            + one_line(error),
        ) from error
    left = size - handle.tell()
    if left:
        raise CheckpointError(
            path,
            f"holds {left} bytes more than the expected model reads "
            "(a different model or settings?)",
        )
    return loaded


def save_model(path: str | os.PathLike[str], model: PyTree[Any]) -> None:
    """Save one model (any PyTree of arrays) to a file, atomically, for `load_model`.

    The leaves are written with `eqx.tree_serialise_leaves` to a temporary file beside
    `path`, which is synced and then renamed over `path`, so `path` holds either the old
    model or the whole new one.

    **Arguments:**

    - `path`: the file to write (its folder is created if missing).
    - `model`: any PyTree of arrays, e.g. an `eqx.Module`.

    **Raises:**

    - `OSError`: of the original kind and errno (e.g. `ENOSPC`, disk full), naming `path`,
        if writing fails. The temporary file is removed and an existing `path` is untouched.
    """
    target = pathlib.Path(path)
    try:
        with atomic_file(target) as handle:
            eqx.tree_serialise_leaves(handle, model)
    except OSError as error:
        raise write_error(error, target, "a model") from error


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
