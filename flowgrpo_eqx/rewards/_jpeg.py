"""DDPO's compressibility rewards: each image's JPEG size, larger or smaller scoring higher."""

import io
from typing import Any, ClassVar, final

import numpy as np
import numpy.typing as npt
from PIL import Image

from ._reward import check_finite_samples, to_uint8_images


def jpeg_sizes_kb(samples: npt.NDArray[Any], quality: int = 95) -> npt.NDArray[np.float64]:
    """The JPEG file size in kB of each image, as DDPO's compressibility rewards measure it."""
    sizes = []
    for image in to_uint8_images(samples):
        buffer = io.BytesIO()
        pil = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
        pil.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float64)


def _checked_quality(quality: int) -> int:
    if not (isinstance(quality, int) and not isinstance(quality, bool) and 1 <= quality <= 95):
        raise ValueError(f"`quality` must be an int in 1..95, got {quality!r}.")
    return quality


class _JpegSizeReward:
    """A reward of each image's JPEG size (kB): larger files score higher with `sign = 1`,
    smaller ones with `sign = -1`.

    **Arguments:**

    - `quality`: the JPEG quality, 1 to 95.

    **Raises:**

    - `ValueError`: for a quality outside 1..95.
    """

    name: ClassVar[str]
    sign: ClassVar[float]

    def __init__(self, quality: int = 95):
        self.quality = _checked_quality(quality)

    def __call__(self, samples: npt.NDArray[Any], rows: Any) -> npt.NDArray[np.float64]:
        """Each image's JPEG size in kB, times `sign`.

        **Arguments:**

        - `samples`: `[N, H, W]` or `[N, H, W, C]` images in [-1, 1], `C` in (1, 3, 4).
        - `rows`: unused.

        **Returns:**

        `[N]` float64 scores.

        **Raises:**

        - `ValueError`: if `samples` is not a batch of images.
        - `RewardError`: naming the rows, if samples hold NaN or inf.
        """
        del rows
        check_finite_samples(self.name, samples)
        return self.sign * jpeg_sizes_kb(samples, self.quality)


@final
class JpegCompressibility(_JpegSizeReward):
    """DDPO's compressibility reward: minus the JPEG size (kB) at quality 95, higher for
    smaller files.

    **Arguments:**

    - `quality`: the JPEG quality, 1 to 95.

    **Raises:**

    - `ValueError`: for a quality outside 1..95.
    """

    name = "jpeg_compressibility"
    sign = -1.0


@final
class JpegIncompressibility(_JpegSizeReward):
    """DDPO's incompressibility reward: the JPEG size (kB) at quality 95, higher for larger
    files.

    **Arguments:**

    - `quality`: the JPEG quality, 1 to 95.

    **Raises:**

    - `ValueError`: for a quality outside 1..95.
    """

    name = "jpeg_incompressibility"
    sign = 1.0
