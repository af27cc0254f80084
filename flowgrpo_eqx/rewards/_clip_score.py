"""CLIP score (Hessel et al., 2021), as torchmetrics' `CLIPScore` states it."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..models import CLIPModel
from ._features import AbstractCLIPReward


@final
class CLIPScore(AbstractCLIPReward):
    """CLIP score of one decoded image for one prompt, on the device:
    `scale * max(cos(image features, text features), 0)` (torchmetrics' `CLIPScore`, scale
    100), the image put through the CLIP image processor (`clip_pixels`). Embed each prompt
    once (`prompt_embedding`) and carry the embedding in the rows.

    **Arguments:**

    - `model`: a `CLIPModel` (OpenAI's ViT-L/14 in torchmetrics' default).
    - `scale`: the score's scale (100).
    """

    model: CLIPModel
    scale: float = eqx.field(default=100.0, static=True)

    def of_cosine(self, cosine: Float[Array, ""]) -> Float[Array, ""]:
        """`scale * max(cosine, 0)`, in `[0, scale]`."""
        out: Float[Array, ""] = self.scale * jnp.maximum(cosine, 0.0)
        return out
