"""PickScore (Kirstain et al., 2023) as flow_grpo's `pickscore_scorer.py` computes it."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..models import CLIPModel
from ._features import AbstractCLIPReward


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

    def of_cosine(self, cosine: Float[Array, ""]) -> Float[Array, ""]:
        """`exp(logit_scale) * cosine / divisor`: the cosine times the learned temperature,
        divided by `divisor`."""
        temperature = jnp.exp(self.model.logit_scale.astype(jnp.float32))
        out: Float[Array, ""] = temperature * cosine / self.divisor
        return out
