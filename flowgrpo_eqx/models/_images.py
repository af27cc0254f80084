"""What the image side checks of the images it is given, before any compute: a float dtype
(an image is float in `[-1, 1]`, or `[0, 1]` where documented; uint8 is refused, never read as
floats in 0..255), the rank, the channels and sides that are not empty."""

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp


SIGNED = "float in [-1, 1]; convert uint8 with x / 127.5 - 1"
"""The rule for images the autoencoders encode and the rewards score."""
UNIT = "float in [0, 1]; convert uint8 with x / 255"
"""The rule for `clip_pixels`' images."""


def check_image(
    name: str,
    image: Any,
    axes: Sequence[str],
    channels: int,
    rule: str = SIGNED,
    hint: str = "",
) -> None:
    """Refuse an image (or video) that is not float, not of rank `len(axes)`, not of
    `channels` channels last, or with an empty side.

    **Arguments:**

    - `name`: the argument's name, for the messages.
    - `image`: the array.
    - `axes`: the axes' names, channels last (`("H", "W", "C")`, `("F", "H", "W", "C")`).
    - `channels`: the channels wanted.
    - `rule`: what its values must be (`SIGNED` or `UNIT`).
    - `hint`: a sentence added to a refusal of its rank (what to do with another rank).

    **Raises:**

    - `ValueError`: naming `name` and what was expected.
    """
    dtype = getattr(image, "dtype", None)
    shape = tuple(getattr(image, "shape", ()))
    if dtype is None:
        raise ValueError(f"`{name}` must be an array ({rule}), got {type(image).__name__}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"`{name}` must be {rule}, got {dtype} values.")
    wanted = "[" + ", ".join([*axes[:-1], str(channels)]) + "]"
    if len(shape) != len(axes):
        extra = f" {hint}" if hint else ""
        raise ValueError(f"`{name}` must be {wanted} channels-last, got shape {shape}.{extra}")
    if shape[-1] != channels:
        raise ValueError(
            f"`{name}` must have {channels} channels last ({wanted}), got shape {shape}: "
            "convert greyscale or RGBA images to RGB first."
            if channels == 3
            else f"`{name}` must have {channels} channels last ({wanted}), got shape {shape}."
        )
    if 0 in shape[:-1]:
        raise ValueError(f"`{name}` must not be empty ({wanted}), got shape {shape}.")
