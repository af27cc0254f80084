"""Single models exported as one `eqx.tree_serialise_leaves` file (`save_model`, `load_model`).

`policy.eqx` and the base models are exports, read by `flowgrpo-eqx eval` or by users' own
code, not checkpoints: one file, written atomically, checked against the expected model when
read.
"""

import os
import pathlib
from typing import Any, TypeVar

import equinox as eqx
from jaxtyping import PyTree

from .._files import atomic_file, read_leaves_to_end
from ._checkpoint_integrity import CheckpointError, write_error


T = TypeVar("T")


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
        try:
            return read_leaves_to_end(handle, like, "the expected model")
        except ValueError as error:
            raise CheckpointError(target, str(error)) from error
