"""`MultiWriter`, which fans one call out to several metrics writers, and `make_writers`,
which makes the named ones for a run folder."""

import os
import pathlib
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, final

import numpy.typing as npt

from ._writers import (
    WRITER_NAMES,
    ImageLike,
    MetricsWriter,
    TensorBoardWriter,
    WandbWriter,
    WriterName,
)


@final
class MultiWriter:
    """Send each call to several writers, in order.

    Also a context manager that closes them all on exit.

    **Arguments:**

    - `writers`: the writers (anything satisfying `MetricsWriter`).

    **Raises:**

    Whatever a writer raises: each call goes to the writers in order and stops at the first
    error, except `close`, which closes every writer first.
    """

    def __init__(self, writers: Sequence[MetricsWriter]):
        self.writers = tuple(writers)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Send `scalars(step, values)` to every writer, in order.

        **Arguments:**

        - `step`, `values`: as `MetricsWriter.scalars`.

        **Raises:**

        Whatever a writer raises; later writers are not called.
        """
        for writer in self.writers:
            writer.scalars(step, values)

    def image(self, step: int, name: str, image: ImageLike) -> None:
        """Send `image(step, name, image)` to every writer, in order.

        **Arguments:**

        - `step`, `name`, `image`: as `MetricsWriter.image`.

        **Raises:**

        Whatever a writer raises; later writers are not called.
        """
        for writer in self.writers:
            writer.image(step, name, image)

    def histogram(self, step: int, name: str, values: npt.ArrayLike) -> None:
        """Send `histogram(step, name, values)` to every writer, in order.

        **Arguments:**

        - `step`, `name`, `values`: as `MetricsWriter.histogram`.

        **Raises:**

        Whatever a writer raises; later writers are not called.
        """
        for writer in self.writers:
            writer.histogram(step, name, values)

    def close(self) -> None:
        """Close every writer, even if one raises; the first error is raised after.

        **Raises:**

        The first error a writer's `close` raised, once every writer has been closed.
        """
        first_error: BaseException | None = None
        for writer in self.writers:
            try:
                writer.close()
            except BaseException as error:  # noqa: BLE001 - re-raised once all are closed
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> "MultiWriter":
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def make_writers(
    names: Sequence[WriterName],
    directory: str | os.PathLike[str],
    *,
    project: str = "flowgrpo-eqx",
    config: Mapping[str, Any] | None = None,
) -> MultiWriter:
    """Make the named writers for one run folder.

    `"tensorboard"` writes under `directory/tensorboard`; `"wandb"` writes an offline run (see
    `WandbWriter`) under `directory/wandb`, named after the folder. All names are checked
    before any writer is made.

    **Arguments:**

    - `names`: writer names from `WRITER_NAMES`; empty gives a `MultiWriter` that does nothing.
    - `directory`: the run folder.
    - `project`: the W&B project.
    - `config`: the run's configuration, given to W&B.

    **Returns:**

    A `MultiWriter` over the writers, in the order named.

    **Raises:**

    - `ValueError`: naming the name, for an unknown or repeated name in `names`.
    """
    for index, name in enumerate(names):
        if name not in WRITER_NAMES:
            raise ValueError(f"`names` has unknown writer {name!r}; known: {WRITER_NAMES}.")
        if name in names[:index]:
            raise ValueError(f"`names` lists writer {name!r} twice.")
    folder = pathlib.Path(directory)
    writers: list[MetricsWriter] = []
    try:
        for name in names:
            if name == "tensorboard":
                writers.append(TensorBoardWriter(folder / "tensorboard"))
            else:
                writers.append(
                    WandbWriter(
                        project,
                        directory=folder,
                        run_name=folder.resolve().name,
                        config=config,
                    )
                )
    except BaseException:
        MultiWriter(writers).close()
        raise
    return MultiWriter(writers)
