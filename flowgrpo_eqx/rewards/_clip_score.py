"""CLIP score (Hessel et al., 2021), as torchmetrics' `CLIPScore` states it."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..models import CLIPModel
from ._features import AbstractCLIPReward, image_embedding


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

    def __call__(
        self, image: Float[Array, "H W C"], prompt: Float[Array, " P"]
    ) -> Float[Array, ""]:
        """The score of one image for one prompt's embedding.

        **Arguments:**

        - `image`: a decoded channels-last image in `[-1, 1]`.
        - `prompt`: the prompt's `prompt_embedding`.

        **Returns:**

        The score, a float32 scalar in `[0, scale]`.
        """
        features = image_embedding(self.model, image)
        out: Float[Array, ""] = self.scale * jnp.maximum(jnp.dot(features, prompt), 0.0)
        return out
