"""Captioned picture grids of samples, written as PNG (host side, root process only)."""

import os
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw, ImageFont

from .rewards import to_uint8_images


def _as_images(samples: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    array = np.asarray(samples)
    if array.ndim == 2:
        # Vectors: show each as a one-row strip of grey levels.
        array = array[:, None, :]
    return to_uint8_images(array)


def preview_grid(
    samples: npt.ArrayLike,
    path: str | os.PathLike[str],
    captions: Sequence[str] | None = None,
    scores: npt.ArrayLike | None = None,
    *,
    columns: int | None = None,
    cell: int = 96,
    title: str | None = None,
) -> str:
    """Write a grid of samples with captions (and scores) as a PNG.

    **Arguments:**

    - `samples`: `[N, H, W, C]` / `[N, H, W]` images or `[N, D]` vectors, in [-1, 1].
    - `path`: where to write the PNG (folders are created).
    - `captions`: one caption per sample (e.g. the prompt text), or `None`.
    - `scores`: one score per sample, shown under the caption, or `None`.
    - `columns`: images per row; default about `sqrt(N)`, at most 8.
    - `cell`: the side in pixels of each upscaled image.
    - `title`: an optional line at the top.

    **Returns:**

    The path written.

    **Raises:**

    - `ValueError`: if `captions` or `scores` do not have one entry per sample.
    """
    images = _as_images(np.asarray(samples))
    count = images.shape[0]
    if captions is not None and len(captions) != count:
        raise ValueError(f"`captions` has {len(captions)} entries for {count} samples.")
    score_values = None if scores is None else np.asarray(scores, dtype=np.float64)
    if score_values is not None and score_values.shape != (count,):
        raise ValueError(f"`scores` has shape {score_values.shape} for {count} samples.")
    columns = columns or max(1, min(8, int(np.ceil(np.sqrt(count)))))
    rows = max(1, -(-count // columns))
    font = ImageFont.load_default()
    wrap = max(8, cell // 6)
    text_lines = 0
    labels = []
    for i in range(count):
        lines = textwrap.wrap(captions[i], wrap) if captions is not None else []
        if score_values is not None:
            lines.append(f"score {score_values[i]:.3f}")
        labels.append(lines)
        text_lines = max(text_lines, len(lines))
    line_height = 12
    header = line_height + 6 if title else 0
    cell_height = cell + 4 + text_lines * line_height
    canvas = Image.new("RGB", (columns * (cell + 8), header + rows * (cell_height + 8)), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((4, 3), title, fill="black", font=font)
    for i, image in enumerate(images):
        x = (i % columns) * (cell + 8) + 4
        y = header + (i // columns) * (cell_height + 8) + 4
        pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image[..., :3])
        height, width = image.shape[:2]
        size = (cell, max(1, round(cell * height / width)))
        canvas.paste(pil.resize(size, Image.Resampling.NEAREST), (x, y))
        for j, line in enumerate(labels[i]):
            draw.text((x, y + size[1] + 2 + j * line_height), line, fill="black", font=font)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    canvas.save(path, format="PNG")
    return os.fspath(path)
