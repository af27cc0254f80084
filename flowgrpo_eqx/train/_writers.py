"""Metrics writers: a small protocol, and writers for JSONL, TensorBoard and Weights & Biases.

A training loop calls a writer once an epoch with scalars, images (preview grids) and
histograms (advantages, the policy ratio). `MultiWriter` fans one call out to several writers
(it and `make_writers` are in `_multi_writer`).

TensorBoard goes through `tensorboardX` and W&B through `wandb`; both are optional extras
(`pip install -e '.[tensorboard]'`, `[wandb]`) and are imported only when a writer that
needs them is made, so that `import flowgrpo_eqx.train` never loads them.
"""

import itertools
import os
import pathlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeAlias, final, runtime_checkable

import numpy as np
import numpy.typing as npt
from PIL import Image

from ._metrics_log import MetricsLog


if TYPE_CHECKING:
    import tensorboardX
    import wandb

# For static checkers these are Literals. At runtime they are plain `str`, so that a runtime
# type checker lets a bad value through to the functions' own checks, which raise a
# `ValueError` naming the argument.
if TYPE_CHECKING:
    WriterName: TypeAlias = Literal["tensorboard", "wandb"]
    WandbMode: TypeAlias = Literal["online", "offline", "disabled"]
else:
    WriterName = str
    WandbMode = str

WRITER_NAMES: Final[tuple[str, ...]] = ("tensorboard", "wandb")
"""The names `make_writers` accepts."""

WANDB_MODES: Final[tuple[str, ...]] = ("online", "offline", "disabled")
"""The modes `WandbWriter` accepts."""

_WANDB_BINS: Final = 64

_event_files_opened = itertools.count()

ImageLike: TypeAlias = npt.NDArray[Any] | str | os.PathLike[str]
"""A `uint8` numpy array `[H, W, 3]`, or the path of an image file (PNG)."""


@runtime_checkable
class MetricsWriter(Protocol):
    """Where a training loop sends its metrics; implement these four methods for your own logger.

    - `scalars(step, values)`: named numbers at one step (Python floats).
    - `image(step, name, image)`: a `uint8` numpy array `[H, W, 3]`, or the path of a PNG.
    - `histogram(step, name, values)`: the distribution of a numpy array of numbers.
    - `close()`: write out what is pending and release the writer.

    Steps are the loop's epochs; a writer may assume they do not decrease.
    """

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Record named numbers at one step.

        **Arguments:**

        - `step`: the loop's epoch.
        - `values`: names to Python floats, e.g. `{"reward_mean": 0.42, "loss": 0.013}`.
        """
        ...

    def image(self, step: int, name: str, image: ImageLike) -> None:
        """Record one picture at one step.

        **Arguments:**

        - `step`: the loop's epoch.
        - `name`: the picture's name, e.g. `"preview"`.
        - `image`: a `uint8` array `[H, W, 3]`, or the path of a PNG; `image_pixels` turns
            either into the array.

        **Raises:**

        - `ValueError`: naming `image`, for an array that is not `uint8` `[H, W, 3]`.
        """
        ...

    def histogram(self, step: int, name: str, values: npt.ArrayLike) -> None:
        """Record the distribution of some numbers at one step.

        **Arguments:**

        - `step`: the loop's epoch.
        - `name`: the histogram's name, e.g. `"advantages"`.
        - `values`: numbers of any shape; they may include NaN or inf (`finite_values`
            leaves those out).

        **Raises:**

        - `ValueError`: naming `values`, if it is empty.
        """
        ...

    def close(self) -> None:
        """Write out what is pending and release the writer; called once, at the end."""
        ...


def image_pixels(name: str, image: ImageLike) -> npt.NDArray[np.uint8]:
    """The `[H, W, 3]` `uint8` pixels of `image`, read from disk if it is a path.

    **Arguments:**

    - `name`: the image's name, for error messages.
    - `image`: a `uint8` array `[H, W, 3]`, or the path of an image file (converted to RGB).

    **Returns:**

    The pixels, `uint8` `[H, W, 3]`.

    **Raises:**

    - `ValueError`: naming `image` and `name`, if an array is not `uint8` `[H, W, 3]`.
    """
    if isinstance(image, str | os.PathLike):
        with Image.open(image) as opened:
            return np.asarray(opened.convert("RGB"), dtype=np.uint8)
    pixels = np.asarray(image)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(
            f"`image` {name!r} must be a uint8 array [H, W, 3] or an image path; got dtype "
            f"{pixels.dtype} and shape {pixels.shape}."
        )
    return pixels


def finite_values(name: str, values: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The finite entries of `values`, flattened to float64, for a histogram.

    Neither TensorBoard nor W&B can bin NaN or inf, and a diverging run is when a histogram of
    the policy ratio matters most, so non-finite entries are left out rather than raising.

    **Arguments:**

    - `name`: the histogram's name, for error messages.
    - `values`: numbers of any shape.

    **Returns:**

    The finite entries, float64 `[M]` (possibly empty).

    **Raises:**

    - `ValueError`: naming `values` and `name`, if `values` is empty.
    """
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    if flat.size == 0:
        raise ValueError(f"`values` of histogram {name!r} is empty.")
    return flat[np.isfinite(flat)]


def _plain_scalars(values: Mapping[str, float]) -> dict[str, float]:
    return {str(key): float(value) for key, value in values.items()}


@final
class JsonlWriter:
    """Append one JSON object per line, flushed at each call; needs nothing beyond the core.

    - scalars: `{step_key: step, **values}`, the format of `metrics.jsonl`;
    - images: written as `images/<name>_<step>.png` beside the log (a path is recorded as
        given), then `{step_key: step, "image": name, "path": path}`;
    - histograms: `{step_key: step, "histogram": name, "count", "min", "max", "sum",
        "sum_squares"}` over the finite values, the statistics TensorBoard keeps.

    **Arguments:**

    - `path`: the log file (its folder is created).
    - `step_key`: the key holding the step, e.g. `"epoch"`.
    """

    def __init__(self, path: str | os.PathLike[str], *, step_key: str = "step"):
        self.path = pathlib.Path(path)
        self.step_key = step_key
        self._log = MetricsLog(self.path)

    def _append(self, record: dict[str, Any]) -> None:
        self._log.write(record)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Append `{step_key: step, **values}`.

        **Arguments:**

        - `step`, `values`: as `MetricsWriter.scalars`.
        """
        self._append({self.step_key: step, **_plain_scalars(values)})

    def image(self, step: int, name: str, image: ImageLike) -> None:
        """Save an array as `images/<name>_<step>.png` beside the log and append its path
        (a path is recorded as given).

        **Arguments:**

        - `step`, `name`, `image`: as `MetricsWriter.image`.

        **Raises:**

        - `ValueError`: naming `image`, for an array that is not `uint8` `[H, W, 3]`.
        """
        if isinstance(image, str | os.PathLike):
            written = os.fspath(image)
        else:
            pixels = image_pixels(name, image)
            file_name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}_{step:06d}.png"
            target = self.path.parent / "images" / file_name
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(target)
            written = str(target)
        self._append({self.step_key: step, "image": name, "path": written})

    def histogram(self, step: int, name: str, values: npt.ArrayLike) -> None:
        """Append the finite values' count, min, max, sum and sum of squares (nothing
        when none is finite).

        **Arguments:**

        - `step`, `name`, `values`: as `MetricsWriter.histogram`.

        **Raises:**

        - `ValueError`: naming `values`, if it is empty.
        """
        finite = finite_values(name, values)
        if finite.size == 0:
            return
        self._append(
            {
                self.step_key: step,
                "histogram": name,
                "count": int(finite.size),
                "min": float(finite.min()),
                "max": float(finite.max()),
                "sum": float(finite.sum()),
                "sum_squares": float(finite @ finite),
            }
        )

    def close(self) -> None:
        """Close the writer; it does nothing, and calling it again is harmless.

        Nothing is held open between calls: each one opens the log, appends and flushes.
        """


@final
class TensorBoardWriter:
    """Write TensorBoard event files with `tensorboardX` (the `tensorboard` extra).

    Every call is flushed to disk, so a running `tensorboard --logdir` shows each epoch as soon
    as it is written. Non-finite histogram values are left out (see `finite_values`); a
    histogram with no finite value is not written.

    **Arguments:**

    - `logdir`: the folder for the event files (created if missing).

    **Raises:**

    - `ImportError`: if `tensorboardX` is not installed, saying which extra to install.
    """

    def __init__(self, logdir: str | os.PathLike[str]):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "TensorBoardWriter needs tensorboardX: pip install tensorboardX (in a checkout "
                "of flowgrpo_eqx: pip install -e '.[tensorboard]')."
            ) from error
        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # tensorboardX names event files by the second and host alone, so a second writer in
        # the same folder within a second (a quick resume) would overwrite the first one's.
        # The suffix makes names unique as TensorBoard's own writer does: process, counter.
        suffix = f".{os.getpid()}.{next(_event_files_opened)}"
        self._writer: tensorboardX.SummaryWriter | None = SummaryWriter(
            logdir=str(self.logdir), filename_suffix=suffix
        )

    def _open(self) -> "tensorboardX.SummaryWriter":
        if self._writer is None:
            raise RuntimeError(f"TensorBoardWriter for {str(self.logdir)!r} is closed.")
        return self._writer

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write each value as a TensorBoard scalar and flush; arguments and errors as
        `MetricsWriter.scalars`, and a `RuntimeError` once closed."""
        writer = self._open()
        for key, value in _plain_scalars(values).items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()

    def image(self, step: int, name: str, image: ImageLike) -> None:
        """Write a TensorBoard image and flush; arguments and errors as `MetricsWriter.image`, and a
        `RuntimeError` once closed."""
        writer = self._open()
        writer.add_image(name, image_pixels(name, image), global_step=step, dataformats="HWC")
        writer.flush()

    def histogram(self, step: int, name: str, values: npt.ArrayLike) -> None:
        """Write a TensorBoard histogram of the finite values and flush (nothing when none is
        finite); arguments and errors as `MetricsWriter.histogram`, and a `RuntimeError` once
        closed."""
        writer = self._open()
        finite = finite_values(name, values)
        if finite.size == 0:
            return
        writer.add_histogram(name, finite, global_step=step)
        writer.flush()

    def close(self) -> None:
        """Flush and close the event file; closing twice does nothing."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@final
class WandbWriter:
    """Log to Weights & Biases (the `wandb` extra), offline unless configured otherwise.

    The run is written under `directory/wandb/`. Offline runs make no network traffic and never
    ask for a login; upload one later with `wandb sync directory/wandb/offline-run-*`. Online
    mode needs credentials already stored (`wandb login` or `WANDB_API_KEY`) and raises rather
    than prompting for them.

    Where unset, `WANDB_SILENT` is set to `true` and, except online, `WANDB_ERROR_REPORTING`
    to `false` (W&B's own crash reporting talks to its servers), before `wandb` is imported.
    System metrics, machine probes, git and code capture are switched off: the run holds only
    what is logged. Images go through `wandb.Image`, histograms through `wandb.Histogram`
    (64 equal bins; non-finite values left out, see `finite_values`). `close()` finishes the
    run, which also stops W&B's service process.

    **Arguments:**

    - `project`: the W&B project name.
    - `directory`: where the run folder goes (created if missing).
    - `run_name`: the run's display name; W&B picks one if `None`.
    - `config`: the run's configuration (JSON-like values), or `None`.
    - `mode`: `"offline"`, `"online"` or `"disabled"`; `None` reads `WANDB_MODE`, defaulting
        to `"offline"`.

    **Raises:**

    - `ValueError`: naming `mode`, if it is not one of `WANDB_MODES`.
    - `ImportError`: if `wandb` is not installed, saying which extra to install.
    - `RuntimeError`: in online mode without stored credentials.
    """

    def __init__(
        self,
        project: str,
        *,
        directory: str | os.PathLike[str],
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: WandbMode | None = None,
    ):
        if mode is not None and mode not in WANDB_MODES:
            raise ValueError(f"`mode` must be one of {WANDB_MODES}, got {mode!r}.")
        chosen = mode if mode is not None else os.environ.get("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        if chosen != "online":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "WandbWriter needs wandb: pip install wandb (in a checkout of flowgrpo_eqx: "
                "pip install -e '.[wandb]')."
            ) from error
        if chosen == "online" and not wandb.login(prompt=False, verify=False):
            raise RuntimeError(
                "W&B online mode needs stored credentials (`wandb login` or WANDB_API_KEY); "
                "use mode='offline' and `wandb sync` later instead."
            )
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            silent=True,
            console="off",
            disable_git=True,
            disable_code=True,
            save_code=False,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
        )
        self._wandb = wandb
        self._run: wandb.Run | None = wandb.init(
            project=project,
            dir=str(self.directory),
            name=run_name,
            config=dict(config) if config is not None else None,
            mode=chosen,  # type: ignore[arg-type]
            reinit="create_new",
            settings=settings,
        )
        self.run_dir = pathlib.Path(self._run.settings.sync_dir)
        """The run's own folder, holding the `.wandb` file (nothing is written when disabled)."""

    def _open(self) -> "wandb.Run":
        if self._run is None:
            raise RuntimeError(f"WandbWriter for {str(self.run_dir)!r} is closed.")
        return self._run

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Log the values to the run at `step`; arguments and errors as `MetricsWriter.scalars`, and
        a `RuntimeError` once closed."""
        self._open().log(_plain_scalars(values), step=step)

    def image(self, step: int, name: str, image: ImageLike) -> None:
        """Log a `wandb.Image` at `step`; arguments and errors as `MetricsWriter.image`, and a
        `RuntimeError` once closed."""
        run = self._open()
        run.log({name: self._wandb.Image(image_pixels(name, image))}, step=step)

    def histogram(self, step: int, name: str, values: npt.ArrayLike) -> None:
        """Log a 64-bin `wandb.Histogram` of the finite values at `step` (nothing when none is
        finite); arguments and errors as `MetricsWriter.histogram`, and a `RuntimeError` once
        closed."""
        run = self._open()
        finite = finite_values(name, values)
        if finite.size == 0:
            return
        counts, edges = np.histogram(finite, bins=_WANDB_BINS)
        run.log({name: self._wandb.Histogram(np_histogram=(counts, edges))}, step=step)

    def close(self) -> None:
        """Finish the run and wait until it is written out; closing twice does nothing.

        `finish()` only hands the run's last records to W&B's service process, which writes
        them later; shutting the service down waits for that. A shutdown would also finish
        this process's other W&B runs, so while any is still open the run is left to be
        written in the background (at the latest when the process exits).
        """
        if self._run is None:
            return
        run, self._run = self._run, None
        run.finish()
        from wandb.sdk import wandb_setup

        if wandb_setup.singleton().most_recent_active_run is None:
            self._wandb.teardown()
