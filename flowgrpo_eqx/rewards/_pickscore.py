"""PickScore (Kirstain et al., 2023) as flow_grpo's `pickscore_scorer.py` computes it."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..models import CLIPModel
from ._features import AbstractCLIPReward, image_embedding


@final
class PickScore(AbstractCLIPReward):
    """PickScore of one decoded image for one prompt, on the device.

    flow_grpo's scorer: the image quantised to 8 bits and put through the CLIP image processor
    (`clip_pixels`), both towers' projected features normalised, their cosine times the learned
    temperature `exp(logit_scale)`, divided by 26 (flow_grpo's "norm to 0-1"). The prompt's
    side does not change during training: embed each prompt once (`prompt_embedding`) and
    carry the embedding in the rows.

    **Arguments:**

    - `model`: PickScore's `CLIPModel` (`yuvalkirstain/PickScore_v1`, read with
        `models.load_clip`).
    - `divisor`: what the score is divided by (26, flow_grpo's).
    """

    model: CLIPModel
    divisor: float = eqx.field(default=26.0, static=True)

    def __call__(
        self, image: Float[Array, "H W C"], prompt: Float[Array, " P"]
    ) -> Float[Array, ""]:
        """The score of one image for one prompt's embedding.

        **Arguments:**

        - `image`: a decoded channels-last image in `[-1, 1]`.
        - `prompt`: the prompt's `prompt_embedding`.

        **Returns:**

        The score, a float32 scalar.
        """
        features = image_embedding(self.model, image)
        temperature = jnp.exp(self.model.logit_scale.astype(jnp.float32))
        out: Float[Array, ""] = temperature * jnp.dot(features, prompt) / self.divisor
        return out
